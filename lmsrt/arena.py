"""Best-fit offset allocator for carving pinned host slabs into activation buffers.

Pinned (page-locked) host memory is expensive to allocate and register, so the
runtime reserves a few large slabs up front and sub-allocates byte ranges inside
them.  This module only does the bookkeeping: it hands out *offsets* into a
region of ``capacity`` bytes and never touches the memory itself.

Policy:

* **Alignment** - every request is rounded up to a multiple of ``alignment``
  (a power of two, 512 by default) and every block starts at an aligned offset,
  so views into the slab satisfy DMA and vectorised-copy alignment.  The
  capacity need not be a multiple of the alignment; the tail block may be
  smaller than one alignment unit and only fits requests that round to no more
  than its size.
* **Best fit** - ``alloc`` takes the free block with the smallest size that is
  at least the rounded request, ties broken by the lowest offset, and carves
  the request from the *front* of that block; the remainder stays free.  Best
  fit keeps large holes intact for the large activations that need them.
* **Coalescing** - ``free`` merges the released block with the free block
  immediately before and after it, so a region whose blocks are all freed is
  again a single block.

Two implementations with bit-for-bit identical behaviour exist:
``lmsrt._native.OffsetAllocator`` (C++, built by ``setup.py`` when a compiler
is available) and :class:`PyOffsetAllocator` below.  :data:`OffsetAllocator`
is the native class when the extension imports and the Python one otherwise;
:func:`native_status` says which one is in use and why.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort

__all__ = [
    "NATIVE",
    "OffsetAllocator",
    "PyOffsetAllocator",
    "native_error",
    "native_status",
]


class PyOffsetAllocator:
    """Pure-Python best-fit allocator of aligned byte offsets in ``[0, capacity)``.

    Free blocks are indexed twice, with sorted lists kept by ``bisect``: by
    offset (to find the neighbours to coalesce with) and by ``(size, offset)``
    (so best fit with lowest-offset tie-breaking is one binary search).
    """

    __slots__ = (
        "_capacity",
        "_alignment",
        "_used_bytes",
        "_free_offsets",
        "_free_size_at",
        "_free_by_size",
        "_allocated",
    )

    def __init__(self, capacity: int, alignment: int = 512) -> None:
        capacity = operator.index(capacity)
        alignment = operator.index(alignment)
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two > 0, got {alignment}")
        self._capacity = capacity
        self._alignment = alignment
        self._used_bytes = 0
        self._free_offsets: list[int] = [0]
        self._free_size_at: dict[int, int] = {0: capacity}
        self._free_by_size: list[tuple[int, int]] = [(capacity, 0)]
        self._allocated: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to the alignment); return the offset, or -1 if nothing
        fits."""
        nbytes = operator.index(nbytes)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        if nbytes > self._capacity:
            return -1
        size = (nbytes + self._alignment - 1) & -self._alignment
        # (size, -1) sorts before every real (size, offset) entry, offsets being >= 0.
        best = bisect_left(self._free_by_size, (size, -1))
        if best == len(self._free_by_size):
            return -1
        block_size, offset = self._free_by_size.pop(best)
        del self._free_size_at[offset]
        position = bisect_left(self._free_offsets, offset)
        remainder = block_size - size
        if remainder:
            # The remainder sorts exactly where its parent block was.
            remainder_offset = offset + size
            self._free_offsets[position] = remainder_offset
            self._free_size_at[remainder_offset] = remainder
            insort(self._free_by_size, (remainder, remainder_offset))
        else:
            del self._free_offsets[position]
        self._allocated[offset] = size
        self._used_bytes += size
        return offset

    def free(self, offset: int) -> None:
        """Release the block at ``offset``, coalescing with free neighbours; KeyError if not
        allocated."""
        offset = operator.index(offset)
        size = self._allocated.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not allocated")
        self._used_bytes -= size

        # Index of the first free block after the released one.
        position = bisect_left(self._free_offsets, offset)
        if position < len(self._free_offsets) and self._free_offsets[position] == offset + size:
            next_offset = self._free_offsets.pop(position)
            next_size = self._free_size_at.pop(next_offset)
            self._remove_by_size(next_size, next_offset)
            size += next_size
        if position > 0:
            prev_offset = self._free_offsets[position - 1]
            prev_size = self._free_size_at[prev_offset]
            if prev_offset + prev_size == offset:
                self._remove_by_size(prev_size, prev_offset)
                merged_size = prev_size + size
                self._free_size_at[prev_offset] = merged_size
                insort(self._free_by_size, (merged_size, prev_offset))
                return
        self._free_offsets.insert(position, offset)
        self._free_size_at[offset] = size
        insort(self._free_by_size, (size, offset))

    def size_of(self, offset: int) -> int:
        """Rounded size of the allocated block at ``offset``; KeyError if not allocated."""
        offset = operator.index(offset)
        size = self._allocated.get(offset)
        if size is None:
            raise KeyError(f"offset {offset} is not allocated")
        return size

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free blocks as ``(offset, size)`` tuples sorted by offset."""
        return [(offset, self._free_size_at[offset]) for offset in self._free_offsets]

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        """Sum of the rounded sizes of all allocated blocks."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used_bytes

    @property
    def largest_free(self) -> int:
        """Size of the largest free block, 0 when the region is full."""
        return self._free_by_size[-1][0] if self._free_by_size else 0

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    def _remove_by_size(self, size: int, offset: int) -> None:
        del self._free_by_size[bisect_left(self._free_by_size, (size, offset))]


OffsetAllocator: type
NATIVE: bool
native_error: str | None

try:
    from lmsrt._native import OffsetAllocator as _NativeOffsetAllocator
except Exception as exc:  # noqa: BLE001 - an absent, stale or ABI-incompatible build
    OffsetAllocator = PyOffsetAllocator
    NATIVE = False
    native_error = f"{type(exc).__name__}: {exc}"
else:
    OffsetAllocator = _NativeOffsetAllocator
    NATIVE = True
    native_error = None


def native_status() -> str:
    """Which allocator implementation is in use, and why the native one is not (if so)."""
    if NATIVE:
        return "native (lmsrt._native)"
    return f"pure Python ({native_error})"
