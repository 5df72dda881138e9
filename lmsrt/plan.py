"""Record a step's sequence of saved storages, and which of them later steps offload.

A step records the sizes of the storages it saves, in save order. If the next step repeats the
sequence (same sizes in the same order), it follows the plan: it offloads the storages before
``cutoff`` (or those ``chosen``), the *earliest* ones, which backward needs last, so their
copies have the whole rest of
forward to go out and most of backward to come back. How far the cutoff reaches is the policy's
decision (policy/: a fixed mark's target in bytes, or the smallest cutoff whose predicted peak
fits). A sequence that differs (dynamic shapes) makes the rest of that step reactive and is
recorded for the next one. The sequence a step is matched against is the last step's, unless the
policy planned for another (``expect``: the sequence its profile learnt); a step that differs
from it by a larger storage, or by more of them, has ``grown`` from there on.

Storages that the engine may rebuild in backward instead of moving (``rebuildable``:
engine/recipes.py, NOTE [ Rebuilt storages ]) cost no copy to offload, so a target in bytes takes
them first. A rebuild reads its inputs at the storage's first use, before their own: where that
would not fit, the policy moves the storage instead (``swapped``).

Storages that outlived last step's backward anyway (an input batch, a buffer, a frozen weight
held as a tensor) are kept: copying them out frees nothing. That set is relearnt every
``_RELEARN_LIVE`` steps, so a tensor a script held once, for a log, is not pinned for good.
"""
from __future__ import annotations

import bisect
import itertools
from typing import List, Optional

from .units import format_bytes

__all__ = ["OffloadPlan"]

_RELEARN_LIVE = 16


class OffloadPlan:
    """Which saved storages (by index in the forward's sequence) to offload."""

    def __init__(self) -> None:
        self.recorded: List[int] = []   # storage sizes of the last finished step, in save order
        self.current: List[int] = []    # sizes seen so far in this step
        self.target = 0                 # bytes to offload, earliest first
        self.cutoff = 0                 # offload storages with index < cutoff
        self.chosen: List[bool] = []    # or, if not empty: offload storage i if chosen[i]
        self.planned = False            # False: this step is reactive
        self.expected: Optional[List[int]] = None   # the sequence planned for (None: recorded)
        self.matched = True             # this step's sequence matches the expected one so far
        self.grown = False              # it differed by a larger storage, or by more of them
        self.diverged: Optional[tuple] = None   # where: (index, bytes expected or None, bytes,
                                                # shape, dtype), for the notes
        self.repeated = False           # the step just finished repeated the one before it
        self.live: set = set()          # indices whose storage outlived the step anyway
        self.live_now: set = set()      # the same, seen in this step's backward
        self.live_age = 0               # steps since the live set was last relearnt
        self.rebuildable: dict = {}     # indices the engine may rebuild instead of moving ->
                                        # the indices of the saved storages their recipes read
        self.swapped: set = set()       # rebuildable ones that the chosen offloads move

    @property
    def mode(self) -> str:
        return "plan" if self.planned and self.matched else "reactive"

    @property
    def sequence(self) -> List[int]:
        """The sequence this step is planned for and matched against."""
        return self.recorded if self.expected is None else self.expected

    @property
    def followed(self) -> bool:
        """Whether the step so far (or just finished) repeated the expected sequence."""
        return self.planned and self.matched and len(self.current) == len(self.sequence)

    @property
    def copied(self) -> int:
        """The target's bytes that are copied out rather than rebuilt: what the host must hold."""
        if not self.rebuildable:
            return self.target
        sequence = self.sequence
        flags = self.chosen or [i < self.cutoff for i in range(len(sequence))]
        return sum(n for i, (n, out) in enumerate(zip(sequence, flags))
                   if out and (i not in self.rebuildable or i in self.swapped))

    def expect(self, sizes: List[int]) -> None:
        """Plan this step for ``sizes`` (a learnt profile's) rather than the last step's."""
        self.expected = list(sizes)
        self.planned = bool(sizes)

    def offload(self, index: int, nbytes: int, tensor=None) -> bool:
        """Record storage ``index`` of this step (saved as ``tensor``, for the notes); True if
        the plan offloads it."""
        self.current.append(nbytes)
        if not (self.planned and self.matched):
            return False
        sequence = self.sequence
        if index < len(sequence) and sequence[index] == nbytes:
            chosen = self.chosen
            if chosen:
                # Flags made for a sequence of another length (a profile learnt before the
                # batch grew) say nothing past their end: kept, as the policy's levels decide.
                return index < len(chosen) and chosen[index]
            return index < self.cutoff
        self.matched = False
        self.grown = index >= len(sequence) or nbytes > sequence[index]
        self.diverged = (index, sequence[index] if index < len(sequence) else None, nbytes,
                         None if tensor is None else tuple(tensor.shape),
                         None if tensor is None else str(tensor.dtype).replace("torch.", ""))
        return False

    def divergence(self) -> str:
        """Where this step (or the one just finished) left the sequence it was planned for, in
        words; "" where it did not."""
        if self.diverged is None:
            short = self.planned and self.matched and len(self.current) < len(self.sequence)
            return (f"{len(self.current)} storages saved where {len(self.sequence)} were "
                    f"planned for" if short else "")
        index, expected, nbytes, shape, dtype = self.diverged
        what = f"{format_bytes(nbytes)}" + (f" ({dtype} {list(shape)})" if shape is not None
                                             else "")
        if expected is None:
            said = f"storage {index + 1} saved, {what}, where {index} were planned for"
        else:
            said = f"storage {index + 1} was {what} where {format_bytes(expected)} was planned for"
        # The sizes around it, planned and saved: an extra storage shifts the rest, another
        # kernel's differ at one place only.
        return (f"{said}; planned {_around(self.sequence, index)}, saved "
                f"{_around(self.current, index)}")

    def outgrew(self, learnt: List[int]) -> bool:
        """Whether the step just finished outgrew ``learnt``: where the two first differ, its
        storage is the larger, or it saved more of them."""
        for mine, theirs in zip(self.recorded, learnt):
            if mine != theirs:
                return mine > theirs
        return len(self.recorded) > len(learnt)

    def lives_on(self, index: int) -> bool:
        """Whether storage ``index`` (already recorded by ``offload``) stayed alive elsewhere
        through last step's backward, so that copying it out freed nothing."""
        return index in self.live and self.planned and self.matched

    def mark_live(self, index: int) -> None:
        self.live_now.add(index)

    def finish_step(self, rebuildable=None) -> bool:
        """Start recording the next step; return whether the one just finished followed the
        plan. ``rebuildable``: the indices of the step just finished that the next may rebuild
        instead of moving, each with the indices its recipe reads (a dict), or a set of them
        (reading none). The policy then sets the target (``set_target`` or ``set_cutoff``)."""
        followed = self.followed
        self.repeated = bool(self.current) and self.current == self.recorded
        self.rebuildable = (dict(rebuildable) if isinstance(rebuildable, dict)
                            else dict.fromkeys(rebuildable or (), ()))
        self.live_age = self.live_age + 1 if followed and self.live_age < _RELEARN_LIVE else 0
        self.live, self.live_now = self.live_now | (self.live if self.live_age else set()), set()
        self.recorded, self.current = self.current, []
        self.planned = bool(self.recorded)
        self.expected = None
        self.matched = True
        self.grown = False
        self.diverged = None
        return followed

    def set_target(self, target: int) -> None:
        """Offload the earliest storages whose sizes add up to at least ``target`` bytes (at
        most all of them: a target past what the step saves, grown by GPU use that is not
        lmsrt's, would otherwise pin host memory for nothing); rebuildable ones first."""
        cumulative = list(itertools.accumulate(self.recorded))
        self.target = min(max(0, int(target)), cumulative[-1] if cumulative else 0)
        self.chosen, self.swapped = [], set()
        self.cutoff = min(len(cumulative), bisect.bisect_left(cumulative, self.target) + 1) \
            if self.target > 0 else 0
        if self.rebuildable and self.target > 0:
            chosen, left = [False] * len(self.recorded), self.target
            first = sorted(i for i in self.rebuildable if i < len(chosen))
            rest = (i for i in range(len(chosen)) if i not in self.rebuildable)
            for i in itertools.chain(first, rest):
                if left <= 0:
                    break
                chosen[i] = True
                left -= self.recorded[i]
            self.set_offloaded(chosen)

    def set_cutoff(self, cutoff: int) -> None:
        """Offload the storages before ``cutoff``."""
        self.cutoff = max(0, min(cutoff, len(self.recorded)))
        self.target = sum(self.recorded[:self.cutoff])
        self.chosen, self.swapped = [], set()

    def set_offloaded(self, chosen: List[bool], swapped=()) -> None:
        """Offload storage i if ``chosen[i]`` (one flag per recorded storage); move those in
        ``swapped`` although rebuildable."""
        self.chosen, self.swapped = list(chosen), set(swapped)
        self.target = sum(n for n, out in zip(self.sequence, chosen) if out)
        self.cutoff = max((i + 1 for i, out in enumerate(chosen) if out), default=0)


def _around(sizes: List[int], index: int) -> str:
    """``sizes`` from two before ``index`` to three after it, the one at ``index`` bracketed."""
    first = max(0, index - 2)
    return " / ".join(f"[{format_bytes(n)}]" if i == index else format_bytes(n)
                     for i, n in enumerate(sizes[first:index + 4], first)) or "none"
