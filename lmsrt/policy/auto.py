"""``AutoPolicy``: ``lms_frac="auto"``, which learns the model's own use.

NOTE [ Auto ]
What the model itself allocates beside the saved tensors rises and falls inside a step:
workspaces, fp32 upcasts, a vocabulary-sized logits tensor and its gradient, gradients, optimizer
temporaries. One mark cannot fit them all (docs/design.md, "The model's own memory is not flat").

  1. Learn. The first step swaps every eligible storage and holds the least (the overlap rule,
     one storage fetched ahead while use stays under a quarter of the limit:
     PrefetchWindow.advance), and at every point reads GPU use and the peak since the last point.
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
     prediction missed; a step that peaked well under its prediction, for half the difference
     less (the learning step's own use is not quite a planned step's); room under the bound that
     the prediction saw is the plan's grain, not its error, and is left. A peak predicted over
     the bound is the model's own: nothing to correct. A step that had to swap a storage the
     plan keeps (use over its level in forward) shows the profile short there: the model's own
     use is raised from that point to the end of forward by what it missed, and the next plan
     offloads earlier storages instead (``_learn_from``). The headroom (room the allocator needs
     beside what is allocated) starts at limit/16; an allocation that failed at the limit (a
     learning step's too) raises it by limit/64; so does a step with an allocator retry near
     the bound beyond the model's own (the allocator freed its cache and synchronised to go on:
     12-17 ms each, far more than the block that more headroom reruns or moves). Once the plan
     answers a raise (holds less, or keeps everything) and the next step retries as often, the
     retries are the model's own, count no more, and the headroom goes back to where it was
     before the first raise for them (a raise the plan's slack absorbed says nothing of them);
     retries that a raise removed, two or more, leave a floor a step over the headroom they
     came at. A step that retried near the bound lowers no correction. After four clean steps
     (none with a retry beyond the model's own) the headroom gives back limit/128, down to
     limit/32 or that floor (no cycle of raise and give-back).
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
     validation forward before training, a graph dropped) is learnt again by the next: its use
     is not a training step's. One that saved nothing (a forward under no_grad inside ``with
     lms:``) is in the history, and neither plan nor policy learns of it. Under cuDNN's
     benchmark mode, the first call of each shape tries every algorithm with workspaces as
     large as memory allows:
     a step with a sequence of sizes not seen in a learning step before is learnt again by the
     next, whose algorithms (chosen with the least held) are those later steps run.
  7. Learn again when told (``relearn``: recompute/regions.py recomputes other regions). The
     headroom and its floor stay: they are the allocator's, not the plan's (a fresh policy gave
     back what allocation failures had taught, and a failure makes cuDNN keep a slower
     algorithm for the run); the retries found to be the model's own are found again for the
     new plan. Under benchmark mode the step
     that learns runs shapes cuDNN has tuned already: learnt at once.
A model that fits under the bound keeps everything: nothing moves; and from its first step where
use stays under half the limit (its swaps deferred, then kept: engine/deferred.py, NOTE [ Deferred
copies ]).

"""
from __future__ import annotations

from typing import List, Optional

from ..options import spelled
from ..plan import OffloadPlan
from ..units import GiB, format_bytes
from .planner import choose_offloads, levels
from .profile import Profile
from .protocol import LimitShares

__all__ = ["AutoPolicy"]

_RELEARN = 16      # AutoPolicy learns a changed sequence again at most this often (steps)
_REPLAN = 8        # AutoPolicy plans again when its budget moved by limit >> _REPLAN
_MISSED = 6        # and learns from a forward point whose use it missed by more than limit >> this


class AutoPolicy(LimitShares):
    """``lms_frac="auto"``: NOTE [ Auto ].

    Example::

        policy = AutoPolicy(limit=16 << 30, window=1 << 30)
        policy.learning                 # True: the first step learns the model's own use
    """

    adapts_to_retries = True           # more headroom for allocator retries (4)
    pins_for_deferred = False          # a step under half the limit keeps what it defers

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
        # asking for workspaces, say); and, after a raise for retries, (retries, headroom,
        # the plan's predicted peak over its base) before it (before the first of raises the
        # plan did not answer), to tell the next step whether it helped.
        self._own_retries = 0
        self._raised: Optional[tuple] = None
        self._base = 0
        self._cutoff = -1
        self._planned_for = None       # the budget the current plan was made for
        self._planned_rebuildable: set = set()   # and the storages it could rebuild
        self._tried: Optional[List[int]] = None  # sizes of the last step cuDNN tuned in
        self._same_shapes = False      # the next learning step runs shapes cuDNN has tuned
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

    def _level_at(self, plan: OffloadPlan, levels: List[int], i: int) -> int:
        """Level ``i`` of this plan's ``levels`` (relative to the step's base) in a planned
        step; 0 in a step that learns or has grown past what was learnt (NOTE [ Auto ], 5); the
        reactive level elsewhere."""
        if self.learning or plan.grown:
            return 0
        if plan.mode == "plan" and 0 <= i < len(levels):
            return self._base + levels[i]
        return self._reactive

    def swap_at(self, plan: OffloadPlan, i: int) -> int:
        return self._level_at(plan, self._swap, i)

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
        return self._level_at(plan, self._hold, i)

    def lean_step(self, plan: OffloadPlan) -> bool:
        """A planned step that offloads nothing, and learns nothing, may take the lean path
        that keeps everything (engine/native.py, NOTE [ Steps that keep everything ])."""
        return plan.planned and plan.target == 0 and self._recording is None

    def may_defer(self, use: int) -> bool:
        """A swap that must not leave its tensor on the GPU is deferred while use is under half
        the limit, and stays deferred for backward if forward ends there (``may_keep_deferred``):
        a model that small fits (engine/deferred.py, NOTE [ Deferred copies ])."""
        return use <= self.limit >> 1

    may_keep_deferred = may_defer

    def lone_fetch_under(self, level: int) -> int:
        """At a fetch level of 0 (learning), the one storage fetched ahead goes only while use
        with it stays under a quarter of the limit (engine/prefetch.py says why); 0: no cap."""
        return 0 if level else self.limit >> 2

    def shed_to(self, plan: OffloadPlan, level: int) -> int:
        """In a planned step, use over the fetch level by more than half the headroom gives
        back copies fetched ahead down to that (engine/prefetch.py, ``PrefetchWindow.shed``); 0:
        none."""
        return level + (self.headroom >> 1) if level and plan.mode == "plan" else 0

    def fetch_to(self, plan: OffloadPlan, j: int) -> int:
        """Past the last backward point learnt, its level holds."""
        return self._level_at(plan, self._fetch, min(j, len(self._fetch) - 1))

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
        if (self._planned_for is not None
                and abs(budget - self._planned_for) < self.limit >> _REPLAN
                and plan.rebuildable == self._planned_rebuildable):
            return                       # the same plan, give or take a few MiB of use
        self._planned_for = budget
        self._planned_rebuildable = rebuildable = plan.rebuildable
        live = plan.live | prof.live
        offload, peaks, between, swapped = choose_offloads(prof, live, rebuildable, budget)
        n = len(prof.sizes)
        plan.set_offloaded(offload, swapped)
        peak = max(peaks, default=0)
        self.predicted_peak = base + peak
        self._slack = slack = max(0, budget - peak)
        self._swap, self._hold, self._fetch = levels(prof, live, offload, between, peaks, budget,
                                                     slack)
        self._reactive = base + budget - prof.growth()
        count = sum(offload)
        moved = sum(size for k, (size, out) in enumerate(zip(prof.sizes, offload))
                    if out and (k not in rebuildable or k in swapped))
        rebuilt = sum(size for k, (size, out) in enumerate(zip(prof.sizes, offload))
                      if out and k in rebuildable and k not in swapped)
        self._cutoff = count
        gib = GiB
        also = f", {rebuilt / gib:.2f} GiB rebuilt instead" if rebuilt else ""
        self.why = (f"offloads {count} of {n} saved storages ({moved / gib:.2f} GiB moved, the "
                    f"earliest{also}) so that the predicted peak, {(base + peak) / gib:.2f} GiB, "
                    f"stays under {(base + budget) / gib:.2f} GiB" if count else
                    f"keeps everything on the GPU: the predicted peak, {(base + peak) / gib:.2f} "
                    f"GiB, is under {(base + budget) / gib:.2f} GiB")

    def relearn(self) -> None:
        """Learn the model's own use again from the next step (NOTE [ Auto ], 7): what the
        model saves changed (recompute/regions.py recomputes other regions), not the shapes it
        runs, nor what the steps taught of the allocator (headroom, retries of the model's own)."""
        self.learning = True
        self.profile = None
        self.correction = 0
        self._same_shapes = True
        self._learning_why = "the regions recomputed changed"

    # -- after a step ------------------------------------------------------------------------

    def _failed(self, failures: int) -> None:
        """An allocation failed at the limit and its caller went on with less: the step needed
        more than its peak shows (cuDNN asked for a workspace, then ran a slower algorithm with
        a smaller one, which it keeps for the run). Leave more room, from a learning step too:
        measured on a conv net under cuDNN's benchmark mode at 85% of its peak on an H200, the
        learning steps 2 and 3 failed 1 and 3 allocations, and the first planned step 1 more."""
        limit = self.limit
        self.headroom = min(limit >> 3, self.headroom + (limit >> 6))
        self._clean = 0
        self.why = (f"{failures} allocation(s) failed at the limit and were worked around (a "
                    f"library fell back to less memory): headroom raised to "
                    f"{self.headroom / GiB:.2f} GiB")

    def finish_step(self, plan: OffloadPlan, *, followed: bool, forward_end_use: int,
                    swapped: int, beyond_plan: int, peak: int, retries: int,
                    failures: int = 0, over: Optional[tuple] = None,
                    tuning: bool = False) -> None:
        """``over``: (forward point, GPU use there less the base) where the step first swapped a
        storage its plan keeps, use standing over the level (NOTE [ Auto ], 4). ``tuning``:
        whether cuDNN's benchmark mode is on (``Device.tunes_algorithms``)."""
        if self.learning:
            if failures:
                self._failed(failures)     # (its note is the learning's, below)
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
            same_shapes, self._same_shapes = self._same_shapes, False
            if tuning and prof.sizes != self._tried and not same_shapes:
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
        limit, bound, gib = self.limit, self.bound, GiB
        # A plan that predicted a peak over the bound moves all it can already: what is left is
        # the model's own, and neither more headroom nor more correction would change it. (Its
        # prediction as corrected: one that learnt too high, corrected down, fits. Read without
        # the correction, Lightning's GPT at a 14.2 GiB cap, predicted 3.3 GiB over its peak,
        # was "beyond" every step, and its two allocator retries a step raised nothing.)
        beyond = self.predicted_peak + self.correction > bound
        raised, self._raised = self._raised, None
        carried = None                 # raises the plan did not answer: the first of them
        if raised is not None and not failures:
            first_retries, first_headroom, planned_peak = raised
            if retries < first_retries:
                # Removed: the headroom they came at is too little, and is never given back to
                # (a ViT at a 10.6 GiB cap: given back from 0.66 to 0.50 GiB every fourth clean
                # step, 3 retries a step there, 0.20 s a step against 0.15), unless one retry
                # did not come back: that says too little.
                if first_retries > 1:
                    self.floor = max(self.floor, first_headroom + (limit >> 7))
            elif (self.predicted_peak - self._base < planned_peak or self._cutoff == 0
                  or self.headroom >= limit >> 3):
                # Answered (a plan holding less, or one holding nothing lmsrt could give up)
                # and not removed: the model's own, at any headroom (a conv net at a 12 GiB cap:
                # 4-5 a step at 0.75 GiB of headroom and at 1.5; raised for them step after
                # step, auto moved 5.9 GiB a step where lms_frac 0.6 moves 3.1).
                self._own_retries = retries
                self.headroom = first_headroom
                self.why = (f"{retries} allocator retries a step with more headroom as without: "
                            f"the model's own; headroom back to {self.headroom / gib:.2f} GiB")
                bound = self.bound
            else:
                # Not answered (the plan's slack took the room): says nothing of them; the next
                # raise counts from the first (Lightning's GPT at 14.2 GiB: two retries a step
                # taken for its own after a raise that left its plan as it was).
                carried = raised
        pressure = retries - self._own_retries      # retries that lmsrt's holdings may cause
        if failures and not beyond:
            self._failed(failures)
        elif pressure > 0 and peak > bound - self.headroom and not beyond:
            # The allocator freed its cache to go on (a device sync) near the bound: leave it
            # more room. A retry cost 12-17 ms of a step on an H200 (Lightning's GPT at 14.2
            # GiB: 0.175 s with one, 0.162 without), more than a block's rerun (~1 ms) or the
            # copy that limit/64 of room costs. Retries far under the bound are the cache
            # filling up (two a step at 14.3 GiB of an 18 GiB cap on an LM): more headroom
            # would not change the plan that led to them.
            self._raised = carried or (retries, self.headroom, self.predicted_peak - self._base)
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
            # Predicted high (the learning step's own use is not quite a planned step's): keep
            # half what the prediction had too much from the next step. Room under the bound
            # that the prediction saw is the plan's grain (the next storage kept would not have
            # fitted), not an error: planning into it ran a conv net at 85% of its peak out of
            # memory, its prediction 17 MB short of that step's peak (an H200).
            room = min(bound, self.predicted_peak + self.correction) - peak
            # Not after a step the allocator retried in near the bound: the plan held too much
            # for it already (Lightning's GPT at 14.2 GiB: a correction lowered step after step
            # as each peaked ~1 GiB under its prediction, the plan keeping more each time, until
            # two retries a step at 12.7 GiB; the raise for the first was undone by the same
            # step's lower correction).
            if (room > limit >> 6 and self._cutoff > 0 and self.correction > -(limit >> 2)
                    and not pressed):
                self.correction = max(-(limit >> 2), self.correction - room // 2)
                self.why = (f"the step peaked {room / gib:.2f} GiB under its prediction: "
                            f"planning for {self.correction / gib:+.2f} GiB against what was "
                            "learnt")
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

    def swaps_everything(self) -> bool:
        return self.learning

    @staticmethod
    def oom_level(config) -> str:
        return "lms_frac=auto (below)"

    def oom_lines(self) -> List[str]:
        prof = self.profile
        lines = [f"  lms_frac=auto: kept GPU use under {self.bound / GiB:.2f} GiB (limit less "
                 f"{self.headroom / GiB:.2f} GiB headroom); {self.why}."]
        if prof is None:
            lines.append("  It was still learning the model's own use (the first step swaps "
                         "every eligible tensor); what is left is the model's own working set.")
        return lines

    @staticmethod
    def oom_to_fit(config, lower_lms: str) -> str:
        return (f"  To fit: {lower_lms}; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "against fragmentation; or give a fixed lms_frac "
                f"({spelled('lms_frac', 0.5)}, say) to swap from a mark you choose.")
