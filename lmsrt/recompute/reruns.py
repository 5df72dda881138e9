"""NOTE [ Reruns under cuDNN's benchmark mode ]
  cuDNN's benchmark mode times its algorithms for each new shape and keeps the fastest, in a
  cache of each thread (torch's cuDNN frontend path: execution plans are not thread-safe). A
  region's rerun runs on autograd's thread, not forward's: there cuDNN times its algorithms
  again (resnet152 at a 12 GiB cap on an H200: 1.1 s more in the step that first reruns its
  blocks) and may keep another than forward's thread did, whose rounding differs. Then the
  recomputed tensors are not the ones forward saved, and the gradients not those of the run
  without lmsrt.
  So while the device tunes its algorithms (``Device.tunes_algorithms``), each kind of call (the
  region's module classes; its inputs' shapes, strides and dtypes; autocast) is checked in
  backward before its drops are trusted: in a step, the first call of a kind not yet checked
  holds on to what it saved as well as dropping it, and its rerun is compared with that bit for
  bit (batch norm's running statistics apart: its op saves them, the rerun updates copies of
  them, and backward in training mode does not read them); the kind's other calls in that
  step keep what they save (the engine keeps or swaps it, as for any region not recomputed).
  The same bits: calls of that kind drop from then on (autograd's thread keeps its choice for
  the run). Other bits: the originals go to backward (the step stays exact) and every region
  called with that kind is refused, said once. A check holds one call's saved tensors per kind
  beside the plan's: a step checks one kind at least, more while what they hold stays under a
  sixteenth of the limit, and the calls of the kinds left keep, checked in later steps (every
  stage of a conv net is a kind of its own: checked all in one step, they held all the net
  saved); a step that learns the model's use checks none (it swaps all it can: a check's bytes
  beside that ran a conv net out of memory at 85% of its peak). One whose call was not rerun
  in backward (no backward through it, or a rerun forced before an optimizer step, on
  forward's thread) is made again in a later step.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from .frames import running_norms

__all__ = ["RerunCheck"]

_DIFFERS = ("its rerun in backward computed other bits than its forward: cuDNN's benchmark mode "
            "chooses its algorithms again on autograd's thread")


class RerunCheck:
    """The checks of one LMS's regions (NOTE [ Reruns under cuDNN's benchmark mode ])."""

    def __init__(self, device, budget: int):
        self.device = device
        self.budget = budget                      # bytes a step's checks may hold, beyond one
        self.verdicts: Dict[tuple, bool] = {}     # kind of call -> its rerun gave the same bits
        self._pending: set = set()                # kinds whose check is in flight this step
        self._held = 0                            # bytes their checking calls hold
        self._step = 0

    def keeps(self, frame, refuse: Callable, step: int, policy=None) -> bool:
        """As ``frame`` settles: whether it keeps what it saved (its kind is being checked by
        another call of this step, or is left for a later step, or was found to differ: then
        its region is refused through ``refuse``). Otherwise it drops; ``frame.kind`` set:
        holding on to what it saved, to check its rerun by. None while ``policy`` learns the
        model's use (its step swaps all it can: nothing is left to make room for a check)."""
        if not self.device.tunes_algorithms():
            return False
        if step != self._step:          # kinds whose checking call was not rerun: again
            self._step, self._pending, self._held = step, set(), 0
        kind = _kind(frame)
        verdict = self.verdicts.get(kind)
        nbytes = 0
        if verdict is None and kind not in self._pending:
            nbytes = sum(t.untyped_storage().nbytes() for t in frame.saved.values())
        # A step's checks hold what their calls saved: one check at least, more while they
        # hold under the budget; the others keep (the engine keeps or swaps what they saved)
        # and are checked in a later step. (Every stage of a conv net is a kind of its own:
        # checked all at once, a step held everything, and ran out of memory.)
        over = (getattr(policy, "learning", False)
                or bool(self._pending) and self._held + nbytes > self.budget)
        if verdict is False or (verdict is None and (kind in self._pending or over)):
            frame.keep()
            if verdict is False:
                refuse(frame.region, _DIFFERS)
            return True
        if verdict is None:
            self._pending.add(kind)
            self._held += nbytes
            frame.kind = kind
        return False

    def compare(self, frame, refuse: Callable) -> None:
        """After ``frame``'s rerun, if it was checked: the same bits, or its originals replace the
        rerun's tensors and its region is refused through ``refuse``."""
        held, frame.check = frame.check, None
        if held is None or torch._C._current_graph_task_id() == -1:
            return                      # not checked, or not on autograd's thread: again later
        stats = {b.untyped_storage().data_ptr() for m in running_norms(frame.region)
                 for b in m.buffers() if b is not None}
        same = all(torch.equal(frame.again[i], t) for i, t in held.items()
                   if i in frame.again and t.untyped_storage().data_ptr() not in stats)
        self.verdicts[frame.kind] = same
        if not same:
            frame.again.update(held)
            refuse(frame.region, _DIFFERS)


def _kind(frame) -> tuple:
    """What cuDNN's choice of algorithm depends on, as far as a call shows it."""
    leaves = frame.inputs or ()
    return (tuple(type(m) for m in frame.region.modules),
            tuple((tuple(t.shape), t.stride(), t.dtype) for _, t, _ in leaves),
            tuple(frame.autocast))
