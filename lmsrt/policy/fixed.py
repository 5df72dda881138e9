"""``FixedPolicy``: Caffe's ``lms_frac``, one mark for every level.

NOTE [ Fixed mark ]
Step 1 swaps every eligible storage (``FixedPolicy.swap_at`` says why). The plan's target then
follows use at the end of forward: it grows by how far that use (net of copies in flight) stood
over the mark without what the mark rule swapped beyond the plan, and shrinks by half the unused
room when it stood well under with nothing swapped beyond the plan. Growing by everything swapped
beyond the plan would ratchet: a transient inside forward (a vocabulary-sized logits tensor)
makes the mark rule swap a little every step whatever the plan offloads. The signal is use at the
end of forward, not the step's peak: the plan controls what is resident when backward starts,
while a peak inside backward does not fall by offloading more.
"""
from __future__ import annotations

from typing import List, Optional

from ..options import spelled
from ..plan import OffloadPlan
from ..units import format_bytes
from .protocol import LimitShares

__all__ = ["FixedPolicy"]

_SLACK = 0.05      # FixedPolicy shrinks its target only when this far under the mark


class FixedPolicy(LimitShares):
    """``lms_frac`` a number: swapping starts when GPU use passes ``lms_frac`` x the limit.

    Example::

        policy = FixedPolicy(0.4, limit=16 << 30, window=1 << 30)
        policy.bound == policy.mark == int(0.4 * (16 << 30))
    """

    recording = None          # records no profile
    adapts_to_retries = False
    pins_for_deferred = True  # a first step swaps what it defers (engine, NOTE [ Deferred copies ])

    def __init__(self, lms_frac: float, limit: int, window: int):
        self.lms_frac = lms_frac
        self.limit = limit
        self.mark = int(lms_frac * limit)
        # At a mark of 0 every byte is over it: let this much be held while its copies run, so
        # they overlap forward instead of each pack waiting for the last copy.
        self.overlap = min(window, limit >> 3)
        self._first = True
        self._reactive_mark = self.mark - (self.mark >> 3)

    @property
    def bound(self) -> int:
        return self.mark

    def begin_step(self, plan: OffloadPlan, base: int, first: int) -> None:
        pass

    @staticmethod
    def lean_step(plan: OffloadPlan) -> bool:
        """A planned step that offloads nothing may take the lean path that keeps everything
        (engine/native.py, NOTE [ Steps that keep everything ])."""
        return plan.planned and plan.target == 0

    def may_lag(self, plan: OffloadPlan) -> bool:
        """Whether a swap may leave its tensor on the GPU while its pin runs: not in the first
        step, which holds the least (``swap_at``)."""
        return not self._first

    def swap_at(self, plan: OffloadPlan, i: int) -> int:
        """The first step swaps every eligible storage. It is the step in which cuDNN and cuBLAS
        pick an algorithm per shape and keep it for the run, each time the fastest whose
        workspace fits in what is free then; and a reactive step keeps its earliest storages
        through the whole of its backward, so it runs out of memory where planned steps fit.
        Measured on an H200 (benchmarks/results): a segmentation net at a 12 GiB cap, lms_frac
        0.45, 1.89 s a step with a reactive first step against 0.43 s (cuDNN's dgrad picked
        under pressure took 1.44 s of backward instead of 0.23 s); a GPT stack at an 8 GiB cap
        ran out of memory in step 1 at every lms_frac above 0.5, and fits at 0.7 this way.

        Later reactive steps (a changed sequence) swap the latest storages, which their backward
        needs first, on demand, right at the peak: from 1/8 under the mark, to leave them room."""
        if self._first:
            return 0
        return self.mark if plan.mode == "plan" else self._reactive_mark

    def hold_to(self, plan: OffloadPlan, i: int) -> int:
        return self.mark

    def swap_levels(self, plan: OffloadPlan, n: int) -> List[int]:
        """``swap_at`` of points 0 to n - 1, in one call."""
        return [self.swap_at(plan, 0)] * n

    def fetch_to(self, plan: OffloadPlan, j: int) -> int:
        return self.mark

    @staticmethod
    def lone_fetch_under(level: int) -> int:
        """At a fetch level of 0, the one storage fetched ahead goes at any use (0: no cap)."""
        return 0

    @staticmethod
    def shed_to(plan: OffloadPlan, level: int) -> int:
        """Copies fetched ahead are never given back (0: shed nothing)."""
        return 0

    def relearn(self) -> None:
        """Plan from the next step as from the first (what the model saves changed)."""
        self._first = True

    def finish_step(self, plan: OffloadPlan, *, followed: bool, forward_end_use: int,
                    swapped: int, beyond_plan: int, peak: int, retries: int,
                    failures: int = 0, over: Optional[tuple] = None,
                    tuning: bool = False) -> None:
        """NOTE [ Fixed mark ]."""
        self._first = False
        mark = self.mark
        if followed:
            target = plan.target + max(0, forward_end_use + beyond_plan - mark)
            room = mark * (1 - _SLACK) - forward_end_use
            if beyond_plan == 0 and room > 0:
                target -= room / 2
        else:
            # A reactive step's own overshoot comes from its backward (it swapped the latest
            # tensors, which come back first, at the peak): it says nothing about a plan.
            target = swapped
        plan.set_target(max(0, int(target)))

    @staticmethod
    def step_figures() -> dict:
        return {}

    @staticmethod
    def note() -> str:
        return ""

    def swaps_everything(self) -> bool:
        return self.mark == 0

    def oom_level(self, config) -> str:
        return f"swapping starts at {format_bytes(self.mark)} (lms_frac={config.lms_frac:g})"

    @staticmethod
    def oom_lines() -> List[str]:
        return []

    @staticmethod
    def oom_to_fit(config, lower_lms: str) -> str:
        return (f"  To fit: lower lms_frac ({spelled('lms_frac')}, now {config.lms_frac:g}) so "
                f"swapping starts earlier; {lower_lms}; set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation; or run "
                "`lmsrt profile` to see the largest layer's working set, below which no offload "
                "goes.")
