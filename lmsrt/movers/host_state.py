"""The host side of optimizer state (NOTE [ Optimizer state on the host ], movers/optimizer.py):
a state tensor's place in the pinned pool, the state dict whose reads go through the mover
(Rules 3, 5), and what is where (the state read past the mover)."""
from __future__ import annotations

import collections
import weakref
from typing import Dict, Iterator, List, Optional

import torch

from .streamed import state_to_come

__all__ = ["Place", "HostState", "in_groups", "on_host", "part_sizes", "states"]


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


# -- what is where (each read past the mover: ``dict``'s own methods) ---------------------------

def in_groups(optimizer) -> list:
    """The parameters of ``optimizer``'s groups (a part's, while a step runs in parts)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def states(optimizer, params: Optional[list]) -> Iterator[tuple]:
    """(param, its state) of ``params`` (each part's, without a walk over the whole state),
    else of every parameter with state."""
    state = optimizer.state
    if params is None:
        yield from dict.items(state)
        return
    for p in params:
        p_state = dict.get(state, p)
        if p_state:
            yield p, p_state


def on_host(optimizer, places: Dict[tuple, Place], params: Optional[list] = None) -> List[tuple]:
    """((id(param), key), its state, key, place) of each state tensor of ``optimizer`` at its
    host place (of ``places``, by (id(param), key)), of ``params`` if given."""
    found = []
    for p, p_state in states(optimizer, params):
        for key, t in p_state.items():
            place = places.get((id(p), key))
            if place is not None and t is place.host:
                found.append(((id(p), key), p_state, key, place))
    return found


def part_sizes(optimizer, places: Dict[tuple, Place]) -> Dict[int, int]:
    """Bytes of state by id of parameter, for a step's parts: at a host place (of ``places``),
    or to be made by this step (a parameter with no state yet that has a gradient now)."""
    per: Dict[int, int] = {}
    for (pid, _), place in places.items():
        per[pid] = per.get(pid, 0) + place.slot.nbytes
    to_come = state_to_come(optimizer)
    for p in in_groups(optimizer):
        if id(p) in to_come and id(p) not in per and not dict.get(optimizer.state, p):
            per[id(p)] = to_come[id(p)]
    return per
