"""Pinned host memory: big slabs, sub-allocated, kept across steps, within a host budget.

torch's pinned caching allocator rounds every block up to a power of two, and pinning is slow
(~0.6 s per GiB on an H200 host), so lmsrt pins a few large slabs (powers of two, so nothing is
rounded away), sub-allocates them with the offset allocator of ``lmsrt.arena``, and keeps them
for the life of the ``LMS`` object. Before each new slab the host budget is checked: psutil's
available memory, the cgroup v2/v1 limit when one applies, divided among the ranks of this node.
Pinned memory cannot be swapped out, so the budget keeps a fifth of what is free for everyone else.
"""
from __future__ import annotations

import os
import warnings
from typing import List, Optional

import psutil
import torch

from .arena import OffsetAllocator

__all__ = ["HostPool", "HostSlot", "host_budget", "cgroup_available"]

_SLAB_MIN = 256 << 20
_ALIGN = 512


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    return None if raw in ("", "max") else int(raw)


def cgroup_available(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes left under this process's cgroup memory limit, or None when no limit applies."""
    for limit_file, usage_file in (("memory.max", "memory.current"),                       # v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        limit = _read_int(os.path.join(root, limit_file))
        if limit is None or limit >= 1 << 60:   # v1 reports "no limit" as a huge number
            continue
        usage = _read_int(os.path.join(root, usage_file)) or 0
        return max(0, limit - usage)
    return None


def host_budget(already_pinned: int = 0, fraction: float = 0.8) -> int:
    """The pinned bytes this rank may hold: its share of ``fraction`` of the free host memory."""
    free = psutil.virtual_memory().available
    cgroup = cgroup_available()
    if cgroup is not None:
        free = min(free, cgroup)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return already_pinned + int(free * fraction / ranks)


class HostSlot:
    """A piece of a pinned slab: ``tensor`` is a uint8 view of it."""

    __slots__ = ("slab", "offset", "tensor")

    def __init__(self, slab: int, offset: int, tensor: torch.Tensor):
        self.slab, self.offset, self.tensor = slab, offset, tensor


class HostPool:
    """Pinned slabs and their allocators. ``alloc`` returns None when the budget says no.

    Example::

        pool = HostPool(device, budget=8 << 30)
        slot = pool.alloc(nbytes)          # None: keep the tensor on the GPU
        ...
        pool.free(slot)
    """

    def __init__(self, device, budget: Optional[int] = None):
        self.device = device
        self.fixed_budget = budget
        self.slabs: List[torch.Tensor] = []
        self.allocators: List[OffsetAllocator] = []
        self.pinned_bytes = 0
        self.used_bytes = 0
        self.peak_used = 0
        self.refused = 0          # allocations refused by the budget or by a failed pin
        self._warned = False

    def budget(self) -> int:
        if self.fixed_budget is not None:
            return self.fixed_budget
        return host_budget(self.pinned_bytes)

    def alloc(self, nbytes: int) -> Optional[HostSlot]:
        for i, allocator in enumerate(self.allocators):
            offset = allocator.alloc(nbytes)
            if offset >= 0:
                return self._slot(i, offset, nbytes)
        if not self._grow(nbytes):
            self.refused += 1
            return None
        offset = self.allocators[-1].alloc(nbytes)
        return self._slot(len(self.allocators) - 1, offset, nbytes)

    def _slot(self, slab: int, offset: int, nbytes: int) -> HostSlot:
        self.used_bytes += self.allocators[slab].size_of(offset)
        self.peak_used = max(self.peak_used, self.used_bytes)
        return HostSlot(slab, offset, self.slabs[slab][offset:offset + nbytes])

    def free(self, slot: HostSlot) -> None:
        allocator = self.allocators[slot.slab]
        self.used_bytes -= allocator.size_of(slot.offset)
        allocator.free(slot.offset)
        slot.tensor = None

    def reserve(self, nbytes: int) -> None:
        """Pin ahead of need (e.g. what the plan will move), so a step does not stall pinning."""
        free = sum(a.largest_free for a in self.allocators)
        if nbytes > free:
            self._grow(nbytes - free)

    def _grow(self, nbytes: int) -> bool:
        # Powers of two: torch's pinned allocator would round anything else up to one anyway.
        # Doubling the total keeps the number of slow pinning calls logarithmic.
        want = max(_SLAB_MIN, nbytes, self.pinned_bytes)
        size = 1 << (want - 1).bit_length()
        room = self.budget() - self.pinned_bytes
        while size > room and size // 2 >= nbytes:
            size //= 2
        if size > room or size < nbytes:
            self._warn_once(f"lmsrt: the host memory budget is reached ({self.pinned_bytes / 2**30:.2f} "
                            f"GiB pinned, {max(room, 0) / 2**30:.2f} GiB more allowed); further saved "
                            "tensors stay on the GPU. Free host memory or raise host_budget_gb "
                            "(LMSRT_HOST_BUDGET_GB) if the GPU runs out.")
            return False
        try:
            slab = self.device.pinned(size)
        except RuntimeError as e:
            self._warn_once(f"lmsrt: pinning {size / 2**30:.2f} GiB of host memory failed ({e}); "
                            "further saved tensors stay on the GPU. Lower host_budget_gb or free "
                            "host memory.")
            return False
        self.slabs.append(slab)
        self.allocators.append(OffsetAllocator(size, _ALIGN))
        self.pinned_bytes += size
        return True

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        """Give the slabs back (to torch's pinned cache) before CUDA tears down."""
        self.slabs.clear()
        self.allocators.clear()
        self.pinned_bytes = self.used_bytes = 0
