"""The host side of optimizer state (NOTE [ Optimizer state on the host ], movers/optimizer.py):
a state tensor's place in the pinned pool, and the state dict whose reads go through the mover
(Rules 3, 5)."""
from __future__ import annotations

import collections
import weakref

import torch

__all__ = ["Place", "HostState"]


class Place:
    """Where one state tensor's bytes live on the host (Rule 2), and how to view them."""

    __slots__ = ("slot", "dtype", "size", "stride", "host")

    def __init__(self, slot, t: torch.Tensor):
        self.slot, self.dtype, self.size, self.stride = slot, t.dtype, t.size(), t.stride()
        # A tensor whose storage is the slot's bytes alone, not the whole slab: what
        # torch.save and deepcopy of a state_dict write is the state, not the slab (through
        # numpy, which wraps the memory without a copy and keeps the slab alive).
        own = torch.from_numpy(slot.tensor.numpy())
        self.host = own.view(t.dtype).as_strided(t.size(), t.stride())

    def fits(self, t: torch.Tensor) -> bool:
        return (t.dtype, t.size(), t.stride()) == (self.dtype, self.size, self.stride)


class HostState(collections.defaultdict):
    """``optimizer.state`` while its tensors may live on the host: reads go through the mover
    (Rules 3, 5)."""

    def __init__(self, mover, optimizer, state: dict):
        """``mover``: the ``OptimizerMover`` whose ``reading(optimizer)`` each read calls."""
        super().__init__(dict, state)
        self._mover = weakref.ref(mover)
        self._optimizer = weakref.ref(optimizer)

    @torch.compiler.disable        # a compiled step reads through here eagerly: no guards on it
    def _touch(self) -> None:
        mover, optimizer = self._mover(), self._optimizer()
        if mover is not None and optimizer is not None:
            mover.reading(optimizer)

    def __getitem__(self, key):
        self._touch()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._touch()
        return super().get(key, default)

    def items(self):
        self._touch()
        return super().items()

    def values(self):
        self._touch()
        return super().values()

    def __reduce__(self):           # copied or pickled: a plain defaultdict of what it holds
        self._touch()
        return collections.defaultdict, (dict,), None, None, iter(dict.items(self))
