"""lmsrt: large model support for PyTorch.

Tensors that autograd saves for backward move to pinned host memory once the GPU fills, and come
back, prefetched, just before backward needs them.

Example::

    import lmsrt
    lms = lmsrt.LMS(lms=1000, lms_frac=0.4)
    with lms:
        loss = loss_fn(model(x), y)
    loss.backward()
    print(lms.summary())

``import lmsrt`` imports neither torch nor the engine: the names below load on first use, so that
``lmsrt --version`` and ``lmsrt --help`` answer at once.
"""
import importlib

from . import say as _say  # noqa: F401 - gives the ``lmsrt`` logger its NullHandler

__all__ = ["LMS", "LMSConfig", "memory_report", "__version__"]
__version__ = "0.1.0"

_LAZY = {"LMS": ".lms", "LMSConfig": ".config", "memory_report": ".profiler"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lmsrt' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
