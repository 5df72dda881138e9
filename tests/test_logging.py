"""lmsrt speaks through the `lmsrt` logger: silent in a library until its logging is set up,
silenced or raised by the logger's level, seen by caplog, and printed on stderr by `lmsrt run`."""
import logging
import subprocess
import sys
import warnings

from processes import ROOT, clean_env, write

from lmsrt.device import SimulatedDevice
from lmsrt.host import HostPool
from lmsrt.say import say_once
from lmsrt.units import MiB

OVER_BUDGET = [MiB, 4 * MiB]          # the second slab does not fit a budget of 3 MiB


def _over_budget() -> None:
    HostPool(SimulatedDevice(), budget=3 * MiB).pin_slabs(OVER_BUDGET)


def test_notes_are_records_of_the_lmsrt_logger_not_warnings(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _over_budget()
    [record] = [r for r in caplog.records if "budget is reached" in r.getMessage()]
    assert record.name.startswith("lmsrt") and record.levelno == logging.WARNING
    assert not record.getMessage().startswith("lmsrt:")       # the handler writes that
    assert not [w for w in caught if "budget" in str(w.message)]


def test_the_loggers_level_silences_them(caplog):
    logger = logging.getLogger("lmsrt")
    logger.setLevel(logging.ERROR)
    try:
        _over_budget()
    finally:
        logger.setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name.startswith("lmsrt")]


def test_say_once_says_a_key_once_and_warns_only_when_asked(caplog):
    given: set = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert say_once("k", "lmsrt: first", given=given)
        assert not say_once("k", "lmsrt: again", given=given)
        assert say_once("w", "lmsrt: act on this", given=given, warn=True)
    assert [r.getMessage() for r in caplog.records] == ["first"]
    assert [str(w.message) for w in caught] == ["lmsrt: act on this"]


NOTE_SCRIPT = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
CONFIG
from lmsrt.device import SimulatedDevice
from lmsrt.host import HostPool
HostPool(SimulatedDevice(), budget=3 << 20).pin_slabs([1 << 20, 4 << 20])
print("done")
"""


def _run(tmp_path, config: str, *launcher: str) -> subprocess.CompletedProcess:
    script = write(tmp_path / "notes.py", NOTE_SCRIPT.replace("CONFIG", config))
    return subprocess.run([sys.executable, *launcher, script], capture_output=True, text=True,
                          env=clean_env(), timeout=120, cwd=str(ROOT))


def test_a_library_says_nothing_until_its_logging_is_set_up(tmp_path):
    plain = _run(tmp_path, "")
    assert plain.returncode == 0 and "done" in plain.stdout and plain.stderr == ""
    configured = _run(tmp_path,
                      "import logging; logging.basicConfig(format='%(name)s|%(message)s')")
    assert "lmsrt|the host memory budget is reached" in configured.stderr


def test_lmsrt_run_prints_each_note_once_on_stderr(tmp_path):
    launched = _run(tmp_path, "", "-m", "lmsrt", "run", "-q")
    notes = [ln for ln in launched.stderr.splitlines() if "budget is reached" in ln]
    assert len(notes) == 1 and notes[0].startswith("lmsrt: the host memory budget"), launched
    # A script that configures logging gets the notes through its own handler, not twice.
    mine = _run(tmp_path, "import logging; logging.basicConfig(format='mine %(message)s')",
                "-m", "lmsrt", "run", "-q")
    notes = [ln for ln in mine.stderr.splitlines() if "budget is reached" in ln]
    assert len(notes) == 1 and notes[0].startswith("mine the host memory budget"), mine.stderr
