"""Copies started later, once their pins land, so that forward need not wait for pinning.

NOTE [ Deferred copies ]
A swap that must not leave its tensor on the GPU (a planned step, the
learning step) would wait for the pin that serves it (host.py, NOTE [ Pinning ]): in the first step
that is most of the pinning, on the training thread (docs/design.md, "Measurements behind the
engine's rules"). Outside a planned step (whose plan counts on each source's drop at its point),
while GPU use is under the policy's share of the limit (``may_defer``: a quarter for a fixed
mark, half under auto), it waits for nothing: the storage is swapped later
(``DeferredCopies.defer``), its source held by lmsrt (counted in ``HeldSources.bytes``) and its
copy started in save order once pins land (checked at each save). Once use passes the share, the
remaining deferred copies start first, waiting for their pins, so the step holds no more than it
would have. When forward ends, those still without a pin start too, waiting, unless the policy
keeps them (``may_keep_deferred``): then they stay on the GPU for backward (counted as kept;
``Offloaded.kept``), where waiting would stall the step for copies that free nothing in time. A
fixed mark keeps them under 1/16 of the limit (a backward needing 15x its forward's end use is not
a real model).
  Under auto (``pins_for_deferred`` false) a deferral starts no pin (only host memory already
  pinned, a layout pinned ahead by cache.py, takes a copy at once), and a forward that ends under
  half the limit keeps all it deferred: such a model fits, and its first step neither pins nor
  moves a byte. What can go wrong, and why it does not in practice:
  1. Backward needs the rest of the limit on top of forward's end use, which is at least half of
     it: only a backward whose own use passes its forward's whole end use (activations, weights,
     optimizer state) runs out where step 1 used to swap. A model's backward adds gradients (at
     most the weights) and one layer's temporaries.
  2. The optimizer's first step creates its state after backward, when the kept sources are
     gone; the next step begins with it, and its plan counts from use at its first save.
  3. Later planned steps learn from this one. The profile counts a kept source as the model's
     own in forward (the model may still use it: a residual stream) and as lmsrt's in backward
     until backward holds every view of it, as it counts a restored copy
     (``Profile.own_in_forward``, ``DeferredCopies.end``, ``UnpackSide._unpack``): a plan that keeps
     it adds its bytes once, not twice, and may still offload it where the step needs room.
  4. cuDNN picks its algorithms in the first step by the memory free then (NOTE [ Auto ], 1):
     with half the limit free, only a workspace over half of it is given up.
Unpack reads a held source as it reads any other; a recorded profile counts a deferred source as
the model's own (``_lmsrt_bytes``)."""
from __future__ import annotations

import collections
from typing import Callable

import torch

from .records import Offloaded

__all__ = ["DeferredCopies"]      # held by SwapEngine (core.py) as ``deferred``


class DeferredCopies:
    """Swapped storages whose copies wait for their pins (``queue``, in save order), their
    sources held on the GPU meanwhile (NOTE [ Deferred copies ]).

    It touches the records it makes and queues and, through what it is given, nothing else: the
    device's ``memory_allocated``, the host pool (slots landed or settled, freed on a failed
    copy), the copy path's ``copy_out``, the gauge's estimate, the engine's policy's ``may_defer``
    and ``may_keep_deferred`` (``policy()``), the held sources (``hold``, ``copying``), the
    prefetch window's order (``add``), the diagnostics (a failed copy said once) and the step's
    figures (``step()``).

    Example::

        s = deferred.defer(t, nbytes, seq, ref, version, stream, key)   # its source held
        deferred.settle()             # at each save: copies start as pins land
        deferred.end(state)           # forward is over: copy the rest, or keep them
    """

    __slots__ = ("queue", "device", "host", "copies", "gauge", "policy", "held", "prefetch",
                 "diagnostics", "step")

    def __init__(self, device, host, copies, gauge, policy: Callable, held, prefetch, diagnostics,
                 step: Callable):
        self.queue: collections.deque = collections.deque()   # waiting for a pin to copy out
        self.device, self.host, self.copies, self.gauge = device, host, copies, gauge
        self.policy, self.held, self.prefetch = policy, held, prefetch
        self.diagnostics, self.step = diagnostics, step

    def __len__(self) -> int:
        return len(self.queue)

    def defer(self, t: torch.Tensor, nbytes: int, seq: int, ref, version: int, stream,
              key) -> Offloaded:
        """Swap ``t``'s storage out once its pin lands: until then its source stays on the GPU,
        held by lmsrt (NOTE [ Deferred copies ])."""
        s = Offloaded(nbytes, seq, ref, version, stream, key)
        self.prefetch.add(s)           # from here the step boundary releases it if orphaned
        s.source = t.detach()          # shares t's version counter
        self.held.hold(s)
        self.queue.append(s)
        self.step().deferred_tensors += 1
        return s

    def clear(self) -> None:
        """Forget every deferred storage (``close``, once the device is synchronized: Rule 8)."""
        self.queue.clear()

    def held_bytes(self) -> int:
        """The bytes of the deferred sources still on the GPU."""
        return sum(s.nbytes for s in self.queue if s.source is not None)

    def settle(self) -> None:
        """Copy out deferred storages, all of them, waiting for their pins, once GPU use passes
        what the policy defers under (``may_defer``)."""
        if not self.policy().may_defer(self.gauge.estimate()):
            self.start(wait=True)
        elif self.host.pins_landed:
            self.start(wait=False)

    def end(self, state) -> None:
        """Forward is over (``state``: the step's ``StepState``): deferred storages stay on the
        GPU for backward where the policy allows it (``may_keep_deferred``: a model that small
        fits, and waiting would stall the step for copies that free nothing in time); elsewhere
        their copies start, waiting for the pins (backward's own use is not known, least of all
        in the learning step)."""
        try:
            self.start(wait=not self.policy().may_keep_deferred(self.device.memory_allocated()))
            step = self.step()
            for s in self.queue:
                if not s.dead and s.source is not None:
                    step.count_kept(s.nbytes)
                    state.deferred_kept += s.nbytes
                    s.kept = "held"
                    if state.rec is not None:        # lmsrt's from here on
                        state.rec.own_in_forward(s.seq)
                        state.rec_lmsrt += s.nbytes
        finally:
            self.queue.clear()

    def start(self, wait: bool) -> None:
        """Start the copies of deferred storages, in save order, as far as pinned memory goes
        (``wait``: all of them, waiting for the pins under way). One that the host budget
        refuses stays on the GPU, held until it dies."""
        deferred, host = self.queue, self.host
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
                done = self.copies.copy_out(s.source.untyped_storage(), slot,    # Rule 1
                                            s.stream)
            except BaseException as e:                     # Rule 7: keep it on the GPU
                host.free(slot)
                deferred.popleft()
                if not isinstance(e, Exception):
                    raise
                self.diagnostics.copy_out_failed(s.nbytes, e)
                continue
            s.copy_done, s.host = done, slot
            deferred.popleft()
            self.held.copying(s)
            self.step().count_out(s.nbytes, s.seq)
