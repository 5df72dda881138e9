"""CacheTrims (``trims``): the caching allocator's free pages given back between steps, where
its retries are its layout's and not the plan's.

NOTE [ Cache trims ]
An allocator retry (the cache freed, the device synced, the allocation tried again: ~13 ms on an
H200) can come from how the cache lies rather than from how much is allocated. Once one retry
has unmapped the free pages of an expandable segment in the middle of a step, the pages mapped
after it lie where that step's frees left room, not where the next step asks for it; each step
then maps past the cap once more and retries again, for good. Measured on transformers' Trainer
with its own checkpointing at a 14 GiB cap on an H200 (lmsrt moving nothing): one retry in every
step from step 3 at a peak of 11.82 GiB allocated and ~12.2 reserved, 0.250 s a step; the same
run without lmsrt grew its one segment to 13.46 GiB in its first two steps and never retried,
0.239 s. More headroom cannot answer that (the plan already holds nothing); freeing the cache
between steps can: at a step's start only what outlives steps is allocated, and the step maps
its pages afresh, in the order it asks for them, as a first step does.

  1. A planned step (one that followed its plan) with an allocator retry has the cache trimmed
     (``Device.trim_cache``) as the next step starts, and its retries count as answered: the
     policy sees none (NOTE [ Auto ], 4, is for retries the plan's holdings cause).
  2. A planned step that retried right after a trim says the trim did not answer: its retries go
     to the policy, and the next trim waits twice as long as the last (1, 2, 4 ... 64 steps).
     A step after a trim without a retry resets the wait to one step.
  3. Steps that learn or leave their plan are not trimmed for: their allocations are not the
     steps' that follow.

A trim costs about what one retry does (its pages unmapped, then mapped again by the next step)
and a device sync, once.
"""
from __future__ import annotations

__all__ = ["CacheTrims"]

_MAX_WAIT = 64


class CacheTrims:
    """When to give the allocator's free pages back between steps (NOTE [ Cache trims ])."""

    def __init__(self):
        self.count = 0           # trims made
        self._last = None        # the step whose retries the last trim answered
        self._wait = 1           # steps from one trim to the next
        self._after = False      # the step finishing ran right after a trim

    def answer(self, step: int, planned: bool, retries: int) -> bool:
        """Whether to trim as the step after ``step`` begins; ``step``'s retries are then
        answered (Rule 1). ``planned``: the step followed its plan."""
        after, self._after = self._after, False
        if not planned or not retries:
            if after and planned:
                self._wait = 1
            return False
        if after:                                        # Rule 2: the trim did not answer
            self._wait = min(_MAX_WAIT, self._wait * 2)
            return False
        if self._last is not None and step - self._last < self._wait:
            return False
        self._last, self._after = step, True
        self.count += 1
        return True
