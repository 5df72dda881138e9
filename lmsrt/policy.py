"""How much lmsrt holds on the GPU, and when: the swap policy, beside the plan.

The engine (engine.py) has the mechanism (copies, events, handles); the plan (plan.py) records
the sequence of saved storages and which of them a step offloads. The policy decides the numbers.
At every point of a step the engine asks it for three levels of GPU use (bytes allocated):

  ``swap_at(i)``   at forward point i, a storage the plan keeps is swapped anyway if use, less
                   the sources still being copied out, stands over this (0: swap everything);
  ``hold_to(i)``   sources still being copied out are let go (the compute stream waits on the
                   oldest copy) while use stands over this (0: hold at most ``overlap`` bytes);
  ``fetch_to(j)``  at backward point j, storages are fetched ahead while use plus the next one
                   stays within this (0: one storage ahead at most).

Forward point i is the i-th storage saved in the step (its index in the plan); backward point j
is the j-th unpack of the step's backward.

``FixedPolicy`` is Caffe's ``lms_frac``: one mark, ``lms_frac`` x the limit, for all three, and
the plan's target follows use at the end of forward (NOTE [ Fixed mark ]). ``AutoPolicy``
(``lms_frac="auto"``) learns the model's own use instead (NOTE [ Auto ]).

NOTE [ Auto ]
What the model itself allocates beside the saved tensors rises and falls inside a step:
workspaces, fp32 upcasts, a vocabulary-sized logits tensor and its gradient, gradients, optimizer
temporaries. One mark cannot fit them all (DESIGN.md, "The model's own memory is not flat").

  1. Learn. The first step swaps every eligible storage and holds the least (the overlap rule,
     one storage fetched ahead while use stays under a quarter of the limit:
     SwapEngine._advance), and at every point reads GPU use and the peak since the last point.
     Less what lmsrt held then (sources in flight, restored copies not yet used), that is the
     model's own use at the point and its peak in the interval before it, relative to use when
     the step began: a ``Profile``. It also notes at which backward point each storage was used
     for the last time, and for a storage that the model itself holds on to after lmsrt let it
     go (a logits tensor the loss still reads), from which point to which it counted as the
     model's own. A swap in a learning step waits for a pin under way: a tensor left on the GPU
     would count as the model's own, and in the run's first step it would take memory from
     cuDNN's choice of algorithms (``FixedPolicy.swap_at``).
  2. Plan. A storage the plan keeps on the GPU occupies its bytes from its save to its last use
     in backward. The predicted peak of each interval is the model's own peak there plus the
     kept storages alive then; it must stay under the bound, the limit less the headroom,
     counted from use at this step's first save. One the plan offloads still waits on the GPU,
     once restored, between its first unpack and its last (``Profile.between``), as a kept one
     would. Storages are kept from the last saved down, each wherever it fits, and the rest
     offloaded: only what must move moves, the earliest first (backward needs them last).
  3. Bound the rest by the same prediction: held sources so that use plus the model's growth in
     the next interval stays under the bound; prefetch so that what is fetched ahead plus the
     highest predicted use still to come in backward stays under it (a prefetch is held until
     its use, which for the earliest storages is the end of backward); a kept storage is
     swapped anyway when use runs over the prediction by more than the plan's slack.
  4. Correct. A step whose peak passed the bound and the prediction plans for what the
     prediction missed; a step that peaked well under it, half the unused room less (the
     learning step's own use is not quite a planned step's). A peak predicted over the bound is
     the model's own: nothing to correct. A step that had to swap a storage the plan keeps
     (use over its level in forward) shows the profile short there: the model's own use is
     raised from that point to the end of forward by what it missed, and the next plan
     offloads earlier storages instead (``_learn_from``). The headroom (room the allocator
     needs beside what is allocated) starts at limit/16; more than two allocator retries a
     step near the bound raise it by limit/64, undone if the next step retries as often (those
     retries are the model's own, and count no more); after four clean steps (none with a
     retry beyond the model's own near the bound) it gives back limit/128, down to limit/32.
  5. Steps are planned for the learnt sequence (a step that returns to it after another batch
     follows the plan). A step whose sequence differs is reactive: where it differs by a
     smaller storage it swaps what passes the bound less the largest growth the profile saw;
     where by a larger one, or by more of them, the profile says nothing of its own use (a
     batch 4x the learnt one grows 4x as fast): it swaps everything from there, as a learning
     step does. A step whose first storage is larger than the learnt one is learnt (the
     largest batch is the one that must fit); so is one that grew later in its sequence and
     repeated. A smaller sequence stays reactive (the last, partial batch of an epoch), and one
     that keeps changing is learnt again at most every ``_RELEARN`` steps.
  6. Learn from a training step. A step none of whose saved storages came back in backward (a
     validation forward before training, a graph dropped, a forward under no_grad) is learnt
     again by the next: its use is not a training step's. Under cuDNN's benchmark mode, the
     first call of each shape tries every algorithm with workspaces as large as memory allows:
     a step with a sequence of sizes not seen in a learning step before is learnt again by the
     next, whose algorithms (chosen with the least held) are those later steps run.
A model that fits under the bound keeps everything: nothing moves.

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

import collections
import itertools
import weakref
from typing import List, Optional

from .plan import OffloadPlan
from .units import format_bytes

__all__ = ["FixedPolicy", "AutoPolicy", "Profile", "make_policy"]

_SLACK = 0.05      # FixedPolicy shrinks its target only when this far under the mark
_RELEARN = 16      # AutoPolicy learns a changed sequence again at most this often (steps)
_NEVER = 1 << 62
_RETRIES = 2       # AutoPolicy leaves more headroom past this many allocator retries a step
_REPLAN = 8        # AutoPolicy plans again when its budget moved by limit >> _REPLAN
_MISSED = 6        # and learns from a forward point whose use it missed by more than limit >> this


class FixedPolicy:
    """``lms_frac`` a number: swapping starts when GPU use passes ``lms_frac`` x the limit."""

    auto = False
    learning = False
    recording = None          # records no profile
    keeps_small = False       # a first step swaps what it defers (engine, NOTE [ Deferred copies ])

    def __init__(self, lms_frac: float, limit: int, window: int):
        self.lms_frac = lms_frac
        self.limit = limit
        self.mark = int(lms_frac * limit)
        # At a mark of 0 every byte is over it: let this much be held while its copies run, so
        # they overlap forward instead of each pack waiting for the last copy.
        self.overlap = min(window, limit >> 3)
        self._first = True
        self._reactive_mark = self.mark - (self.mark >> 3)

    def begin_step(self, plan: OffloadPlan, base: int, first: int) -> None:
        pass

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

    def oom_lines(self) -> List[str]:
        return []


class _Freed(weakref.ref):
    """A profile's reference to saved storage ``index`` (``Profile.watch``)."""

    __slots__ = ("index",)


class Profile:
    """What a learning step measured, relative to GPU use when it began (NOTE [ Auto ], 1)."""

    def __init__(self) -> None:
        self.sizes: List[int] = []       # storage sizes in save order
        self.fwd_own: List[int] = []     # the model's own use at forward point i
        self.fwd_peak: List[int] = []    # its peak in the interval ending at point i
        self.bwd_own: List[int] = []     # the same at backward point j
        self.bwd_peak: List[int] = []
        self.last_use: List[int] = []    # backward point of each storage's last unpack
        self.first_use: List[int] = []   # and of its first
        self.live: set = set()           # storages alive anyway (never worth keeping count of)
        # Storage i counted as the model's own from point held[i][0] to held[i][1] (points
        # numbered through forward, then backward): the model held on to it after lmsrt let go.
        self.held: dict = {}
        self.closed = False
        self._freed: collections.deque = collections.deque()   # _Freed refs, dead, unread

    def _point(self) -> int:
        return len(self.fwd_own) + len(self.bwd_own)

    def own_from(self, i: int) -> None:
        if not self.closed:
            self.held[i] = (self._point(), None)

    def watch(self, storage, i: int) -> "_Freed":
        """A weak reference to storage i whose death closes its span in ``held`` at the point
        where it happened. The callback is a deque's C ``append``: no Python frame runs while
        autograd frees a graph, so a Ctrl-C cannot land in one and be lost (NOTE [ Interrupts
        and versions ] in engine.py); the next point, or the close, reads the queue. The
        caller keeps the reference (a dead one calls nothing)."""
        ref = _Freed(storage, self._freed.append)
        ref.index = i
        return ref

    def _read_freed(self) -> None:
        freed, point = self._freed, self._point()
        while freed:
            i = freed.popleft().index
            span = self.held.get(i)
            if span is not None and span[1] is None:
                self.held[i] = (span[0], point)

    def close(self) -> None:
        """Storages freed from here on tell it nothing."""
        self._read_freed()
        self.closed = True

    def kept_spans(self, k: int, readings: bool = False):
        """The points at which keeping storage k adds its bytes to what was learnt: from its
        save to its last unpack (to there the learning step counted its restored copy as
        lmsrt's; after it, autograd frees it as it frees a kept one), less the span in which
        the model held it anyway: from where lmsrt let go of it (that interval's peak was read
        with it allocated) to the interval in which it was freed (which may have peaked after
        it was: counted). With ``readings``, the points whose reading of GPU use it adds to
        (the swap and fetch levels are readings, not peaks): that last point is counted too,
        since its reading came after the free (leaving it out made a level short by the
        storage there, which swapped one the plan keeps, in every step)."""
        n, p = len(self.fwd_own), len(self.bwd_own)
        start, end = k + 1, n + min(self.last_use[k], p - 1)
        span = self.held.get(k)
        if span is None:
            return [(start, end)]
        lo, hi = span
        hi = end + 1 if hi is None else hi if readings else max(hi, lo + 1)
        return [(a, b) for a, b in ((start, min(end, lo - 1)), (max(start, hi), end)) if a <= b]

    def record(self, backward: bool, used: int, peak: int, held_before: int, held_now: int,
               nbytes: int = 0) -> None:
        if self._freed:
            self._read_freed()          # freed in the interval that ends here
        own = used - held_now
        own_peak = max(peak - held_before, own)
        if backward:
            self.bwd_own.append(own)
            self.bwd_peak.append(own_peak)
        else:
            self.sizes.append(nbytes)
            self.last_use.append(_NEVER)
            self.first_use.append(_NEVER)
            self.fwd_own.append(own)
            self.fwd_peak.append(own_peak)

    def used_at(self, i: int, j: int) -> None:
        if 0 <= i < len(self.last_use):
            self.last_use[i] = j
            if i < len(self.first_use) and self.first_use[i] == _NEVER:
                self.first_use[i] = j

    def between(self, k: int) -> Optional[tuple]:
        """The points (numbered through forward, then backward) at which storage k, restored,
        waits between its first unpack and its last (a tensor that two backward functions
        read: a convolution's input that a ReLU before it also saved), or None. The learning
        step counted it as lmsrt's there, as it counts a copy fetched ahead; a planned step
        that offloads it holds it all the same (measured on a conv net at a 6 GiB cap: a
        577 MiB activation between its two unpacks made every 1.1 GiB cuDNN workspace of the
        first planned step fail, 79 of them, and cuDNN kept the slower algorithms for the
        run)."""
        if k >= len(self.first_use):
            return None
        first, last, n = self.first_use[k], self.last_use[k], len(self.fwd_own)
        last = min(last, len(self.bwd_own) - 1)
        if first == _NEVER or first >= last:
            return None
        return n + first + 1, n + last

    def growth(self) -> int:
        """The largest rise of the model's own use within one interval."""
        own = self.fwd_own + self.bwd_own
        peak = self.fwd_peak + self.bwd_peak
        return max((p - o for o, p in zip(own, peak[1:])), default=0)


class AutoPolicy:
    """``lms_frac="auto"``: NOTE [ Auto ]."""

    auto = True
    keeps_small = True        # a step under a quarter of the limit keeps what it defers

    def __init__(self, limit: int, window: int):
        self.limit = limit
        # Learning holds little: its step must fit before anything is known of the model.
        self.overlap = min(window, limit >> 4)
        # The allocator needs room beside what is allocated (reserved but unallocated blocks,
        # ~0.45 GiB measured on an LM at an 18 GiB cap with expandable segments).
        self.headroom = limit >> 4
        self.floor = limit >> 5
        self.correction = 0            # how far the profile over- (-) or under- (+) predicts
        self.profile: Optional[Profile] = None
        self.learning = True           # this step records a profile
        self._learning_why = ""        # why a later step learns again, if not for its own note
        self._recording: Optional[Profile] = None
        self._since_learnt = 0
        self._clean = 0
        # Allocator retries a step that more headroom did not remove (the model's own: cuDNN
        # asking for workspaces, say); and, after a raise for retries, (retries, headroom)
        # before it, to tell next step whether it helped.
        self._own_retries = 0
        self._raised: Optional[tuple] = None
        self._base = 0
        self._cutoff = -1
        self._planned_for = None       # the budget the current plan was made for
        self._planned_rebuildable: set = set()   # and the storages it could rebuild
        self._tried: Optional[List[int]] = None  # sizes of the last step cuDNN tuned in
        self._swap: List[int] = []
        self._slack = 0
        self._hold: List[int] = []
        self._fetch: List[int] = []
        self._reactive = 0
        self.predicted_peak = 0
        self.why = "learning the model's own use (step 1 swaps every eligible tensor)"

    # -- the three levels ----------------------------------------------------------------------

    @property
    def bound(self) -> int:
        return self.limit - self.headroom

    def begin_step(self, plan: OffloadPlan, base: int, first: int) -> None:
        """A step begins at its first saved storage, of ``first`` bytes (NOTE [ Auto ], 5)."""
        self._base = base
        prof = self.profile
        if not self.learning and prof is not None and prof.sizes and first > prof.sizes[0]:
            self.learning = True
            self._learning_why = ("its first saved storage is larger than the one learnt: a "
                                  "larger batch, or longer sequences")
        if self.learning:
            self._recording = Profile()
            return
        self._recording = None
        if prof is not None:
            plan.expect(prof.sizes)
            self._make_plan(plan, base)

    def swap_at(self, plan: OffloadPlan, i: int) -> int:
        if self.learning or plan.grown:
            return 0
        if plan.mode == "plan" and i < len(self._swap):
            return self._base + self._swap[i]
        return self._reactive

    def swap_levels(self, plan: OffloadPlan, n: int) -> List[int]:
        """``swap_at`` of points 0 to n - 1, in one call."""
        if self.learning or plan.grown:
            return [0] * n
        if plan.mode != "plan":
            return [self._reactive] * n
        base = self._base
        levels = [base + x for x in self._swap[:n]]
        return levels + [self._reactive] * (n - len(levels))

    def hold_to(self, plan: OffloadPlan, i: int) -> int:
        if self.learning or plan.grown:
            return 0
        if plan.mode == "plan" and i < len(self._hold):
            return self._base + self._hold[i]
        return self._reactive

    def fetch_to(self, plan: OffloadPlan, j: int) -> int:
        if self.learning or plan.grown:
            return 0
        if plan.mode == "plan" and self._fetch:
            return self._base + self._fetch[min(j, len(self._fetch) - 1)]
        return self._reactive

    # -- learning ----------------------------------------------------------------------------

    def may_lag(self, plan: OffloadPlan) -> bool:
        """A learning step's swaps wait for their pins (NOTE [ Auto ], 1), and so do those of a
        step that has grown past what was learnt (5)."""
        return not (self.learning or plan.grown)

    @property
    def recording(self) -> Optional[Profile]:
        return self._recording

    # -- planning ----------------------------------------------------------------------------

    def _make_plan(self, plan: OffloadPlan, base: int) -> None:
        prof = self.profile
        budget = self.bound - base - self.correction
        if (self._planned_for is not None and abs(budget - self._planned_for) < self.limit >> _REPLAN
                and plan.rebuildable == self._planned_rebuildable):
            return                       # the same plan, give or take a few MiB of use
        self._planned_for = budget
        self._planned_rebuildable = rebuildable = plan.rebuildable
        n, p = len(prof.sizes), len(prof.bwd_own)
        live = plan.live | prof.live
        # Keep storages from the last saved down (backward needs them first), each one whose
        # bytes fit under the budget at every point from its save to its last use; offload the
        # rest. (Keeping a plain suffix would have to keep the last storages first, which are
        # often the largest and alive at the peak: an LM's fp32 log-softmax output.) Storages
        # the engine can rebuild cost no copy to offload: they are kept only with the room that
        # the others leave.
        peaks = prof.fwd_peak + prof.bwd_peak        # points through forward, then backward
        # A storage restored for backward waits between its first unpack and its last, kept or
        # not (Profile.between): use the learning step counted as lmsrt's.
        between = [None if k in live else prof.between(k) for k in range(n)]
        waits = [0] * (n + p + 1)
        for k, span in enumerate(between):
            if span is not None:
                waits[span[0]] += prof.sizes[k]
                waits[span[1] + 1] -= prof.sizes[k]
        waits = list(itertools.accumulate(waits))[:n + p]
        peaks = [v + w for v, w in zip(peaks, waits)]
        offload = [False] * n
        down = range(n - 1, -1, -1)
        for k in [k for k in down if k not in rebuildable] + [k for k in down if k in rebuildable]:
            size = prof.sizes[k]
            if k in live or not size:
                continue
            spans = _without(prof.kept_spans(k), between[k])
            if all(max(peaks[a:b + 1], default=0) + size <= budget for a, b in spans):
                for a, b in spans:
                    peaks[a:b + 1] = [v + size for v in peaks[a:b + 1]]
            else:
                offload[k] = True
        fwd, bwd = peaks[:n], peaks[n:]
        plan.set_offloaded(offload)
        peak = max(fwd + bwd, default=0)
        self.predicted_peak = base + peak
        self._slack = slack = max(0, budget - peak)
        fwd_own, bwd_own = prof.fwd_own, prof.bwd_own
        # What the kept storages add to each point's reading of use, and the restored ones
        # waiting between two unpacks (a difference array).
        kept = [0] * (n + p + 1)
        for k, size in enumerate(prof.sizes):
            if k in live or not size:
                continue
            spans = [] if offload[k] else _without(prof.kept_spans(k, readings=True), between[k])
            if between[k] is not None:
                spans.append(between[k])
            for a, b in spans:
                kept[a] += size
                kept[b + 1] -= size
        kept = list(itertools.accumulate(kept))
        kept_fwd, kept_bwd = kept[:n], kept[n:n + p]
        self._swap = [fwd_own[i] + kept_fwd[i] + slack for i in range(n)]
        nxt = prof.fwd_peak[1:] + prof.bwd_peak[:1]
        self._hold = [budget - max(0, nxt[i] - fwd_own[i]) if i < len(nxt) else budget
                      for i in range(n)]
        # Highest predicted use in backward after point j, against predicted use at j.
        fetch: List[int] = [0] * p
        later = None
        for j in range(p - 1, -1, -1):
            now = bwd_own[j] + kept_bwd[j]
            fetch[j] = budget - max(0, later - now) if later is not None else budget
            later = bwd[j] if later is None else max(later, bwd[j])
        self._fetch = fetch
        self._reactive = base + budget - prof.growth()
        count = sum(offload)
        moved = sum(size for k, (size, out) in enumerate(zip(prof.sizes, offload))
                    if out and k not in rebuildable)
        rebuilt = sum(size for k, (size, out) in enumerate(zip(prof.sizes, offload))
                      if out and k in rebuildable)
        self._cutoff = count
        gib = 2**30
        also = f", {rebuilt / gib:.2f} GiB rebuilt instead" if rebuilt else ""
        self.why = (f"offloads {count} of {n} saved storages ({moved / gib:.2f} GiB moved, the "
                    f"earliest{also}) so that the predicted peak, {(base + peak) / gib:.2f} GiB, "
                    f"stays under {self.bound / gib:.2f} GiB" if count else
                    f"keeps everything on the GPU: the predicted peak, {(base + peak) / gib:.2f} "
                    f"GiB, is under {self.bound / gib:.2f} GiB")

    # -- after a step ------------------------------------------------------------------------

    def finish_step(self, plan: OffloadPlan, *, followed: bool, forward_end_use: int,
                    swapped: int, beyond_plan: int, peak: int, retries: int,
                    failures: int = 0, over: Optional[tuple] = None,
                    tuning: bool = False) -> None:
        """``over``: (forward point, GPU use there less the base) where the step first swapped a
        storage its plan keeps, use standing over the level (NOTE [ Auto ], 4). ``tuning``:
        whether cuDNN's benchmark mode is on (``Device.tunes_algorithms``)."""
        if self.learning:
            prof = self._recording
            self._recording = None
            if prof is not None:
                prof.close()
            if prof is None or not prof.bwd_own:
                # No saved tensor came back (NOTE [ Auto ], 6): a validation forward, or one
                # whose graph was dropped. What it held is not a training step's: learn again.
                plan.set_target(swapped)
                self.why = ("learning the model's own use from the first step with a backward "
                            "(the last forward had none)")
                return
            if tuning and prof.sizes != self._tried:
                # cuDNN tried its algorithms for these shapes in this step (NOTE [ Auto ], 6).
                self._tried = prof.sizes
                plan.set_target(swapped)
                self.why = ("cuDNN's benchmark mode tried its algorithms in this step: learning "
                            "the model's own use from the next one")
                return
            self.learning = False
            self._since_learnt = 0
            if prof is not None and prof.sizes and len(prof.sizes) == len(plan.recorded):
                prof.live = set(plan.live)
                self.profile = prof
                self.correction = 0        # what another profile mispredicted tells nothing
                self._own_retries = 0      # nor the retries another batch made
                self._raised = None
                why = f" ({self._learning_why})" if self._learning_why else ""
                self.why = f"learnt the model's own use{why}; planning from the next step"
            elif self.profile is None:
                self._reactive = self.bound - self.overlap
            self._learning_why = ""
            plan.set_target(swapped)
            self._planned_for = None
            return
        self._since_learnt += 1
        limit, bound, gib = self.limit, self.bound, 2**30
        # A plan that predicted a peak over the bound moves all it can already: what is left is
        # the model's own, and neither more headroom nor more correction would change it.
        beyond = self.predicted_peak > bound
        raised, self._raised = self._raised, None
        if raised is not None and retries >= raised[0] and not failures:
            # More headroom removed none of the retries: they are the model's own, and cost the
            # same at any headroom (measured on a conv net at a 12 GiB cap: 4-5 a step at 0.75
            # GiB of headroom and at 1.5, and at lms_frac 0.6 with 0.32 GiB; raised for them
            # step after step, auto moved 5.9 GiB a step where 0.6 moves 3.1).
            self._own_retries = retries
            self.headroom = raised[1]
            self.why = (f"{retries} allocator retries a step with more headroom as without: "
                        f"the model's own; headroom back to {self.headroom / gib:.2f} GiB")
            bound = self.bound
        pressure = retries - self._own_retries      # retries that lmsrt's holdings may cause
        if failures and not beyond:
            # An allocation failed at the limit and its caller went on with less: the step
            # needed more than its peak shows (cuDNN asked for a workspace, then ran a slower
            # algorithm with a smaller one, which it keeps for the run). Leave more room.
            self.headroom = min(limit >> 3, self.headroom + (limit >> 6))
            self._clean = 0
            self.why = (f"{failures} allocation(s) failed at the limit and were worked around "
                        f"(a library fell back to less memory): headroom raised to "
                        f"{self.headroom / gib:.2f} GiB")
        elif pressure > _RETRIES and peak > bound - self.headroom and not beyond:
            # The allocator freed its cache to go on (a device sync) near the bound, more than
            # a couple of times: leave it more room. Retries far under the bound are the cache
            # filling up, not pressure lmsrt makes (measured: two a step at 14.3 GiB of an 18
            # GiB cap on an LM); two a step near it cost less than the bytes that more headroom
            # moves (measured on the LM at 18 GiB: 0.56 s a step at 1.1 GiB of headroom, 0.60 s
            # once two retries a step had raised it to 2 GiB, still with two).
            self._raised = (retries, self.headroom)
            self.headroom = min(limit >> 3, self.headroom + (limit >> 6))
            self._clean = 0
            self.why = (f"the allocator freed its cache {retries} time(s) to go on near the "
                        f"bound: headroom raised to {self.headroom / gib:.2f} GiB")
        if peak > bound:
            # Correct by what the prediction missed, not by the distance to the bound.
            missed = peak - max(self.predicted_peak, bound)
            self._clean = 0
            if missed > 0:
                self.correction += missed
                self.why = (f"the step's peak, {peak / gib:.2f} GiB, passed the bound and the "
                            f"prediction: planning for {self.correction / gib:+.2f} GiB more "
                            "than learnt")
            else:
                self.why = (f"the model's own peak, {peak / gib:.2f} GiB, is over the bound: "
                            "every eligible storage moves")
        elif followed:
            # A step whose allocator had to free its cache near the bound is not clean, even
            # once: the room it needed beside what is allocated (blocks split by the step's
            # frees, partly used pages of expandable segments) is about all the headroom there
            # is. Measured on a GPT at a 10 GiB cap: one retry a step at 0.62 GiB of headroom,
            # and out of memory (0.43 GiB reserved, not allocated) once steps with one retry
            # had given it back to 0.39.
            pressed = pressure > 0 and peak > bound - self.headroom
            self._clean = 0 if pressed else self._clean + 1
            room = bound - peak
            if room > limit >> 6 and self._cutoff > 0 and self.correction > -(limit >> 2):
                # Predicted high (the learning step's own use is not quite a planned step's):
                # keep half the unused room's worth more from the next step.
                self.correction = max(-(limit >> 2), self.correction - room // 2)
                self.why = (f"the step peaked {room / gib:.2f} GiB under the bound: planning for "
                            f"{self.correction / gib:+.2f} GiB against what was learnt")
            elif self._clean >= 4 and self.headroom > self.floor:
                self.headroom = max(self.floor, self.headroom - (limit >> 7))
                self._clean = 0
                self.why = f"clean steps: headroom given back to {self.headroom / gib:.2f} GiB"
        if over is not None and followed:
            self._learn_from(over)
        if not followed and self._since_learnt >= _RELEARN:
            self.learning = True        # the sequence changed: learn it again
            self.why = "the sequence of saved tensors changed: learning it again"
        elif plan.repeated and self.profile is not None and plan.outgrew(self.profile.sizes):
            self.learning = True        # it grew, and repeated: the profile is another's
            self.why = ("the sequence of saved tensors grew and repeated: learning it again")
        if self.profile is None:
            plan.set_target(swapped)
            self._reactive = bound - self.overlap

    def _learn_from(self, over: tuple) -> None:
        """Forward point ``i`` used more than the plan predicted, so a storage the plan keeps
        was swapped as it was saved, at the last moment (measured on an LM at an 18 GiB cap: its
        3 GiB fp32 log-probabilities, every step, with no forward left to copy them out in and
        needed first in backward: 0.37 s a step against 0.26-0.31 where the learning step had
        read the same model's use at forward's end 1.6 GiB higher). The learning step misread
        the model's own use from there (which tensors the model itself still held depended on
        when lmsrt's copies finished): raise it, from point i to the end of forward, by what it
        missed, and plan again; the plan then offloads earlier storages instead, whose copies
        have the rest of forward to go out."""
        i, used = over
        prof = self.profile
        if prof is None or i >= len(self._swap) or i >= len(prof.fwd_own):
            return
        missed = used - (self._swap[i] - self._slack)
        if missed <= self.limit >> _MISSED:
            return          # the allocator's own noise: the level's slack is there for it
        for k in range(i, len(prof.fwd_own)):
            prof.fwd_own[k] += missed
            prof.fwd_peak[k] += missed
        self._planned_for = None
        self.why = (f"GPU use at forward point {i} stood {format_bytes(missed)} over the "
                    f"prediction and a storage the plan keeps was swapped there: planning "
                    f"for that much more use from there to the end of forward")

    def step_figures(self) -> dict:
        """What a step runs with, for its StepStats."""
        return {"headroom_bytes": self.headroom, "predicted_peak_bytes": self.predicted_peak}

    def note(self) -> str:
        """What the policy learnt or changed after the step just finished."""
        return self.why

    def oom_lines(self) -> List[str]:
        prof = self.profile
        lines = [f"  lms_frac=auto: kept GPU use under {self.bound / 2**30:.2f} GiB (limit less "
                 f"{self.headroom / 2**30:.2f} GiB headroom); {self.why}."]
        if prof is None:
            lines.append("  It was still learning the model's own use (the first step swaps "
                         "every eligible tensor); what is left is the model's own working set.")
        return lines


def _without(spans: list, gap: Optional[tuple]) -> list:
    """``spans`` (inclusive (first, last) point pairs) less the points of ``gap``."""
    if gap is None:
        return list(spans)
    lo, hi = gap
    out = []
    for a, b in spans:
        if a < lo:
            out.append((a, min(b, lo - 1)))
        if b > hi:
            out.append((max(a, hi + 1), b))
    return out


def make_policy(lms_frac, limit: int, window: int):
    """The policy for a setting of ``lms_frac``: "auto" or a fraction."""
    if lms_frac == "auto":
        return AutoPolicy(limit, window)
    return FixedPolicy(float(lms_frac), limit, window)

