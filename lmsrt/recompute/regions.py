"""Whole regions recomputed in backward, beside the engine's keep, swap and rebuild.

A region is one call of a repeated block (a transformer layer, a conv net's stage), found from
the model's structure through global module hooks, so ``lmsrt run`` sees unmodified scripts. A
recomputed region keeps only its inputs (handed to the engine, which keeps or swaps them like
any saved tensor) and drops everything its ops saved; backward runs its forward again at the
first use of one of them, as ``torch.utils.checkpoint`` (non-reentrant) does. The plan
(``choose_regions``) recomputes regions where moving their bytes would cost more step time than
running them again: NOTE [ Region plan ].

NOTE [ Recomputed regions ]
  Rule 1 (what a region is; finder.py). A child of an ``nn.ModuleList`` or
    ``nn.Sequential`` whose class appears there more than once, unless compiled (compiled.py:
    the partitioner's budget chooses what it recomputes); one object listed several times is one
    region. In a plain ``nn.Sequential`` of mixed classes (a conv net's layers), children are
    grouped into stages, run as one chain: a stage starts at each child of the class that leads
    the container (its first child with parameters), or earlier, at the parameter-free child
    before it whose input is smallest (pooling ends a stage, upsampling starts the next); the
    sizes come from the first step that ran with grad, which recomputes nothing. A stage starts
    at a child listed once in the container, and its frame follows it by position.
  Rule 2 (only where lmsrt saves). A region is entered only while grad is on, outside backward,
    and with this LMS's saved-tensor hooks innermost: inside a user's own checkpoint (its hooks
    are innermost; a reentrant one runs forward without grad), ``save_on_cpu``, a torch.func
    transform, or another region, nothing changes.
  Rule 3 (a frame never outlives its forward; ``_close``). Every tensor in its arguments, nested
    and keyword ones included (pytree), goes to the engine at entry; its ops' saved tensors are
    held while it runs and dropped when it returns. Its other arguments are copied as they are
    at its call, containers and plain objects only, sharing their tensors (``as_called``), and
    its rerun gets a copy of that: an object forward changes is found as forward found it, and
    the caller's is left alone (transformers' DynamicCache, which each layer's attention appends
    to, was twice its length after a backward that reran its layers). It closes when its last
    module returns, when any module in it raises, when a walk leaves a stage early (a module
    outside it is called or returns), and at the ``with`` block's exit or the next step; each
    close takes exactly its own hooks off the stack. A frame that raised or was left keeps what
    it saved, as does one that changed an input in place (Rule 6): kept tensors go to the
    engine, which keeps or swaps them.
    While a frame is open the engine's rebuild recorder sleeps (rebuilds.py, ``sleep``): what the
    region's ops save is recomputed, not rebuilt, and a recorder on the mode stack runs every op
    through Python (GPT-2 medium at an 18 GiB cap, 20 of 24 blocks recomputed: ~0.2 s a step
    with it awake against 0.10 uncapped).
  Rule 4 (recomputed; frames.py). At the first unpack of a dropped tensor, the region
    runs again from its inputs (brought back by the engine) with grad on, up to the save of the
    last tensor it dropped (the rest is skipped, as torch's checkpoint stops early). The running
    statistics of its batch norms in training mode, updated once by forward, are put back after
    the rerun. Tensors are matched by the order they were saved in; a rerun that saves other
    shapes or dtypes raises. Python code in its forward before that save runs again. A rerun
    that runs out of memory runs once more after the engine gave back the copies it fetched
    ahead (``SwapEngine.room_in_backward``), with the same inputs, RNG state and statistics.
  Rule 5 (versions). Autograd skips its in-place check while hooks are set, so each handle keeps
    its tensor's version counter (``engine.counter_only``) and unpack raises autograd's error
    when it moved; the engine checks the inputs it holds. An input its ops did not save may be
    changed after it (``x += block(x)``): a region's first calls drop at the next region's entry
    only if such inputs stood unchanged, else they keep and the region's later calls hand the
    engine a copy of those inputs; a change seen only in backward raises saying so.
  Rule 6 (what is restored, what is refused; safety.py). The rerun restores the CPU RNG
    and that of every CUDA device its tensors live on, autocast, the backend flags,
    ``sdpa_kernel``'s backends, deterministic mode and each module's train flag as in forward.
    Refused, said once with the block and why (``refuse``; ``stats()["regions"]["refused"]``):
    TorchScript, a module holding a ``torch.Generator``, forward hooks of the user's or global
    ones not lmsrt's, a forward that changed a parameter or buffer in place (batch norm's
    statistics apart) or an input, or drew from Python's or numpy's generator (checked on a
    region's first calls). Not seen: other generators, writes that bump no version. Under
    cuDNN's benchmark mode each kind of call's rerun is checked once, bit for bit (reruns.py).
  Rule 7 (parameters between forward and backward). Before an optimizer steps or ``p.data`` is
    read or set (params.py), dropped regions that read those parameters run again at once
    (``materialize``); a checked call gives its check up (reruns.py). A parameter or buffer
    changed otherwise in place is found as the rerun starts: it raises saying so, and the
    region is refused.

NOTE [ Region plan ]
  1. Step 1 surveys: regions are found, a mixed Sequential's output sizes read, nothing is
     recomputed, and the engine learns as always. Its peak plus what it saved estimates the
     step's use with everything kept; what it left on the GPU by step 2's first save (an
     optimizer's state, made by its first step) raises the peak of every later step's passes
     (its forward and backward, up to its last recorded point: the Trainer, GPT-2 and Lightning
     loops' planned steps took 2.5-5 GiB more off the GPU than the excess without it). That
     peak is the model's own, what lmsrt held at each point (sources in flight, restored
     copies) left out: what it saved counts them. The excess is that over the engine's bound.
  2. Where the excess is under 1/16 of the limit (or the link is free, the simulated device),
     nothing is recomputed and the hooks go idle. A region whose rerun would pass the bound is
     never recomputed (``SurveyCalls``; said): a rerun holds all its call saved from its first
     unpack, each storage to its last, and the saved storages it was called with, where
     swapping brought each back alone, at its own first unpack; and step 1
     (every eligible storage swapped) says what use is there (a conv net at 85% of its peak
     ran out of memory in backward where it reran its 768 MiB stages, on an H200). Otherwise
     step 2 recomputes every region that fits and times its forward (CUDA events; wall time on
     the simulated device): in step 1 the swaps slow forward down, and a region that swaps
     nothing runs at its own speed. The engine learns again (``SwapEngine.relearn``): what the
     model saves has changed.
  3. Step 3 plans (``choose_regions``) with one probe of the link's bandwidth, forward's time
     as its regions' and backward's as twice that. The step that times them learns: what its
     forward waited for copies out inside a region (``swapout_wait_ms``' events) is taken off
     that region's time; a region counts at the faster of that and its rerun in the same step's
     backward (the same ops, nothing swapped: what a recompute costs, up to the last save it
     needs); blocks of one class count at the fastest of them. A swap costs the
     copy time compute does not hide (out: forward's; in: backward's); rebuilt bytes (step 1's
     share) cross no link (``StepFigures``).
  4. The plan holds from step 3: no step is spent trying other choices (each cost a learning
     step that moves every eligible byte, and two timed steps; trials settled only around step
     12). Where it recomputes every region, step 2 has learnt it already; otherwise the engine
     learns it in step 3. Every step that learns holds the least the engine can hold, so none
     runs out of memory where swapping alone fits.
  5. The first planned step is read once, with two figures measured as it ran: what it took off
     the GPU (moved, rebuilt and recomputed), and how long its compute stream stood still
     waiting for copies (``swapout_wait_ms`` in forward, ``swapin_wait_ms`` in backward). Where
     it took more than the excess the plan was made for by over an eighth (the learning step's
     peak is not a planned step's: measured on a Llama, 10.7 GiB planned, 14.2 taken), or its
     copies stalled compute longer than predicted (by over 5% of the passes' time), the plan's
     figures take the measured ones (``checked``): the excess, and how much of the passes hides
     copies (``calibrated``); the plan is made again, and the engine learns the regions it
     adds; never fewer. (The GPU is synchronized once first, so that every wait is read.)
  6. Allocator retries that stay add a region (plan.py, ``RetriedSteps``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref
from typing import List, Optional

import torch
from torch import nn

from .. import params
from ..hook_stack import innermost_is
from ..say import say_once
from ..units import format_bytes
from . import plan as spans
from .account import BlockAccount
from .finder import BlockFinder, Region, blocks_line
from .frames import RERUNS, Frame, rerun
from .plan import (
    SIM_BANDWIDTH,
    StepFigures,
    SurveyCalls,
    checked,
    choose_regions,
    link_bandwidth,
    over_bound,
    timed_order,
)
from .reruns import RerunCheck

__all__ = ["Regions", "StepFigures", "choose_regions", "link_bandwidth", "SIM_BANDWIDTH"]

_WORTH_SHIFT = 4         # regions are timed only when the excess is over limit >> this


def _locked(method):
    """``method`` of ``Regions`` under its lock: threads that share one LMS each begin steps
    (the engine's step listener) and read finished reruns, at once."""
    @functools.wraps(method)
    def run(self, *args):
        with self._lock:
            return method(self, *args)
    return run


class Regions:
    """Finds a model's repeated blocks, measures them, and recomputes those the plan chooses
    (NOTE [ Recomputed regions ], NOTE [ Region plan ]). One per LMS under ``recompute``; its
    global module hooks act only while that LMS's saved-tensor hooks are innermost.

    Example::

        lms = lmsrt.LMS(device="sim")             # recompute=True: lms owns a Regions
        lms.stats()["regions"]["recomputed"]      # regions recomputed in the last step
    """

    def __init__(self, engine, hooks, recompute: bool = True):
        self.engine = engine
        self.finds_only = not recompute     # blocks found and accounted for, never recomputed
        self._rebuilds = engine.rebuilds
        self.hooks = (hooks.pack, hooks.unpack)
        self._owner = hooks             # the engine, or its C++ hooks
        self.simulated = engine.device.kind == "sim"
        self.bandwidth: Optional[float] = SIM_BANDWIDTH if self.simulated else None
        self.worth = engine.limit >> _WORTH_SHIFT    # least excess the regions are timed for
        self.step = 0
        self.phase = "survey"           # survey (step 1), timing (step 2), planned
        self.idle = False               # planned to recompute nothing: the hooks return at once
        self._all = False               # recompute every usable region (the timing step)
        self._unchecked = False         # the plan's first planned step is still to be read (5)
        self.note = "step 1 finds the model's repeated blocks and recomputes none"
        refuse = weakref.WeakMethod(self.refuse)        # (no cycle: a dropped LMS goes at once)
        self.finder = BlockFinder(lambda region, why: refuse()(region, why))
        self._of = self.finder.of       # a region's first module -> the region
        self.account = BlockAccount(engine, self.finder.region_of, hooks)
        self.order: List[Region] = []  # regions in forward order, as the timing step ran them
        self.figures: Optional[StepFigures] = None   # what the plan was made from
        self._local = threading.local()     # this thread's open frame and the one to settle
        self._waiting: "weakref.WeakSet" = weakref.WeakSet()   # dropped frames not yet rerun
        self._lock = threading.RLock()  # threads sharing the LMS: its sets, steps, times
        self._said: set = set()         # this LMS's lines said once
        self._saw_grad = False          # this step ran a forward with grad (not an evaluation)
        self._timings: list = []        # [region, start, end, forward waits]: timing step
        self._recomputes: collections.deque = collections.deque()   # [start, end], unread
        self._reruns: list = []         # (region, [start, end]) of the timing step's reruns
        self._kept_calls = 0            # this step's region calls that kept their tensors
        self._rerun_check = RerunCheck(engine.device)
        self._span: list = []           # forward's first region start and last region end
        self._calls = SurveyCalls()     # step 1's calls of region modules (Region plan, 2)
        self._retried = spans.RetriedSteps()    # (Region plan, 6)
        _flush_dead()                   # hooks of Regions collected before this one
        handles = _module_hooks(weakref.ref(self))
        self.finder.kwargs_of = handles[0].id
        # Collected, it only marks them: torch.compile builds guards over the global hook dicts,
        # and a collection inside a compilation that removed one would break it (_flush_dead).
        self._finalizer = weakref.finalize(self, _dead_hooks.extend, handles)
        # Held weakly by the engine, as by the hooks: a dropped LMS is freed at once, no cycle.
        listener = weakref.WeakMethod(self._begin_step)
        engine.step_listeners.append(lambda step: (listener() or spans.ignore_step)(step))

    def close(self) -> None:
        """Remove the global module hooks."""
        self._finalizer()
        _flush_dead()

    # -- structure (Rule 1) --------------------------------------------------------------------

    def _group(self) -> None:
        self.finder.group()

    # -- forward (Rules 2, 3) ------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict):
        local = self._local
        frame = getattr(local, "frame", None)
        if frame is not None:
            if frame.enters(module):        # inside it, or its stage's next module
                return None
            self._close(frame, "")          # a walk left the stage before its end (Rule 3)
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None
        if not innermost_is(self._owner):
            if self.phase == "survey":      # (another's hooks are: NOTE [ Region plan ], 2)
                self._calls.outside.add(module)
            return None
        self._saw_grad = True
        if module not in self.finder.scanned:
            self.finder.scan(module)
        region = self._of.get(module)
        if self.phase == "survey":          # its calls' spans of saves (NOTE [ Region plan ], 2)
            if region is not None or module in self.finder.scanned_children:
                self._calls.enter(module, self.engine, args, kwargs)
            return None
        if region is None:
            return None
        pending = getattr(local, "pending", None)
        if pending is not None:             # the last region's inputs stood unchanged till here
            local.pending = None
            self._settle(pending)
        if not (region.usable and not region.unfit and (region.chosen or self._all)):
            return None
        why = region.state.hooks()
        if why:
            self.refuse(region, why)
            return None
        frame = Frame(self, region, args, kwargs or {}, self.hooks)
        frame.blind = kwargs is None and not region.chain
        local.frame = frame
        if self.phase == "timing":
            waits = getattr(self.engine, "_timed_waits", None)
            frame.span = [region, *spans.mark_span(self.simulated), (waits, len(waits or ()))]
            self._timings.append(frame.span)
        frame.hooks.__enter__()
        if self._rebuilds is not None:
            self._rebuilds.sleep()
        return None

    def _post(self, module: nn.Module, kwargs, output=None):
        if self.phase == "survey":
            if isinstance(output, torch.Tensor) and isinstance(kwargs, dict):
                self.finder.note_output(module, output)
                self._calls.leave(module, self.engine.save_point())
            return None
        frame = getattr(self._local, "frame", None)
        if frame is None:
            return None
        if not isinstance(kwargs, dict):    # it raised (Rule 3): closed at once
            self._close(frame, "it raised")
        else:
            walked = frame.returns()
            if walked == "left":            # a module around the stage returned
                self._close(frame, "")
            elif walked != "inside" and frame.blind and kwargs:
                self.refuse(frame.region, "its keyword arguments were not seen at its entry")
                self._close(frame, "its keyword arguments were not seen")
            elif walked == "done":
                self._close(frame, "")
        return None

    def _close(self, frame: Frame, keep_why: str) -> None:
        """NOTE [ Recomputed regions ], Rules 3 and 5: the frame ends; what it saved is dropped
        now, kept, or (a region's first calls, with inputs its ops did not save) dropped at the
        next region's entry if those inputs stand unchanged."""
        local = self._local
        local.frame = None
        if frame.span is not None:
            spans.end_region(frame.span, self.simulated, getattr(self.engine, "_timed_waits", None))
        why = frame.close(keep_why)
        if self._rebuilds is not None:
            self._rebuilds.follow_noting()      # awake again where the engine notes (Rule 3)
        region = frame.region
        if why:
            self.refuse(region, why)
        if why or keep_why:
            self._kept_calls += 1
            return
        if frame.unsaved and region.copies:
            frame.copy_unsaved()
        if frame.unsaved and region.learning > 0:
            region.learning -= 1
            pending, local.pending = getattr(local, "pending", None), frame
            if pending is not None:
                self._settle(pending)
            return
        self._settle(frame)

    def _settle(self, frame: Frame) -> None:
        # What a call saves is what recomputing it frees, also where this call keeps (its
        # unsaved inputs changed: later calls copy them, and drop).
        frame.region.nbytes = max(frame.region.nbytes, frame.nbytes)
        if self._rerun_check.keeps(frame, self.refuse, self.step):
            self._kept_calls += 1
            if not frame.checking:
                return
        else:
            if frame.settle():
                frame.region.copies = True      # Rule 5: from now on its inputs are copied
            if not frame.dropped:
                self._kept_calls += 1
                return
            self.engine.step.count_recomputed(frame.nbytes)
            self.account.drop(frame.region, frame.nbytes)
        with self._lock:                # rerun in backward: before the parameters it reads
            self._waiting.add(frame)    # change, ``materialize`` sees it (Rule 7)
        params.watch(self, parameters=True)

    def leave(self) -> None:
        """This thread's forward is over (its ``with`` block ends, or a step begins): a frame
        still open (an interrupt, a walk that stopped) closes and keeps what it saved; one
        waiting to drop drops (Rule 3)."""
        local = self._local
        frame, pending = getattr(local, "frame", None), getattr(local, "pending", None)
        if frame is not None:
            self._close(frame, "the forward left it")
        if pending is not None:
            local.pending = None
            self._settle(pending)

    def refuse(self, region: Region, why: str) -> None:
        """Never recompute ``region`` again, because ``why`` (said once, Rule 6)."""
        region.usable, region.why = False, why
        if "blocks" in self._said:          # found after the line of blocks: a line of its own
            say_once(f"refused {region.name}", f"lmsrt: region {region.name} is not "
                     f"recomputed: {why}", given=self._said, stacklevel=3)

    def materialize(self, parameters) -> None:
        """Rerun now the dropped regions, not yet rerun, that read the parameters whose ids are
        in ``parameters``: they are about to change (params.py calls it before an optimizer
        step and before ``p.data`` is read or set; NOTE [ Recomputed regions ], Rule 7)."""
        if not self._waiting or getattr(self._local, "frame", None) is not None:
            return
        ids = parameters if isinstance(parameters, (set, frozenset)) else set(parameters)
        with self._lock:
            frames = [f for f in self._waiting if f.again is None and f.region.param_ids & ids]
            self._waiting.difference_update(frames)
        for frame in frames:            # a checked call keeps: its kind is checked later
            frame.uncheck() if frame.checking else self.recompute(frame)

    def check_rebuilt(self) -> None:
        """(params.py asks each watcher; a region's rerun checks itself as it runs.)"""

    # -- backward (Rule 4) ---------------------------------------------------------------------

    def recompute(self, frame: "Frame") -> None:
        """Run ``frame``'s region again (``rerun``), its GPU time taken."""
        with self._lock:
            self._waiting.discard(frame)
        timing = spans.mark_span(self.simulated)
        try:
            rerun(frame)
        except torch.OutOfMemoryError:
            if not self.engine.room_in_backward():
                raise
            rerun(frame)            # the same inputs, RNG state and statistics (Rule 4)
        spans.end_span(timing, self.simulated)
        self._rerun_check.compare(frame, self.refuse)
        self._recomputes.append((frame.region, timing))
        if self.phase == "timing":
            self._reruns.append((frame.region, timing))

    # -- steps and the plan --------------------------------------------------------------------

    @_locked
    def _begin_step(self, step: int) -> None:
        """The engine's step listener: finish the last step's figures, move to the next phase
        (NOTE [ Region plan ])."""
        self.read_times()                # into the step that ends, before the engine closes it
        self.leave()
        self.account.restart()
        self._kept_calls = 0
        self.step = step
        # An evaluation (no grad) is no step to find or time regions in.
        learnt, self._saw_grad = self._saw_grad, False
        if not learnt and self.phase in ("survey", "timing"):
            pass
        elif self.phase == "survey" and step >= 2:
            self._survey_done()
        elif self.phase == "timing":
            self._plan()
        elif self.phase == "planned" and self._unchecked:
            # Once: the GPU finishes the step, so that all its waits for copies are read.
            self.engine.device.synchronize()
            ending = self.engine.current_step()
            if ending.mode == "plan":
                self._check_plan(ending)
        elif self.phase == "planned" and not self.idle:
            self._retried.read(self)
        if self._rerun_check.take_trusted():
            self.engine.relearn()        # trusted kinds drop from now on: another sequence
        self._timings = []
        if self.phase not in ("survey", "timing"):
            self._say_blocks()

    @_locked
    def read_times(self) -> None:
        """Add the GPU time of finished recomputes (in order: one stream runs them) to the step
        in flight's ``recompute_ms``; one still running counts in the step that reads it done."""
        pending, step = self._recomputes, self.engine.step
        while pending:
            region, (start, end) = pending[0]
            if end is None or not (self.simulated or end.query()):
                return
            ms = (end - start) * 1e3 if self.simulated else start.elapsed_time(end)
            step.recompute_ms += ms
            self.account.rerun(region, ms)
            pending.popleft()

    def _survey_done(self) -> None:
        self._group()
        step1 = self.engine.current_step()
        # The excess over the bound must leave (NOTE [ Region plan ], 1).
        self._saved, self._excess = over_bound(step1, self.engine.mark,
                                               self.engine.carried_over())
        self._rebuilt = step1.recipe_bytes
        found = len(set(self._of.values()))
        if self.finds_only:
            self._done(f"{found} regions; recompute is off")
            return
        if not self._of or self._excess < self.worth or self.bandwidth == SIM_BANDWIDTH:
            self._done(f"{found} regions, none recomputed: {format_bytes(self._excess)} over the "
                       f"bound is left to the swaps")
            return
        if not self._fit():
            self._done(f"{found} regions, none recomputed: {spans.unfit_note(self._found())}")
            return
        self.phase, self._all = "timing", True
        self.note = "step 2 recomputes every region to time its forward"
        self.engine.relearn()

    def _fit(self) -> bool:
        """NOTE [ Region plan ], 2: mark the regions whose rerun would pass the bound in the
        survey step; whether any usable one is left."""
        calls, self._calls = self._calls, SurveyCalls()
        found = self._found()
        calls.mark_unfit(found, self.engine)
        return any(r.usable and not r.unfit for r in found)

    def _done(self, note: str) -> None:
        """Nothing to recompute: the hooks return at once. (They stay: removing a global hook
        makes torch.compile compile its graphs again.)"""
        self.phase, self.note, self.idle = "planned", note, True

    def _plan(self) -> None:
        """NOTE [ Region plan ]."""
        self.order = order = timed_order(self._timings, self._reruns, self.simulated)
        self._reruns = []
        t_fwd = sum(r.seconds for r in order)
        bandwidth = self.bandwidth or link_bandwidth(self.engine.device)
        usable = [r for r in order if r.usable]
        self.figures = StepFigures(self._excess, self._saved, self._rebuilt, t_fwd, 2 * t_fwd,
                                   bandwidth)
        chosen = [usable[i] for i in choose_regions([(r.nbytes, r.seconds) for r in usable],
                                                    self.figures)]
        self._apply(chosen)
        self.phase, self._unchecked = "planned", True
        if chosen != usable:
            self.engine.relearn()        # step 2 learnt every region recomputed (4)
        self.note = (f"recompute {len(chosen)} of {len(order)} regions (frees "
                     f"{format_bytes(sum(r.nbytes for r in chosen))}, forward "
                     f"{sum(r.seconds for r in chosen) * 1e3:.1f} ms): "
                     f"{format_bytes(self._excess)} over the bound, forward {t_fwd * 1e3:.1f} ms, "
                     f"link {bandwidth / 1e9:.0f} GB/s, swaps predicted to cost "
                     f"{self.figures.swap_seconds(0) * 1e3:.1f} ms without regions")

    def _check_plan(self, step) -> None:
        """NOTE [ Region plan ], 5: the plan's first planned step took ``left`` bytes off the
        GPU (moved, rebuilt, recomputed) and its compute stream waited ``exposed`` seconds for
        copies; where either is more than the plan counted on, plan once more for them."""
        self._unchecked = False
        figures = self.figures
        if figures is None:
            return
        figures, said = checked(figures, step)
        if not said:
            return
        usable = [r for r in self.order if r.usable]
        chosen = [usable[i] for i in choose_regions([(r.nbytes, r.seconds) for r in usable],
                                                    figures)]
        if len(chosen) <= sum(r.chosen for r in usable):
            return
        self.figures = figures
        self._apply(chosen)
        self.engine.relearn()
        self.note = (f"recompute {len(chosen)} of {len(self.order)} regions: "
                     f"{'; '.join(said)}; " + self.note)

    def _apply(self, chosen: list) -> None:
        """Recompute ``chosen`` from this step on."""
        self._all = False
        for region in self.order:
            region.chosen = region in chosen
        self.idle = not chosen

    def _found(self) -> List[Region]:
        """Every region found, in forward order where known."""
        return list(dict.fromkeys(self.order + self.finder.found))

    def _say_blocks(self) -> None:
        """Once: the blocks found and those refused, with why (Rule 6)."""
        found = self._found()
        if (self.finds_only or not found or "blocks" in self._said
                or (self.idle and all(r.usable and not r.unfit for r in found))):
            return                      # (nothing recomputed, nothing refused: nothing to say)
        say_once("blocks", blocks_line(found), given=self._said, stacklevel=5)

    def blocks(self) -> list:
        """``LMS.stats()["blocks"]``: per block of the step in flight, and outside them, what
        its saved tensors became (account.py, NOTE [ Block account ])."""
        return self.account.rows(self._found())

    def stats(self) -> dict:
        """The regions and the plan, for ``LMS.stats()["regions"]`` (which reads the times
        first); of the step in flight, its ``StepStats``' figures and the calls that kept."""
        step = self.engine.step
        return dict(regions=len(self.order) or len(self.finder.found),
                    phase=self.phase, planned=sum(r.chosen for r in self.order),
                    figures=self.figures and dataclasses.asdict(self.figures),
                    each=[(r.name, r.nbytes, round(r.seconds * 1e3, 3), r.chosen)
                          for r in self.order],
                    refused={r.name: r.why for r in self._found() if not r.usable},
                    unfit={r.name: r.unfit for r in self._found() if r.usable and r.unfit},
                    note=self.note, recomputed=step.recomputed_regions,
                    dropped_bytes=step.recomputed_bytes, recompute_ms=step.recompute_ms,
                    kept_calls=self._kept_calls)


def _module_hooks(me) -> list:
    """The global module hooks of the ``Regions`` ``me()`` (held weakly), registered. Under
    torch.compile (which traces module hooks) nothing is done: saved-tensor hooks see a
    compiled graph's tensors all at once, after it (DESIGN.md, "Compiled graphs")."""
    def pre(module, args, kwargs=None):
        # kwargs: for a region's module only, which names this hook in its
        # ``_forward_pre_hooks_with_kwargs`` (a global pre-hook has no with_kwargs of its own).
        regions = None if torch.compiler.is_compiling() else me()
        if regions is None or RERUNS.depth:
            return None
        regions.account.pre(module)         # before a frame takes the block's inputs
        return None if regions.idle else regions._pre(module, args, kwargs)

    def post(module, args, *rest):
        # (kwargs, output) after a forward; (output,) where it raised (always_call).
        regions = None if torch.compiler.is_compiling() else me()
        if regions is not None and not RERUNS.depth:
            if not regions.idle:
                regions._post(module, *rest)
            regions.account.post(module)
        return None

    return [nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post, with_kwargs=True,
                                                           always_call=True)]


# Hooks of collected Regions, inert (their weak reference is dead) and not yet removed: removed
# only from code the user called (a Regions made or closed), never from the collector, which
# may run in the middle of a torch.compile between its reading the global hook dicts and its
# guarding their keys.
_dead_hooks: list = []


def _flush_dead() -> None:
    while _dead_hooks and not torch.compiler.is_compiling():
        _dead_hooks.pop().remove()
