"""The region plan as data (regions.py, NOTE [ Region plan ]): what a step's figures say about
which regions to recompute, and how much compiled blocks may keep (compiled.py, NOTE [ Regions
under LMS ], Rule 7); the link's speed they are weighed by (``link_bandwidth``).

Example::

    step = StepFigures(excess=12 << 30, saved=15 << 30, rebuilt=0, t_fwd=0.05, t_bwd=0.1,
                       bandwidth=55e9)
    choose_regions([(1 << 30, 0.003)] * 16, step)
    memory_budget(step, blocks=14 << 30)       # 0.3: the share of their saves blocks may keep
"""
from __future__ import annotations

import dataclasses
import math
import time
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_leaves

from ..device import copy_bandwidth
from ..units import format_bytes

__all__ = ["StepFigures", "calibrated", "checked", "choose_regions", "end_region", "end_span",
           "ignore_step", "link_bandwidth", "mark_span", "memory_budget", "over_bound",
           "rerun_peak", "RetriedSteps", "SurveyCalls", "timed_order", "unfit_note",
           "LEAST_BUDGET", "SIM_BANDWIDTH", "UNCALLED"]

SIM_BANDWIDTH = float("inf")   # the simulated device's copies take no step time (a test
                               # sets ``Regions.bandwidth`` to make them cost)
_PROBE_BYTES = 64 << 20  # a copy this large measures the link's bandwidth, once
_PROBED: dict = {}       # device index -> the bandwidth its probe measured
UNCALLED = ("its calls ran inside the script's own checkpointing (or another saved-tensor "
            "hook), where lmsrt leaves them")
LEAST_BUDGET = 0.1      # memory_budget's floor: below it the partitioner keeps little more than
                        # the blocks' inputs, and what must still leave is moved
_BUDGET_STEP = 0.05     # budgets are rounded down to this: one said, compiled and cached value
_EXPOSED_SLACK = 0.05   # waits under the prediction plus this share of the passes' time are the
                        # plan's own (``checked``)
RETRY_STEPS = 4         # planned steps in a row whose allocator retried: one region more
RETRY_S = 0.012         # what one retry costs a step (``RetriedSteps``)


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What the region plan knows of a step (NOTE [ Region plan ]), in bytes and seconds."""

    excess: int         # over the bound, were every saved tensor kept
    saved: int          # saved in all (eligible storages)
    rebuilt: int        # of which the engine rebuilds rather than moves
    t_fwd: float
    t_bwd: float
    bandwidth: float    # of the link, each way
    hide: float = 1.0   # the share of forward's and backward's time copies hide under (1.0 at
                        # first; measured from a planned step's waits: ``calibrated``)

    def moved(self, freed: int) -> float:
        """Bytes that cross the link each way where recomputed regions free ``freed``: the
        excess left, less what the engine rebuilds (the same share of what remains)."""
        share = self.rebuilt / self.saved if self.saved else 0.0
        return max(0.0, self.excess - freed - share * max(0, self.saved - freed))

    def swap_seconds(self, freed: int) -> float:
        """Step time the swaps cost where recomputed regions free ``freed`` bytes: the copy
        time that compute does not hide (out: under ``hide`` of forward's; in: of backward's)."""
        t = self.moved(freed) / self.bandwidth
        return max(0.0, t - self.hide * self.t_fwd) + max(0.0, t - self.hide * self.t_bwd)


def choose_regions(regions: Sequence[Tuple[int, float]], step: StepFigures) -> List[int]:
    """NOTE [ Region plan ]: the indices (in forward order) of the regions to recompute.

    ``regions`` are (bytes a recompute frees, seconds its forward takes). Recomputing a region
    costs its forward time and frees its bytes; swaps cost ``step.swap_seconds``. Regions are
    taken from the last in forward (backward needs them first, where their copies would hide
    worst), skipping any whose forward takes longer than a copy of its bytes (moving them never
    costs more); the count taken is the one of least predicted time, the fewest on a tie (none
    where the swaps hide already).

    Example::

        step = StepFigures(excess=12 << 30, saved=15 << 30, rebuilt=0, t_fwd=0.05, t_bwd=0.1,
                           bandwidth=55e9)
        choose_regions([(1 << 30, 0.003)] * 16, step)   # the last ones, as many as pay
    """
    best, best_cost = 0, step.swap_seconds(0)
    freed, spent, taken = 0, 0.0, []
    for i in range(len(regions) - 1, -1, -1):
        nbytes, seconds = regions[i]
        if not best_cost:
            break
        if seconds * step.bandwidth >= nbytes:
            continue
        freed, spent = freed + nbytes, spent + seconds
        taken.append(i)
        cost = spent + step.swap_seconds(freed)
        if cost < best_cost:
            best, best_cost = len(taken), cost
        if cost == spent:
            break                      # nothing left to move that does not hide
    return sorted(taken[:best])


def calibrated(step: StepFigures, freed: int, exposed: float) -> StepFigures:
    """``step`` made to predict ``exposed`` seconds of copies not hidden where regions free
    ``freed`` bytes: what a planned step's compute stream was measured to wait for its copies
    (``swapout_wait_ms`` and ``swapin_wait_ms``; NOTE [ Region plan ], 5). Less of forward and
    backward hides copies (``hide``), and where none hiding is still too little, the link is
    slower than probed (``bandwidth``). Never more hopeful than ``step``.

    Example::

        step = StepFigures(excess=8 << 30, saved=16 << 30, rebuilt=0, t_fwd=0.06, t_bwd=0.12,
                           bandwidth=55e9)
        calibrated(step, freed=0, exposed=0.2).hide      # 0.624 of the passes hides copies
    """
    if exposed <= step.swap_seconds(freed):
        return step
    blind = dataclasses.replace(step, hide=0.0)
    if blind.swap_seconds(freed) <= exposed:
        moved = blind.moved(freed)
        slower = 2 * moved / exposed if exposed > 0 and moved else step.bandwidth
        return dataclasses.replace(blind, bandwidth=min(step.bandwidth, slower))
    lo, hi = 0.0, step.hide                 # swap_seconds falls as hide grows
    for _ in range(40):
        mid = (lo + hi) / 2
        if dataclasses.replace(step, hide=mid).swap_seconds(freed) > exposed:
            lo = mid
        else:
            hi = mid
    return dataclasses.replace(step, hide=round(lo, 3))


def checked(figures: StepFigures, step) -> Tuple[StepFigures, List[str]]:
    """NOTE [ Region plan ], 5: ``figures`` made to agree with the first planned step (a
    ``StepStats``), and what disagreed, in words (none: the plan stands). Where the step took
    more off the GPU (moved, rebuilt, recomputed) than the excess by over an eighth, the
    excess is what it took; where its compute stream waited longer for copies than predicted
    (by over 5% of the passes' time), ``calibrated`` to those waits."""
    said = []
    left = step.out_bytes + step.recipe_bytes + step.recomputed_bytes
    if left > figures.excess + (figures.excess >> 3):
        figures = dataclasses.replace(figures, excess=left, rebuilt=step.recipe_bytes)
        said.append(f"step {step.step} took {format_bytes(left)} off the GPU, more than the "
                    "plan's excess")
    exposed = (step.swapout_wait_ms + step.swapin_wait_ms) / 1e3
    freed = step.recomputed_bytes
    predicted = figures.swap_seconds(freed)
    if exposed > predicted + _EXPOSED_SLACK * (figures.t_fwd + figures.t_bwd):
        figures = calibrated(figures, freed, exposed)
        said.append(f"its copies stalled compute {exposed * 1e3:.1f} ms, "
                    f"{predicted * 1e3:.1f} predicted")
    return figures, said


def link_bandwidth(device) -> float:
    """Pinned device-to-host copy bandwidth, bytes/s: one probe per device and process, when a
    plan first needs it (the simulated device's copies take no time: ``SIM_BANDWIDTH``)."""
    if device.kind == "sim":
        return SIM_BANDWIDTH
    if device.index not in _PROBED:
        _PROBED[device.index] = copy_bandwidth(device.index, _PROBE_BYTES, reps=4,
                                               directions=("d2h",))["d2h"]
    return _PROBED[device.index]


def over_bound(step, bound: int, carried: Tuple[int, int] = (0, 0)) -> Tuple[int, int]:
    """(saved, excess) of a step (``StepStats``) that swapped everything it could (a learning
    step): what it saved (swapped, kept, alive anyway, rebuilt), and by how much a step like it
    would pass ``bound`` keeping all of it: its peak plus what it saved (NOTE [ Region plan ],
    1). ``carried``: (the model's own peak in its passes, lmsrt's bytes left out, which
    ``saved`` counts; what it left on the GPU for later steps: the engine's ``carried_over``):
    their passes peak that much higher."""
    saved = step.out_bytes + step.kept_bytes + step.live_bytes + step.recipe_bytes
    passes, left = carried
    peak = max(step.gpu_peak_bytes, passes + left) if passes else step.gpu_peak_bytes
    return saved, max(0, peak + saved - bound)


def rerun_peak(prof, start: int, end: int, inputs=()) -> int:
    """NOTE [ Region plan ], 2: the model's own use (from its step's base) that backward would
    have reached in the step ``prof`` recorded (a ``Profile``: every eligible storage swapped,
    nothing recomputed) had the call that saved storages ``start`` to ``end - 1`` been
    recomputed: from the first unpack of one of them its rerun holds them all, each until its
    last unpack, where swapping brought each back alone; and so the storages saved before it
    that it was called with (``inputs``: the rerun starts from them), which swapping brought
    back only at their own first unpack (a conv net's stage reads the last stage's output,
    unpacked last in its backward). 0 where none was unpacked.

    Example::

        rerun_peak(rec, call.start, call.end, call.inputs) + base > bound    # would not fit
    """
    points = len(prof.bwd_peak)
    uses = [(prof.first_use[i], prof.last_use[i], prof.sizes[i])
            for i in range(start, min(end, len(prof.sizes)))
            if prof.first_use[i] < points and i not in prof.live]      # (never read: NEVER)
    if not uses or not points:
        return 0
    # Point j's peak is read as unpack j begins: the rerun (in unpack ``first``) lands in the
    # interval that ends at the next point, and a storage's last reader runs in the one after
    # its last unpack.
    first = min(f for f, _, _ in uses)
    last = max(u for _, u, _ in uses) + 1
    uses += [(first, prof.last_use[i], prof.sizes[i]) for i in set(inputs)
             if i < start and i not in prof.live]
    peak = 0
    for j in range(min(first + 1, points - 1), min(last, points - 1) + 1):
        held = sum(size for _, u, size in uses if u >= j - 1)
        peak = max(peak, prof.bwd_peak[j] + held)
    return peak


class SurveyCalls:
    """The survey step's calls of region modules (a region's first, and every child of a mixed
    Sequential, whose stages are not known yet), each [its first save point, its end, the
    points of the storages saved before it that it was called with] (NOTE [ Region plan ], 2);
    a region's calls run from its first module's to its last module's."""

    def __init__(self) -> None:
        self.calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.outside: "weakref.WeakSet" = weakref.WeakSet()   # called with grad, under others'

    def enter(self, module, engine, args: tuple, kwargs: Optional[dict]) -> None:
        # (tree_leaves: tree_flatten's closure would leave a cycle of garbage at each call)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = engine.saved_points(tensors)
        self.calls.setdefault(module, []).append([engine.save_point(), None, inputs])

    def leave(self, module, point: int) -> None:
        calls = self.calls.get(module)
        if calls and calls[-1][1] is None:
            calls[-1][1] = point

    def mark_unfit(self, regions, engine) -> None:
        """Say in ``unfit`` of each of ``regions`` whose rerun would pass ``engine``'s bound
        (``rerun_peak``) in the step just ended, what it would hold (where that step recorded
        a profile: auto's policy), and of each whose first module ran with grad only under
        saved-tensor hooks not lmsrt's (``UNCALLED``: a library's own checkpointing ran it; a
        frame opens only there), that nothing reruns it."""
        for region in regions:
            first = region.modules[0]
            if first is not None and first in self.outside and not self.calls.get(first):
                region.unfit = UNCALLED
        prof, base = engine.state.rec, engine.state.base
        if prof is None or base is None:
            return
        base += max(0, engine.carried_over()[1])     # (an optimizer's state made by step 1)
        for region in regions:
            modules = region.modules
            if any(m is None for m in modules) or region.unfit:
                continue
            spans = zip(self.calls.get(modules[0], ()), self.calls.get(modules[-1], ()))
            peak = max((rerun_peak(prof, a[0], b[1], a[2]) for a, b in spans
                        if b[1] is not None), default=0)
            if base + peak > engine.mark:
                region.unfit = (f"its rerun would hold {format_bytes(base + peak)} in backward, "
                                f"over the bound ({format_bytes(engine.mark)})")


def unfit_note(regions) -> str:
    """Why no region of ``regions`` is recomputed where none fits (``SurveyCalls.mark_unfit``),
    for the plan's note."""
    if {r.unfit for r in regions if r.usable} == {UNCALLED}:
        return UNCALLED.replace("its", "their", 1)
    return "no rerun would fit under the bound"


def memory_budget(step: StepFigures, blocks: int) -> float:
    """The partitioner's recompute budget for compiled blocks that save ``blocks`` bytes a step
    at torch's default (``torch._functorch.config.activation_memory_budget``: the share of those
    bytes they may keep; 1.0 recomputes nothing more than torch would). NOTE [ Regions under LMS ],
    Rule 7: where ``step.swap_seconds(0)`` says the swaps hide, 1.0; else the blocks free the
    fewest bytes after which they do, rounded down to a twentieth and at least ``LEAST_BUDGET``.

    Example::

        step = StepFigures(excess=6 << 30, saved=16 << 30, rebuilt=0, t_fwd=0.0, t_bwd=0.0,
                           bandwidth=55e9)
        memory_budget(step, blocks=12 << 30)      # 0.5: half of what the blocks save must go
    """
    if blocks <= 0 or step.swap_seconds(0) == 0:
        return 1.0
    share = step.rebuilt / step.saved if step.saved else 0.0
    if share >= 1.0:
        return 1.0                  # all of it rebuilt: what the blocks keep changes nothing
    hidden = step.bandwidth * step.hide * min(step.t_fwd, step.t_bwd)
    # swap_seconds(freed) is 0 where what is moved, excess - freed - share * (saved - freed),
    # takes no longer than the shorter pass.
    freed = (step.excess - share * step.saved - hidden) / (1.0 - share)
    budget = math.floor((1.0 - freed / blocks) / _BUDGET_STEP + 1e-9) * _BUDGET_STEP
    return round(min(1.0, max(LEAST_BUDGET, budget)), 2)


def mark_span(simulated: bool) -> list:
    """[start, end] of a timed span, its start taken now (``end_span`` takes its end): CUDA events;
    on the simulated device, wall times."""
    if simulated:
        return [time.perf_counter(), None]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return [start, end]


def end_region(span: list, simulated: bool, timed_waits: Optional[list]) -> None:
    """A timed region's span ends: its end taken now, and the forward waits for copies out
    timed inside it kept, to be taken off its time (they are the learning step's; the engine's
    ``timed_waits`` now)."""
    if simulated:
        span[2] = time.perf_counter()
    else:
        span[2].record()
    waits, first = span[3]
    span[3] = ([w for w in waits[first:] if w[0] == "swapout_wait_ms"]
               if waits is not None and waits is timed_waits else [])


def end_span(span: list, simulated: bool) -> None:
    if simulated:
        span[-1] = time.perf_counter()
    else:
        span[-1].record()


def timed_order(timings: list, reruns: list, simulated: bool) -> list:
    """The timing step's regions in forward order, each with its ``seconds`` (regions.py,
    NOTE [ Region plan ], 3) from its timed spans ([region, start, end, forward waits for
    copies out]) and its reruns in that step's backward ((region, [start, end]))."""
    seen, order = set(), []
    for region, start, end, waits in timings:
        if end is None or isinstance(waits, tuple):      # still running on another thread
            continue
        if not simulated:
            end.synchronize()
        seconds = (end - start) if simulated else start.elapsed_time(end) / 1e3
        # What forward waited for copies out inside it is the learning step's, not its own
        # (measured on a GPT of 24 layers: 106 ms of forward timed, ~45 in a plain step).
        waited = sum(a.elapsed_time(b) for _, a, b in waits) / 1e3
        seconds = max(seconds - waited, seconds / 4)
        region.seconds = seconds if region not in seen else min(region.seconds, seconds)
        if region not in seen:
            seen.add(region)
            order.append(region)
    # Its rerun in backward ran the same ops without swapping a byte, and is what a recompute
    # costs: a region counts at the faster of the two.
    for region, (start, end) in reruns:
        if region in seen and end is not None:
            if not simulated:
                end.synchronize()
            seconds = (end - start) if simulated else start.elapsed_time(end) / 1e3
            region.seconds = min(region.seconds, seconds)
    # The timing step learns: its swaps and pins slow some regions down (measured on a 24-layer
    # Llama: 3.4 to 5.4 ms a layer, 115 ms in all, against a plain forward of 62 ms), which made
    # the plan count on copies hiding under a forward twice as long as it is. Blocks of one
    # class do the same work: each counts at the fastest of its class, and so does forward's.
    fastest: dict = {}
    for r in order:
        kind = type(r.modules[0])
        fastest[kind] = min(fastest.get(kind, r.seconds), r.seconds)
    for r in order:
        r.seconds = fastest[type(r.modules[0])]
    return order


def ignore_step(step: int) -> None:
    """The step listener of a collected ``Regions`` or compiled model: nothing to do."""


class RetriedSteps:
    """NOTE [ Region plan ], 6: allocator retries that stay. The policy answers a retry near
    its bound with headroom (policy/auto.py), which moves more; where planned steps still retry
    the allocator in ``RETRY_STEPS`` planned steps in a row, one region more is recomputed (the
    last in forward of those kept, next to the ones recomputed already) if its forward, with
    those of the regions added so before it, costs less than the retries of a step (``RETRY_S``
    each: a device sync and the cache freed, 12-17 ms on an H200), and the engine learns again.
    Measured on an H200, Lightning's GPT at a 14.2 GiB cap: 20 of 24 blocks recomputed (forward
    34 ms), one or two retries a step from the fifth on whatever the headroom, 0.18-0.19 s a
    step against its checkpointing's 0.16 (every block rerun, 11.2 GiB peak, no retry); with
    all 24 blocks added so, 0.176, steps without a retry 0.158-0.162. Never fewer regions; once
    retries stop, or every region is recomputed, nothing changes."""

    def __init__(self) -> None:
        self.steps = 0
        self.added = 0.0        # the forward seconds of the regions added so

    def read(self, regions) -> None:
        """At the boundary after a step of ``regions``' planned phase."""
        engine = regions.engine
        if engine.saved_nothing():
            return                      # an evaluation between training steps: not counted
        retries = engine.retries_in_step() if engine.current_step().mode == "plan" else 0
        self.steps = self.steps + 1 if retries else 0
        if self.steps < RETRY_STEPS:
            return
        self.steps = 0
        kept = [r for r in regions.order if r.usable and not r.unfit and not r.chosen]
        if not kept or self.added + kept[-1].seconds >= RETRY_S * retries:
            return
        self.added += kept[-1].seconds
        kept[-1].chosen = True
        engine.relearn()
        regions.note = (f"recompute {sum(r.chosen for r in regions.order)} of "
                        f"{len(regions.order)} regions: {retries} allocator retries a step in "
                        f"{RETRY_STEPS} planned steps; " + regions.note)
