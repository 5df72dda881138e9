"""The swap engine: pack/unpack of saved tensors, D2H and H2D streams, prefetch, release.

The engine is a package of rooms, one idea each, that ``SwapEngine`` (core.py) puts together.
The rooms that own state are objects the engine holds and calls (gauge.py, release.py,
prefetch.py, deferred.py; the host pool is lmsrt/host.py's); the others are its own methods:

  core.py        SwapEngine: the rooms together, its state, what dead storages held given back,
                 close, what is outstanding, and what goes wrong (annotate_oom)
  entry.py       enter()/exit() for LMS: hooks pushed and popped, the rebuild recorder
  records.py     what the engine keeps per saved storage, and the handles autograd holds
  copies.py      the copy path (``copies``): C++ or torch's bindings
  gauge.py       GpuGauge (``gauge``): GPU use, read exactly, estimated between readings
  boundaries.py  step boundaries: StepState made afresh at each step, its figures read at its end
  forward.py     pack: keep or offload each saved storage, as the policy's levels say
  swap_out.py    copies to host memory, and the stream orders that free a block after its copy
  release.py     HeldSources (``held``): sources held while their copies run, and let go
  deferred.py    DeferredCopies (``deferred``): copies started later, once their pins land
  recipes.py     storages rebuilt in backward instead of copied
  native.py      the hand-over to and from the C++ hooks
  backward.py    unpack: bring a storage back for backward
  prefetch.py    PrefetchWindow (``prefetch``): the swapped storages in save order, fetched
                 ahead of backward, and what runs over given back

The numbers (how much may be held where, what may wait or be deferred, how far to fetch ahead)
are the policy's (lmsrt/policy/): the engine asks, and never asks which kind of policy it has.

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
"""
from ..hook_stack import pop_own_hooks
from .core import SwapEngine

__all__ = ["SwapEngine", "pop_own_hooks"]
