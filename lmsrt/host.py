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

__all__ = ["HostPool", "HostSlot", "host_budget", "cgroup_available", "local_world_size"]

_SLAB_MIN = 256 << 20
_ALIGN = 512


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):        # no such file, or "max" (no limit), or garbage
        return None


def _read_stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


# (controller directory, limit file, usage file, memory.stat key of reclaimable page cache)
_CGROUP_LAYOUTS = (("", "memory.max", "memory.current", "inactive_file"),                     # v2
                   ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                    "total_inactive_file"))                                                   # v1


def _own_cgroups(proc_cgroup: str) -> dict:
    """This process's cgroup path per layout directory, from /proc/self/cgroup."""
    paths = {}
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            paths.setdefault("", path)                    # v2: "0::/path"
        elif "memory" in controllers.split(","):
            paths["memory"] = path                        # v1: "4:memory:/path"
    return paths


def cgroup_available(root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """Bytes left under this process's cgroup memory limits (v2, else v1), or None if none apply.

    Every limit from the process's own cgroup up to ``root`` counts (a parent's limit binds its
    children); in a container its own cgroup is usually ``root`` itself. Usage leaves out the
    inactive page cache, which the kernel reclaims before it would fail an allocation (as
    ``docker stats`` and the kubelet count it): a data loader that has read a large data set
    must not look like a host out of memory.
    """
    own = _own_cgroups(proc_cgroup)
    for directory, limit_file, usage_file, cache_key in _CGROUP_LAYOUTS:
        base = os.path.join(root, directory) if directory else root
        path = own.get(directory, "/").strip("/")
        parts = path.split("/") if path else []
        best = None
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(base, *parts[:depth])
            limit = _read_int(os.path.join(folder, limit_file))
            if limit is None or limit >= 1 << 60:     # v1 reports "no limit" as a huge number
                continue
            usage = _read_int(os.path.join(folder, usage_file)) or 0
            usage -= _read_stat(os.path.join(folder, "memory.stat"), cache_key)
            left = max(0, limit - max(0, usage))
            best = left if best is None else min(best, left)
        if best is not None:
            return best
    return None


def local_world_size(environ=None) -> int:
    """Processes of this job on this node (torchrun's LOCAL_WORLD_SIZE); 1 if unset or bad."""
    raw = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    try:
        return max(1, int(raw))
    except ValueError:
        return 1


def host_budget(already_pinned: int = 0, fraction: float = 0.8) -> int:
    """The pinned bytes this rank may hold: its share of ``fraction`` of the free host memory.

    Free is psutil's available memory, or what the cgroup limit leaves if that is less, shared
    equally among the ``LOCAL_WORLD_SIZE`` ranks of this node.

    Example::

        host_budget()             # 8 ranks, 512 GiB free: 0.8 * 512 / 8 = 51.2 GiB each
    """
    free = psutil.virtual_memory().available
    cgroup = cgroup_available()
    if cgroup is not None:
        free = min(free, cgroup)
    return already_pinned + int(free * fraction / local_world_size())


class HostSlot:
    """``nbytes`` at ``offset`` in pinned slab number ``slab`` (the tensor ``base``); ``tensor``
    is a uint8 view of them, made on first use (the C++ copy path needs only base and offset)."""

    __slots__ = ("slab", "offset", "nbytes", "base", "_tensor")

    def __init__(self, slab: int, offset: int, nbytes: int, base: torch.Tensor):
        self.slab, self.offset, self.nbytes, self.base = slab, offset, nbytes, base
        self._tensor: Optional[torch.Tensor] = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self.base[self.offset:self.offset + self.nbytes]
        return self._tensor


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
        self.closed = False
        self._warned = False
        # The smallest request that could not grow the pool in this step: larger ones are refused
        # without asking again (a budget check reads psutil and cgroup files; a failed pin costs
        # a driver call), until the next step. After a failed pin nothing is tried in the step,
        # and the next step tries a slab half the size.
        self._refused_from: Optional[int] = None
        self._pin_cap: Optional[int] = None

    def budget(self) -> int:
        if self.fixed_budget is not None:
            return self.fixed_budget
        return host_budget(self.pinned_bytes)

    def alloc(self, nbytes: int) -> Optional[HostSlot]:
        for i, allocator in enumerate(self.allocators):
            offset = allocator.alloc(nbytes)
            if offset >= 0:
                return self._slot(i, offset, nbytes)
        refused_from = self._refused_from
        if (refused_from is not None and nbytes >= refused_from) or not self._grow(nbytes):
            self.refused += 1
            return None
        offset = self.allocators[-1].alloc(nbytes)
        return self._slot(len(self.allocators) - 1, offset, nbytes)

    def _slot(self, slab: int, offset: int, nbytes: int) -> HostSlot:
        self.used_bytes += self.allocators[slab].size_of(offset)
        self.peak_used = max(self.peak_used, self.used_bytes)
        return HostSlot(slab, offset, nbytes, self.slabs[slab])

    def free(self, slot: HostSlot) -> None:
        """Give ``slot`` back; a second call (a release retried after an interrupt) or one after
        ``close`` does nothing."""
        if slot.base is None or self.closed:
            return
        slot.base = slot._tensor = None          # first: an interrupt below leaks, never frees twice
        allocator = self.allocators[slot.slab]
        self.used_bytes -= allocator.size_of(slot.offset)
        allocator.free(slot.offset)

    def new_step(self) -> None:
        """A new step: host memory may have been freed since, so growing may be tried again."""
        self._refused_from = None

    def reserve(self, nbytes: int) -> None:
        """Pin ahead of need (e.g. what the plan will move), so a step does not stall pinning."""
        free = sum(a.largest_free for a in self.allocators)
        if nbytes > free:
            self._grow(nbytes - free)

    def _grow(self, nbytes: int) -> bool:
        # Powers of two: torch's pinned allocator would round anything else up to one anyway.
        # Doubling the total keeps the number of slow pinning calls logarithmic.
        if self.closed:
            return False
        want = max(_SLAB_MIN, nbytes, self.pinned_bytes)
        size = 1 << (want - 1).bit_length()
        if self._pin_cap is not None:
            size = max(min(size, self._pin_cap), 1 << (nbytes - 1).bit_length())
        room = self.budget() - self.pinned_bytes
        while size > room and size // 2 >= nbytes:
            size //= 2
        if size > room or size < nbytes:
            self._refuse(nbytes)
            self._warn_once("lmsrt: the host memory budget is reached "
                            f"({self.pinned_bytes / 2**30:.2f} GiB pinned, "
                            f"{max(room, 0) / 2**30:.2f} GiB more allowed); saved "
                            "tensors that do not fit stay on the GPU (said once). Free host "
                            "memory, or raise host_budget_gb (--host-budget-gb, "
                            "LMSRT_HOST_BUDGET_GB) if the GPU runs out.")
            return False
        try:
            slab = self.device.pinned(size)
        except (RuntimeError, MemoryError) as e:
            self._refused_from, self._pin_cap = 0, size // 2
            self._warn_once(f"lmsrt: pinning {size / 2**30:.2f} GiB of host memory failed ({e}); "
                            "saved tensors that do not fit in what is pinned stay on the GPU "
                            "(said once). Free host memory, or set host_budget_gb "
                            "(--host-budget-gb, LMSRT_HOST_BUDGET_GB) to what can be pinned.")
            return False
        self.slabs.append(slab)
        self.allocators.append(OffsetAllocator(size, _ALIGN))
        self.pinned_bytes += size
        return True

    def _refuse(self, nbytes: int) -> None:
        if self._refused_from is None or nbytes < self._refused_from:
            self._refused_from = nbytes

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        """Give the slabs back (to torch's pinned cache) before CUDA tears down; pins no more."""
        self.closed = True
        self.slabs.clear()
        self.allocators.clear()
        self.pinned_bytes = self.used_bytes = 0
