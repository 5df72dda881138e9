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
"""
from .config import LMSConfig
from .lms import LMS
from .profiler import memory_report

__all__ = ["LMS", "LMSConfig", "memory_report", "__version__"]
__version__ = "0.1.0"
