"""``SwapEngine``: one engine per ``LMS``, made of the rooms of this package."""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable

import torch

from .. import params
from ..cache import PinMemo
from ..config import LMSConfig
from ..diagnostics import Diagnostics
from ..host import HostPool
from ..movers import OptimizerMover
from ..plan import OffloadPlan
from ..policy import make_policy
from ..recompute.rebuilds import Rebuilds
from ..stats import RunStats, StepStats
from .backward import UnpackSide
from .boundaries import StepBoundaries, StepState
from .copies import NativeCopies, TorchCopies, finish_copies
from .deferred import DeferredCopies
from .entry import EnterExit
from .forward import PackSide
from .gauge import EXACT_EVERY, GpuGauge
from .native import NativeHandOver
from .prefetch import PrefetchWindow
from .recipes import RecipeOffload
from .records import Offloaded
from .release import HeldSources
from .swap_out import SwapOut

__all__ = ["SwapEngine"]


def _no_entry(t: torch.Tensor) -> None:
    return None


def _now(me: weakref.ref, name: str) -> Callable:
    """A getter of what the engine behind ``me`` has as ``name`` now (its step's figures, made
    afresh at each step; its policy), through the weak reference: a room that holds the getter
    does not keep the engine alive."""
    return lambda: getattr(me(), name)


def _step_peak(engine) -> int:
    """The peak of ``engine``'s step so far (0 once it is gone)."""
    return 0 if engine is None else engine.step_peak()


class SwapEngine(EnterExit, StepBoundaries, PackSide, NativeHandOver, RecipeOffload, SwapOut,
                 UnpackSide):
    """Swaps saved tensors between the GPU and pinned host memory for one ``LMS`` object.

    The rooms that own state are objects it holds and calls: ``gauge`` (GPU use), ``host``
    (pinned memory), ``held`` (sources held while their copies run), ``prefetch`` (the swapped
    storages in save order, and the window fetched ahead of backward) and ``deferred`` (copies
    that wait for their pins). What they are given of the engine they reach through weak
    references: a dropped LMS is freed at once, without the cycle collector."""

    owns_hooks = True         # its pack/unpack pairs are lmsrt's (hook_stack.pop_own_hooks)

    def __init__(self, config: LMSConfig, device):
        self.config = config
        self.device = device
        self.min_bytes = config.min_bytes
        self.d2h = device.new_stream()
        self.h2d = device.new_stream()
        # The per-tensor CUDA calls go through lmsrt.copy_path's C++ when it is built (the same
        # calls, ~30% less CPU per swapped tensor), else through torch's Python bindings.
        self._native = device.copy_path
        self.copies = (NativeCopies(self._native, self.d2h, self.h2d) if self._native
                        else TorchCopies(device, self.d2h, self.h2d))
        # An exact reading of GPU use is cheap natively: no need to estimate between readings.
        self.gauge = GpuGauge(device, 0 if self._native else EXACT_EVERY)
        self.compute = device.current_stream()
        self._compute_key = device.stream_key()
        self.host = HostPool(device, config.host_budget_bytes)
        self.plan = OffloadPlan()
        self.run_stats = RunStats()
        self.step = StepStats()
        self.state = StepState()          # made afresh as each step begins
        self.limit = device.memory_limit()
        # What the last run of this command used starts pinning now (cache.py, NOTE [ Pinning
        # ahead ]).
        self.memo = (PinMemo({k: v for k, v in config.as_dict().items() if k != "device"},
                             f"{getattr(device, 'name', type(device).__name__)}"
                             f":{getattr(device, 'index', 0)}", self.limit)
                     if config.pin_ahead else None)
        if self.memo is not None and self.memo.recalled:
            self.host.pin_slabs(self.memo.recalled)
        self.policy = make_policy(config.lms_frac, self.limit, config.prefetch_bytes)
        self.diagnostics = Diagnostics()   # one-time warnings, out-of-memory text
        # The rooms that own state, asked through weak references (see the class's docstring).
        me = weakref.ref(self)
        policy, step = _now(me, "policy"), _now(me, "step")
        self.held = HeldSources(policy, self.limit, wait_out=lambda s: me()._wait_out(s),
                                step=step, profile=lambda: me().state.rec)
        self.prefetch = PrefetchWindow(
            device, self.copies, self.h2d, self.gauge, policy, self.held, config.prefetch_bytes,
            order_after=lambda s, event: me()._order_after(s, event), step=step)
        self.deferred = DeferredCopies(device, self.host, self.copies, self.gauge, policy,
                                       self.held, self.prefetch, self.diagnostics, step=step)
        # NOTE [ Rebuilt storages ]; its recorders are entered with the hooks (lms.py).
        # Asked through a weak method: the table must not keep the engine alive (a dropped LMS
        # is freed at once, without the cycle collector).
        entry_of = weakref.WeakMethod(self._entry_of)
        self.rebuilds = (Rebuilds(device, lambda t: (entry_of() or _no_entry)(t))
                         if config.recompute else None)
        # NOTE [ Parameters a rebuild reads ] (params.py): id(parameter) -> rebuilt storages
        # that read it, not yet made; and (op, differs?) of each rebuild against its sample.
        self._param_rebuilds: dict = {}
        self._samples: list = []
        if self.rebuilds is not None:
            params.watch(self)
        self._lock = threading.RLock()
        # NOTE [ Optimizer state on the host ]: asked through weak references, as above.
        self.optimizer_mover = OptimizerMover(
            device, self.copies, self.host, self._lock, min_bytes=self.min_bytes,
            mode=config.optimizer_state, step_peak=lambda: _step_peak(me()),
            fits=self.policy.step_fits, room=self.policy.room_beside,
            part_bytes=max(self.limit >> 4, 64 << 10))
        self._dead: collections.deque = collections.deque()   # watches of dropped handles
        # Every watch's callback, made once: a bound method made per watch is one more object
        # per saved tensor for the collector to track from forward to backward.
        self._dead_append = self._dead.append
        self._swapped_last = 0          # bytes the last finished step swapped or rebuilt
        self._lean_from = 0             # the first step that may be lean (boundaries.py)
        self._lean_ban = 8              # steps without lean ones once a lean step left the plan
        self._timed_waits: list = []
        self._after_backward: set = set()  # threads whose saved tensors backward has used since
        self._stale_hooks: set = set()     # threads whose hooks an exit in backward left pushed
        self._forward_open = False     # packs of this step's forward may still come
        self._keeper = None            # weak reference to the C++ hooks (native_hooks), if any
        self._armed = False            # they decide this step's packs (NOTE [ Steps that ... ])
        self.step_listeners: list = []  # called with the step number as each step begins
        self._relearn = False          # the step that begins next learns afresh (relearn)
        self.closed = False
        # An engine dropped without close() (no graph can use it then: a graph holds unpack)
        # still lets its copies finish before its pinned slabs go back (Rules 2, 8).
        weakref.finalize(self, finish_copies, self.d2h, self.h2d)

    @property
    def mark(self) -> int:
        """Use above which swapping starts: lms_frac x the limit, or under lms_frac="auto" the
        bound the policy keeps predicted peaks under."""
        return self.policy.bound

    # -- release: what dead storages held given back, and close -------------------------------

    def outstanding(self, reap: bool = True) -> dict:
        """What the engine still tracks (``reap``: after giving back what dead storages held):
        ``storages`` swapped or rebuilt since the last step boundary, of which ``released``;
        sources ``held`` on the GPU while their copies run (``held_bytes``) and ``deferred``;
        restored bytes not yet used (``restored_bytes``); handles dropped by autograd and not
        yet reaped (``dead_handles``).

        Example::

            assert engine.outstanding()["held_bytes"] == 0     # after backward, every copy done
        """
        with self._lock:
            if reap:
                self._reap()
            order = self.prefetch.order
            return {"storages": len(order), "released": sum(s.dead for s in order),
                    "held": len(self.held), "held_bytes": self.held.bytes,
                    "deferred": len(self.deferred), "restored_bytes": self.prefetch.ahead,
                    "dead_handles": len(self._dead)}

    def _sweep_orphans(self) -> None:
        """Release storages that no handle holds: a pack interrupted before it handed its handle
        to autograd (NOTE [ Interrupts and versions ], b)."""
        for s in self.prefetch.order:
            if not s.watches and not s.needed_by and not s.dead:
                self._release(s)

    def _reap(self) -> None:
        """Give back what dead storages held (autograd freed every graph that used them). A
        watch leaves the queue only once handled, so an interrupt in here loses nothing."""
        dead = self._dead
        while dead:
            watch = dead[0]
            s = getattr(watch, "storage", None)
            if s is None:                 # its handle was lost before it was counted
                dead.popleft()
                continue
            if watch.generation == s.generation and id(watch) in s.watches:
                s.unpacked -= 1
            s.watches.discard(id(watch))
            if not s.watches and not s.needed_by:
                self._release(s)
            dead.popleft()

    def _release(self, s: Offloaded) -> None:
        """Give back what ``s`` holds; safe to repeat after an interrupt."""
        s.dead = True
        if s.gpu is not None:
            if not s.fetch_waited and s.fetch_done is not None:
                self._order_after(s, s.fetch_done)         # Rule 4
            self.prefetch.drop(s)
        if s.source is not None:
            if s.copy_done is not None:                    # (none: a deferred copy never went)
                self._order_after(s, s.copy_done)          # Rule 2
            self.held.drop(s)
        slot = s.host
        if slot is not None:
            self.host.free(slot)                           # Rule 5
            s.host = None
        if s.inputs:
            self._release_inputs(s)

    def close(self) -> None:
        """Wait for copies in flight and give back pinned memory. The engine is unusable after:
        a graph still alive fails in backward with a clear error (``PrefetchWindow.fetch``), and
        its handles die harmlessly."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.optimizer_mover.close()        # its state back where the optimizer runs
                self.device.synchronize()                   # Rule 8
            finally:
                self._reap()
                for s in self.prefetch.order:
                    s.source = s.gpu = s.host = None
                    s.inputs = ()
                self.held.clear()
                self.deferred.clear()
                self.prefetch.clear()
                self._param_rebuilds = {}
                params.unwatch(self)                # the last engine takes torch's patches
                self.state.by_ptr.clear()
                if self.memo is not None:             # the step in flight counts too
                    self.memo.saw(self.host.used_slabs())
                    self.memo.close()
                self.host.close()

    # -- what goes wrong (its texts: diagnostics.py) -----------------------------------------

    def annotate_oom(self, exc: BaseException, where: str) -> None:
        """Add what lmsrt knows to an out-of-memory error raised while it is active
        (``Diagnostics.annotate_oom``)."""
        device = self.device
        self.diagnostics.annotate_oom(
            exc, where, config=self.config, policy=self.policy, step=self.step,
            allocated=device.memory_allocated(),
            peak=self.step_peak(), limit=self.limit,
            largest=self.state.largest, host_refused=self.host.refused,
            optimizer_on_host=self.optimizer_mover.figures()["optimizer_host_bytes"],
            # (under "gpu" no hooks count the steps)
            optimizer_stepped=(self.optimizer_mover.steps_seen > 0
                               or self.config.optimizer_state == "gpu"))


