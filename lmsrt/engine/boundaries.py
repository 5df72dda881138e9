"""Where steps begin and end: the step state made afresh, the plan begun at the first save, the
step's figures read at its end.

NOTE [ Lean steps that leave the plan ]
  A planned step that offloads nothing after a step that moved nothing is lean: it notes no
  recipes for rebuilding (no dispatch mode on the stack) and, where the copy path is built, its
  packs are decided in C++ (NOTE [ Steps that keep everything ]). If such a step saves another
  sequence of storages than the step before it, which followed the plan (a library's kernel
  chosen differently without the mode on the stack, say), the rest of it is reactive and swaps
  all it can, and the next step, having moved bytes, is not lean and follows the plan again: a
  slow step every other step (measured on the transformers Trainer at a 20 GiB cap on an H200:
  9.5 GiB moved and 0.53 s every second step against 0.25). So a lean step that leaves the
  plan after a step that followed it ends lean steps for 8 steps, twice as many at each
  recurrence (16, 32, ...): a model whose every lean step leaves the plan pays one slow step
  per doubling (two in 40 steps, ten in ten thousand), and one that leaves it once (an
  epoch's last batch; a Trainer's step once in a run) keeps its lean steps for the rest of the
  run. Not for good: measured on that Trainer on an H200, one run's lean steps left the plan at
  step 31 and never again, another's at step 5 and never again, a third's never; ended for good
  at step 5, that run's settled step was 0.282 s against 0.239 s where lean steps held. (One
  cause found since: the C++ hooks, armed by the step's first storage, did not know it as kept,
  and a second save of it took a point of its own; the Trainer's every lean step left its plan
  at its third storage so. They are armed with the storages kept before now.)"""
from __future__ import annotations

import threading
import time

import torch

from ..plan import OffloadPlan
from ..stats import StepStats
from .records import Offloaded

__all__ = ["StepBoundaries", "StepState"]      # a room of SwapEngine (core.py)


class StepState:
    """What the engine knows of the step in flight. Made afresh as each step begins
    (``begin_forward``), so nothing of a step outlives it by being forgotten in a reset."""

    __slots__ = ("index", "by_ptr", "base", "keeps_all", "lean", "largest", "sigs", "beyond_plan",
                 "over",
                 "rec", "rec_lmsrt", "step_peak", "deferred_kept", "forward_end_use", "bwd_point",
                 "retries_before", "failures_before", "cpu_before", "began", "forward_s")

    def __init__(self, retries_before: int = 0, failures_before: int = 0):
        self.index = 0                 # storages saved in this forward
        self.by_ptr: dict = {}         # storage address -> Offloaded/Kept, for this forward
        self.base = None               # GPU use at the step's first save (None: not yet)
        self.keeps_all = False         # the step's plan keeps everything (set at its first save)
        self.lean = False              # it began as one that keeps everything: no recipes noted,
                                       # or decided in C++ (NOTE [ Lean steps that leave the plan ])
        self.largest = (0, 0)          # (bytes, save index) of this forward's largest storage
        self.sigs: dict = {}           # forward point -> signature of its recipe
        self.beyond_plan = 0           # bytes swapped beyond the plan
        self.over = None               # (forward point, GPU use there) of the first of them
        self.rec = None                # the policy's Profile, while this step is recorded
        self.rec_lmsrt = 0             # lmsrt's bytes at the last recorded point
        self.step_peak = 0             # highest peak read before a reset inside this step
        self.deferred_kept = 0         # deferred swaps that forward ended without
        self.forward_end_use = 0       # GPU use when forward ended, net of copies in flight
        self.bwd_point = 0             # unpacks so far in this backward (the policy's point j)
        self.retries_before = retries_before      # the allocator's retry count as it began
        self.failures_before = failures_before    # and its count of failed allocations
        self.cpu_before = time.process_time()     # and the process's CPU seconds
        self.began = time.perf_counter()          # and wall time
        self.forward_s = 0.0           # wall seconds of its forward, once over


class StepBoundaries:
    """Step boundaries of a ``SwapEngine``."""

    # -- step boundaries ---------------------------------------------------------------------

    def relearn(self) -> None:
        """Plan afresh from the next step on, learning it as step 1 was: what the model saves
        has changed (recompute/regions.py recomputes other regions). Called from a step listener."""
        self._relearn = True

    def after_backward(self) -> bool:
        """Whether this thread's next save begins a new step: a backward used its saved
        tensors since its forward began, and none runs now (forward.py's ``pack``)."""
        return (threading.get_ident() in self._after_backward
                and torch._C._current_graph_task_id() == -1)

    def carried_over(self) -> tuple:
        """(the model's own peak in the step in flight's passes, 0 where it recorded none; GPU
        use now less its base, its use at its first save): read at the next step's start, how
        high a learning step's passes went, less what lmsrt held at each recorded point (sources
        in flight, restored copies: its saved bytes count them), and what it left to the steps
        after it (an optimizer's state, made by its first step), which raises their passes'
        peak."""
        st = self.state
        if st.base is None:
            return 0, 0
        passes = 0 if st.rec is None else st.base + st.rec.own_peak()
        return passes, self.device.memory_allocated() - st.base

    def saved_so_far(self) -> tuple:
        """(the step in flight, the bytes of the storages it has saved so far): what
        recompute/compiled.py counts around a block's eager call."""
        step = self.current_step()
        return step.step, sum(self.plan.current)

    def save_point(self) -> int:
        """The forward point the next storage saved in this step gets (while the C++ hooks decide
        the packs, theirs: NOTE [ Steps that keep everything ]); recompute/account.py marks
        where each block's call begins and ends by it."""
        keeper = self._keeper() if self._armed else None
        return self.state.index if keeper is None else keeper.index

    def saved_points(self, tensors) -> list:
        """The forward points of the storages of ``tensors`` that this step has saved and
        swapped so far (a region's inputs in the survey step: NOTE [ Region plan ], 2)."""
        entries = (self._entry_of(t) for t in tensors)       # (engine/recipes.py)
        return [e.seq for e in entries if type(e) is Offloaded]

    def begin_forward(self) -> None:
        """A step's forward begins (``with`` entry, or the first save after a backward). Step
        listeners run first, with the number of the step that begins; one may raise to stop
        the script there (the launcher's LMSRT_MAX_STEPS), before anything of that step is held."""
        for listener in self.step_listeners:
            listener(self.run_stats.steps + 1 + bool(self.step.step))
        if self._samples:
            self.check_rebuilt()
        with self._lock:
            self._reap()
            for key, pending in list(self._param_rebuilds.items()):
                pending = [s for s in pending if not s.dead]
                if pending:
                    self._param_rebuilds[key] = pending
                else:
                    del self._param_rebuilds[key]
            self._sweep_orphans()
            self.held.release_finished()
            self.prefetch.forget_dead()
            stream = self.device.current_stream()
            if stream != self.compute and (self._forward_open or self.prefetch.order):
                raise RuntimeError(
                    f"lmsrt: a forward started on stream {stream} while tensors saved on stream "
                    f"{self.compute} are still in use (another thread's forward, or a graph not "
                    "yet run backward). One LMS orders its copies against one compute stream "
                    "(NOTE [ Stream lifetimes ], Rule 6): run every forward that shares it on "
                    "the same stream, or give each stream its own lmsrt.LMS.")
            self._after_backward.discard(threading.get_ident())
            if self._forward_open:
                self.end_forward()
            self._forward_open = True
            if self.step.step:
                self._finish_step()
            if self._relearn:
                self._relearn = False
                self.plan = OffloadPlan()
                self.policy.relearn()
            keeper = self._keeper and self._keeper()
            if keeper is not None:
                keeper.backward(False)    # unpacks go to Python until forward ends
            self.step = StepStats(step=self.run_stats.steps + 1, mode=self.plan.mode)
            self.state = StepState(self.device.alloc_retries(), self.device.alloc_failures())
            self.compute = stream
            self._compute_key = self.device.stream_key()
            self.prefetch.reindex()
            if self.rebuilds is not None:
                # The first forward checks recipes as their outputs are saved (NOTE [ Rebuilt
                # storages ]): their inputs are held until then, or until forward ends.
                if self.rebuilds.retaining:
                    self.rebuilds.let_go()
                self.rebuilds.retaining = self.step.step == 1
                # A planned step that offloads nothing rebuilds nothing: no recipes (each costs
                # the op's dispatch through Python and objects for the collector: docs/design.md,
                # "Measurements behind the engine's rules"). Should it swap after all, it
                # copies; the step after notes recipes again.
                self.state.lean = lean = (self.plan.planned and self.plan.target == 0
                                          and not self._swapped_last
                                          and self.step.step >= self._lean_from)
                self.rebuilds.noting = self.rebuilds.worthwhile and not lean
                self.rebuilds.follow_noting()
            self.host.new_step()
            self.optimizer_mover.new_step()

    def _begin_plan(self, first: int) -> None:
        """The step's first saved storage: GPU use now is the base its policy plans from. (Not
        at ``begin_forward``: under ``lmsrt run`` the first step begins with the script, before
        its model exists, later steps with their first save; the first save is the same point
        in every step either way.)"""
        st = self.state
        st.base = base = self.device.memory_allocated()
        if self.rebuilds is not None:
            # The recorder's ops are counted from here: the forward's, not the optimizer's, nor
            # (under ``lmsrt run``) the script's before its first step.
            self.rebuilds.dispatched[0] = 0
        self.gauge.restart(base)
        policy, plan, step = self.policy, self.plan, self.step
        policy.begin_step(plan, base, first)
        st.rec = policy.recording
        if st.rec is not None:
            self.device.reset_peak()
            st.rec_lmsrt = self._lmsrt_bytes()
        step.plan_target_bytes = plan.target if plan.planned else 0
        rebuilds = self.rebuilds
        st.keeps_all = (policy.lean_step(plan) and self.step.step >= self._lean_from
                        and (rebuilds is None or not (rebuilds.noting or rebuilds.retaining)))
        st.lean = st.lean or st.keeps_all
        step.bound_bytes = self.mark
        for name, value in policy.step_figures().items():
            setattr(step, name, value)
        if plan.planned:
            self.host.reserve(plan.copied)         # rebuilt storages need no host memory

    def end_forward(self) -> None:
        """Forward is over: at ``with`` exit, or at the first unpack of a backward that follows
        (under one ``with`` around a whole loop no exit marks it)."""
        with self._lock:
            if not self._forward_open:
                return
            self._forward_open = False
            self.state.forward_s = time.perf_counter() - self.state.began
            if self._armed:
                self._absorb(entries=False)
            if self.rebuilds is not None and self.rebuilds.retaining:
                self.rebuilds.retaining = False
                self.rebuilds.let_go()
            if self.deferred:
                self.deferred.end(self.state)
            self.held.release_finished()
            self.state.forward_end_use = self.device.memory_allocated() - self.held.bytes
            self.step.forward_end_bytes = self.state.forward_end_use
            self.state.by_ptr.clear()
            self.prefetch.from_top()
            self.state.bwd_point = 0
            keeper = self._keeper and self._keeper()
            if keeper is not None:
                # Nothing to prefetch or record: kept handles need no Python in backward.
                keeper.backward(not self.prefetch.walking and self.state.rec is None)

    def _finish_step(self) -> None:
        s = self.step
        s.cpu_s = time.process_time() - self.state.cpu_before
        s.gpu_peak_bytes = self.step_peak()
        self._read_figures(s)
        if self.memo is not None:
            self.memo.saw(self.host.used_slabs())
        s.alloc_retries = self.retries_in_step()
        s.mode = "plan" if self.plan.followed else "reactive"
        s.alloc_failures = self.device.alloc_failures() - self.state.failures_before
        if s.alloc_retries and s.mode == "plan" and not self.policy.adapts_to_retries:
            self.diagnostics.alloc_retries(s)
        if s.alloc_failures:
            self.diagnostics.alloc_failures(s)
        rebuildable = self._finish_rebuilds(s) if self.rebuilds is not None else None
        if self.saved_nothing():
            # An evaluation under no_grad inside ``with lms:``: a step of the history, which no
            # plan or policy learns of (ending the plan there left a loop that evaluates after
            # every training step unplanned).
            s.policy_note = "saved nothing: the plan stands"
        else:
            self._take_in(s, rebuildable)
        self.state.rec = None
        self.run_stats.add(s)
        self.device.reset_peak()

    def _take_in(self, s: StepStats, rebuildable) -> None:
        """The plan and the policy take in the step ending (``_finish_step``)."""
        where = self.plan.divergence()
        # A step the policy planned (not one it learnt from) that left its sequence.
        strayed = (self.plan.planned and not self.plan.followed
                   and self.policy.recording is None)
        followed = self.plan.finish_step(rebuildable)
        history = self.run_stats.history
        left = (self.state.lean and not followed and bool(history)
                and history[-1].mode == "plan")     # (the step before followed its plan)
        if left:                        # NOTE [ Lean steps that leave the plan ]
            ban, self._lean_ban = self._lean_ban, self._lean_ban * 2
            self._lean_from = s.step + 1 + ban
        self._swapped_last = s.out_bytes + s.recipe_bytes + self.state.deferred_kept
        s.beyond_plan_bytes = self.state.beyond_plan if s.mode == "plan" else 0
        # Judged by its training pass, not the optimizer's update after it (NOTE [ Optimizer
        # state on the host ], Rule 9).
        mark = self.optimizer_mover.marks.pass_peak
        peak = s.gpu_peak_bytes if mark is None else mark
        self.policy.finish_step(self.plan, followed=followed,
                                forward_end_use=self.state.forward_end_use,
                                swapped=self._swapped_last,
                                beyond_plan=self.state.beyond_plan, peak=peak,
                                retries=s.alloc_retries, failures=s.alloc_failures,
                                over=self.state.over, tuning=self.device.tunes_algorithms())
        s.policy_note = self.policy.note()
        if strayed and where and not left:
            s.policy_note = (f"this step left its plan ({where})"
                             + (f"; {s.policy_note}" if s.policy_note else ""))
        if left:
            s.policy_note = (f"a step that kept everything saved another sequence than the one "
                             f"before it ({where or 'fewer storages'}): none for {ban} steps"
                             + (f"; {s.policy_note}" if s.policy_note else ""))

    def _finish_rebuilds(self, s: StepStats) -> set:
        """Read the step's bitwise checks and rebuild times; return the forward points whose
        storages the next step may rebuild, each with the points its recipe reads (for the
        plan)."""
        s.rebuild_ms, s.rebuild_checks, mismatched = self.rebuilds.finish_step()
        if mismatched:
            self.diagnostics.rebuild_mismatch(mismatched)
        st = self.state
        if not self.rebuilds.judge_recorder(s, st.forward_s, time.perf_counter() - st.began,
                                            planned=self.plan.planned):
            return {}
        trusted = self.rebuilds.trusted
        return {i: reads for i, (sig, reads) in self.state.sigs.items() if sig in trusted}

    def step_peak(self) -> int:
        """The peak of the step in flight so far, resets of the device's counter inside it
        included."""
        return max(self.device.peak_allocated(), self.state.step_peak)

    def saved_nothing(self) -> bool:
        """Whether the step in flight has saved no tensor (a forward under no_grad)."""
        return self.save_point() == 0 and not self.plan.current and not self.step.skipped_tensors

    def retries_in_step(self) -> int:
        """The allocator's retries in the step in flight so far (its optimizer's included)."""
        return self.device.alloc_retries() - self.state.retries_before

    def current_step(self) -> StepStats:
        """The step in flight, with its peaks read now."""
        s = self.step
        if self._armed:
            with self._lock:
                self._absorb(entries=True)
        if s.step:
            s.mode = self.plan.mode
            s.gpu_peak_bytes = self.device.peak_allocated()
            s.cpu_s = time.process_time() - self.state.cpu_before      # so far
            self._read_figures(s)
        return s

    def _read_figures(self, s: StepStats) -> None:
        """Into ``s``: the host pool's and the optimizer mover's figures, and the copy waits
        whose times are in."""
        for name, value in (self.host.figures() | self.optimizer_mover.figures()).items():
            setattr(s, name, value)
        pending = []
        for wait in self._timed_waits:
            name, start, end = wait
            if end.query():
                setattr(s, name, getattr(s, name) + start.elapsed_time(end))
            else:
                pending.append(wait)
        self._timed_waits = pending

