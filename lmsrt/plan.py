"""Record a step's sequence of saved storages, and plan which of them later steps offload.

Step 1 swaps every eligible storage (SwapEngine._swap_mark says why); a later step whose
sequence changed is reactive: storages are swapped once GPU use passes the mark (less 1/8, to
leave its backward room), so the *latest* ones go out, which backward needs first. From the step
after, if the sequence of saved storages repeats (same sizes in the same order), the plan
offloads the *earliest* ones instead: backward needs them last, so their copies have the whole
rest of forward to go out and most of backward to come back. It offloads only ``target`` bytes,
and the target follows the measured peak:

- after an unplanned step, ``target`` = the bytes that step swapped;
- after a planned step, it grows by how far GPU use at the end of forward (net of copies still in
  flight) would have stood over the mark without what the mark rule swapped beyond the plan, and
  shrinks by half the unused room when it stood well under with nothing swapped beyond the plan.

Growing by all the bytes swapped beyond the plan would ratchet: a transient inside forward (a
vocabulary-sized logits tensor, say) makes the mark rule swap a little every step whatever the
plan offloads, and the target would grow by that much each step until everything is offloaded.

The signal is use at the end of forward, not the step's peak: the plan controls what is resident
when backward starts, while a peak inside backward (gradients, workspaces, the one storage always
fetched ahead) does not fall by offloading more, and chasing it would end up swapping everything.

A sequence that differs (dynamic shapes) makes the rest of that step reactive and is recorded
for the next one.
"""
from __future__ import annotations

import bisect
import itertools
from typing import List

__all__ = ["OffloadPlan"]

# Shrink the target only when the peak is this far under the mark, so the plan does not oscillate.
_SLACK = 0.05
_RELEARN_LIVE = 16


class OffloadPlan:
    """Which saved storages (by index in the forward's sequence) to offload."""

    def __init__(self) -> None:
        self.recorded: List[int] = []   # storage sizes of the last finished step, in save order
        self.current: List[int] = []    # sizes seen so far in this step
        self.target = 0                 # bytes to offload, earliest first
        self.cutoff = 0                 # offload storages with index < cutoff
        self.planned = False            # False: this step is reactive
        self.matched = True             # this step's sequence matches the recording so far
        self.live: set = set()          # indices whose storage outlived the step anyway
        self.live_now: set = set()      # the same, seen in this step's backward
        self.live_age = 0               # steps since the live set was last relearnt

    @property
    def mode(self) -> str:
        return "plan" if self.planned and self.matched else "reactive"

    @property
    def followed(self) -> bool:
        """Whether the step so far (or just finished) repeated the recorded sequence."""
        return self.planned and self.matched and len(self.current) == len(self.recorded)

    def offload(self, index: int, nbytes: int) -> bool:
        """Record storage ``index`` of this step; True if the plan offloads it."""
        self.current.append(nbytes)
        if not (self.planned and self.matched):
            return False
        if index < len(self.recorded) and self.recorded[index] == nbytes:
            return index < self.cutoff
        self.matched = False
        return False

    def lives_on(self, index: int) -> bool:
        """Whether storage ``index`` (already recorded by ``offload``) stayed alive elsewhere
        through last step's backward, so that copying it out freed nothing."""
        return index in self.live and self.planned and self.matched

    def mark_live(self, index: int) -> None:
        self.live_now.add(index)

    def finish_step(self, forward_end_use: int, swapped: int, beyond_plan: int, mark: int) -> None:
        """Update the target from the step just finished and start recording the next one."""
        followed = self.followed
        # Storages kept because they outlived backward stay kept while the sequence repeats,
        # relearnt every _RELEARN_LIVE steps (a tensor a script held once, for a log, is not
        # pinned for good).
        self.live_age = self.live_age + 1 if followed and self.live_age < _RELEARN_LIVE else 0
        self.live, self.live_now = self.live_now | (self.live if self.live_age else set()), set()
        if followed:
            target = self.target + max(0, forward_end_use + beyond_plan - mark)
            room = mark * (1 - _SLACK) - forward_end_use
            if beyond_plan == 0 and room > 0:
                target -= room / 2
        else:
            # A reactive step's own overshoot comes from its backward (it swapped the latest
            # tensors, which come back first, at the peak): it says nothing about a plan.
            target = swapped
        self.recorded, self.current = self.current, []
        self.target = max(0, int(target))
        cumulative = list(itertools.accumulate(self.recorded))
        self.cutoff = min(len(cumulative), bisect.bisect_left(cumulative, self.target) + 1) \
            if self.target > 0 else 0
        self.planned = bool(self.recorded)
        self.matched = True
