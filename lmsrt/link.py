"""The host link's speed, measured: pinned host <-> GPU copies timed with CUDA events."""
from __future__ import annotations

import statistics
from typing import Dict, Sequence

import torch

__all__ = ["copy_bandwidth"]


def copy_bandwidth(index: int = 0, nbytes: int = 256 << 20, reps: int = 5,
                   directions: Sequence[str] = ("h2d", "d2h")) -> Dict[str, float]:
    """Pinned host <-> GPU ``index`` copy speed in bytes/s, each of ``directions``: the median
    of ``reps`` timed copies of ``nbytes`` after one untimed (first-use costs are no bandwidth).

    Example::

        copy_bandwidth(0)["d2h"] / 1e9     # ~55 on a PCIe Gen5 H100 or H200
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    pairs = {"h2d": (gpu, host), "d2h": (host, gpu)}
    result = {}
    with torch.cuda.device(index):
        for name in directions:
            dst, src = pairs[name]
            dst.copy_(src, non_blocking=True)
            seconds = []
            for _ in range(reps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            result[name] = nbytes / statistics.median(seconds)
    return result
