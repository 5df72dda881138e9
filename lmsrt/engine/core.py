"""``SwapEngine``: one engine per ``LMS``, made of the rooms of this package."""
from __future__ import annotations

import collections
import threading
import weakref
from typing import List

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
from .prefetch import Prefetch
from .recipes import RecipeOffload
from .records import Offloaded
from .release import Release
from .swap_out import SwapOut

__all__ = ["SwapEngine"]


def _no_entry(t: torch.Tensor) -> None:
    return None


def _step_peak(engine) -> int:
    """The peak of ``engine``'s step so far (0 once it is gone)."""
    return 0 if engine is None else engine.step_peak()


class SwapEngine(EnterExit, StepBoundaries, PackSide, NativeHandOver, RecipeOffload, SwapOut,
                 DeferredCopies, UnpackSide, Prefetch, Release):
    """Swaps saved tensors between the GPU and pinned host memory for one ``LMS`` object."""

    owns_hooks = True         # its pack/unpack pairs are lmsrt's (hook_stack.pop_own_hooks)

    def __init__(self, config: LMSConfig, device):
        self.config = config
        self.device = device
        self.min_bytes = config.min_bytes
        self.window = config.prefetch_bytes
        self.d2h = device.new_stream()
        self.h2d = device.new_stream()
        # The per-tensor CUDA calls go through lmsrt.copy_path's C++ when it is built (the same
        # calls, ~30% less CPU per swapped tensor), else through torch's Python bindings.
        self._native = device.copy_path
        self._copies = (NativeCopies(self._native, self.d2h, self.h2d) if self._native
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
        self.policy = make_policy(config.lms_frac, self.limit, self.window)
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
        me = weakref.ref(self)
        self.optimizer_mover = OptimizerMover(
            device, self._copies, self.host, self._lock, min_bytes=self.min_bytes,
            mode=config.optimizer_state, step_peak=lambda: _step_peak(me()),
            fits=self.policy.step_fits, room=self.policy.room_beside,
            part_bytes=max(self.limit >> 4, 64 << 10))
        self._dead: collections.deque = collections.deque()   # watches of dropped handles
        self._held: collections.deque = collections.deque()  # swapped, source still on the GPU
        self._deferred: collections.deque = collections.deque()   # waiting for a pin to copy out
        self._swapped_last = 0          # bytes the last finished step swapped or rebuilt
        self._lean_from = 0             # the first step that may be lean (boundaries.py)
        self._lean_ban = 8              # steps without lean ones once a lean step left the plan
        self._held_bytes = 0
        self._order: List[Offloaded] = []   # swapped storages in save order, for prefetch
        self._cursor = -1              # next candidate in _order to prefetch (walks down)
        self._ahead = 0                # restored bytes not yet used
        self._timed_waits: list = []
        self._after_backward: set = set()  # threads whose saved tensors backward has used since
        self._stale_hooks: set = set()     # threads whose hooks an exit in backward left pushed
        self._forward_open = False     # packs of this step's forward may still come
        self._keeper = None            # weak reference to the C++ hooks (native_hooks), if any
        self._armed = False            # they decide this step's packs (NOTE [ Steps that ... ])
        self.diagnostics = Diagnostics()   # one-time warnings, out-of-memory text
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


