"""What the engine keeps for a saved tensor: the records of swapped and kept storages, the
handles autograd holds, and how a handle tells that its bytes were modified.

NOTE [ Interrupts and versions ]
A KeyboardInterrupt can arrive between any two Python calls, also inside engine code, and
autograd frees graphs wherever it likes. So: (a) nothing runs Python when autograd drops a
handle: each handle is watched by a weak reference whose callback is a deque's C ``append``,
and ``_reap`` does the bookkeeping later, under the lock; a ``__del__`` would swallow an
interrupt that lands in it. The recipe table's and a learning profile's weak references to
storages queue themselves the same way (``RecipeTable``, ``Profile.watch``). (b) Every change
of engine state is made so that an interrupt
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
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..host import HostSlot

__all__ = ["Offloaded", "Kept", "KeptHandle", "SwapHandle", "Watch", "NotAtHand", "producer_of",
           "kept_handle", "counter_only", "counters_only", "modified_error", "bytes_of"]

_NO_IDS = frozenset()


class Offloaded:
    """One saved storage that is swapped out; its views come back as views of one restored copy."""

    __slots__ = ("nbytes", "index", "seq", "storage_ref", "version", "stream", "stream_key",
                 "source", "counter", "host", "copy_done", "gpu", "fetch_done", "fetch_waited",
                 "watches", "unpacked", "generation", "consumed", "dead", "recipe", "check",
                 "inputs", "needed_by", "sample", "kept")

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
        self.inputs: tuple = ()         # what its recipe reads: entries it needs, kept storages
        # ids of the storages whose recipes will read this one: a set of its own once one does
        # (``RecipeSide``), until then the empty frozenset, which the collector does not track
        self.needed_by = _NO_IDS
        self.sample = None              # a few of its words, for a rebuild to match (params.py)
        # Deferred, never copied, kept for backward (NOTE [ Deferred copies ]): "held" while
        # lmsrt's (in ``HeldSources.bytes``), "used" once backward has every view; else None.
        self.kept: Optional[str] = None


class Kept:
    """An eligible storage that stays on the GPU (so later views of it stay too)."""

    __slots__ = ("storage_ref", "version", "seq")
    dead = False

    def __init__(self, storage_ref, version: int, seq: int = -1):
        self.storage_ref, self.version = storage_ref, version
        self.seq = seq                  # its place among this forward's saved storages, if known


class KeptHandle:
    """What autograd holds for a saved tensor that stays on the GPU, with what unpack checks."""

    __slots__ = ("tensor", "version", "producer", "thread")

    def __init__(self, tensor: torch.Tensor, version: int, producer, thread: int):
        self.tensor, self.version, self.producer, self.thread = tensor, version, producer, thread


class SwapHandle:
    """What autograd holds for a swapped tensor: its storage, how to view it, what to check."""

    __slots__ = ("storage", "watch", "dtype", "size", "stride", "offset", "base_ref", "version",
                 "producer", "thread", "__weakref__")

    def __init__(self, storage: Offloaded, t: torch.Tensor, producer, thread: int):
        self.storage = storage
        self.watch = None
        # A plain tuple, not a torch.Size: CPython stops tracking a tuple of ints, never a Size.
        self.dtype, self.size = t.dtype, tuple(t.shape)
        self.stride, self.offset = t.stride(), t.storage_offset()
        # Views share their base's version counter, and keep the base alive: while anything
        # could still modify these bytes in place, the base is there to say so.
        self.base_ref = weakref.ref(t if t._base is None else t._base)
        self.version = t._version
        self.producer = producer
        self.thread = thread


class Watch(weakref.ref):
    """Watches a ``SwapHandle``; when autograd drops it, the callback (the engine's dead queue's C
    ``append``, no Python frame that an interrupt could land in) queues this watch for ``_reap``.
    The handle holds its watch, so the watch lives until it is reaped."""

    __slots__ = ("storage", "generation")


def producer_of(fn, t: torch.Tensor):
    """(grad_fn name, output number) of ``t`` for autograd's in-place error; None for a leaf."""
    return None if fn is None else (fn.name(), t.output_nr)


def kept_handle(t: torch.Tensor, thread: int) -> KeptHandle:
    """The handle of a saved tensor that stays on the GPU. Never one that holds a tensor with
    a grad_fn: a saved output would point back at its own node. detach() shares the version
    counter, which unpack checks. (Called for most saved tensors: kept lean.)"""
    fn = t.grad_fn
    if fn is None:
        return KeptHandle(t, t._version, None, thread)
    return KeptHandle(t.detach(), t._version, (fn.name(), t.output_nr), thread)



def counter_only(alias: torch.Tensor) -> torch.Tensor:
    """``alias`` (a detached alias of a saved tensor) let go of its storage but kept as the
    tensor's version counter: it tells whether the saved bytes were modified in place, also after
    every tensor that could do it is gone. (The set_ runs below autograd's in-place layer, so it
    does not itself count as a change.)"""
    counters_only((alias,))
    return alias


def counters_only(aliases) -> None:
    """``counter_only`` of each of ``aliases``, under one guard (a recomputed region's call lets
    go of some thirty at once)."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        for alias in aliases:
            alias.set_()


def modified_error(kind: str, size, producer, now: int, saved: int, how: str) -> RuntimeError:
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


class NotAtHand(Exception):
    """A recipe input that forward no longer has on the GPU."""


def bytes_of(storage) -> torch.Tensor:
    """A storage's bytes as a uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

