"""A GPU capped as if it were smaller (``--gpu-limit``), for the whole process.

NOTE [ Capping a GPU ]
Two ways, chosen by ``LMSRT_GPU_CAP``:

- ``fraction`` (the default): torch's per-process memory fraction: what the caching allocator
  reserves stays under the cap, whatever CUDA itself maps beside it. The allocator refuses a
  request that no free block holds whenever its reserved bytes plus the *whole* request pass the
  cap, before it looks at its expandable segment: it frees its whole cache, synchronises and
  maps again (a retry, ~13 ms on an H200) where a GPU of the cap's size would map only the pages
  the segment lacks (transformers' Trainer with its checkpointing at 14 GiB under lmsrt: 12.05
  GiB reserved + a 2000 MiB request passed 14 GiB by 8 MiB, one retry a step).
- ``hold``: the memory above the cap is taken from the driver at once (``cuMemAlloc``) and held
  for the life of the process, outside the allocator, which then meets the cap as it meets the
  end of a smaller GPU: a mapping fails when pages run out, and no request is refused whole.
  What CUDA itself maps later (kernels loaded on first use, library workspaces, cuDNN's engines)
  counts against the cap, less ``LMSRT_GPU_CAP_SPARE_MB`` left beside it (256 unless set), which
  the allocator may take too where CUDA does not.

Measured side by side on an H200 (benchmarks/results/h200-2026-11-29-session31): held (no spare
then), the Trainer with its checkpointing at 14 GiB ran with no retry, lmsrt 0.240 s against its
checkpointing's 0.241 (one retry a step and 1.05x under the fraction), and plain runs were as
fast as under the fraction (0.2384/0.2368 s against 0.2431/0.2346, interleaved); but a compiled
GPT at a 2.58 GiB cap ran out of memory without the spare, and torchvision's resnet152 at 12 GiB
ran out of memory in step 22 with it (97 MiB free, cuDNN's own maps in the cap): how much CUDA
maps beside the allocator depends on the model, so ``fraction`` stays the default, and ``hold``
is there to tell a retry of the fraction's from one a GPU of that size would make.

``hold`` falls back to ``fraction`` where the driver cannot be reached or refuses, where less is
free than the cap and its spare, and where the GPU is shared (more local ranks than GPUs: the
first process would take what the others need).
Either way ``limit(index)`` is the cap; ``Device.memory_limit`` reads it where memory is held
(the fraction, read back, says the same otherwise).
"""
from __future__ import annotations

import ctypes
import math
import os
import warnings
from typing import Dict, Mapping, Optional

__all__ = ["apply", "check", "limit", "held_bytes", "release", "way", "ENV_WAY", "ENV_SPARE",
           "WAYS"]

ENV_WAY = "LMSRT_GPU_CAP"
ENV_SPARE = "LMSRT_GPU_CAP_SPARE_MB"
WAYS = ("fraction", "hold")
_SPARE_MB = 256
GiB = 1 << 30

_caps: Dict[int, int] = {}          # device index -> the cap, bytes
_held: Dict[int, tuple] = {}        # device index -> (driver pointer, bytes)


def way(environ: Optional[Mapping[str, str]] = None) -> str:
    """The way asked for in ``LMSRT_GPU_CAP`` (``fraction`` unless set); ValueError if
    unknown."""
    environ = os.environ if environ is None else environ
    value = (environ.get(ENV_WAY) or "fraction").strip().lower()
    if value not in WAYS:
        raise ValueError(f"{ENV_WAY}={value!r} is not one of {', '.join(WAYS)}; leave it unset "
                         "for fraction, torch's per-process memory fraction")
    return value


def spare(environ: Optional[Mapping[str, str]] = None) -> int:
    """Bytes a hold leaves beside the cap for what CUDA maps later (``LMSRT_GPU_CAP_SPARE_MB``)."""
    environ = os.environ if environ is None else environ
    raw = (environ.get(ENV_SPARE) or "").strip()
    try:
        mib = float(raw) if raw else _SPARE_MB
    except ValueError:
        mib = -1.0
    if not (math.isfinite(mib) and mib >= 0):
        raise ValueError(f"{ENV_SPARE}={raw!r} is not a number of MiB at or above 0; e.g. "
                         f"{ENV_SPARE}=512, or leave it unset for {_SPARE_MB}")
    return int(mib * (1 << 20))


def limit(index: int) -> Optional[int]:
    """The cap on device ``index`` in bytes, or None where none was applied in this process."""
    return _caps.get(index)


def held_bytes(index: int) -> int:
    """Bytes held from the driver above the cap on device ``index``."""
    return _held.get(index, (0, 0))[1]


def _shared(environ: Mapping[str, str]) -> bool:
    import torch

    raw = environ.get("LOCAL_WORLD_SIZE", "")
    return raw.isdigit() and int(raw) > torch.cuda.device_count()


def check(limit_bytes: int, index: int) -> int:
    """The total memory of GPU ``index``; ValueError where a cap of ``limit_bytes`` passes it."""
    import torch

    total = torch.cuda.get_device_properties(index).total_memory
    if limit_bytes > total:
        raise ValueError(f"a cap of {limit_bytes / GiB:g} GiB is more than GPU {index} has "
                         f"({total / GiB:.2f} GiB); give at most {total / GiB:.2f}, or leave "
                         "--gpu-limit out")
    return total


def apply(limit_bytes: int, index: int, environ: Optional[Mapping[str, str]] = None) -> str:
    """Cap device ``index`` at ``limit_bytes`` (NOTE [ Capping a GPU ]; ValueError past the
    GPU's total): under the fraction, what torch's allocator reserves stays under it; held, what
    it reserves and what CUDA maps later stay under it plus the spare. Returns the way it was
    done: ``hold`` or ``fraction``. A second call on the same device moves the cap (a hold is
    given back and taken again)."""
    import torch

    environ = os.environ if environ is None else environ
    how, beside = way(environ), spare(environ)
    if how == "hold" and _shared(environ):
        how = "fraction"
    total = check(limit_bytes, index)
    release(index)
    if how == "hold":
        with torch.cuda.device(index):
            free, _ = torch.cuda.mem_get_info(index)
            take = free - max(0, limit_bytes - torch.cuda.memory_reserved(index)) - beside
            pointer = _driver_alloc(take) if take > 0 else None
        if pointer is None:        # refused, or too little free to hold any: the fraction caps
            how = "fraction"
        else:
            _held[index] = (pointer, take)
    fraction = 1.0 if how == "hold" else min(1.0, limit_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _caps[index] = limit_bytes
    return how


def release(index: int) -> None:
    """Lift the cap on device ``index``: what was held goes back to the driver."""
    held, capped = _held.pop(index, None), _caps.pop(index, None)
    if held is None and capped is None:
        return
    import torch

    if held is not None:
        with torch.cuda.device(index):
            torch.cuda.synchronize(index)
            if _driver().cuMemFree_v2(ctypes.c_uint64(held[0])) != 0:
                warnings.warn(f"lmsrt: the {held[1] / GiB:.2f} GiB held above the cap on GPU "
                              f"{index} could not be given back to the driver", stacklevel=2)
    torch.cuda.set_per_process_memory_fraction(1.0, index)


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _driver_alloc(nbytes: int) -> Optional[int]:
    """``nbytes`` of device memory from the driver in the current context, or None where the
    driver library or the memory is not there."""
    try:
        lib = _driver()
    except OSError:
        return None
    pointer = ctypes.c_uint64(0)
    if lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes)) != 0:
        return None
    return pointer.value
