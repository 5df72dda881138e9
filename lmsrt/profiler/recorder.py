"""What one training step keeps in memory, module by module: the measuring half of ``report.py``.

``StepRecorder`` installs global module forward hooks, global optimizer step hooks and a
saved-tensors hook pair, counts steps, and records step N: what each module saved for backward
(deduplicated by storage), its own parameters, gradients and optimizer state, and, where a real
allocator is there to read (CUDA), the peak inside each module beyond what it keeps.

NOTE [ Where memory is attributed ]
  * Forward. A stack of running modules, pushed by the pre-hook and popped by the post-hook
    (registered with ``always_call`` so an exception cannot leave it unbalanced). A storage saved
    for backward belongs to the innermost module running when it was first saved; a later saver
    of the same storage (the next Linear saving the ReLU output it consumes) does not count it
    again, but does list it among the storages its backward needs (``used``).
  * Backward. Full module backward hooks would tell when each module's backward runs, but they
    wrap inputs and outputs in a custom Function, and an in-place op on such an output (BN then
    ReLU(inplace=True), the common case) raises. Instead the pack hook tags every saved tensor
    with the module that saved it, and the unpack hook, which autograd calls when a backward
    node needs that tensor, says which module's backward is running. Backward may run on
    autograd's device thread, so unpack makes no thread check.
  * Boundaries. Each module entry and exit, each change of module in backward, the end of
    backward and the optimizer step close a segment: the allocator's peak since the last
    boundary is read and reset there. A forward segment's peak counts for every module on the
    stack, so a module's forward peak includes its children's; a module's transient is that
    peak minus what is allocated when it returns. A backward segment's transient is its peak
    minus what was allocated when it began (new gradients and workspaces).
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from typing import Dict, List, Optional, Set

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_leaves

from ..device import CudaDevice, SimulatedDevice

__all__ = ["StepRecorder", "ModuleStats", "Sample", "StepDone", "OUTSIDE"]

OUTSIDE = "(outside modules)"


class StepDone(BaseException):
    """Raised from a hook once the profiled step is complete, to stop the script there.

    A BaseException, so that a script's ``except Exception`` cannot swallow it.
    """


@dataclasses.dataclass(eq=False)
class ModuleStats:
    """Running figures of one module (or of the code outside every module) during the step."""

    name: str
    type: str
    depth: int
    module: Optional[torch.nn.Module] = None
    order: int = -1                  # position of its first call in forward order; -1: not called
    calls: int = 0
    output_shape: str = ""
    saved: int = 0                   # bytes of the storages it saved first
    used: int = 0                    # bytes of every storage it saved, shared ones included
    output_bytes: int = 0            # bytes of the output storages it produced first
    io_bytes: int = 0                # tensor inputs plus outputs, largest call
    params: int = 0                  # its own parameters and buffers, not its children's
    grads: int = 0
    optimizer: int = 0
    fwd_transient: Optional[int] = None
    bwd_transient: Optional[int] = None

    @property
    def transient(self) -> Optional[int]:
        seen = [t for t in (self.fwd_transient, self.bwd_transient) if t is not None]
        return max(seen) if seen else None


@dataclasses.dataclass(frozen=True)
class Sample:
    """One boundary of the step: memory then, and the peak of the segment it closes."""

    phase: str          # "forward", "backward" or "optimizer"
    where: str          # the module (or OUTSIDE, or "optimizer") whose segment closes here
    depth: int          # depth of that module, to choose which boundaries a plot labels
    allocated: int
    peak: int


class _Saved:
    """What the graph holds instead of a saved tensor: the tensor and the module that saved it
    (None outside the recorded step, where only its unpack matters: a backward ran)."""

    __slots__ = ("tensor", "owner")

    def __init__(self, tensor: torch.Tensor, owner: Optional[ModuleStats]):
        self.tensor = tensor
        self.owner = owner


@dataclasses.dataclass
class _Frame:
    module: torch.nn.Module
    stats: Optional[ModuleStats]
    peak: int = 0


def _tensors(obj) -> List[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shape(obj) -> str:
    ts = _tensors(obj)
    if not ts:
        return "-"
    first = "x".join(str(s) for s in ts[0].shape) or "scalar"
    return first if len(ts) == 1 else f"{first} +{len(ts) - 1}"


def _storage_key(t: torch.Tensor):
    """The storage of ``t`` and a key for it, or (None, None) for tensors without one.

    The key is the storage object's id: torch keeps one Python object per live storage, and
    meta storages, which have no address, need a key too. A finalizer forgets the key when the
    storage dies, so an id reused later is not mistaken for it.
    """
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):     # sparse and other storage-less tensors
        return None, None
    return storage, id(storage)


class StepRecorder:
    """Count training steps and record step ``target`` (1-based).

    A step begins with a grad-enabled forward of the root module (the first top-level module
    called, or the one given to ``add_root``) and ends at the first optimizer step, or else at
    the next root forward after a backward. With ``stop=True`` the recorder raises ``StepDone``
    there, so a script under ``lmsrt profile`` stops after the step it profiles.

    Example::

        rec = StepRecorder(target=1)
        rec.add_root(model)
        with rec:
            loss_fn(model(x)).backward()
            opt.step()
        rows = rec.modules()
    """

    def __init__(self, target: int = 1, stop: bool = False, snapshot: Optional[str] = None,
                 meter=None):
        if target < 1:
            raise ValueError(f"the step to profile counts from 1, got {target}; pass --steps 1 "
                             "or more.")
        self.target, self.stop, self.snapshot = target, stop, snapshot
        self.meter = meter                 # chosen at the step's start unless given
        self.measured = False              # True when the meter is a real allocator (CUDA)
        self.device: Optional[torch.device] = None
        self.step = 0
        self.recording = False
        self.done = False
        self.error: Optional[str] = None
        self.root: Optional[torch.nn.Module] = None
        self.timeline: List[Sample] = []
        self.saved_sizes: List[int] = []   # every storage saved in the step, once
        self.output_bytes = 0              # root outputs alive at backward start and not saved
        self.optimizer_transient: Optional[int] = None
        self.optimizers_seen = 0
        self.baseline = 0                  # allocated when the step began
        self.peak, self.peak_where = 0, ""
        self._thread = threading.get_ident()
        self._stack: List[_Frame] = []
        self._inference: Optional[torch.nn.Module] = None
        self._closed = False               # a backward or an optimizer step ended the step
        self._names: Dict[int, str] = {}
        self._tops: List[torch.nn.Module] = []
        self._stats: Dict[int, ModuleStats] = {}
        self._called = 0
        self._state_keys: Set[int] = set()
        self._param_owner: Dict[int, tuple] = {}
        self._saved: Dict[int, list] = {}    # storage key -> [nbytes, owners]
        self._outputs_seen: Set[int] = set()
        self._root_outputs: List[weakref.ref] = []
        self.backward_seen = False
        self._callback_queued = False
        self._phase = "forward"
        self._seg_owner: Optional[ModuleStats] = None
        self._seg_start = 0
        self._handles: list = []
        self._failure: Optional[tuple] = None     # (exception, where it was raised)
        self._tensor_hooks = None

    # -- installing ---------------------------------------------------------------------------

    def add_root(self, module: torch.nn.Module) -> None:
        """Name ``module``'s submodules relative to it and treat it as the root."""
        self.root = module
        self._add_top(module)

    def __enter__(self) -> "StepRecorder":
        mod = torch.nn.modules.module
        self._handles = [
            mod.register_module_forward_pre_hook(self._pre),
            mod.register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._tensor_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._tensor_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tensor_hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- modules and names --------------------------------------------------------------------

    def _add_top(self, top: torch.nn.Module) -> None:
        if id(top) in self._names:
            return
        self._tops.append(top)
        for name, sub in top.named_modules():
            self._names.setdefault(id(sub), name or type(top).__name__)
        for t in list(top.parameters()) + list(top.buffers()):
            self._state_keys.add(_storage_key(t)[1])

    def _stats_for(self, module: torch.nn.Module, depth: int) -> ModuleStats:
        """The figures of ``module``, created at its first call (``depth``: modules running)."""
        stats = self._stats.get(id(module))
        if stats is not None:
            return stats
        if id(module) not in self._names:
            # Built inside a forward and so in no named_modules() of a top-level module.
            parent = self._stack[-1].stats if self._stack and self._stack[-1].stats else None
            prefix = f"{parent.name}." if parent else ""
            self._names[id(module)] = f"{prefix}<{type(module).__name__}>"
        stats = ModuleStats(self._names[id(module)], type(module).__name__, depth, module)
        for p in module.parameters(recurse=False):
            stats.params += _nbytes(p)
            self._param_owner.setdefault(id(p), (p, stats))
            self._state_keys.add(_storage_key(p)[1])
        for b in module.buffers(recurse=False):
            stats.params += _nbytes(b)
            self._state_keys.add(_storage_key(b)[1])
        self._stats[id(module)] = stats
        return stats

    def _outside(self) -> ModuleStats:
        stats = self._stats.get(0)
        if stats is None:
            stats = self._stats[0] = ModuleStats(OUTSIDE, "-", 0)
        return stats

    def modules(self) -> List[ModuleStats]:
        """Every module of the step in forward order, then the uncalled ones holding state."""
        called = sorted((s for s in self._stats.values() if s.order >= 0),
                        key=lambda s: s.order)
        outside = self._stats.get(0)
        if outside is not None:
            called.append(outside)
        idle = []
        for top in self._tops:
            for name, sub in top.named_modules():
                if id(sub) not in self._stats and any(True for _ in sub.parameters(recurse=False)):
                    stats = self._stats_for(sub, name.count(".") + 1 if name else 0)
                    stats.output_shape = "not called"
                    idle.append(stats)
        return called + idle

    # -- boundaries ---------------------------------------------------------------------------

    def _begin(self, root: torch.nn.Module, args) -> None:
        if self.meter is None:
            ref = next(iter(root.parameters()), None)
            ref = ref if ref is not None else next(iter(_tensors(args)), None)
            self.device = ref.device if ref is not None else torch.device("cpu")
            if self.device.type == "cuda":
                self.meter = CudaDevice(self.device.index)
            else:
                # Not an allocator: it counts the saved storages alive, for the estimated timeline.
                self.meter = SimulatedDevice(capacity=1 << 62)
        else:
            self.device = getattr(self.meter, "torch_device", torch.device("cpu"))
        self.measured = self.meter.kind == "cuda"
        if self.snapshot and self.measured:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.meter.reset_peak()
        self.baseline = self._seg_start = self.meter.memory_allocated()
        self.recording = True

    def _boundary(self, next_owner: Optional[ModuleStats], next_phase: str) -> int:
        """Close the segment running now; return what is allocated at this boundary."""
        alloc = self.meter.memory_allocated()
        peak = max(self.meter.peak_allocated(), alloc)
        self.meter.reset_peak()
        owner, phase = self._seg_owner, self._phase
        if phase == "forward":
            for frame in self._stack:
                frame.peak = max(frame.peak, peak)
            if self.measured and not self._stack and peak > alloc:
                # Code between modules (a functional loss): what it freed again was transient.
                outside = self._outside()
                outside.fwd_transient = max(outside.fwd_transient or 0, peak - alloc)
        elif self.measured and phase == "backward" and owner is not None:
            owner.bwd_transient = max(owner.bwd_transient or 0, peak - self._seg_start)
        elif self.measured and phase == "optimizer":
            self.optimizer_transient = max(self.optimizer_transient or 0, peak - self._seg_start)
        where = "optimizer" if phase == "optimizer" and owner is None else (
            owner.name if owner else OUTSIDE)
        self.timeline.append(Sample(phase, where, owner.depth if owner else 0, alloc, peak))
        if peak > self.peak:
            self.peak, self.peak_where = peak, (
                "the optimizer step" if where == "optimizer" else
                f"{phase} of {where}" + (f" ({owner.type})" if owner and owner.type != "-" else ""))
        self._seg_owner, self._phase, self._seg_start = next_owner, next_phase, alloc
        return alloc

    def _where_now(self) -> str:
        if self._phase == "optimizer":
            return "the optimizer step"
        owner = self._stack[-1].stats if self._stack and self._stack[-1].stats else self._seg_owner
        return f"{self._phase} of " + (f"{owner.name} ({owner.type})" if owner else OUTSIDE)

    def where_failed(self, exc: BaseException) -> str:
        """Where ``exc`` was raised, e.g. ``'forward of net.3 (Conv2d)'``: the innermost module
        it left, seen by the post-hook that runs as it propagates; else where the step is now."""
        if self._failure is not None and self._failure[0] is exc:
            return self._failure[1]
        return self._where_now()

    def finish(self, error: Optional[str] = None) -> None:
        """End the recording (at the step's end, or early with ``error`` saying why)."""
        if not self.recording:
            return
        if error is not None:
            self.error = error
            self._stack.clear()
        self._boundary(None, self._phase)
        self._read_grads()
        self.recording, self.done = False, True
        if self.snapshot and self.measured:
            torch.cuda.memory._dump_snapshot(self.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)

    def _end_step(self) -> None:
        if self.recording:
            self.finish()
            if self.stop:
                raise StepDone()

    # -- hooks --------------------------------------------------------------------------------

    def _pre(self, module: torch.nn.Module, args) -> None:
        if self.done or threading.get_ident() != self._thread or self._inference is not None:
            return
        if not self._stack:
            if not torch.is_grad_enabled():
                self._inference = module        # an evaluation forward: not part of a step
                return
            self._add_top(module)
            if self.root is None:
                self.root = module
            if module is self.root and (self.step == 0 or self._closed):
                self._end_step()
                self.step += 1
                self._closed = False
                if self.step == self.target:
                    self._begin(module, args)
        if not self.recording:
            self._stack.append(_Frame(module, None))
            return
        stats = self._stats_for(module, len(self._stack))
        if stats.order < 0:
            stats.order, self._called = self._called, self._called + 1
        stats.calls += 1
        alloc = self._boundary(stats, "forward")
        self._stack.append(_Frame(module, stats, alloc))

    def _post(self, module: torch.nn.Module, args, output) -> None:
        if threading.get_ident() != self._thread:
            return
        if self._inference is module:
            self._inference = None
            return
        if not self._stack or self._stack[-1].module is not module:
            return
        exc = sys.exc_info()[1]       # set when the forward raised and this runs as always_call
        if exc is not None and (self._failure is None or self._failure[0] is not exc):
            self._failure = (exc, self._where_now())
        frame = self._stack[-1]
        if frame.stats is None or not self.recording:
            self._stack.pop()
            return
        stats = frame.stats
        alloc = self._boundary(self._stack[-2].stats if len(self._stack) > 1 else None, "forward")
        self._stack.pop()
        if self.measured:
            stats.fwd_transient = max(stats.fwd_transient or 0, frame.peak - alloc)
        outs = _tensors(output)
        if stats.calls == 1:
            stats.output_shape = _shape(output)
        in_bytes = sum(_nbytes(t) for t in _tensors(args))
        stats.io_bytes = max(stats.io_bytes, in_bytes + sum(_nbytes(t) for t in outs))
        for t in outs:
            storage, key = _storage_key(t)
            if key is not None and key not in self._outputs_seen:
                self._outputs_seen.add(key)
                stats.output_bytes += storage.nbytes()
        if module is self.root:
            self._root_outputs = [weakref.ref(t) for t in outs if t.requires_grad]

    def _pack(self, t: torch.Tensor):
        if not self.recording:
            # Tagged all the same: its unpack says that a backward ran, which can end a step.
            return t if self.done else _Saved(t, None)
        if t.device.type != self.device.type:
            return t
        storage, key = _storage_key(t)
        if key is None or key in self._state_keys:
            return t          # parameters and buffers are counted as such, not as saved
        owner = self._stack[-1].stats if self._stack and self._stack[-1].stats else self._outside()
        entry = self._saved.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            entry = self._saved[key] = [nbytes, set()]
            weakref.finalize(storage, self._saved.pop, key, None)
            owner.saved += nbytes
            self.saved_sizes.append(nbytes)
            self.meter.note_saved(storage)
        if owner not in entry[1]:
            entry[1].add(owner)
            owner.used += entry[0]
        return _Saved(t, owner)

    def _unpack(self, handle):
        if not isinstance(handle, _Saved):
            return handle
        if not self._callback_queued and not self.done:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._callback_queued = True
            except RuntimeError:
                pass      # unpacked outside a backward pass (e.g. by checkpoint recompute)
        if self.recording and handle.owner is not None:
            if not self.backward_seen:
                self.backward_seen = True
                self.output_bytes = sum(
                    t.untyped_storage().nbytes() for t in (r() for r in self._root_outputs)
                    if t is not None and id(t.untyped_storage()) not in self._saved)
            if handle.owner is not self._seg_owner or self._phase != "backward":
                self._boundary(handle.owner, "backward")
        return handle.tensor

    def _backward_done(self) -> None:
        self._callback_queued = False
        self._closed = True
        if self.recording:
            self._boundary(None, "backward")
            self._read_grads()

    def _read_grads(self) -> None:
        totals: Dict[int, int] = {}
        for p, stats in self._param_owner.values():
            if p.grad is not None:
                totals[id(stats)] = totals.get(id(stats), 0) + _nbytes(p.grad)
        if totals:
            for _, stats in self._param_owner.values():
                stats.grads = totals.get(id(stats), 0)

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        if self.recording:
            self._read_grads()
            self._boundary(None, "optimizer")

    def _opt_post(self, optimizer, args, kwargs) -> None:
        self._closed = True
        if not self.recording:
            return
        self.optimizers_seen += 1
        self._boundary(None, "optimizer")
        for group in optimizer.param_groups:
            for p in group["params"]:
                known = self._param_owner.get(id(p))
                owner = known[1] if known else self._outside()
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.device.type == self.device.type:
                        owner.optimizer += _nbytes(value)
        self._end_step()
