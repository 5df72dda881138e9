"""The swap engine's per-tensor CUDA calls in C++ (csrc/copy_path.cpp), built against the torch
in use.

Optional. Without it the engine makes the same calls through torch's Python bindings, which
costs ~1.4x the CPU per swapped tensor (benchmarks/pack_overhead.py measures both). It is a
torch extension, so it must be compiled for the installed torch, and it is, on first use on a
CUDA GPU: the first ``LMS`` (or ``lmsrt info``) on a machine compiles it (a C++ compiler and
ninja, 14-18 s, once per torch version) and says so in one line; see NOTE [ Building on
first use ]. ``lmsrt build`` does the same ahead of time::

    lmsrt build          # then `lmsrt info` says "copy path: native"

The build lands in ``$LMSRT_CACHE`` (cache.py, ``cache_root``), in a folder per torch version,
Python and source, and ``LMS`` picks it up from there, if that folder and the built file are the
user's own and not writable by others; if not, it says so once and builds in a private folder
instead (cache.py, NOTE [ Trusting the cache ]). ``LMSRT_COPY_PATH=python`` turns it off.
Without a CUDA GPU nothing is compiled unless asked (``lmsrt build``).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import time
from typing import Iterator, Optional, Tuple

from .cache import cache_root, say_once, trusted_dir, unsafe, write_file

__all__ = ["build", "load", "status", "set_enabled", "source_path", "build_dir", "private_root"]

_ENV_OFF = "LMSRT_COPY_PATH"
_FAILED = "build-failed.txt"    # in build_dir(): why the last build failed; stops automatic retries
_LOCK_TIMEOUT_S = 900           # a build takes 14-18 s; a lock held this long is stuck
_loaded: Optional[Tuple[object, str]] = None     # (module or None, why not)

# NOTE [ Building on first use ]
# README's set-up (pip install -e ".[test]") cannot compile a torch extension: pip builds in an
# isolated environment without the user's torch, and pulling torch into it would download an
# unpinned, multi-GB wheel. So the first load() on a CUDA GPU compiles it instead:
#   1. Only with a CUDA GPU, the one place the engine uses it. On a CPU-only machine load()
#      never compiles (a test run would spend 15 s on it for nothing); ``lmsrt build`` still
#      can, and tests/test_copy_path.py does, against CPU torch.
#   2. One builder per machine. torchrun starts a process per GPU and each creates an LMS: the
#      first takes a file lock in build_dir() and compiles, the others wait on the lock, then find
#      the built file and load it. The lock is an OS lock (filelock), released if its holder dies;
#      torch's own lock file in the same folder is left behind by a killed build and would make
#      every later build wait forever, so a holder of ours removes it.
#   3. Never fails a run. No compiler or no ninja: say so once, use the Python path. A failed
#      compile: say so once and write build-failed.txt, so that later processes (every trial of
#      ``lmsrt tune``, every rank) do not spend 15 s failing again; ``lmsrt build`` retries.
#   4. The folder's name carries the torch version, the Python and a digest of the source, so a
#      new torch or an edited csrc/copy_path.cpp builds afresh rather than loading a stale module.
#      The module's name is the folder's, so one process may build it in two folders (another
#      LMSRT_CACHE, the private folder): torch's memory of names it built is cleared before
#      each build (``_compile``), and the module is loaded by its file's path.


def source_path() -> str:
    """csrc/copy_path.cpp: the copy a wheel carries (``lmsrt/_csrc/``, put there by setup.py's
    build_py), else the checkout's (``pip install -e``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    shipped = os.path.join(here, "_csrc", "copy_path.cpp")
    if os.path.exists(shipped):
        return shipped
    return os.path.join(os.path.dirname(here), "csrc", "copy_path.cpp")


def _module_name() -> str:
    import torch
    tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    _check_source()
    with open(source_path(), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:10]
    return f"lmsrt_copy_path_{tag}_py{sys.version_info.major}{sys.version_info.minor}_{digest}"


def build_dir() -> str:
    """The folder the copy path is built in and loaded from: its folder in the cache, or if that
    cannot be trusted its folder in ``private_root()``, said once (NOTE [ Trusting the cache ],
    Rule 2). PermissionError if neither can be trusted.

    Example::

        print(lmsrt.copy_path.build_dir())   # ~/.cache/lmsrt/lmsrt_copy_path_2_13_0_cpu_py312_...
    """
    folder, why = _cache_refusal()
    if not why:
        return folder
    root = private_root()
    private = os.path.join(root, _module_name())
    also = (unsafe(root, link_ok=False) if os.path.lexists(root) else "") or _untrusted(private)
    if also:
        raise PermissionError(f"the C++ copy path's folders cannot be trusted: {why}; {also}. "
                              "Set LMSRT_CACHE to a folder of your own that others cannot write.")
    say_once(f"lmsrt: the C++ copy path is not loaded from {folder}: {why}; it builds in "
             f"{private} instead (make the cache yours, not writable by others: chmod go-w, or "
             "set LMSRT_CACHE to a folder of your own)")
    return private


def private_root() -> str:
    """Where the copy path builds when the cache cannot be trusted: a folder of this user's
    in the temporary folder, made 0700 (its sticky bit keeps others from replacing it)."""
    return os.path.join(tempfile.gettempdir(), f"lmsrt-{os.geteuid()}")


def _cache_refusal() -> Tuple[str, str]:
    """The copy path's folder in the cache, and why it cannot be trusted ('' if it can)."""
    folder = os.path.join(cache_root(), _module_name())
    return folder, _untrusted(folder)


def _untrusted(folder: str) -> str:
    """Why the build folder ``folder``, the folder holding it or the file built there must not
    be used, or '' (what is not there yet is made by lmsrt, 0700)."""
    for path, link_ok in ((os.path.dirname(folder), True), (folder, False),
                          (_built_in(folder), False)):
        if path and os.path.lexists(path):
            why = unsafe(path, link_ok)
            if why:
                return why
    return ""


def _built_in(folder: str) -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for name in (_module_name() + ".so", _module_name() + suffix):
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            return path
    return ""


def _built_file() -> str:
    return _built_in(build_dir())


def _check_source() -> None:
    if not os.path.exists(source_path()):
        raise FileNotFoundError(
            f"{source_path()} is not there; the C++ copy path builds from the source that a "
            "wheel or a source checkout carries: reinstall lmsrt (pip install lmsrt, or git "
            "clone, then pip install -e .).")


def build(verbose: bool = False) -> str:
    """Compile csrc/copy_path.cpp for the installed torch; return the built file's path.

    Waits while another process builds it (NOTE [ Building on first use ]), and clears an
    earlier failure when it succeeds.

    Example::

        import lmsrt.copy_path
        print(lmsrt.copy_path.build())
    """
    with _tools_on_path(), _build_lock():
        return _compile(verbose)


def _compile(verbose: bool) -> str:
    """Compile into build_dir(), the build lock held; record a failure in build-failed.txt."""
    global _loaded
    import torch
    from torch.utils import cpp_extension

    folder = build_dir()
    failed = os.path.join(folder, _FAILED)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, "lock"))     # torch's, left by a killed build
    # Against a CUDA build of torch the copies are raw cudaMemcpyAsync calls (csrc says why).
    cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    # torch builds a name again in a process only if its sources changed, whatever the folder
    # (and records them as built even when the compiler failed): forget the name, and ninja
    # decides what is up to date (NOTE [ Building on first use ], 4).
    with contextlib.suppress(AttributeError):
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(_module_name(), None)
    try:
        with _quiet(cpp_extension.__name__, verbose):
            cpp_extension.load(name=_module_name(), sources=[source_path()],
                               build_directory=folder,
                               extra_cflags=["-O2"] + (["-DLMSRT_CUDA"] if cuda else []),
                               with_cuda=cuda, verbose=verbose)
    except Exception as e:
        write_file(failed, f"{type(e).__name__}: {e}\n")
        raise
    with contextlib.suppress(FileNotFoundError):
        os.remove(failed)
    _loaded = None
    path = _built_in(folder)
    if not path:
        raise RuntimeError(f"lmsrt build: the compiler finished but nothing is in {folder}")
    # The linker honours the umask: a group-writable file would be refused at its next load.
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    return path


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    from filelock import FileLock

    folder = build_dir()
    why = trusted_dir(folder)
    if why:
        raise PermissionError(f"{why}; set LMSRT_CACHE to a folder of your own that others "
                              "cannot write")
    with FileLock(os.path.join(folder, "build.lock"), timeout=_LOCK_TIMEOUT_S):
        yield


@contextlib.contextmanager
def _quiet(logger_name: str, verbose: bool) -> Iterator[None]:
    """torch's extension builder logs warnings that do not apply to one .cpp file (no
    TORCH_CUDA_ARCH_LIST: nvcc never runs); a build says one line, or everything if verbose."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _tools_on_path() -> Iterator[None]:
    """pip puts ninja beside this Python (venv/bin), which is on PATH only in an activated venv,
    and torch looks for ninja on PATH: add that folder while building."""
    scripts, path = sysconfig.get_path("scripts"), os.environ.get("PATH", "")
    if not scripts or scripts in path.split(os.pathsep):
        yield
        return
    os.environ["PATH"] = os.pathsep.join(p for p in (path, scripts) if p)
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _missing_tool() -> str:
    """What the build would miss, or ''."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja is missing (pip install ninja)"
    return ""


def _gpu_present() -> bool:
    import torch
    return torch.version.cuda is not None and torch.cuda.is_available()


def _say(text: str, end: str = "\n", every_rank: bool = False) -> None:
    """A line on stderr; by default from local rank 0 only, since torchrun's ranks would all say
    the same (the one process that builds speaks whatever its rank)."""
    if every_rank or os.environ.get("LOCAL_RANK", "0") == "0":
        print(text, end=end, file=sys.stderr, flush=True)


def _first_error(e: Exception) -> str:
    """The compiler's first error line in a failed build's message, else its first line."""
    lines = str(e).splitlines() or [""]
    return next((line for line in lines if "error" in line.lower() and ":" in line and
                 not line.startswith("Error building")), lines[0]).strip().rstrip(".")[:200]


def _build_on_first_use() -> Tuple[str, str]:
    """(built file, '') or ('', why not), having said which in one line; NOTE [ Building on
    first use ]."""
    with _tools_on_path():
        why = _missing_tool()
        if not why:
            try:
                with _build_lock():
                    return _build_once()
            except Exception as e:      # noqa: BLE001 - lock timeout, unwritable cache, ...
                why = f"{type(e).__name__}: {e}"
    why = f"not built: {why}"
    _say(f"lmsrt: C++ copy path {_fallback(why)}")
    return "", why


def _build_once() -> Tuple[str, str]:
    """The build lock held: the file another process built while this one waited, or an earlier
    failure, or a build now."""
    import torch

    path = _built_file()
    if path:
        return path, ""
    failed = os.path.join(build_dir(), _FAILED)
    if os.path.exists(failed):
        why = f"not built: an earlier build failed (see {failed})"
        _say(f"lmsrt: C++ copy path {_fallback(why)}")
        return "", why
    _say(f"lmsrt: building the C++ copy path for torch {torch.__version__} (once per torch "
         "version) ...", end="", every_rank=True)
    start = time.perf_counter()
    try:
        path = _compile(verbose=False)
    except Exception as e:              # noqa: BLE001 - a failed build must not stop training
        why = f"build failed ({_first_error(e)}; all of it in {failed})"
        _say(f" {_fallback(why)}", every_rank=True)
        return "", why
    _say(f" built in {time.perf_counter() - start:.0f} s ({path})", every_rank=True)
    return path, ""


def _fallback(why: str) -> str:
    return (f"{why}; LMS uses the Python copy path (~30% more CPU per swapped tensor). "
            f"`lmsrt build --verbose` shows why and retries; {_ENV_OFF}=python chooses Python "
            "without this note.")


def load():
    """The native module, or None; ``status()`` says why not. Cheap after the first call.

    On a CUDA GPU the first call builds it if it is not built yet (NOTE [ Building on first
    use ]); anything that goes wrong there is said once and leaves the Python path in use.
    """
    global _loaded
    if _loaded is None:
        _loaded = _find_or_build()
    return _loaded[0]


def _find_or_build() -> Tuple[object, str]:
    if os.environ.get(_ENV_OFF, "").lower() in ("python", "0", "off"):
        return None, f"off ({_ENV_OFF}={os.environ[_ENV_OFF]})"
    try:
        path = _built_file() or ("" if _gpu_present() else None)
    except Exception as e:      # noqa: BLE001 - no torch, no source, odd home: just not native
        return None, f"{type(e).__name__}: {e}"
    if path is None:
        return None, ("not built: no CUDA GPU here; it builds itself on first use on one, or run "
                      "`lmsrt build`")
    if not path:
        path, why = _build_on_first_use()
        if not path:
            return None, f"{why}; `lmsrt build --verbose` shows why and retries"
    try:
        loader = importlib.machinery.ExtensionFileLoader(_module_name(), path)
        spec = importlib.util.spec_from_file_location(_module_name(), path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as e:      # noqa: BLE001 - a stale or broken build must not stop training
        return None, f"{path} did not load ({type(e).__name__}: {e}); run `lmsrt build` again"
    return module, ""


def set_enabled(enabled: bool) -> None:
    """Use the native copy path (if built) or not, for LMS objects created from now on; for
    comparing the two in one process (benchmarks/pack_overhead.py, tests).

    Example::

        lmsrt.copy_path.set_enabled(False)      # this process's new LMS objects use Python
    """
    global _loaded
    _loaded = None if enabled else (None, "off (set_enabled(False))")


def status() -> str:
    """Which copy path the engine uses on a GPU, and why not the native one if so; where it
    comes from if not the cache, and why not."""
    module = load()
    try:
        folder, why = _cache_refusal()
    except Exception:       # noqa: BLE001 - no torch, no source: said by load()
        why = ""
    refused = f"; not from {folder}: {why}, so from {private_root()}" if why else ""
    if module is None:
        return f"Python ({_loaded[1]}{refused})"
    how = "cudaMemcpyAsync" if getattr(module, "raw_copies", False) else "copy_"
    return f"native (csrc/copy_path.cpp, copies by {how}{refused})"
