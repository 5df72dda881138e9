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
  backward before its drops are trusted. In a step, the first call of each kind not yet checked
  (its inputs unchanged since it returned: ``x += block(x)`` keeps, unchecked) keeps what it
  saved (the engine keeps or swaps it, as for any region not recomputed) and its inputs too;
  at the first unpack in backward it runs again and its rerun is compared with what it kept,
  bit for bit, brought back one tensor at a time (batch norm's running statistics apart: its
  op saves them, the rerun updates copies of them, and backward in training mode does not read
  them); backward then gets, of each tensor, the rerun's where the bits are the same and what
  it kept where not, whatever the verdict (the step stays exact), and the GPU holds no more
  than a rerun does, plus one tensor (all that it kept brought back at once beside the rerun's
  tensors ran a conv net out of memory at 85% of its peak). The kind's other calls in
  that step keep too. The same bits: calls of that kind drop from then on (autograd's thread
  keeps its choice for the run). Other bits: every region called with that kind is refused,
  said once. A check holds nothing beside what keeping holds, and keeps the step's sequence of
  saved storages that of keeping: every kind is checked in the first step that calls it, a
  step that learns the model's use included, and once kinds start to drop (the sequence
  changed), the policy learns again from the next step. (Checks that held on to their calls'
  saved tensors on the GPU ran a conv net out of memory at 85% of its peak: all at once, they
  held everything it saved; one a step, each step's sequence differed from the one learnt
  before, and no plan held.) One whose call was not rerun on autograd's thread (no backward
  through it) or that read parameters changed before backward (an optimizer step, a ``p.data``
  write: its rerun would read their new values; given up as they change) is made again in a
  later step, by the kind's next call (a kind whose first call of a step never has a backward
  would otherwise never be checked, and never recomputed).
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

    def __init__(self, device):
        self.device = device
        self.verdicts: Dict[tuple, bool] = {}     # kind of call -> its rerun gave the same bits
        self.trusted_new = False                  # a kind was trusted since ``take_trusted``
        self._pending: set = set()                # kinds whose check is in flight this step
        self._calls: Dict[tuple, int] = {}        # kind -> its calls settled this step
        self._last_calls: Dict[tuple, int] = {}   # the same, the step before
        self._skip: Dict[tuple, int] = {}         # kind -> calls a step lets by before checking
        self._step = 0

    def keeps(self, frame, refuse: Callable, step: int) -> bool:
        """As ``frame`` settles: whether it keeps what it saved (its kind is not trusted yet:
        the first call of the kind in this step is then checked, ``frame.checking``; or its
        kind was found to differ: then its region is refused through ``refuse``). Not for a
        call whose input moved since it returned (``Frame.moved``): its rerun could not start
        from that input, and ``Frame.settle`` keeps it, unchecked."""
        if not self.device.tunes_algorithms() or frame.moved():
            return False
        if step != self._step:          # kinds whose checking call was not rerun: again,
            for kind in self._pending:  # with the next call of theirs (it may have no backward)
                if kind not in self.verdicts:
                    self._skip[kind] = self._skip.get(kind, 0) + 1
            self._step, self._pending = step, set()
            self._last_calls, self._calls = self._calls, {}
        kind = _kind(frame)
        verdict = self.verdicts.get(kind)
        if verdict:
            return False
        if verdict is False:
            frame.keep()
            refuse(frame.region, _DIFFERS)
            return True
        calls = self._calls[kind] = self._calls.get(kind, 0) + 1
        which = self._skip.get(kind, 0) % self._last_calls.get(kind, 1)
        checking = kind not in self._pending and calls - 1 == which
        if checking:
            self._pending.add(kind)
            frame.kind = kind
        frame.keep(checking=checking)
        return True

    def compare(self, frame, refuse: Callable) -> None:
        """After ``frame``'s rerun, if it was checked: its verdict, from the rerun's tensors
        against what it kept, brought back from the engine one at a time; its region refused
        through ``refuse`` where they differ. Backward gets, of each tensor, the rerun's where
        the two are the same bits, else the one kept: the GPU holds the rerun's tensors and one
        brought back beside them, as a region's rerun holds its own (all that it kept at once
        beside them ran a conv net out of memory at 85% of its peak)."""
        if not frame.checking:
            return
        frame.checking = False
        rerun, frame.again, frame.leaves = frame.again or {}, {}, None
        if torch._C._current_graph_task_id() == -1:
            return      # not on autograd's thread: checked in a later step; backward fetches
        stats = {b.untyped_storage().data_ptr() for m in running_norms(frame.region)
                 for b in m.buffers() if b is not None}
        same = True
        for i, handle in frame.outer.items():
            if i not in rerun:
                continue                # brought back when backward asks for it
            kept = frame.outer_unpack(handle)
            if kept.untyped_storage().data_ptr() in stats:
                frame.again[i] = kept   # the running statistics themselves
                continue
            equal = torch.equal(rerun[i], kept)
            same = same and equal
            frame.again[i] = rerun[i] if equal else kept
            del kept
        self.verdicts[frame.kind] = same
        self.trusted_new = self.trusted_new or same
        if not same:
            refuse(frame.region, _DIFFERS)

    def take_trusted(self) -> bool:
        """Whether a kind was trusted since the last call: its calls drop from now on, so the
        steps save another sequence than the one learnt."""
        trusted, self.trusted_new = self.trusted_new, False
        return trusted


def _kind(frame) -> tuple:
    """What cuDNN's choice of algorithm depends on, as far as a call shows it."""
    leaves = frame.inputs or ()
    return (tuple(type(m) for m in frame.region.modules),
            tuple((tuple(t.shape), t.stride(), t.dtype) for _, t, _ in leaves),
            tuple(frame.autocast))
