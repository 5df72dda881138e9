"""The swap engine: pack/unpack of saved tensors, D2H and H2D streams, prefetch, release.

NOTE [ Stream lifetimes ]
Three streams touch a swapped storage: its own stream (the stream current when it was saved: the
step's compute stream, or a side stream the model runs some ops on; autograd runs each backward
node on its forward op's stream, so this is also the stream that uses it in backward), the D2H
stream and the H2D stream. Every rule below is a stream-ordered dependency, never a host sync:

  Rule 1 (swap-out reads the right bytes). The D2H copy waits on an event recorded on the
    storage's stream when the tensor is packed, i.e. after the kernel that wrote it was queued.
  Rule 2 (a source outlives its copy). The GPU source is held until its copy event has been seen
    complete, or until the storage's stream has been made to wait on that event; only then is
    the reference dropped. The caching allocator is stream-ordered: a freed block is reused only
    by work queued on its stream after that point, which the wait orders after the copy. (A
    tensor used on a stream other than the one that allocated it must be recorded on that
    stream, PyTorch's own rule; then the same holds.)
  Rule 3 (swap-in writes a block nobody uses). A restored storage is allocated while its stream
    is current, so the allocator hands out a block whose previous users are ordered before now on
    that stream; the H2D copy waits on an event recorded there after the allocation, and the
    stream waits on the copy's event before the first use. Should backward use it on yet another
    stream, that stream waits too and the block is recorded on it.
  Rule 4 (an unused prefetch is dropped safely). A restored storage that is dropped before any
    use first makes its stream wait on its copy event (Rule 2 for the H2D stream).
  Rule 5 (host slots are reused in order). A host slot is freed only when its storage's last
    handle is dead. Any H2D copy that read it is by then a dependency of the storage's stream
    (Rules 3 and 4), and every later D2H write into that slot waits on a later event (Rule 1),
    so a write cannot overtake a read; two D2H writes are ordered by their one stream.
  Rule 6 (one compute stream at a time). A forward may start on another stream only when no
    swapped storage of an earlier forward is alive and no other thread's forward is open;
    begin_forward refuses it otherwise. Threads that share one LMS therefore share its compute
    stream (CUDA's default stream, unless set). Side streams inside a forward are fine (Rule 1).
  Rule 7 (a failed copy is never trusted). A D2H copy that raises frees its slot at once (any
    later write into it is ordered behind on the D2H stream) and the source stays on the GPU
    as a kept tensor. An H2D copy that raises drops the restored block and fails backward.
  Rule 8 (close waits). close() synchronizes the device before it drops sources, restored
    copies and host slots, so nothing in flight outlives what it reads or writes.
  Rule 9 (one storage, one stream). A storage saved again from a stream other than its own is
    kept on the GPU for that save, so every copy of it is ordered against one stream.

NOTE [ Interrupts and versions ]
A KeyboardInterrupt can arrive between any two Python calls, also inside engine code, and
autograd frees graphs wherever it likes. So: (a) nothing runs Python when autograd drops a
handle: each handle is watched by a weak reference whose callback is a deque's C ``append``,
and ``_reap`` does the bookkeeping later, under the lock; a ``__del__`` would swallow an
interrupt that lands in it. The recipe table's and a learning profile's weak references to
storages queue themselves the same way (``RecipeTable``, ``Profile.watch``). (b) Every change of engine state is made so that an interrupt
leaves either the old state or the new one: a restored block is marked only after its copy is
queued, a storage's handle count is the size of a set of watches (added and removed in one
step), a release is idempotent and retried, and storages no handle ever reached are released
at the next step boundary; an interrupt that lands between two statements leaks a host slot at
worst, never hands backward wrong bytes. (c) Autograd skips its own in-place check when
saved-tensor hooks are set, so every handle, kept or swapped, carries the saved tensor's version
and unpack raises autograd's error when it changed. The version is read through the handle's
base tensor while it lives, else through an empty tensor that shares its version counter but not
its storage. So it also catches a kernel that wrote the storage while its D2H copy was reading
it (Rule 1 orders the copy after the writes before the save, not after later ones): that write
bumps the version.

NOTE [ Rebuilt storages ]
Under ``recompute`` a storage whose recipe (rebuild.py, NOTE [ Recipes ]) reads only inputs the
engine holds anyway (parameters, storages saved in this forward: kept, swapped or rebuilt
themselves) is offloaded without a copy when the engine would otherwise swap it: its source is
dropped at once, and backward runs the op again at its first use, on its stream, from its inputs
(a swapped input is brought back for it, early by the little that separates the two uses: an
op's output is used in backward just before its input). The recipe pins its inputs' entries
(``pinned_by``), so an input no handle holds any more still outlives it; kept inputs are held by
their storage. A recipe's signature is trusted once a rebuild of it has matched bit for bit on
this device. The first check is made in forward, as the storage is saved (``_check_now``: one
rebuild, one comparison, one device sync per signature), while the storage and its inputs are
still on the GPU: in the first forward each recipe holds its inputs' storages until its output
is saved (``Recipe.hold``). Trusted there, the storage is rebuilt from this step on, and no copy
goes out for it: the first step pins and moves only what must move. Where that check cannot be
made (no room for a second copy, an input gone), the storage is swapped as usual and carries the
recipe as a check: its first use rebuilds it beside the copy and compares on the GPU
(``Rebuilds.check``); the step's end reads the comparisons, and that signature's storages are
rebuilt from the next step on. Prefetch walks past rebuilt storages; the plan offloads
rebuildable storages first (policy.py). A planned step that offloads nothing notes no recipes
(``Rebuilds.noting``; under ``with lms:`` per step no recorder is entered at all).

NOTE [ Deferred copies ]
A swap that must not leave its tensor on the GPU (a planned step, the learning step) would wait for
the pin that serves it (host.py, NOTE [ Pinning ]): in the first step that is most of the pinning,
on the training thread (measured on an H200: 0.5-1.2 s). Outside a planned step (whose plan counts
on each source's drop at its point), while GPU use is under a quarter of the limit, it waits for
nothing: the storage is swapped later (``_defer``), its source held by lmsrt (counted in
``_held_bytes``; a recorded profile counts it as the model's own, as the model may well still use
it meanwhile: ``_hold``) and its copy started in save order once pins land (checked at each save).
Once use passes the quarter, the remaining deferred copies start first, waiting for their pins, so
the step holds no more than it would have. When forward ends, those still without a pin start too,
waiting, unless use is under 1/16 of the limit: then they stay on the GPU for backward (counted as
kept), where there is room (a backward needing 15x its forward's end use is not a real model), and
waiting would stall the step for copies that free nothing in time. Unpack reads a held source as it
reads any other. Under auto (``policy.keeps_small``) a deferral starts no pin (only host memory
already pinned, a layout pinned ahead by cache.py, takes a copy at once), and forward that ends
under the quarter keeps what it deferred: a model that small fits, and its first step neither
pins nor moves a byte (a backward needing 3x its forward's end use on top is not a real model).

NOTE [ Steps that keep everything ]
A model that fits its cap still passes each saved tensor through the hooks, and its forward often
runs on the CPU's time: measured on an H200, an LM of 564 saved tensors a step at a 30 GiB cap ran
1.10x its step without lmsrt through the Python hooks (~11 us a tensor), where minimal Python
hooks that only check versions cost 1.03x. So a planned step whose plan offloads nothing, with
nothing recorded, held, deferred or noted for rebuilding (``_keeps_all``, set at its first save),
takes a lean path in ``_decide``, and where the copy path is built its packs are decided in C++
(csrc/copy_path.cpp, ``Keeper``; ``native_hooks``): the first save of the step arms it (``_arm``)
with the plan's sizes and the policy's swap levels per point, and from there it keeps each saved
tensor as the Python path would (the same eligibility, the same counts) while the step's sizes
follow the plan and GPU use stays under the level. Anything else goes to ``_take_over``, which
first takes over what the C++ side counted (``_absorb``: forward points, the sizes for the plan,
the storages kept, the step's counts; it disarms for the rest of the step) and then packs in
Python, which swaps as the policy decides. The same happens when forward ends or stats are read.
Its handles are tuples (tensor, version, grad_fn name, output number, thread); in backward, while
nothing is to be prefetched or recorded, C++ checks their versions and hands the tensors back,
and anything else (a version changed: autograd's error) goes to ``unpack``. The C++ hooks hold
the engine; the engine holds them weakly and the LMS holds them, so a dropped LMS is freed at once.
Measured side by side on that LM: 1.04x with the C++ hooks, 1.10x with the Python ones.

Bounding what forward holds (DESIGN.md, "Freeing memory in forward"): copies run at ~55 GB/s and
forward makes activations several times faster, so sources still being copied pile up. When held
sources would keep GPU use over the mark, the compute stream waits on the oldest copy and its
source is dropped at once (Rule 2).
"""
from __future__ import annotations

import collections
import sys
import threading
import weakref
from _thread import get_ident as _get_ident
from typing import List, Optional

import torch

from .cache import PinMemo
from .config import LMSConfig
from .diagnostics import Diagnostics
from .host import HostPool, HostSlot
from .plan import OffloadPlan
from .policy import make_policy
from .rebuild import Rebuilds
from .stats import RunStats, StepStats
from .units import format_bytes

__all__ = ["SwapEngine"]

# An exact GPU-use reading costs ~10-20 us (the allocator builds a stats dict). Between readings
# the engine estimates: the last reading plus what lmsrt itself added since (saved storages,
# restored copies), never minus what it dropped (another reference may keep a dropped block
# alive), so the estimate errs high on lmsrt's part. It reads again after this many estimates, or
# as soon as the estimate comes within 1/16 of the mark, where decisions change. It cannot see the
# model's own allocations (activations not saved, transients), so a decision about a storage of
# _EXACT_BYTES or more, whose copy takes 100x a reading, always reads: measured on an H100, a
# segmentation net at a 16 GiB cap (1.5 GiB activations) ran 0.54 s a step on estimates, which let
# held sources crowd out cuDNN's workspace, and 0.29 s on exact readings. The C++ copy path reads
# exactly in ~0.3 us and never estimates.
_EXACT_EVERY = 8
_EXACT_BYTES = 64 << 20
_DEFER_SHIFT = 2             # swaps are deferred while GPU use is under limit >> this

# Saved tensors of a torch.compile'd region reach pack from AOTAutograd's autograd.Function, all
# at once after the region's forward; Function.apply is then the Python frame that called pack.
_FUNCTION_APPLY = torch.autograd.Function.apply.__func__.__code__


class _Storage:
    """One saved storage that is swapped out; its views come back as views of one restored copy."""

    __slots__ = ("nbytes", "index", "seq", "storage_ref", "version", "stream", "stream_key",
                 "source", "counter", "host", "copy_done", "gpu", "fetch_done", "fetch_waited",
                 "watches", "unpacked", "generation", "consumed", "dead", "recipe", "check",
                 "inputs", "pinned_by")

    def __init__(self, nbytes: int, seq: int, storage_ref, version: int, stream, stream_key):
        self.nbytes = nbytes
        self.index = 0                  # its place in the engine's swap order
        self.seq = seq                  # its place among this forward's saved storages
        self.storage_ref = storage_ref  # weakref to the source storage: tells a reused address
        self.version = version          # apart, and says whether the source lives on elsewhere
        self.stream, self.stream_key = stream, stream_key   # where it is used (Rules 1-4, 9)
        self.source: Optional[torch.Tensor] = None   # alias of the GPU source, until released
        self.counter: Optional[torch.Tensor] = None  # an empty tensor sharing its version counter
        self.host: Optional[HostSlot] = None
        self.copy_done = None
        self.gpu: Optional[torch.Tensor] = None      # restored uint8 copy on the GPU
        self.fetch_done = None
        self.fetch_waited = False
        self.watches: set = set()       # ids of the live handles' watches (NOTE [ Interrupts ])
        self.unpacked = 0               # handles unpacked since the restored copy was made
        self.generation = 0             # restored copies made so far
        self.consumed = False           # every view handed to backward in this pass
        self.dead = False
        # NOTE [ Rebuilt storages ]: with a recipe and no host slot, it is rebuilt in backward;
        # with both, it is swapped and its first use checks a rebuild against the copy.
        self.recipe = None
        self.check = False
        self.inputs: tuple = ()         # what its recipe reads: entries pinned, kept storages held
        self.pinned_by: set = set()     # ids of the storages whose recipes will read this one


class _Kept:
    """An eligible storage that stays on the GPU (so later views of it stay too)."""

    __slots__ = ("storage_ref", "version")
    dead = False

    def __init__(self, storage_ref, version: int):
        self.storage_ref, self.version = storage_ref, version


class _KeptRef:
    """What autograd holds for a saved tensor that stays on the GPU, with what unpack checks."""

    __slots__ = ("tensor", "version", "producer", "thread")

    def __init__(self, tensor: torch.Tensor, version: int, producer, thread: int):
        self.tensor, self.version, self.producer, self.thread = tensor, version, producer, thread


class _SwapRef:
    """What autograd holds for a swapped tensor: its storage, how to view it, what to check."""

    __slots__ = ("storage", "watch", "dtype", "size", "stride", "offset", "base_ref", "version",
                 "producer", "thread", "__weakref__")

    def __init__(self, storage: _Storage, t: torch.Tensor, producer, thread: int):
        self.storage = storage
        self.watch = None
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        # Views share their base's version counter, and keep the base alive: while anything
        # could still modify these bytes in place, the base is there to say so.
        self.base_ref = weakref.ref(t if t._base is None else t._base)
        self.version = t._version
        self.producer = producer
        self.thread = thread


class _Watch(weakref.ref):
    """Watches a ``_SwapRef``; when autograd drops it, the callback (the engine's dead queue's C
    ``append``, no Python frame that an interrupt could land in) queues this watch for ``_reap``.
    The handle holds its watch, so the watch lives until it is reaped."""

    __slots__ = ("storage", "generation")


def _producer(fn, t: torch.Tensor):
    """(grad_fn name, output number) of ``t`` for autograd's in-place error; None for a leaf."""
    return None if fn is None else (fn.name(), t.output_nr)


def _kept_ref(t: torch.Tensor, thread: int) -> _KeptRef:
    """The handle of a saved tensor that stays on the GPU. Never one that holds a tensor with
    a grad_fn: a saved output would point back at its own node. detach() shares the version
    counter, which unpack checks. (Called for most saved tensors: kept lean.)"""
    fn = t.grad_fn
    if fn is None:
        return _KeptRef(t, t._version, None, thread)
    return _KeptRef(t.detach(), t._version, (fn.name(), t.output_nr), thread)


def pop_own_hooks(engine: Optional["SwapEngine"] = None):
    """Pop this thread's innermost saved-tensor hooks if they are ``engine``'s (any lmsrt
    engine's when None); return the pair popped, or None if they are someone else's."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = None if top is None else getattr(top[0], "__self__", None)
    owner = getattr(owner, "engine", owner)         # C++ hooks (native_hooks) name theirs
    if owner is engine if engine is not None else isinstance(owner, SwapEngine):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        return top
    return None


def _counter_only(alias: torch.Tensor) -> torch.Tensor:
    """``alias`` (a detached alias of a saved tensor) let go of its storage but kept as the
    tensor's version counter: it tells whether the saved bytes were modified in place, also after
    every tensor that could do it is gone. (The set_ runs below autograd's in-place layer, so it
    does not itself count as a change.)"""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        alias.set_()
    return alias


def _modified_error(kind: str, size, producer, now: int, saved: int, how: str) -> RuntimeError:
    """Autograd's own in-place error, which it does not raise itself while hooks are set."""
    which = f", which is output {producer[1]} of {producer[0]}," if producer else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{kind} {list(size)}]{which} is at version {now}; expected version {saved} "
        "instead. Hint: enable anomaly detection to find the operation that failed to compute "
        "its gradient, with torch.autograd.set_detect_anomaly(True).\n"
        f"lmsrt: this tensor was saved for backward at version {saved} and {how}; without LMS "
        "autograd raises this same error. Clone the tensor before modifying it in place, or "
        "modify it only after backward.")


class _NotAtHand(Exception):
    """A recipe input that forward no longer has on the GPU."""


def _bytes_of(storage) -> torch.Tensor:
    """A storage's bytes as a uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _finish_copies(d2h, h2d) -> None:
    try:
        d2h.synchronize()
        h2d.synchronize()
    except Exception:       # noqa: BLE001 - at exit CUDA may already be gone
        pass


class _TorchCopies:
    """Swap-out, swap-in and views through torch's Python bindings."""

    def __init__(self, device, d2h, h2d):
        self.device, self.d2h, self.h2d = device, d2h, h2d
        # Marks "the saving stream got this far" for a copy stream to wait on. One event serves
        # every copy: a stream wait takes the event's state when it is issued, so re-recording it
        # for the next copy (always under the engine's lock, right before its own wait) cannot
        # loosen an earlier wait, and creating an event per copy costs ~1 us more.
        self.ready = device.new_event()
        self.on_d2h = device.stream(d2h)
        self.on_h2d = device.stream(h2d)

    def copy_out(self, storage, slot: HostSlot, stream):
        source = _bytes_of(storage)
        self.ready.record(stream)
        self.ready.wait(self.d2h)                          # Rule 1
        with self.on_d2h:
            slot.tensor.copy_(source, non_blocking=True)
            done = self.device.new_event()
            done.record(self.d2h)
        return done

    def copy_in(self, block: torch.Tensor, slot: HostSlot, stream):
        self.ready.record(stream)
        self.ready.wait(self.h2d)                          # Rule 3
        with self.on_h2d:
            block.copy_(slot.tensor, non_blocking=True)
            done = self.device.new_event()
            done.record(self.h2d)
        return done

    @staticmethod
    def view(data: torch.Tensor, ref: "_SwapRef") -> torch.Tensor:
        """The saved tensor, as a view of its storage's bytes (source or restored copy)."""
        return torch.empty(0, dtype=ref.dtype, device=data.device).set_(
            data.untyped_storage(), ref.offset, ref.size, ref.stride)


class _NativeCopies:
    """The same through lmsrt.copy_path's C++ (csrc/copy_path.cpp): one native call each."""

    def __init__(self, native, d2h, h2d):
        self.native, self.d2h, self.h2d = native, d2h, h2d
        self.ready = native.Event()

    def copy_out(self, storage, slot: HostSlot, stream):
        return self.native.copy_out(storage, slot.base, slot.offset, self.ready,  # Rule 1
                                    stream, self.d2h)[1]

    def copy_in(self, block: torch.Tensor, slot: HostSlot, stream):
        return self.native.copy_in(block, slot.base, slot.offset, self.ready,     # Rule 3
                                   stream, self.h2d)

    def view(self, data: torch.Tensor, ref: "_SwapRef") -> torch.Tensor:
        return self.native.view(data, ref.dtype, ref.size, ref.stride, ref.offset)


def _no_entry(t: torch.Tensor) -> None:
    return None


class SwapEngine:
    """Swaps saved tensors between the GPU and pinned host memory for one ``LMS`` object."""

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
        self._copies = (_NativeCopies(self._native, self.d2h, self.h2d) if self._native
                        else _TorchCopies(device, self.d2h, self.h2d))
        # An exact reading of GPU use is cheap natively: no need to estimate between readings.
        self._exact_every = 0 if self._native else _EXACT_EVERY
        self.compute = device.current_stream()
        self._compute_key = device.stream_key()
        self.host = HostPool(device, config.host_budget_bytes)
        self.plan = OffloadPlan()
        self.run_stats = RunStats()
        self.step = StepStats()
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
        self._sigs: dict = {}           # forward point -> signature of its recipe, this step
        self._lock = threading.RLock()
        self._dead: collections.deque = collections.deque()   # watches of dropped handles
        self._held: collections.deque = collections.deque()  # swapped, source still on the GPU
        self._deferred: collections.deque = collections.deque()   # waiting for a pin to copy out
        self._deferred_kept = 0
        self._swapped_last = 0          # bytes the last finished step swapped or rebuilt
        self._held_bytes = 0
        self._by_ptr: dict = {}        # storage address -> _Storage/_Kept, for this forward
        self._order: List[_Storage] = []   # swapped storages in save order, for prefetch
        self._cursor = -1              # next candidate in _order to prefetch (walks down)
        self._ahead = 0                # restored bytes not yet used
        self._index = 0                # storages saved in this forward
        self._beyond_plan = 0          # bytes swapped beyond the plan this step
        self._over = None              # (forward point, GPU use there) of the first of them
        self._bwd_point = 0            # unpacks so far in this backward (the policy's point j)
        self._base = None              # GPU use at this step's first save (None: not yet)
        self._step_peak = 0            # highest peak read before a reset inside this step
        self._rec = None               # the policy's Profile, while this step is recorded
        self._rec_hold = 0             # what lmsrt held since the last recorded point
        self._forward_end_use = 0      # GPU use when forward ended, net of copies in flight
        self._timed_waits: list = []
        self._after_backward: set = set()  # threads whose saved tensors backward has used since
        self._stale_hooks: set = set()     # threads whose hooks an exit in backward left pushed
        self._forward_open = False     # packs of this step's forward may still come
        self._use_read = 0             # GPU use at the last exact reading
        self._use_delta = 0            # bytes lmsrt added (+) or released (-) since that reading
        self._use_age = self._exact_every   # estimates given since that reading
        self._largest = (0, 0)         # (bytes, save index) of this forward's largest storage
        self._keeps_all = False        # this step's plan keeps everything (set at its first save)
        self._keeper = None            # weak reference to the C++ hooks (native_hooks), if any
        self._armed = False            # they decide this step's packs (NOTE [ Steps that ... ])
        self._retries_before = 0       # the allocator's retry count when this step began
        self._failures_before = 0      # and its count of failed allocations
        self.diagnostics = Diagnostics()   # one-time warnings, out-of-memory text
        self.step_listeners: list = []  # called with the step number as each step begins
        self._relearn = False          # the step that begins next learns afresh (relearn)
        self.closed = False
        # An engine dropped without close() (no graph can use it then: a graph holds unpack)
        # still lets its copies finish before its pinned slabs go back (Rules 2, 8).
        weakref.finalize(self, _finish_copies, self.d2h, self.h2d)

    @property
    def mark(self) -> int:
        """Use above which swapping starts: lms_frac x the limit, or under lms_frac="auto" the
        bound the policy keeps predicted peaks under."""
        policy = self.policy
        return policy.bound if policy.auto else policy.mark

    # -- step boundaries ---------------------------------------------------------------------

    def relearn(self) -> None:
        """Plan afresh from the next step on, learning it as step 1 was: what the model saves
        has changed (regions.py recomputes other regions). Called from a step listener."""
        self._relearn = True

    def begin_forward(self) -> None:
        """A step's forward begins (``with`` entry, or the first save after a backward). Step
        listeners run first, with the number of the step that begins; one may raise to stop
        the script there (the launcher's LMSRT_MAX_STEPS), before anything of that step is held."""
        for listener in self.step_listeners:
            listener(self.run_stats.steps + 1 + bool(self.step.step))
        with self._lock:
            self._reap()
            self._sweep_orphans()
            self._release_finished()
            self._order = [s for s in self._order if not s.dead]
            # Recounted at each step, so an interrupt between a restored copy's marking and its
            # count leaves no lasting drift (NOTE [ Interrupts and versions ], b).
            self._ahead = sum(s.nbytes for s in self._order if s.gpu is not None)
            stream = self.device.current_stream()
            if stream != self.compute and (self._forward_open or self._order):
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
                self.policy = make_policy(self.config.lms_frac, self.limit, self.window)
            self._base = None
            self._keeps_all = False
            keeper = self._keeper and self._keeper()
            if keeper is not None:
                keeper.backward(False)    # unpacks go to Python until forward ends
            self._step_peak = 0
            self._deferred_kept = 0       # deferred swaps that forward ended without
            self.step = StepStats(step=self.run_stats.steps + 1, mode=self.plan.mode)
            self._retries_before = self.device.alloc_retries()
            self._failures_before = self.device.alloc_failures()
            self.compute = stream
            self._compute_key = self.device.stream_key()
            self._by_ptr.clear()
            for i, s in enumerate(self._order):
                s.index = i
            self._cursor = len(self._order) - 1    # indices changed: prefetch walks from the top
            self._index = self._beyond_plan = 0
            self._over = None
            self._sigs = {}
            self._largest = (0, 0)
            if self.rebuilds is not None:
                # The first forward checks recipes as their outputs are saved (NOTE [ Rebuilt
                # storages ]): their inputs are held until then, or until forward ends.
                if self.rebuilds.holding:
                    self.rebuilds.let_go()
                self.rebuilds.holding = self.step.step == 1
                # A planned step that offloads nothing rebuilds nothing: no recipes (each costs
                # the op's dispatch through Python and objects for the collector: measured on an
                # LM that fits its cap, 1.7x the step without lmsrt). Should it swap after all,
                # it copies; the step after notes recipes again.
                self.rebuilds.noting = not (self.plan.planned and self.plan.target == 0
                                            and not self._swapped_last)
            self.host.new_step()

    def _begin_plan(self, first: int) -> None:
        """The step's first saved storage: GPU use now is the base its policy plans from. (Not
        at ``begin_forward``: under ``lmsrt run`` the first step begins with the script, before
        its model exists, later steps with their first save; the first save is the same point
        in every step either way.)"""
        self._base = base = self.device.memory_allocated()
        self._use_read, self._use_delta, self._use_age = base, 0, 0
        policy, plan, step = self.policy, self.plan, self.step
        policy.begin_step(plan, base, first)
        self._rec = policy.recording
        if self._rec is not None:
            self.device.reset_peak()
            self._rec_hold = self._hold()
        step.plan_target_bytes = plan.target if plan.planned else 0
        rebuilds = self.rebuilds
        self._keeps_all = (plan.planned and plan.target == 0 and self._rec is None
                           and (rebuilds is None or not (rebuilds.noting or rebuilds.holding)))
        step.bound_bytes = self.mark
        for name, value in policy.step_figures().items():
            setattr(step, name, value)
        if plan.planned:
            self.host.reserve(plan.copied)         # rebuilt storages need no host memory

    def _sweep_orphans(self) -> None:
        """Release storages that no handle holds: a pack interrupted before it handed its handle
        to autograd (NOTE [ Interrupts and versions ], b)."""
        for s in self._order:
            if not s.watches and not s.pinned_by and not s.dead:
                self._release(s)

    def end_forward(self) -> None:
        """Forward is over: at ``with`` exit, or at the first unpack of a backward that follows
        (under one ``with`` around a whole loop no exit marks it)."""
        with self._lock:
            if not self._forward_open:
                return
            self._forward_open = False
            if self._armed:
                self._absorb(entries=False)
            if self.rebuilds is not None and self.rebuilds.holding:
                self.rebuilds.holding = False
                self.rebuilds.let_go()
            if self._deferred:
                self._end_deferred()
            self._release_finished()
            self._forward_end_use = self.device.memory_allocated() - self._held_bytes
            self.step.forward_end_bytes = self._forward_end_use
            self._by_ptr.clear()
            self._cursor = len(self._order) - 1
            self._bwd_point = 0
            keeper = self._keeper and self._keeper()
            if keeper is not None:
                # Nothing to prefetch or record: kept handles need no Python in backward.
                keeper.backward(self._cursor < 0 and self._rec is None)

    def _finish_step(self) -> None:
        s = self.step
        s.gpu_peak_bytes = max(self.device.peak_allocated(), self._step_peak)
        s.host_pinned_bytes = self.host.pinned_bytes
        s.host_peak_bytes = self.host.peak_used
        s.host_refused = self.host.refused
        s.host_pin_s = self.host.pin_seconds
        s.host_pin_wait_s = self.host.pin_wait_seconds
        s.host_lagged = self.host.lagged
        s.host_given_back_bytes = self.host.given_back_bytes
        s.host_pins_in_flight = self.host.pins_in_flight
        if self.memo is not None:
            self.memo.saw(self.host.used_slabs())
        self.host.refused = 0
        self.host.peak_used = self.host.used_bytes
        self._collect_waits(s)
        s.alloc_retries = self.device.alloc_retries() - self._retries_before
        s.mode = "plan" if self.plan.followed else "reactive"
        s.alloc_failures = self.device.alloc_failures() - self._failures_before
        if s.alloc_retries and s.mode == "plan" and not self.policy.auto:
            self.diagnostics.alloc_retries(s)
        if s.alloc_failures:
            self.diagnostics.alloc_failures(s)
        rebuildable = self._finish_rebuilds(s) if self.rebuilds is not None else None
        followed = self.plan.finish_step(rebuildable)
        self._swapped_last = s.out_bytes + s.recipe_bytes + self._deferred_kept
        s.beyond_plan_bytes = self._beyond_plan if s.mode == "plan" else 0
        self.policy.finish_step(self.plan, followed=followed,
                                forward_end_use=self._forward_end_use,
                                swapped=self._swapped_last,
                                beyond_plan=self._beyond_plan, peak=s.gpu_peak_bytes,
                                retries=s.alloc_retries, failures=s.alloc_failures,
                                over=self._over, tuning=self.device.tunes_algorithms())
        s.policy_note = self.policy.note()
        self._rec = None
        self.run_stats.add(s)
        self.device.reset_peak()

    def _finish_rebuilds(self, s: StepStats) -> set:
        """Read the step's bitwise checks and rebuild times; return the forward points whose
        storages the next step may rebuild (for the plan)."""
        s.rebuild_ms, s.rebuild_checks, mismatched = self.rebuilds.finish_step()
        if mismatched:
            self.diagnostics.rebuild_mismatch(mismatched)
        trusted = self.rebuilds.trusted
        return {i for i, sig in self._sigs.items() if sig in trusted}

    def current_step(self) -> StepStats:
        """The step in flight, with its peaks read now."""
        s = self.step
        if self._armed:
            with self._lock:
                self._absorb(entries=True)
        if s.step:
            s.mode = self.plan.mode
            s.gpu_peak_bytes = self.device.peak_allocated()
            s.host_pinned_bytes = self.host.pinned_bytes
            s.host_peak_bytes = self.host.peak_used
            s.host_refused = self.host.refused
            s.host_pin_s = self.host.pin_seconds
            s.host_pin_wait_s = self.host.pin_wait_seconds
            s.host_lagged = self.host.lagged
            s.host_given_back_bytes = self.host.given_back_bytes
            s.host_pins_in_flight = self.host.pins_in_flight
            self._collect_waits(s)
        return s

    def _collect_waits(self, s: StepStats) -> None:
        pending = []
        for start, end in self._timed_waits:
            if end.query():
                s.swapin_wait_ms += start.elapsed_time(end)
            else:
                pending.append((start, end))
        self._timed_waits = pending

    # -- forward: pack -----------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        thread = _get_ident()
        if self._after_backward and thread in self._after_backward \
                and torch._C._current_graph_task_id() == -1:
            # One `with lms:` around a whole loop (or `lmsrt run`): a forward that follows a
            # backward of this thread's saved tensors starts a new step. Packs inside backward
            # (checkpoint recompute) do not, nor another thread's forward.
            self.begin_forward()
        if self._stale_hooks and thread in self._stale_hooks:
            self._pop_stale_hooks(thread)
        storage = self._eligible_storage(t)
        if storage is None:
            self.step.skipped_tensors += 1
            return _kept_ref(t, thread)
        with self._lock:
            if self._dead:
                self._reap()
            version = t._version
            entry = self._by_ptr.get(storage.data_ptr())
            if (entry is None or entry.storage_ref() is not storage or entry.version != version
                    or entry.dead):                 # released: its handles all died meanwhile
                entry = self._new_storage(t, storage, version)
            elif type(entry) is _Storage and entry.stream_key != self.device.stream_key():
                return _kept_ref(t, thread)                 # Rule 9
            if type(entry) is _Kept:
                return _kept_ref(t, thread)
            return self._handle(entry, t, thread)

    def _handle(self, s: _Storage, t: torch.Tensor, thread: int) -> _SwapRef:
        """A handle for autograd, counted in ``s.watches`` in one step (NOTE [ Interrupts and
        versions ], a and b): until its watch is in the set, a lost handle frees nothing."""
        ref = _SwapRef(s, t, _producer(t.grad_fn, t), thread)
        watch = _Watch(ref, self._dead.append)
        watch.storage, watch.generation = s, -1
        ref.watch = watch
        s.watches.add(id(watch))
        return ref

    def _eligible_storage(self, t: torch.Tensor):
        """The storage to swap for saved tensor ``t``, or None if swapping it would free nothing
        or cannot be done.

        Parameters and other trainable leaves (and views of them) live for the whole run, so
        they stay. Tensors without a grad_fn are not excluded as such: pooling indices and masks
        are saved that way and can be the largest tensors of a step (a max-pool's int64 indices
        at full resolution). Nested tensors and tensor subclasses other than parameters have no
        one flat storage to copy: they stay, and a warning says so once.
        """
        if type(t) is not torch.Tensor or t.is_nested:
            if not isinstance(t, torch.nn.Parameter) and self.device.owns(t):
                self.diagnostics.unswappable(t)
            return None                          # parameters, subclasses, nested tensors
        if not self.device.owns(t):
            return None                          # other devices
        base = t if t._base is None else t._base
        if base.requires_grad and base.is_leaf:
            return None                          # trainable leaves and views of them
        if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.is_quantized:
            return None
        storage = t.untyped_storage()
        return storage if storage.nbytes() >= self.min_bytes else None

    def _new_storage(self, t: torch.Tensor, storage, version: int):
        nbytes = storage.nbytes()
        index = self._index
        self._index += 1
        if self._base is None:
            self._begin_plan(nbytes)
        if not self._keeps_all and "compile" not in self.diagnostics.given:
            # (A step that keeps everything has nothing to warn about.)
            caller = sys._getframe(1).f_back       # what called pack; None on autograd's threads
            if caller is not None and caller.f_code is _TAKE_OVER:
                caller = caller.f_back             # through the C++ hooks
            if caller is not None and caller.f_code is _FUNCTION_APPLY:
                self.diagnostics.compiled_region(caller.f_back)
        self.device.note_saved(storage)
        if self._rec is not None:
            self._record(False, nbytes)
            try:
                return self._decide(t, storage, version, nbytes, index)
            finally:
                self._recorded()
        entry = self._decide(t, storage, version, nbytes, index)
        if self._keeps_all and self._keeper is not None and not self._armed:
            self._arm()
        return entry

    # -- C++ hooks for steps that keep everything ---------------------------------------------

    def native_hooks(self):
        """C++ saved-tensor hooks for this engine (csrc/copy_path.cpp, ``Keeper``), or None
        where the copy path is not built. NOTE [ Steps that keep everything ]. They hold the
        engine; it holds them weakly, so the caller (the LMS) must keep them."""
        module = getattr(self.device, "native_hooks", None)
        if module is None or not hasattr(module, "Keeper"):
            return None
        device = self.device
        simulated = device.kind == "sim"
        keeper = module.Keeper(device.torch_device, self.min_bytes, self._take_over, self.unpack,
                               self._after_backward,
                               device.memory_allocated if simulated else None,
                               device.note_saved if simulated else None)
        self._keeper = weakref.ref(keeper)
        return keeper

    def _take_over(self, t: torch.Tensor):
        """The C++ pack's way into the Python one: what it counted first becomes the engine's."""
        if self._armed:
            with self._lock:
                if self._armed:
                    self._absorb(entries=True)
        return self.pack(t)

    def _arm(self) -> None:
        keeper = self._keeper()
        if keeper is None or self._held or self._deferred:
            return
        plan, policy = self.plan, self.policy
        sizes = plan.sequence
        keeper.arm(sizes, policy.swap_levels(plan, len(sizes)), list(plan.live), self._index)
        self._armed = True

    def _absorb(self, entries: bool) -> None:
        """Take over what the C++ hooks decided since they were armed (``entries``: the storages
        they kept, for the rest of this forward), and disarm them for the rest of the step."""
        self._armed = self._keeps_all = False
        index, recorded, kept, counts, largest = self._keeper().take(entries)
        self._index = index
        self.plan.current.extend(recorded)
        for storage, version in kept:
            self._by_ptr[storage.data_ptr()] = _Kept(weakref.ref(storage), version)
        s = self.step
        kept_bytes, kept_tensors, live_bytes, live_tensors, skipped = counts
        s.kept_bytes += kept_bytes
        s.kept_tensors += kept_tensors
        s.live_bytes += live_bytes
        s.live_tensors += live_tensors
        s.skipped_tensors += skipped
        self._use_delta += kept_bytes + live_bytes
        self._use_age = self._exact_every      # the next decision reads GPU use afresh
        if largest[0] > self._largest[0]:
            self._largest = tuple(largest)

    def _decide(self, t: torch.Tensor, storage, version: int, nbytes: int, index: int):
        """Swap, keep, or keep as alive anyway, the storage saved at forward point ``index``."""
        if nbytes > self._largest[0]:
            self._largest = (nbytes, index)
        self._use_delta += nbytes
        plan = self.plan
        if self._keeps_all and not self._held and not self._deferred:
            # NOTE [ Steps that keep everything ]
            ref = weakref.ref(storage)
            plan.offload(index, nbytes)                 # records it; offloads nothing
            if plan.matched:
                level = self.policy.swap_at(plan, index)
                if self._gpu_use(nbytes, level) - self._held_bytes <= level:
                    step = self.step
                    if index in plan.live:
                        step.live_bytes += nbytes
                        step.live_tensors += 1
                    else:
                        step.kept_bytes += nbytes
                        step.kept_tensors += 1
                    entry = self._by_ptr[storage.data_ptr()] = _Kept(ref, version)
                    return entry
            return self._choose(t, storage, version, nbytes, index, ref, False)
        rec = self._rec
        ref = weakref.ref(storage) if rec is None else rec.watch(storage, index)
        if self._held:
            self._release_finished()
        if self._deferred:
            self._settle_deferred()
        return self._choose(t, storage, version, nbytes, index, ref, plan.offload(index, nbytes))

    def _choose(self, t: torch.Tensor, storage, version: int, nbytes: int, index: int, ref,
                planned: bool):
        """``_decide`` for a storage already recorded in the plan (``planned``: whether the
        plan offloads it)."""
        if self.plan.lives_on(index):
            # Last step's copy of this storage freed nothing: something else kept it alive
            # through backward (an input batch, a buffer, a frozen weight held as a tensor).
            self.step.live_bytes += nbytes
            self.step.live_tensors += 1
            entry = self._by_ptr[storage.data_ptr()] = _Kept(ref, version)
            return entry
        # Sources still being copied out will be freed anyway: swap more only if GPU use would
        # stay over the level once they are (else copies that lag forward would look like demand).
        recipe = None
        if self.rebuilds is not None and self.rebuilds.recipes:
            recipe = self.rebuilds.usable(t, self._available)
            if recipe is not None:
                self._sigs[index] = recipe.signature
        policy, plan = self.policy, self.plan
        level = 0 if planned else policy.swap_at(plan, index)
        hold = policy.hold_to(plan, index)
        used = None if planned else self._gpu_use(nbytes, level or hold)
        entry = None
        if planned or used - self._held_bytes > level:
            over = None if planned else used - self._held_bytes
            entry = self._offload(t, storage, nbytes, index, ref, version, recipe)
            if entry is not None and over is not None:
                self._beyond_plan += nbytes
                if self._over is None and plan.mode == "plan":
                    # The first point at which the plan's prediction fell short (policy.py,
                    # NOTE [ Auto ], 4): GPU use there, from the step's base.
                    self._over = (index, over - self._base)
        if entry is None:
            entry = _Kept(ref, version)
            self.step.kept_bytes += nbytes
            self.step.kept_tensors += 1
        self._by_ptr[storage.data_ptr()] = entry
        if self.rebuilds is not None and self.rebuilds.holding:
            self.rebuilds.let_go(storage)        # its check, if any, is done
        if self._held:
            self._bound_held(self._gpu_use(nbytes, hold) if used is None else used, hold)
        return entry

    def _record(self, backward: bool, nbytes: int = 0) -> None:
        """A point of a recorded step (policy.py, NOTE [ Auto ], 1): GPU use now and its peak
        since the last point, less what lmsrt held meanwhile."""
        device = self.device
        used, peak = device.memory_allocated(), device.peak_allocated()
        self._use_read, self._use_delta, self._use_age = used, 0, 0
        if peak > self._step_peak:
            self._step_peak = peak
        base = self._base
        self._rec.record(backward, used - base, peak - base, self._rec_hold,
                         self._hold(), nbytes)

    def _hold(self) -> int:
        """What a recorded profile counts as lmsrt's: held sources and restored copies, less
        deferred sources (NOTE [ Deferred copies ]): held for long, and the model may still be
        using them itself (a residual stream), so they count as the model's own, on the safe
        side."""
        hold = self._held_bytes + self._ahead
        if self._deferred:
            hold -= sum(s.nbytes for s in self._deferred if s.source is not None)
        return hold

    def _recorded(self) -> None:
        self._rec_hold = self._hold()
        self.device.reset_peak()

    def _gpu_use(self, nbytes: int, level: int) -> int:
        """GPU use, exact near ``level`` (the policy's level for the decision at hand) or for a
        decision about ``nbytes`` >= _EXACT_BYTES, estimated otherwise (see _EXACT_EVERY). At a
        level of 0 any use is over it, so no reading is needed."""
        estimate = self._use_read + self._use_delta
        if level == 0 or (self._use_age < self._exact_every and nbytes < _EXACT_BYTES
                          and estimate < level - (level >> 4)):
            self._use_age += 1
            return estimate
        self._use_read, self._use_delta, self._use_age = self.device.memory_allocated(), 0, 0
        return self._use_read

    def _offload(self, t: torch.Tensor, storage, nbytes: int, seq: int, ref, version: int,
                 recipe) -> Optional[_Storage]:
        """Take storage ``seq`` off the GPU: by its recipe when its signature is trusted, else
        by a copy (checked against its recipe at first use, if it has one: NOTE [ Rebuilt
        storages ])."""
        if recipe is not None:
            rebuilds = self.rebuilds
            if recipe.signature not in rebuilds.trusted:
                self._check_now(recipe, storage, nbytes)
            if recipe.signature in rebuilds.trusted:
                return self._as_recipe(t, nbytes, seq, ref, version, recipe)
            if recipe.signature in rebuilds.refused:
                recipe = None
        s = self._swap_out(t, storage, nbytes, seq, ref, version)
        if s is not None and recipe is not None:
            s.recipe, s.check = recipe, True
            self._pin_inputs(s)
        return s

    def _check_now(self, recipe, storage, nbytes: int) -> None:
        """Check ``recipe`` against the ``storage`` it made while both are at hand, if a rebuild
        fits beside what is allocated (within 1/16 of the limit): then no copy goes out for a
        check in backward (NOTE [ Rebuilt storages ]). A rebuild may need up to ~3x ``nbytes``
        at once (an autocast cast rebuilt from a LayerNorm's fp32 output, which is rebuilt
        first; the comparison's mask). An input no longer on the GPU, or anything else that
        fails it, leaves the check to backward."""
        limit = self.limit
        if self.device.memory_allocated() + 4 * nbytes > limit - (limit >> 4):
            return
        try:
            self.rebuilds.check_now(recipe, storage, self._input_at_hand)
        except Exception:       # noqa: BLE001 - only a check: backward checks it instead
            pass
        self._use_read, self._use_delta, self._use_age = self.device.memory_allocated(), 0, 0

    @staticmethod
    def _input_at_hand(inp) -> Optional[torch.Tensor]:
        """A recipe input in forward, as a rebuild in backward would read it: a parameter, the
        saved storage itself while it is on the GPU (raises ``_NotAtHand`` once it is not), or
        None for one that its own recipe makes."""
        if inp.entry is None:
            return inp.tensor() if inp.parameter is not None else None
        t = inp.tensor()
        if t is None:
            raise _NotAtHand
        return t

    def _as_recipe(self, t: torch.Tensor, nbytes: int, seq: int, ref, version: int,
                   recipe) -> _Storage:
        key = self.device.stream_key()
        stream = self.compute if key == self._compute_key else self.device.stream_of(key)
        s = _Storage(nbytes, seq, ref, version, stream, key)
        s.recipe = recipe
        s.counter = _counter_only(t.detach())   # NOTE [ Interrupts and versions ], c
        s.index = len(self._order)
        self._order.append(s)       # from here the step boundary releases it if orphaned
        self._pin_inputs(s)
        self.step.recipe_bytes += nbytes
        self.step.recipe_tensors += 1
        return s

    def _entry_of(self, t: torch.Tensor):
        """What this forward made of saved tensor ``t``'s storage (a recorder asks, for the
        inputs of the ops it records), or None."""
        storage = t.untyped_storage()
        entry = self._by_ptr.get(storage.data_ptr())
        if (entry is None or entry.dead or entry.storage_ref() is not storage
                or entry.version != t._version):
            return None
        return entry

    @staticmethod
    def _available(inp) -> bool:
        """Whether a recipe input's entry will still be there in backward (once pinned). One
        that is gone (its graph dropped in forward) is forgotten, for good: the input is then
        made by its own recipe, if it has one, in ``walk`` and in ``_recipe_input`` too."""
        entry = inp.entry
        if entry is None:
            return False
        if entry.dead or type(entry) is _Kept and entry.storage_ref() is None:
            inp.entry = None
            return False
        return True

    @staticmethod
    def _pin_inputs(s: _Storage) -> None:
        """Pin what ``s``'s recipe reads. ``s.inputs`` is set first and each pin is one set
        insertion, so an interrupt anywhere leaves pins that ``_unpin_inputs`` removes
        (NOTE [ Interrupts and versions ], b)."""
        held = []
        for inp in s.recipe.walk():
            entry = inp.entry
            if entry is None:
                continue
            if type(entry) is _Kept:
                storage = entry.storage_ref()
                if storage is not None:
                    held.append(storage)
            else:
                held.append(entry)
        s.inputs = tuple(held)
        for entry in held:
            if type(entry) is _Storage:
                entry.pinned_by.add(id(s))

    def _unpin_inputs(self, s: _Storage) -> None:
        for entry in s.inputs:
            if type(entry) is _Storage:
                entry.pinned_by.discard(id(s))
                if not entry.pinned_by and not entry.watches and not entry.dead:
                    self._release(entry)
        s.inputs = ()

    def _swap_out(self, t: torch.Tensor, storage, nbytes: int, seq: int, ref,
                  version: int) -> Optional[_Storage]:
        key = self.device.stream_key()
        stream = self.compute if key == self._compute_key else self.device.stream_of(key)
        # A swap waits for a pin under way where keeping the tensor would undo what the policy
        # counts on: a planned step; a step that must hold the least (the first, in which cuDNN
        # picks its algorithms for the run by the memory free then: policy.may_lag); or use
        # within 1/8 of the limit. Under a quarter of the limit, outside a planned step (whose
        # pins were started at its beginning, and whose plan counts on each source's drop), it
        # is deferred instead (NOTE [ Deferred copies ]). Elsewhere (a later reactive step with
        # room) the tensor stays on the GPU while its pin runs (host.py, NOTE [ Pinning ]).
        limit, use = self.limit, self._use_read + self._use_delta      # no new reading
        planned = self.plan.mode == "plan"
        wait = planned or not self.policy.may_lag(self.plan) or use > limit - (limit >> 3)
        if (wait and not planned and self._forward_open and key == self._compute_key
                and use <= limit >> _DEFER_SHIFT):
            refused = self.host.refused
            # Under auto no pin starts here (NOTE [ Deferred copies ]).
            slot = (self.host.landed(nbytes) if self.policy.keeps_small
                    else self.host.alloc(nbytes, wait=False))
            if slot is None:
                return None if self.host.refused != refused else self._defer(
                    t, nbytes, seq, ref, version, stream, key)
        else:
            if wait and self._deferred:
                self._copy_deferred(wait=True)             # copies go out in save order
            slot = self.host.alloc(nbytes, wait=wait)
            if slot is None:
                return None
        order = self._order
        try:
            s = _Storage(nbytes, seq, ref, version, stream, key)
            s.copy_done = self._copy_out(storage, slot, stream)      # Rule 1
            s.source, s.host = t.detach(), slot    # Rule 2; also shares t's version counter
            s.index = len(order)
            order.append(s)          # from here the step boundary releases it if orphaned
        except BaseException as e:                         # Rule 7: keep it on the GPU
            if order and order[-1].host is slot:           # interrupted once committed
                self._held_bytes += nbytes
                self._held.append(order[-1])
                raise
            self.host.free(slot)
            if not isinstance(e, Exception):
                raise
            self.diagnostics.copy_out_failed(nbytes, e)
            return None
        self._held_bytes += nbytes
        self._held.append(s)
        self.step.out_bytes += nbytes
        self.step.out_tensors += 1
        return s

    def _defer(self, t: torch.Tensor, nbytes: int, seq: int, ref, version: int, stream,
               key) -> _Storage:
        """Swap ``t``'s storage out once its pin lands: until then its source stays on the GPU,
        held by lmsrt (NOTE [ Deferred copies ])."""
        s = _Storage(nbytes, seq, ref, version, stream, key)
        s.index = len(self._order)
        self._order.append(s)          # from here the step boundary releases it if orphaned
        s.source = t.detach()          # shares t's version counter
        self._held_bytes += nbytes
        self._deferred.append(s)
        self.step.deferred_tensors += 1
        return s

    def _settle_deferred(self) -> None:
        """Copy out deferred storages, all of them, waiting for their pins, once GPU use passes
        a quarter of the limit."""
        if self._use_read + self._use_delta > self.limit >> _DEFER_SHIFT:
            self._copy_deferred(wait=True)
        elif self.host.pins_landed:
            self._copy_deferred(wait=False)

    def _end_deferred(self) -> None:
        """Forward is over: deferred storages stay on the GPU for backward while use is under a
        quarter of the limit (a model that small fits: NOTE [ Deferred copies ]); over it,
        their copies start, waiting for the pins (backward's own use is not known, least of
        all in the learning step)."""
        try:
            small = self.limit >> (_DEFER_SHIFT if self.policy.keeps_small else 4)
            self._copy_deferred(wait=self.device.memory_allocated() > small)
            for s in self._deferred:
                if not s.dead and s.source is not None:
                    self.step.kept_bytes += s.nbytes
                    self.step.kept_tensors += 1
                    self._deferred_kept += s.nbytes
        finally:
            self._deferred.clear()

    def _copy_deferred(self, wait: bool) -> None:
        """Start the copies of deferred storages, in save order, as far as pinned memory goes
        (``wait``: all of them, waiting for the pins under way). One that the host budget
        refuses stays on the GPU, held until it dies."""
        deferred, host = self._deferred, self.host
        while deferred:
            s = deferred[0]
            if s.dead or s.source is None:
                deferred.popleft()
                continue
            slot = host.settle(s.nbytes) if wait else host.landed(s.nbytes)
            if slot is None:
                if not wait:
                    return
                deferred.popleft()
                continue
            try:
                done = self._copy_out(s.source.untyped_storage(), slot, s.stream)   # Rule 1
            except BaseException as e:                     # Rule 7: keep it on the GPU
                host.free(slot)
                deferred.popleft()
                if not isinstance(e, Exception):
                    raise
                self.diagnostics.copy_out_failed(s.nbytes, e)
                continue
            s.copy_done, s.host = done, slot
            deferred.popleft()
            self._held.append(s)
            self.step.out_bytes += s.nbytes
            self.step.out_tensors += 1

    def _copy_out(self, storage, slot: HostSlot, stream):
        """Start the D2H copy of ``storage`` into ``slot`` after ``stream``'s work so far;
        return the copy's event."""
        return self._copies.copy_out(storage, slot, stream)

    def _release_finished(self) -> None:
        held = self._held
        while held and (held[0].source is None or held[0].copy_done.query()):
            self._drop_source(held.popleft())              # Rule 2: copy seen complete

    def _bound_held(self, used: int, level: int) -> None:
        """Let go of held sources, oldest first, while use stands over ``level``; at a level of
        0, while more than the policy's overlap is held or use would pass the limit."""
        held, overlap = self._held, self.policy.overlap
        while held and (used > level if level else (self._held_bytes > overlap
                                                    or used + overlap > self.limit)):
            s = held.popleft()
            if s.source is None:
                continue
            self._order_after(s, s.copy_done)              # Rule 2: wait, then drop at once
            self._drop_source(s)
            used -= s.nbytes
            self.step.swapout_waits += 1

    def _order_after(self, s: _Storage, event) -> None:
        """Make the streams that may reuse ``s``'s GPU block wait on ``event``: its own stream,
        and the compute stream too for a side-stream storage (its block may be the compute
        stream's, if the script did not record it on the side stream)."""
        event.wait(s.stream)
        if s.stream_key != self._compute_key:
            event.wait(self.compute)

    def _drop_source(self, s: _Storage) -> None:
        source = s.source
        if source is not None:
            s.source = None
            self._held_bytes -= s.nbytes
            s.counter = _counter_only(source)   # NOTE [ Interrupts and versions ], c
            del source
            if self._rec is not None and s.storage_ref() is not None:
                self._rec.own_from(s.seq)       # held on by the model: its own use from here

    # -- backward: unpack --------------------------------------------------------------------

    def unpack(self, ref):
        if self._forward_open:
            self.end_forward()
        if self._rec is None:
            try:
                return self._unpack(ref)
            finally:
                self._bwd_point += 1
        with self._lock:                        # a recorded step (policy.py, NOTE [ Auto ])
            self._record(True)
            try:
                return self._unpack(ref)
            finally:
                self._bwd_point += 1
                self._recorded()

    def _unpack(self, ref):
        kind = type(ref)
        if kind is tuple:                       # the C++ hooks' handle (native_hooks)
            ref = _KeptRef(ref[0], ref[1], None if ref[2] is None else (ref[2], ref[3]), ref[4])
            kind = _KeptRef
        if kind is _KeptRef:
            self._after_backward.add(ref.thread)
            t = ref.tensor
            if t._version != ref.version:
                raise _modified_error(t.type(), t.size(), ref.producer, t._version, ref.version,
                                      "kept on the GPU")
            if self._cursor >= 0:               # every unpack moves prefetch along
                with self._lock:
                    self._advance()
            return t
        if kind is not _SwapRef:
            return ref                          # saved while lmsrt stepped aside
        self._after_backward.add(ref.thread)
        with self._lock:
            if self._dead:
                self._reap()
            s = ref.storage
            self._check_version(ref, s)
            try:
                data = self._resident(s)
            except torch.OutOfMemoryError as e:
                self.annotate_oom(e, f"bringing a saved tensor back for backward: a {ref.dtype} "
                                  f"tensor of shape {tuple(ref.size)}, whose storage of "
                                  f"{format_bytes(s.nbytes)} did not fit")
                raise
            if s.check:
                self._check_rebuild(s, data)
            if self._rec is not None:
                self._rec.used_at(s.seq, self._bwd_point)
            watch = ref.watch
            if watch.generation != s.generation:       # a handle counts once per restored copy
                watch.generation = s.generation
                s.unpacked += 1
            if s.unpacked >= len(s.watches) and s.gpu is not None:
                # Every live view has been handed out: autograd's references keep the block
                # alive for as long as it is read; ours would keep it for the rest of backward.
                self._drop_restored(s)
                s.consumed = True
            # Viewed under the lock: another thread may release the source alias meanwhile.
            view = self._copies.view(data, ref)
            self._advance()
        return view

    def _check_version(self, ref: _SwapRef, s: _Storage) -> None:
        base = ref.base_ref()
        if base is not None:
            now = base._version
        else:
            alias = s.source if s.source is not None else s.counter
            now = ref.version if alias is None else alias._version
        if now != ref.version:
            kind = torch.empty(0, dtype=ref.dtype, device=self.device.torch_device).type()
            raise _modified_error(kind, ref.size, ref.producer, now, ref.version,
                                  "swapped to host memory")

    def _resident(self, s: _Storage, for_recipe: bool = False) -> torch.Tensor:
        """``s``'s bytes on the GPU, ready for the current stream: its source, a restored or
        rebuilt copy, or the storage itself where it lives on. ``for_recipe``: wanted as the
        input of a rebuild, which may come after backward's own last use of it."""
        if s.source is not None:
            return s.source
        if s.gpu is None:
            live = s.storage_ref()
            if live is not None:
                # The source lives on elsewhere, unchanged (checked): use it, move nothing, and
                # keep this storage on the GPU from the next step (plan.lives_on).
                if s.seq not in self.plan.live_now:
                    self.plan.mark_live(s.seq)
                    self.step.live_bytes += s.nbytes
                    self.step.live_tensors += 1
                return _bytes_of(live)
            if s.consumed and not for_recipe:
                self._new_pass(s)
            if s.host is None and s.recipe is not None:
                self._rebuild(s)
            else:
                self.step.prefetch_misses += 1
                self._fetch(s)
        else:
            self.step.prefetch_hits += 1
        if not s.fetch_waited:
            self._wait_fetch(s)
        key = self.device.stream_key()
        if key != s.stream_key:                            # Rule 3: another consumer stream
            consumer = self.device.stream_of(key)
            done = s.fetch_done
            if done is None:                               # rebuilt, on its own stream
                done = self.device.new_event()
                done.record(s.stream)
            done.wait(consumer)
            s.gpu.record_stream(consumer)
        return s.gpu

    def _rebuild(self, s: _Storage) -> None:
        """Run ``s``'s recipe again, on its own stream (NOTE [ Rebuilt storages ])."""
        if s.stream_key == self.device.stream_key():
            out = self.rebuilds.run(s.recipe, self._recipe_input)
        else:
            with self.device.stream(s.stream):
                out = self.rebuilds.run(s.recipe, self._recipe_input)
        storage = out.untyped_storage()
        self.device.note_saved(storage)
        s.fetch_done, s.fetch_waited, s.unpacked = None, True, 0
        s.gpu = _bytes_of(storage)
        s.generation += 1
        self._ahead += s.nbytes
        self._use_delta += s.nbytes
        self.step.rebuilt_bytes += s.nbytes
        self.step.rebuilt_tensors += 1

    def _recipe_input(self, inp) -> Optional[torch.Tensor]:
        """A rebuild's input as its op saw it (``Recipe.rebuild``'s ``resolve``); None for one
        the engine did not save, which its own recipe rebuilds."""
        entry = inp.entry
        if entry is None:
            return inp.tensor() if inp.parameter is not None else None
        if type(entry) is _Kept:
            storage = entry.storage_ref()
            if storage is None:
                return None
            t = inp.view(storage)
            key = self.device.stream_key()
            if key != self._compute_key:       # read on a side stream: its block waits for it
                t.record_stream(self.device.stream_of(key))
            return t
        alias = entry.source if entry.source is not None else entry.counter
        if alias is not None and alias._version != entry.version:
            kind = torch.empty(0, dtype=inp.dtype, device=self.device.torch_device).type()
            raise _modified_error(kind, inp.size, None,
                                  alias._version, entry.version,
                                  "is the input from which lmsrt rebuilds a saved tensor")
        return inp.view(self._resident(entry, for_recipe=True).untyped_storage())

    def _check_rebuild(self, s: _Storage, data: torch.Tensor) -> None:
        """The first use of a swapped storage with a recipe: rebuild it beside the copy and
        queue the bitwise comparison (NOTE [ Rebuilt storages ]). Only a check: whatever goes
        wrong in it, backward goes on with the copy, and the signature is not trusted."""
        s.check = False
        try:
            self.rebuilds.check(s.recipe, data.untyped_storage(), self._recipe_input)
        except Exception:       # noqa: BLE001 - e.g. an input modified in place: not trusted
            pass
        finally:
            s.recipe = None
            self._unpin_inputs(s)

    def _wait_fetch(self, s: _Storage) -> None:
        stream = s.stream
        if s.fetch_done.query():
            s.fetch_done.wait(stream)
        else:
            start, end = self.device.new_event(timing=True), self.device.new_event(timing=True)
            start.record(stream)
            s.fetch_done.wait(stream)                      # Rule 3: wait before the first use
            end.record(stream)
            self._timed_waits.append((start, end))
        s.fetch_waited = True

    def _fetch(self, s: _Storage) -> None:
        if s.host is None:
            raise RuntimeError(
                "lmsrt: backward needs a saved tensor that this LMS swapped out, but the LMS was "
                "closed (LMS.close(), or interpreter exit) and its host memory given back. Run "
                "backward before closing the LMS.")
        gpu = self._alloc_on(s)                           # Rule 3: allocated on its stream
        try:
            done = self._copy_in(gpu, s.host, s.stream)
        except BaseException as e:                        # Rule 7: never hand out those bytes
            s.stream.wait_stream(self.h2d)    # a copy queued before the error may still write
            if not isinstance(e, Exception):
                raise
            raise RuntimeError(
                f"lmsrt: copying a swapped-out saved tensor ({format_bytes(s.nbytes)}) back to "
                f"the GPU for backward failed ({type(e).__name__}: {e}), so backward stops "
                "rather than use bytes that may be wrong. If it recurs, run without LMS "
                "(lms=0) to see whether the GPU itself is at fault.") from e
        # Marked restored only now, with its copy queued (NOTE [ Interrupts and versions ], b).
        s.fetch_done, s.fetch_waited, s.unpacked = done, False, 0
        s.generation += 1
        s.gpu = gpu
        self._ahead += s.nbytes
        self._use_delta += s.nbytes
        self.step.in_bytes += s.nbytes
        self.step.in_tensors += 1

    def _alloc_on(self, s: _Storage) -> torch.Tensor:
        if s.stream_key == self.device.stream_key():
            return self.device.empty(s.nbytes)
        with self.device.stream(s.stream):
            return self.device.empty(s.nbytes)

    def _copy_in(self, block: torch.Tensor, slot: HostSlot, stream):
        """Start the H2D copy of ``slot`` into ``block`` after ``stream``'s work so far; return
        the copy's event."""
        return self._copies.copy_in(block, slot, stream)

    def _drop_restored(self, s: _Storage) -> None:
        s.gpu = None
        self._ahead -= s.nbytes

    def _new_pass(self, s: _Storage) -> None:
        """A storage already used in this pass is needed again: backward runs once more over a
        retained graph. Prefetch starts over from below it."""
        for other in self._order:
            other.consumed = False
        self._cursor = s.index - 1

    def _advance(self) -> None:
        """Backward moved on: fetch the swapped storages it needs next, in reverse save
        order, while the restored-but-unused bytes stay within ``window`` and GPU use stays under
        the policy's level (``fetch_to``). Backward uses saved data faster than H2D brings it back
        (~145 vs ~55 GB/s on a GPT stack), so fetching starts as soon as memory allows, not when
        the data is near. At a level of 0 (``lms_frac=0``) one storage is still fetched ahead,
        so that a copy overlaps compute; above 0 the level holds strictly, since in plan mode the
        next swapped storage is needed only late in backward and fetching it early would land on
        the peak. A learning step (auto's level of 0) fetches that one ahead only while GPU use
        with it stays under a quarter of the limit: it cannot know the model's transients yet,
        and one that fails for lmsrt's copy is not a one-off. cuDNN then runs the next algorithm
        whose workspace fits and keeps it for the run (a segmentation net at 8 GiB on an H200:
        the 384 MiB copy ahead made a 3 GiB backward workspace fail, and every later step's
        backward took 1.5 s instead of 0.33 s).
        Backward does not walk the save order strictly downwards (inside a block it jumps about),
        so the walk is by a cursor that skips what is resident, used, or alive elsewhere."""
        order = self._order
        level = self.policy.fetch_to(self.plan, self._bwd_point)
        learning = not level and self.policy.auto
        if self._held:
            # Sources whose copies still run when backward begins (forward ends faster than
            # the last copies go out) are lmsrt's bytes that no prediction counts: backward's
            # first transient (an LM's logits gradient) met them (an LM at 18 GiB, 2 runs in 5).
            # Let them go by the level that leaves room for the peaks to come (Rule 2).
            self._release_finished()
            self._bound_held(self._gpu_use(0, level), level)
        if self._ahead and level and self.policy.auto and self.plan.mode == "plan":
            self._shed(level + (self.policy.headroom >> 1))
        while self._cursor >= 0:
            s = order[self._cursor]
            if (s.dead or s.consumed or s.gpu is not None or s.source is not None
                    or s.host is None or s.storage_ref() is not None):
                self._cursor -= 1
                continue
            if (self._ahead or level) and (self._ahead + s.nbytes > self.window
                                           or self._gpu_use(s.nbytes, level) + s.nbytes > level):
                break
            if learning and self._gpu_use(s.nbytes, self.limit >> _DEFER_SHIFT) + s.nbytes > (
                    self.limit >> _DEFER_SHIFT):
                break
            try:
                self._fetch(s)
            except torch.OutOfMemoryError:
                # A prefetch is optional: stop for this pass (each failed allocation empties
                # the allocator's cache) and let backward fetch on demand.
                self._cursor = -1
                break
            self._cursor -= 1

    def _shed(self, level: int) -> None:
        """Under lms_frac="auto" the fetch level is what use may be now for the peaks the plan
        predicts further on to fit. Use over it means the model holds more than the plan
        predicted: copies fetched ahead earlier, when it did not, would then meet those peaks and
        make an allocation fail there (cuDNN's workspace, which then falls back to a slower
        algorithm for the rest of the run). Give back the restored copies not yet used, those
        needed last first, until use is within the level; they are fetched again later (clean
        copies: their bytes are still in host memory)."""
        use = self._gpu_use(0, level)
        order = self._order
        for k in range(self._cursor + 1, len(order)):      # ascending: needed last first
            if use <= level or not self._ahead:
                return
            s = order[k]
            if (s.gpu is None or s.unpacked or s.consumed or s.source is not None
                    or s.fetch_done is None):                  # rebuilt: not a prefetch
                continue
            self._order_after(s, s.fetch_done)                 # Rule 4
            self._drop_restored(s)
            self._use_delta -= s.nbytes
            use -= s.nbytes
            self._cursor = max(self._cursor, k)
            self.step.prefetch_dropped += 1

    # -- release -----------------------------------------------------------------------------

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
            if not s.watches and not s.pinned_by:
                self._release(s)
            dead.popleft()

    def _release(self, s: _Storage) -> None:
        """Give back what ``s`` holds; safe to repeat after an interrupt."""
        s.dead = True
        if s.gpu is not None:
            if not s.fetch_waited and s.fetch_done is not None:
                self._order_after(s, s.fetch_done)         # Rule 4
            self._drop_restored(s)
        if s.source is not None:
            if s.copy_done is not None:                    # (none: a deferred copy never went)
                self._order_after(s, s.copy_done)          # Rule 2
            self._drop_source(s)
        slot = s.host
        if slot is not None:
            self.host.free(slot)                           # Rule 5
            s.host = None
        if s.inputs:
            self._unpin_inputs(s)

    def close(self) -> None:
        """Wait for copies in flight and give back pinned memory. The engine is unusable after:
        a graph still alive fails in backward with a clear error (``_fetch``), and its handles
        die harmlessly."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.device.synchronize()                   # Rule 8
            finally:
                self._reap()
                for s in self._order:
                    s.source = s.gpu = s.host = None
                    s.inputs = ()
                self._held.clear()
                self._deferred.clear()
                self._held_bytes = self._ahead = 0
                self._order.clear()
                self._cursor = -1                   # nothing left to prefetch
                self._by_ptr.clear()
                if self.memo is not None:             # the step in flight counts too
                    self.memo.saw(self.host.used_slabs())
                    self.memo.close()
                self.host.close()

    # -- hooks left behind -------------------------------------------------------------------

    def mark_stale_hooks(self, thread: int) -> None:
        """``with lms:`` was left inside backward: autograd restores the thread's hook stack when
        backward ends, with this engine's pair still on it. The next pack on that thread outside
        backward pops it; that one save is still handled as usual."""
        self._stale_hooks.add(thread)

    def _pop_stale_hooks(self, thread: int) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        self._stale_hooks.discard(thread)
        pop_own_hooks(self)
        if self.rebuilds is not None:
            self.rebuilds.pop_stale_recorder()

    # -- what goes wrong (its texts: diagnostics.py) -----------------------------------------

    def annotate_oom(self, exc: BaseException, where: str) -> None:
        """Add what lmsrt knows to an out-of-memory error raised while it is active
        (``Diagnostics.annotate_oom``)."""
        device = self.device
        self.diagnostics.annotate_oom(
            exc, where, config=self.config, policy=self.policy, step=self.step,
            allocated=device.memory_allocated(),
            peak=max(device.peak_allocated(), self._step_peak), limit=self.limit,
            largest=self._largest, host_refused=self.host.refused)


_TAKE_OVER = SwapEngine._take_over.__code__
