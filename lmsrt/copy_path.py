"""The swap engine's per-tensor CUDA calls in C++ (csrc/copy_path.cpp), built against the torch
in use.

Optional. Without it the engine makes the same calls through torch's Python bindings, which
costs ~1.4x the CPU per swapped tensor (benchmarks/pack_overhead.py measures both). It is a
torch extension, so it must be compiled for the installed torch; build it once on the machine
that trains (it needs a C++ compiler and ninja, and takes about a minute)::

    lmsrt build          # then `lmsrt info` says "copy path: native"

The build lands in ``$LMSRT_CACHE`` (default ``~/.cache/lmsrt``), in a folder per torch
version and Python, and ``LMS`` picks it up from there. ``LMSRT_COPY_PATH=python`` turns it off.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from typing import Optional, Tuple

__all__ = ["build", "load", "status", "set_enabled", "source_path", "build_dir"]

_ENV_OFF = "LMSRT_COPY_PATH"
_loaded: Optional[Tuple[object, str]] = None     # (module or None, why not)


def source_path() -> str:
    """csrc/copy_path.cpp of this checkout (``lmsrt build`` needs a source install: pip -e)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                        "copy_path.cpp")


def _module_name() -> str:
    import torch
    tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    return f"lmsrt_copy_path_{tag}_py{sys.version_info.major}{sys.version_info.minor}"


def build_dir() -> str:
    root = os.environ.get("LMSRT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lmsrt")
    return os.path.join(root, _module_name())


def _built_file() -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for name in (_module_name() + ".so", _module_name() + suffix):
        path = os.path.join(build_dir(), name)
        if os.path.exists(path):
            return path
    return ""


def build(verbose: bool = False) -> str:
    """Compile csrc/copy_path.cpp for the installed torch; return the built file's path.

    Example::

        import lmsrt.copy_path
        print(lmsrt.copy_path.build())
    """
    global _loaded
    from torch.utils import cpp_extension

    source = source_path()
    if not os.path.exists(source):
        raise FileNotFoundError(
            f"lmsrt build: {source} is not there; the C++ copy path builds from a source "
            "checkout (git clone, then pip install -e .).")
    import torch
    os.makedirs(build_dir(), exist_ok=True)
    # Against a CUDA build of torch the copies are raw cudaMemcpyAsync calls (csrc says why).
    cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    cpp_extension.load(name=_module_name(), sources=[source], build_directory=build_dir(),
                       extra_cflags=["-O2"] + (["-DLMSRT_CUDA"] if cuda else []),
                       with_cuda=cuda, verbose=verbose)
    _loaded = None
    path = _built_file()
    if not path:
        raise RuntimeError(f"lmsrt build: the compiler finished but nothing is in {build_dir()}")
    return path


def load():
    """The native module, or None; ``status()`` says why not. Cheap after the first call."""
    global _loaded
    if _loaded is None:
        _loaded = _import()
    return _loaded[0]


def _import() -> Tuple[object, str]:
    if os.environ.get(_ENV_OFF, "").lower() in ("python", "0", "off"):
        return None, f"off ({_ENV_OFF}={os.environ[_ENV_OFF]})"
    try:
        path = _built_file()
    except Exception as e:      # noqa: BLE001 - no torch, odd home: just not native
        return None, f"{type(e).__name__}: {e}"
    if not path:
        return None, "not built (run `lmsrt build` once on this machine)"
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
    """Which copy path the engine uses on a GPU, and why not the native one if so."""
    module = load()
    if module is None:
        return f"Python ({_loaded[1]})"
    how = "cudaMemcpyAsync" if getattr(module, "raw_copies", False) else "copy_"
    return f"native (csrc/copy_path.cpp, copies by {how})"
