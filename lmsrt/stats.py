"""Counters of the swap engine, per step and in total (their summary for people: summary.py).

A step is one forward and the backward after it (a micro-batch), not an optimizer step."""
from __future__ import annotations

import collections
import dataclasses
from typing import Deque, Dict

__all__ = ["StepStats", "RunStats", "SUMMED", "HISTORY_STEPS"]


def _summed(default):
    """A field of ``StepStats`` that adds up over steps (in ``SUMMED``)."""
    return dataclasses.field(default=default, metadata={"summed": True})


@dataclasses.dataclass
class StepStats:
    """What one step (one ``with lms:`` forward and the backward after it) did."""

    step: int = 0
    mode: str = "off"                     # "reactive" (step 1, or a changed sequence) or "plan"
    plan_target_bytes: int = 0            # bytes the plan meant to offload (earliest saved first)
    out_bytes: int = _summed(0)           # swapped out to pinned host memory
    out_tensors: int = _summed(0)         # storages swapped out (views of one storage count once)
    beyond_plan_bytes: int = _summed(0)   # of which the plan meant to keep: GPU use stood over the
                                          # policy's level when they were saved
    kept_bytes: int = _summed(0)          # eligible but kept on the GPU
    kept_tensors: int = _summed(0)
    skipped_tensors: int = _summed(0)     # saved tensors not eligible (small, parameters, other
                                          # devices)
    live_bytes: int = _summed(0)          # eligible but alive anyway (the caller holds them): kept
                                          # from the step after, used in place if already swapped
    live_tensors: int = _summed(0)
    recipe_bytes: int = _summed(0)        # offloaded without a copy: rebuilt in backward
                                          # (recompute)
    recipe_tensors: int = _summed(0)
    rebuilt_bytes: int = _summed(0)       # rebuilt in backward from their inputs
    rebuilt_tensors: int = _summed(0)
    rebuild_ms: float = _summed(0.0)      # GPU time of those rebuilds
    rebuild_checks: int = _summed(0)      # rebuilds checked bit for bit against a copy
    recomputed_regions: int = _summed(0)  # region calls whose saved tensors forward dropped, to
                                          # run again in backward (recompute/regions.py)
    recomputed_bytes: int = _summed(0)    # what they dropped: freed without a copy
    recompute_ms: float = _summed(0.0)    # GPU time of their reruns in backward (read once done)
    in_bytes: int = _summed(0)            # brought back for backward
    in_tensors: int = _summed(0)
    prefetch_hits: int = _summed(0)       # needed tensor was already fetched ahead
    prefetch_misses: int = _summed(0)     # needed tensor was fetched on demand
    swapin_wait_ms: float = _summed(0.0)  # time the compute stream waited on swap-in copies
    swapout_waits: int = _summed(0)       # times forward waited on a swap-out to stay under the
                                          # mark
    swapout_wait_ms: float = _summed(0.0)  # time the compute stream waited on those copies
    host_refused: int = _summed(0)        # swap-outs refused by the host budget (kept on the GPU)
    alloc_retries: int = _summed(0)       # times the CUDA allocator had to free its cache to go on
    alloc_failures: int = _summed(0)      # allocations that failed at the limit and were caught
                                          # (cuDNN then runs a slower algorithm, and keeps it for
                                          # the run)
    prefetch_dropped: int = _summed(0)    # restored copies given back unused: use ran over the plan
    backward_retries: int = _summed(0)    # allocations of backward tried again (copies given back)
    cpu_s: float = _summed(0.0)           # CPU seconds of the process's threads from this step's
                                          # start to the next's (near its wall time: the host is
                                          # the limit, not the GPU)
    optimizer_in_bytes: int = _summed(0)  # optimizer state brought back for optimizer steps
    optimizer_out_bytes: int = _summed(0)  # and written back to host memory after them
    optimizer_update_ms: float = _summed(0.0)  # GPU time of the optimizer steps whose state
                                          # moved: copies in, the update (not the last copies
                                          # out: they run on their own stream after it)
    optimizer_host_bytes: int = 0         # optimizer state in host memory at the end of the step
                                          # (movers/optimizer.py)
    gpu_peak_bytes: int = 0               # peak allocated GPU memory of the step
    forward_end_bytes: int = 0            # GPU use when forward ended, net of copies still in
                                          # flight
    host_pinned_bytes: int = 0            # pinned host memory held at the end of the step
    host_peak_bytes: int = 0              # peak pinned bytes in use
    host_pin_s: float = _summed(0.0)      # seconds spent pinning host memory (all pinning threads)
    host_pin_wait_s: float = _summed(0.0)  # of which the training thread waited for a pin
    host_lagged: int = _summed(0)         # swap-outs kept on the GPU while the pins they needed ran
    deferred_tensors: int = _summed(0)    # of which forward went on, their copies started once the
                                          # pins landed (those still without one at forward's end:
                                          # kept)
    # pinned bytes unregistered and freed (use had shrunk)
    host_given_back_bytes: int = _summed(0)
    host_pins_in_flight: int = 0          # pins under way at the end of the step
    bound_bytes: int = 0                  # the level lmsrt kept use under: lms_frac x the limit, or
                                          # under lms_frac="auto" the limit less the headroom
    headroom_bytes: int = 0               # auto: room kept free under the limit (fragmentation,
                                          # error)
    predicted_peak_bytes: int = 0         # auto: the peak the plan predicted for this step
    policy_note: str = ""                 # auto: what the policy learnt or changed after this step

    def count_kept(self, nbytes: int, tensors: int = 1, live: bool = False) -> None:
        """``tensors`` eligible storages of ``nbytes`` in all stayed on the GPU (``live``: alive
        anyway, the caller holds them)."""
        if live:
            self.live_bytes += nbytes
            self.live_tensors += tensors
        else:
            self.kept_bytes += nbytes
            self.kept_tensors += tensors

    def __post_init__(self) -> None:
        # (forward point, bytes) of each storage swapped out and each rebuilt, in the order
        # counted: what recompute/account.py attributes to blocks. Not fields: not in as_dict.
        self.out_points: list = []
        self.recipe_points: list = []

    def count_out(self, nbytes: int, point: int) -> None:
        """The storage saved at forward ``point`` (``nbytes``) was copied out to host memory."""
        self.out_bytes += nbytes
        self.out_tensors += 1
        self.out_points.append((point, nbytes))

    def count_recipe(self, nbytes: int, point: int) -> None:
        """The storage saved at forward ``point`` (``nbytes``) is rebuilt in backward."""
        self.recipe_bytes += nbytes
        self.recipe_tensors += 1
        self.recipe_points.append((point, nbytes))

    def count_recomputed(self, nbytes: int) -> None:
        """A region call dropped ``nbytes`` of saved tensors, to run again in backward."""
        self.recomputed_regions += 1
        self.recomputed_bytes += nbytes

    def as_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


# The fields that add up over steps (``RunStats`` keeps their sums), read from the marks above.
SUMMED = tuple(f.name for f in dataclasses.fields(StepStats) if f.metadata.get("summed"))


# Finished steps kept for ``LMS.stats()["history"]``. A run of a million steps must not grow by a
# record per step, nor make each ``stats()`` call slower: totals are kept as running sums.
HISTORY_STEPS = 200


@dataclasses.dataclass
class RunStats:
    """Running totals of all finished steps, and the last ``HISTORY_STEPS`` of them."""

    history: Deque[StepStats] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_STEPS))
    steps: int = 0
    sums: Dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(SUMMED, 0))
    gpu_peak_bytes: int = 0
    host_peak_bytes: int = 0

    def add(self, step: StepStats) -> None:
        # Its points are the block account's of the step in flight only: not kept in history.
        step.out_points, step.recipe_points = [], []
        self.history.append(step)
        self.steps += 1
        for name in SUMMED:
            self.sums[name] += getattr(step, name)
        self.gpu_peak_bytes = max(self.gpu_peak_bytes, step.gpu_peak_bytes)
        self.host_peak_bytes = max(self.host_peak_bytes, step.host_peak_bytes)

    def totals(self, current: StepStats) -> Dict[str, object]:
        """Sums over the finished steps and ``current`` (the step in flight, if any)."""
        live = [current] if current.step else []
        total: Dict[str, object] = {name: self.sums[name] + sum(getattr(s, name) for s in live)
                                    for name in SUMMED}
        total["steps"] = self.steps + len(live)
        total["gpu_peak_bytes"] = max([self.gpu_peak_bytes] + [s.gpu_peak_bytes for s in live])
        total["host_peak_bytes"] = max([self.host_peak_bytes] + [s.host_peak_bytes for s in live])
        total["host_pinned_bytes"] = current.host_pinned_bytes
        total["optimizer_host_bytes"] = current.optimizer_host_bytes
        total["host_pins_in_flight"] = current.host_pins_in_flight
        return total
