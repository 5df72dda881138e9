"""What lies under $LMSRT_CACHE as another user (or a corrupted disk) could leave it: pin records
that are FIFOs, links, huge, nested, truncated or out of bounds; links planted where lmsrt
writes; folders and builds that others can write (lmsrt/cache.py, NOTE [ Trusting the cache ])."""
import collections
import json
import os
import pathlib
import stat
import threading

import pytest
from click.testing import CliRunner
from models import says

import lmsrt
import lmsrt.cache as cache
import lmsrt.copy_path as copy_path
import lmsrt.host as host_module
from lmsrt._cli import main
from lmsrt.device import SimulatedDevice
from lmsrt.host import HostPool
from lmsrt.units import GiB, MiB

SETTINGS = {"lms": 1.0}


@pytest.fixture(autouse=True)
def _a_new_process(monkeypatch):
    """Each test as a fresh process: its records count from the first, its lines are said anew."""
    monkeypatch.setattr(cache, "_runs", collections.Counter())
    monkeypatch.setattr(cache, "_said", set())


def _memo(seconds: float = 10.0) -> cache.PinMemo:
    """A PinMemo made on another thread, failing (rather than hanging the suite) if reading its
    record blocks."""
    made = []
    thread = threading.Thread(target=lambda: made.append(cache.PinMemo(SETTINGS, "sim:0", GiB)),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    assert made, f"reading the pin record blocked for {seconds} s"
    cache._runs.clear()                      # the next one is the same run's record again
    return made[0]


def _record_path() -> str:
    path = _memo().path
    assert cache.trusted_dir(os.path.dirname(path)) == ""
    return path


def _hostile_records(tmp_path, path):
    """(name, a function that puts it at ``path``)."""
    valid = tmp_path / "elsewhere.json"
    valid.write_text(json.dumps({"slabs": [4096]}))

    def text(body):
        return lambda: pathlib.Path(path).write_text(body)
    return [
        ("fifo", lambda: os.mkfifo(path)),
        ("link to /dev/zero", lambda: os.symlink("/dev/zero", path)),
        ("link to a valid record", lambda: os.symlink(valid, path)),
        ("huge", text(json.dumps({"slabs": [4096]}) + " " * (cache._MAX_RECORD + 1))),
        ("nested", text('{"slabs": ' + "[" * 100_000 + "]" * 100_000 + "}")),
        ("nested in another key", text('{"slabs": [4096], "command": [[["x"]]]}')),
        ("truncated", text('{"slabs": [4096, 81')),
        ("a slab of 1e15 bytes", text(json.dumps({"slabs": [10 ** 15]}))),
        ("too many slabs", text(json.dumps({"slabs": [4096] * (cache._MAX_SLABS + 1)}))),
        ("negative", text(json.dumps({"slabs": [4096, -4096]}))),
        ("wrong type", text(json.dumps({"slabs": [4096, "4096"]}))),
        ("not utf-8", lambda: pathlib.Path(path).write_bytes(b'{"slabs": [\xff]}')),
    ]


def test_hostile_records_are_ignored_with_one_line_and_never_block(tmp_path, capsys,
                                                                  notes_on_stderr):
    path = _record_path()
    for name, plant in _hostile_records(tmp_path, path):
        cache._said.clear()
        plant()
        memo = _memo()
        assert memo.recalled == [] and memo.written == 0, name
        said = capsys.readouterr().err.splitlines()
        assert len(said) == 1 and path in said[0] and "delete it" in said[0], (name, said)
        os.unlink(path)
    pathlib.Path(path).write_text(json.dumps({"slabs": [4096, 8192], "command": ["x"]}))
    assert _memo().recalled == [4096, 8192] and capsys.readouterr().err == ""


def test_pinned_ahead_counts_only_what_was_pinned(tmp_path):
    """A record asking for more than the budget allows, or a pin that fails: the stats say what
    was pinned, not what the record asked for."""
    pool = HostPool(SimulatedDevice(), budget=3 * MiB)
    with says("budget is reached"):
        pool.pin_slabs([MiB, 4 * MiB, MiB])    # the second does not fit: pinning stops there
    assert pool.pinned_ahead == pool.pinned_bytes == MiB
    failing = HostPool(SimulatedDevice(pin_limit=3 * MiB // 2), budget=GiB)
    failing.pin_slabs([MiB, MiB])              # the second pin fails as it is made
    with says("failed"):
        failing._adopt()
    assert failing.pinned_ahead == failing.pinned_bytes == MiB

    def make():
        cache._runs.clear()
        return lmsrt.LMS(device=SimulatedDevice(), lms=1, lms_frac=0.0, pin_ahead=True,
                         host_budget_gb=1)

    lms = make()
    path = lms._engine.memo.path
    lms.close()
    assert cache.trusted_dir(os.path.dirname(path)) == ""
    with open(path, "w") as f:
        json.dump({"slabs": [1 << 39]}, f)     # within the record's bounds, over the budget
    with says("budget is reached"):
        lms = make()
    assert lms._engine.memo.recalled == [1 << 39]
    assert lms.stats()["pinned_ahead_bytes"] == lms._engine.host.pinned_bytes == 0
    lms.close()


class _CountedDeque(collections.deque):
    """A deque that counts the items walked through it."""
    walked = 0

    def __iter__(self):
        for item in super().__iter__():
            _CountedDeque.walked += 1
            yield item


def test_pinning_a_recorded_layout_is_linear_in_its_slabs(monkeypatch):
    """16,000 slabs took 6.7 s and 100,000 over a minute: each pin read the host's free memory
    and summed every pin under way. Now the budget is read once and no pin is walked."""
    reads = []
    budget = host_module.host_budget
    monkeypatch.setattr(host_module, "host_budget", lambda *a: reads.append(a) or budget(*a))
    pool = HostPool(SimulatedDevice(pin_threads=2))
    pool._pending = _CountedDeque()
    _CountedDeque.walked = 0
    gate = pool.device.pin_gate
    gate.clear()                                # every pin stays under way
    try:
        pool.pin_slabs([4096] * 2000)
        assert pool.pinned_bytes == 2000 * 4096
    finally:
        gate.set()
    assert len(reads) == 1 and _CountedDeque.walked == 0
    pool.close()


def test_a_link_planted_at_a_temporary_name_is_not_followed(tmp_path):
    """Records were written to `<record>.<pid>.tmp` with open(): a link planted there made lmsrt
    overwrite what it points to, and the record became that link."""
    path = _record_path()
    target = tmp_path / "victim"
    target.write_text("precious")
    os.symlink(target, f"{path}.{os.getpid()}.tmp")
    memo = _memo()
    memo.saw([4096])
    assert target.read_text() == "precious"
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert json.loads(pathlib.Path(path).read_text())["slabs"] == [4096]
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    assert [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")] \
        == [os.path.basename(path) + f".{os.getpid()}.tmp"]      # the planted link, untouched


@pytest.mark.parametrize("how", ["pins is a link", "pins is group-writable",
                                 "cache is world-writable", "pins is another user's"])
def test_an_untrusted_records_folder_is_neither_read_nor_written(tmp_path, monkeypatch, capsys,
                                                                 notes_on_stderr, how):
    root = tmp_path / "cache"
    pins = root / "pins"
    elsewhere = tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    monkeypatch.setattr(cache, "pins_dir", lambda: str(pins))
    if how == "pins is a link":
        os.symlink(elsewhere, pins)
    else:
        pins.mkdir(mode=0o700)
    if how == "pins is group-writable":
        os.chmod(pins, 0o770)
    if how.startswith("cache is world"):
        os.chmod(root, 0o777)
    if how == "pins is another user's":
        uid = os.geteuid()
        monkeypatch.setattr(cache.os, "geteuid", lambda: uid + 1)
    key = os.path.basename(_memo().path)
    planted = json.dumps({"slabs": [4096]})
    for folder in (elsewhere, pins):
        if not os.path.lexists(folder / key):
            (folder / key).write_text(planted)
    capsys.readouterr()
    cache._said.clear()
    memo = _memo()
    assert memo.recalled == []
    memo.saw([8192])
    memo.close()
    assert (elsewhere / key).read_text() == planted and (pins / key).read_text() == planted
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "pin records are off" in said[0] and "LMSRT_CACHE" in said[0], said


def test_the_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LMSRT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == str(tmp_path / "xdg" / "lmsrt")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")       # the spec says: ignore it
    assert cache.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "lmsrt")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "lmsrt")
    monkeypatch.setenv("LMSRT_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == str(tmp_path / "mine")


# -- the built copy path ---------------------------------------------------------------------
@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A cache holding a "built" copy path whose load would show (it is no shared object: a load
    says "did not load"); the private folder in the test's own."""
    monkeypatch.setattr(copy_path, "_loaded", None)
    monkeypatch.setenv("LMSRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMSRT_COPY_PATH", raising=False)
    monkeypatch.setattr(copy_path, "private_root", lambda: str(tmp_path / "private"))
    monkeypatch.setattr(copy_path, "_gpu_present", lambda: False)
    folder = tmp_path / "cache" / copy_path._module_name()
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "cache", 0o700)
    so = folder / (copy_path._module_name() + ".so")
    so.write_bytes(b"not a shared object")
    os.chmod(so, 0o600)
    yield folder, so
    copy_path._loaded = None


def test_a_build_of_ones_own_is_loaded(planted):
    """The control: the same planted file in a folder of the user's own is loaded."""
    assert copy_path.load() is None and "did not load" in copy_path.status()


@pytest.mark.parametrize("how", ["folder group-writable", "file world-writable",
                                 "cache group-writable", "folder a link", "file another user's"])
def test_a_build_others_could_write_is_not_loaded(planted, tmp_path, monkeypatch, capsys, how,
                                                   notes_on_stderr):
    folder, so = planted
    if how == "folder group-writable":
        os.chmod(folder, 0o770)
    elif how == "file world-writable":
        os.chmod(so, 0o666)
    elif how == "cache group-writable":
        os.chmod(tmp_path / "cache", 0o770)
    elif how == "folder a link":
        os.rename(folder, tmp_path / "real")
        os.symlink(tmp_path / "real", folder)
    else:
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
        monkeypatch.setattr(copy_path, "private_root", lambda: str(tmp_path / f"private-{uid}"))
        os.makedirs(tmp_path / f"private-{uid}")       # the fallback folder: not ours either
    assert copy_path.load() is None
    status = copy_path.status()
    assert "did not load" not in status, status
    assert f"not from {folder}" in status, status
    said = capsys.readouterr().err.splitlines()
    if how != "file another user's":
        assert len(said) == 1 and "is not loaded from" in said[0] and "LMSRT_CACHE" in said[0]
        assert copy_path.build_dir() == str(tmp_path / "private" / copy_path._module_name())
        info = CliRunner().invoke(main, ["info"])
        assert info.exit_code == 0 and f"not from {folder}" in info.output, info.output
    else:                      # no folder can be trusted: none is used, and status says why
        assert "cannot be trusted" in status and "not by this user" in status
        with pytest.raises(PermissionError, match="LMSRT_CACHE"):
            copy_path.build_dir()
