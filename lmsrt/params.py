"""Rebuilds that read parameters are made before the parameters change.

NOTE [ Parameters a rebuild reads ]
A rebuild (recompute/recipes.py, NOTE [ Recipes ]) reads its inputs as they are in backward;
autograd reads what forward saved. For a parameter the two part when it changes in between: an
optimizer step of one network before the backward of a graph that went through it (GAN loops),
decoupled weight decay or an EMA written through ``p.data``. So every rebuild that reads a
parameter is noted by the engine (``SwapEngine.materialize``), and made at once, while the
parameter still holds what forward saw, just before the parameter can change:

  Rule 1. Before any torch.optim optimizer steps (its global step pre-hook, while an engine
    that rebuilds lives): the pending rebuilds that read the parameters it updates. Storages
    whose graph autograd freed are not pending (the engine reaps them first): where forward
    and backward run inside the step, as a closure (Lightning, LBFGS), the pre-hook comes
    before them, and the last step's storages read parameters that step changed.
  Rule 2. Before ``p.data`` of such a parameter is read or set (a property on
    ``torch.nn.Parameter``, from the first noted rebuild until the last engine that noted one
    closes or is collected): ``.data`` writes bump no version counter, so nothing could tell
    them afterwards.

Both are counted changes to torch (torch_patches.py, NOTE [ What lmsrt changes in torch ], 7
and 8): with no engine left, ``p.data`` costs what it costs without lmsrt.

A rebuild made early holds its bytes until backward uses them, as PyTorch does without lmsrt.
Not seen: writes through other aliases made without ``.data`` or a version bump (a tensor
taken from ``p.data`` before forward, ``p.untyped_storage()``, DLPack or numpy views) and
``.data`` inside compiled code. What no rule catches, the engine's samples of each dropped
storage do as an error (``SwapEngine.check_rebuilt``), not as a silent difference: a few words
of each rebuilt storage are compared with the same words of the original, read before the next
optimizer step or the next forward.
"""
from __future__ import annotations

import weakref

import torch

from . import torch_patches

__all__ = ["watch", "unwatch", "before_step"]

_engines: "weakref.WeakSet" = weakref.WeakSet()     # engines that rebuild (with recompute on)


def _before_change(p: torch.Tensor) -> None:
    for engine in list(_engines):                    # Rule 2
        engine.materialize((id(p),))


def before_step(optimizer, args=(), kwargs=None) -> None:
    """torch.optim's global step pre-hook (Rule 1), and the last moment to refuse a step whose
    gradients came from a rebuild that differed."""
    engines = list(_engines)
    if not engines:
        return None
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in engines:
        engine.check_rebuilt()
        engine.materialize(ids)
    return None


# Made while an engine needs them, undone when the last one closes or is collected
# (torch_patches.py, NOTE [ What lmsrt changes in torch ], 7 and 8).
_data_property = torch_patches.parameter_data_patch(_before_change)
_step_hook = torch_patches.optimizer_step_patch(before_step)


def watch(engine, parameters: bool = False) -> None:
    """Have ``engine``'s rebuilds made before the parameters they read change (``parameters``:
    it has such rebuilds pending, so the ``p.data`` property is needed from now on). Until
    ``unwatch(engine)``, or until the engine is collected."""
    _engines.add(engine)
    _step_hook.add_user(engine)
    if parameters:
        _data_property.add_user(engine)


def unwatch(engine) -> None:
    """``engine`` closed: nothing of it is made before parameters change any more; the last
    engine watched takes torch's patches with it."""
    _engines.discard(engine)
    _data_property.remove_user(engine)
    _step_hook.remove_user(engine)
