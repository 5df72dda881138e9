"""``Policy``: the questions the engine asks a swap policy, declared as ``Device`` is
(lmsrt/device.py); and ``LimitShares``, the fractions of the limit that every policy answers
alike.

A policy answers in bytes of GPU use (allocated) and in yes or no; the engine never asks which
kind of policy it has. A planner that rebuilds whole regions, or a pass over a compiled graph,
answers the same questions.

Example::

    def may_defer_here(policy: Policy, use: int) -> bool:
        return policy.may_defer(use)
"""
from __future__ import annotations

from typing import List, Optional, Protocol

from ..config import LMSConfig
from ..plan import OffloadPlan
from ..recompute.plan import StepFigures, memory_budget
from .profile import Profile

__all__ = ["Policy", "LimitShares"]


class Policy(Protocol):
    """What the engine asks of a swap policy (``FixedPolicy``, ``AutoPolicy``)."""

    limit: int                  # the bytes this process may allocate
    bound: int                  # the level GPU use is kept under (``LMS.stats()``'s mark)
    overlap: int                # at a hold level of 0, the bytes held while their copies run
    adapts_to_retries: bool     # it answers allocator retries itself (no warning needed)
    pins_for_deferred: bool     # a deferred swap may start a pin (else: host memory at hand)
    recording: Optional[Profile]    # the profile this step records, if it learns

    # -- the step --------------------------------------------------------------------------
    def begin_step(self, plan: OffloadPlan, base: int, first: int) -> None: ...
    def lean_step(self, plan: OffloadPlan) -> bool: ...
    def relearn(self) -> None: ...
    def finish_step(self, plan: OffloadPlan, *, followed: bool, forward_end_use: int,
                    swapped: int, beyond_plan: int, peak: int, retries: int,
                    failures: int = 0, over: Optional[tuple] = None,
                    tuning: bool = False) -> None: ...

    # -- how much may be held at this point --------------------------------------------------
    def swap_at(self, plan: OffloadPlan, i: int) -> int: ...
    def swap_levels(self, plan: OffloadPlan, n: int) -> List[int]: ...
    def hold_to(self, plan: OffloadPlan, i: int) -> int: ...

    # -- may this copy wait, or be deferred ---------------------------------------------------
    def must_wait(self, plan: OffloadPlan, use: int) -> bool: ...
    def may_defer(self, use: int) -> bool: ...
    def may_keep_deferred(self, use: int) -> bool: ...
    def check_fits(self, use: int) -> bool: ...
    def step_fits(self, peak: int) -> bool: ...
    def room_beside(self, peak: int) -> int: ...

    # -- what to fetch next, and how far ahead ------------------------------------------------
    def fetch_to(self, plan: OffloadPlan, j: int) -> int: ...
    def lone_fetch_under(self, level: int) -> int: ...
    def shed_to(self, plan: OffloadPlan, level: int) -> int: ...

    # -- what compiled blocks may keep --------------------------------------------------------
    def compiled_budget(self, step: StepFigures, blocks: int) -> float: ...

    # -- what it tells ------------------------------------------------------------------------
    def step_figures(self) -> dict: ...
    def note(self) -> str: ...
    def swaps_everything(self) -> bool: ...
    def oom_level(self, config: LMSConfig) -> str: ...
    def oom_lines(self) -> List[str]: ...
    def oom_to_fit(self, config: LMSConfig, lower_lms: str) -> str: ...


class LimitShares:
    """The fractions of the limit that every policy answers alike (``self.limit``: bytes)."""

    limit: int

    def may_lag(self, plan: OffloadPlan) -> bool:
        raise NotImplementedError

    def must_wait(self, plan: OffloadPlan, use: int) -> bool:
        """Whether a swap at GPU use ``use`` waits for a pin under way rather than leave its
        tensor on the GPU while the pin runs: where the policy says a step must not lag
        (``may_lag``), or within 1/8 of the limit."""
        return not self.may_lag(plan) or use > self.limit - (self.limit >> 3)

    def may_defer(self, use: int) -> bool:
        """Whether a swap that must not leave its tensor on the GPU may still start its copy
        later, once its pin lands (engine/deferred.py, NOTE [ Deferred copies ]): while use is
        under a quarter of the limit (auto: half). Over it, deferred copies start at once,
        waiting."""
        return use <= self.limit >> 2

    def may_keep_deferred(self, use: int) -> bool:
        """Whether deferred swaps still without a pin when forward ends stay on the GPU for
        backward: while use is under 1/16 of the limit (auto: half)."""
        return use <= self.limit >> 4

    def compiled_budget(self, step: StepFigures, blocks: int) -> float:
        """The recompute budget of blocks compiled under this LMS that save ``blocks`` bytes a
        step, from a learnt step's figures (recompute/compiled.py, NOTE [ Regions under LMS ],
        Rule 7; ``recompute.plan.memory_budget``); 1.0 leaves torch's default."""
        return memory_budget(step, blocks)

    def check_fits(self, use: int) -> bool:
        """Whether a recipe's check in forward fits: ``use`` (allocated plus what the rebuild
        and its comparison need) within 1/16 of the limit (engine/recipes.py)."""
        return use <= self.limit - (self.limit >> 4)

    def step_fits(self, peak: int) -> bool:
        """Whether a step peaking at ``peak`` fits: within 1/16 of the limit (the allocator's
        room beside what is allocated; movers/optimizer.py asks it of a step with its optimizer
        state added)."""
        return peak <= self.limit - (self.limit >> 4)

    def room_beside(self, peak: int) -> int:
        """Bytes a step peaking at ``peak`` may add and still fit with a margin (1/32 of the
        limit beyond ``step_fits``' sixteenth): what optimizer state may stay on the GPU once
        some must leave (movers/optimizer.py)."""
        return max(0, self.limit - (self.limit >> 4) - (self.limit >> 5) - peak)
