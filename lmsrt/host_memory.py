"""How much host memory lmsrt may pin: psutil's available memory, the cgroup v2/v1 limit when
one applies, divided among the ranks of this node. Pinned memory cannot be swapped out, so the
budget keeps a fifth of what is free for everyone else.

Example::

    from lmsrt.host_memory import host_budget
    budget = host_budget(already_pinned=pool.pinned_bytes)    # bytes the pool may hold
"""
from __future__ import annotations

import os
from typing import Optional

import psutil

from .device import local_world_size

__all__ = ["host_budget", "cgroup_available"]


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
