"""The optional C++ copy path: found or not, said so, turned off, built on first use on a GPU
(one builder among concurrent processes), a failed build falling back once.

On a GPU, tests/test_cuda.py runs its race and leak checks through both copy paths."""
import os
import re
import subprocess
import sys
import sysconfig

import pytest
import torch
from click.testing import CliRunner
from processes import clean_env
from torch.utils import cpp_extension

import lmsrt.copy_path as copy_path
from lmsrt._cli import main

# A process that finds a CUDA GPU (whether or not there is one), waits until its sibling is ready
# too, so that both ask for the copy path at once, then loads it and says what it got.
FIRST_USE = """
import os, sys, time
import lmsrt.copy_path as copy_path
copy_path._gpu_present = lambda: True
ready = sys.argv[1]
open(ready + sys.argv[2], "w").close()
while not all(os.path.exists(ready + i) for i in ("0", "1")):
    time.sleep(0.01)
copy_path.load()
print(copy_path.status())
"""

BUILT = re.compile(r"lmsrt: building the C\+\+ copy path for torch \S+ \(once per torch version\) "
                   r"\.\.\. built in \d+ s \((.+)\)")

needs_tools = pytest.mark.skipif(bool(copy_path._missing_tool()),
                                 reason="needs a C++ compiler and ninja: "
                                 f"{copy_path._missing_tool()}")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(copy_path, "_loaded", None)
    monkeypatch.setenv("LMSRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMSRT_COPY_PATH", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    yield
    copy_path._loaded = None


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(copy_path, "_gpu_present", lambda: True)


@pytest.fixture
def compiles(monkeypatch):
    """Counts the compiles that copy_path starts (each still runs)."""
    calls = []
    compile_ = copy_path._compile

    def counted(verbose):
        calls.append(verbose)
        return compile_(verbose)

    monkeypatch.setattr(copy_path, "_compile", counted)
    return calls


def test_without_a_gpu_nothing_is_built_and_status_says_how(tmp_path, monkeypatch, capsys,
                                                            compiles):
    monkeypatch.setattr(copy_path, "_gpu_present", lambda: False)
    assert copy_path.load() is None
    status = copy_path.status()
    assert status.startswith("Python") and "first use on one" in status and "lmsrt build" in status
    assert compiles == [] and not (tmp_path / "cache").exists()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["python", "off", "0"])
def test_env_turns_it_off(monkeypatch, on_a_gpu, compiles, value):
    monkeypatch.setenv("LMSRT_COPY_PATH", value)
    assert copy_path.load() is None
    assert f"LMSRT_COPY_PATH={value}" in copy_path.status()
    assert compiles == []


def test_set_enabled_false_wins_until_enabled_again(on_a_gpu, compiles):
    copy_path.set_enabled(False)
    assert copy_path.load() is None and "set_enabled(False)" in copy_path.status()
    assert compiles == []
    copy_path.set_enabled(True)
    assert copy_path._loaded is None          # looked up again on the next load()


def test_broken_build_falls_back_and_says_so(tmp_path):
    folder = tmp_path / "cache" / copy_path._module_name()
    folder.mkdir(parents=True)
    (folder / (copy_path._module_name() + ".so")).write_bytes(b"not a shared object")
    assert copy_path.load() is None
    assert "did not load" in copy_path.status() and "lmsrt build" in copy_path.status()


def test_build_without_source_is_a_clear_error(tmp_path, monkeypatch, on_a_gpu):
    monkeypatch.setattr(copy_path, "source_path", lambda: str(tmp_path / "missing.cpp"))
    result = CliRunner().invoke(main, ["build"])
    assert result.exit_code == 1
    assert "source checkout" in result.output and "optional" in result.output
    assert copy_path.load() is None and "source checkout" in copy_path.status()


def test_info_names_the_copy_path(monkeypatch):
    monkeypatch.setenv("LMSRT_COPY_PATH", "python")
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "copy path" in result.output and "LMSRT_COPY_PATH=python" in result.output


@pytest.mark.parametrize("local_rank", [None, "0", "1"])
def test_missing_ninja_falls_back_and_says_so_once(tmp_path, monkeypatch, capsys, on_a_gpu,
                                                   compiles, local_rank):
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    assert copy_path.load() is None and copy_path.load() is None
    assert "not built: ninja is missing (pip install ninja)" in copy_path.status()
    err = capsys.readouterr().err.splitlines()
    if local_rank == "1":
        assert err == []                      # torchrun's other ranks would say the same
    else:
        assert len(err) == 1 and "ninja is missing" in err[0] and "Python copy path" in err[0]
    assert compiles == [] and not os.path.exists(os.path.join(copy_path.build_dir(),
                                                              copy_path._FAILED))


@needs_tools
def test_failed_build_falls_back_once_and_is_not_retried(tmp_path, monkeypatch, capsys, on_a_gpu,
                                                         compiles):
    source = tmp_path / "copy_path.cpp"
    source.write_text("#error deliberately broken\n")
    monkeypatch.setattr(copy_path, "source_path", lambda: str(source))
    assert copy_path.load() is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "build failed" in err[0] and "#error deliberately broken" in err[0]
    assert "Python copy path" in err[0] and "lmsrt build --verbose" in err[0]
    failed = os.path.join(copy_path.build_dir(), copy_path._FAILED)
    assert "deliberately broken" in open(failed).read()
    assert "build failed" in copy_path.status() and len(compiles) == 1

    copy_path._loaded = None                  # a later process: it does not fail again slowly
    assert copy_path.load() is None and len(compiles) == 1
    assert "an earlier build failed" in copy_path.status() and failed in copy_path.status()

    result = CliRunner().invoke(main, ["build"])       # retries, and says why it failed
    assert result.exit_code == 1 and "deliberately broken" in result.output
    assert len(compiles) == 2 and os.path.exists(failed)


def _first_use_in(tmp_path, i: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FIRST_USE, str(tmp_path / "ready"), i],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(LMSRT_CACHE=str(tmp_path / "cache")))


@needs_tools
def test_first_use_on_a_gpu_builds_once_for_concurrent_processes(tmp_path, capsys):
    """Two processes (two torchrun workers) ask for the copy path at once on a machine where it
    is not built: one builds it against this torch (CPU or CUDA build alike) and says so in one
    line, the other waits and loads it. The module then views bytes as torch does."""
    procs = [_first_use_in(tmp_path, i) for i in ("0", "1")]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert all(out.startswith("native (csrc/copy_path.cpp") for out, _ in results), results
    said = sorted((err for _, err in results), key=len)
    assert said[0] == "", said                # the one that waited says nothing
    assert len(said[1].splitlines()) == 1 and BUILT.fullmatch(said[1].strip()), said
    path = BUILT.fullmatch(said[1].strip()).group(1)
    assert path == copy_path._built_file()

    native = copy_path.load()                 # this process finds it built: no second build
    assert native is not None and copy_path.status().startswith("native")
    assert capsys.readouterr().err == ""
    block = torch.arange(64, dtype=torch.uint8)
    got = native.view(block, torch.int16, (3, 4), (1, 3), 8)
    want = torch.empty(0, dtype=torch.int16).set_(block.untyped_storage(), 8, (3, 4), (1, 3))
    assert torch.equal(got, want) and got.stride() == (1, 3) and got.storage_offset() == 8
    assert got.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()

    failed = os.path.join(copy_path.build_dir(), copy_path._FAILED)
    with open(failed, "w") as f:
        f.write("an earlier failure\n")
    result = CliRunner().invoke(main, ["build"])     # ahead of time: up to date, failure cleared
    assert result.exit_code == 0, result.output
    assert "copy path: native" in result.output and not os.path.exists(failed)


def test_tools_next_to_python_are_found_outside_an_activated_venv(monkeypatch):
    """pip installs ninja beside python (venv/bin); `venv/bin/python train.py` does not put that
    folder on PATH, and torch looks for ninja on PATH only."""
    scripts = sysconfig.get_path("scripts")
    if not os.path.exists(os.path.join(scripts, "ninja")):
        pytest.skip(f"ninja is not in {scripts}")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not os.path.exists(os.path.join(p, "ninja")))
    monkeypatch.setenv("PATH", path)
    assert not cpp_extension.is_ninja_available()
    with copy_path._tools_on_path():
        assert cpp_extension.is_ninja_available()
    assert os.environ["PATH"] == path


@needs_tools
def test_a_second_cache_in_one_process_builds_and_loads_there(tmp_path, monkeypatch):
    """As a suite run without xdist does (test_copy_path.py, then test_native_hooks.py's
    fixture): a process that built and loaded the module in one cache builds it in another
    and loads it. torch remembered the name as built and skipped the compiler: "the
    compiler finished but nothing is in ..."."""
    for cache in ("first", "second"):
        monkeypatch.setenv("LMSRT_CACHE", str(tmp_path / cache))
        copy_path._loaded = None
        path = copy_path.build()
        assert path.startswith(str(tmp_path / cache)) and os.path.isfile(path), path
        module = copy_path.load()     # the process may keep the first file's code: the same
        assert module is not None and hasattr(module, "view"), copy_path.status()
