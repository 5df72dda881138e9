"""Pinned host memory: slabs pinned in the background, sub-allocated, within a host budget.

NOTE [ Pinning ]
Pinning is slow (torch's pinned allocator: 0.4-0.73 s per GiB on an H200 host; ``Device.pinned``,
which touches the pages before registering them, ~22 GiB/s on 8-12 threads there) and pinned
memory cannot be paged out, so the pool pins close to what is used and never on the training
thread unless asked to:

  Sizing. Slabs are exactly the bytes asked for (``Device.pinned`` registers page-aligned memory
    with the driver; torch's pinned allocator would round each up to a power of two). The pool
    grows by chunks of an eighth of what it holds, from ``chunk_min`` to ``chunk_max``; a request
    of half a chunk or more gets a slab of its own size. ``reserve`` (the plan's bytes at a step's
    start) pins what is missing, plus 1/32 for fragmentation.
  Background. Pins run on ``Device.pin_threads`` threads (0: on the caller's thread, at once),
    first in, first out: two on CUDA, so that one registers with the driver while the next is
    touched, and the pins of a layout (``pin_slabs``) land one after another, the first first,
    rather than all at the end. A request no slab can take claims room in a pin under way, or
    starts one; then ``alloc`` returns None (the tensor stays on the GPU; counted in ``lagged``)
    or, with ``wait=True``, blocks until that pin lands. Claims keep a burst of misses from
    starting a pin each: a step pins what it asked for. From a step's second miss on (it
    outruns its pins, as the first step does), chunks are half as large, and a request that
    waits for a pin under way also keeps one such chunk under way beyond it, unclaimed, so that
    the next pin runs while the caller waits for this one (measured on an H200 host: pins
    waited for one at a time ran at 9.4 GiB/s, two at once at 22), with no more left over at
    the step's end than one chunk of the usual size. A request that lags (``wait=False``) does
    not: the caller goes on, and its burst of claims already keeps the pins busy.
  Failures. A pin that fails (or the budget) stops growth for the rest of the step; the next step
    tries once, at most half the failed size. Said once, on the training thread.
  Give-back. Requests fill the oldest slabs first, so when use shrinks the newest fall idle. A
    slab with nothing in it that no request touched for ``idle_steps`` steps (100) is given
    back, and at once after 2 idle steps where the pool holds more than the host budget now
    allows (other processes took the host's memory), unless the last ``reserve`` still needs
    it: a pinning thread waits for the device (a copy queued long ago may still read it), then
    drops it, which unregisters and unmaps it. A step gives back at most ``give_back_step``
    bytes (1 GiB; at least one slab), the rest in the steps after: unregistering holds the
    driver, and the training thread's CUDA calls wait for it (measured on an H200: 10.6 GiB
    given back in one step made it 327 ms against ~100; 1 GiB a step stalled the GPU ~30 ms
    a step). So a run that settles on less than its learning steps pinned (a region plan: 21
    GiB pinned in step 1, 4.9 moved from step 6) keeps the rest for 100 steps: given back after
    10, it stalled steps 16 to 30 of a Llama under the Trainer by 20-37 ms each.
  Lifetime. The threads see only a ``_Pinner``, never the pool, so a dropped pool is collected at
    once; its finalizer (or ``close``) stops and joins the threads before the slabs go.

Before each pin the host budget is checked (host_memory.py: psutil's available memory, the cgroup
v2/v1 limit when one applies, divided among the ranks of this node).
"""
from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Deque, List, Optional

import torch

from .arena import OffsetAllocator
from .device import Device
from .host_memory import host_budget
from .options import spelled
from .say import say_once
from .units import GiB, MiB, format_bytes

__all__ = ["HostPool", "HostSlot"]

_ALIGN = 512                  # offsets within a slab (DMA and vector copies)
_PAGE = 4096                  # slab sizes are whole pages
_CHUNK_MIN = 64 * MiB         # the first chunk lands in ~50 ms
_CHUNK_MAX = GiB              # growth by an eighth of what is held, at most this much a pin
_IDLE_STEPS = 100             # steps a slab sits unused before it is given back
_SQUEEZED_IDLE_STEPS = 2      # the same where the pool holds more than the host budget allows
_GIVE_BACK_STEP = GiB         # most bytes a step gives back (beyond its first slab)


class _Slab:
    """A pinned slab (``tensor``) and its allocator; ``last_used`` is the pool's step number when
    a request last took room in it, ``used`` whether one ever did."""

    __slots__ = ("tensor", "allocator", "size", "last_used", "used", "__weakref__")

    def __init__(self, tensor: torch.Tensor, size: int, step: int):
        self.tensor, self.size, self.last_used, self.used = tensor, size, step, False
        self.allocator = OffsetAllocator(size, _ALIGN)


class HostSlot:
    """``nbytes`` at ``offset`` in the pinned slab ``base`` (a uint8 CPU tensor); ``tensor`` is a
    uint8 view of them, made on first use (the C++ copy path needs only base and offset)."""

    __slots__ = ("slab", "offset", "nbytes", "base", "_tensor")

    def __init__(self, slab: _Slab, offset: int, nbytes: int):
        self.slab, self.offset, self.nbytes, self.base = slab, offset, nbytes, slab.tensor
        self._tensor: Optional[torch.Tensor] = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self.base[self.offset:self.offset + self.nbytes]
        return self._tensor


class _Pin:
    """One pin asked of the pinning threads: its size and the bytes of requests waiting for it
    (``claimed``); once ``finished``, the slab tensor or the error, and the seconds it took."""

    __slots__ = ("size", "claimed", "finished", "tensor", "error", "seconds", "ahead")

    def __init__(self, size: int):
        self.size, self.claimed, self.finished = size, 0, False
        self.ahead = False        # started by pin_slabs
        self.tensor: Optional[torch.Tensor] = None
        self.error: Optional[BaseException] = None
        self.seconds = 0.0


class _Pinner:
    """The pinning threads and what they share with the pool: pins to make and slabs to give back
    (``todo``), finished pins (``done``). It holds no reference to the pool (NOTE [ Pinning ],
    Lifetime). With no threads, pins are made on the caller's thread."""

    def __init__(self, device: Device, threads: int):
        self.device, self.max_threads = device, threads
        self.cond = threading.Condition()
        self.todo: Deque[object] = collections.deque()   # _Pin to make, or a slab tensor to drop
        self.done: Deque[_Pin] = collections.deque()
        self.in_flight = 0                               # pins asked and not finished
        self.threads: List[threading.Thread] = []
        self.idle = 0
        self.stopped = False

    def pin(self, pin: _Pin) -> None:
        if not self.max_threads:
            self._make(pin)
            pin.finished = True
            self.done.append(pin)
            return
        self._queue(pin)

    def give_back(self, slab: torch.Tensor) -> None:
        """Drop ``slab`` once the device has finished all work queued so far."""
        if not self.max_threads:
            self.device.synchronize()
            return
        self._queue(slab)

    def _queue(self, job: object) -> None:
        with self.cond:
            self.todo.append(job)
            self.in_flight += isinstance(job, _Pin)
            if len(self.todo) > self.idle and len(self.threads) < self.max_threads:
                thread = threading.Thread(target=self._work, name=f"lmsrt-pin-{len(self.threads)}",
                                          daemon=True)
                self.threads.append(thread)
                thread.start()
            self.cond.notify()

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.todo and not self.stopped:
                    self.idle += 1
                    self.cond.wait()
                    self.idle -= 1
                if self.stopped:
                    return
                job = self.todo.popleft()
            if isinstance(job, _Pin):
                self._make(job)
                with self.cond:
                    # Finished only once adoptable: a waiter that saw it finished before it
                    # was in ``done`` would find no slab and start another pin.
                    job.finished = True
                    self.in_flight -= 1
                    if self.stopped:
                        job.tensor = None
                    else:
                        self.done.append(job)
                    self.cond.notify_all()
            else:
                try:
                    self.device.synchronize()
                except Exception:    # noqa: BLE001 - a failed device fails the training thread
                    pass
                del job              # the last reference: unregistered and unmapped here

    def _make(self, pin: _Pin) -> None:
        start = time.perf_counter()
        try:
            pin.tensor = self.device.pinned(pin.size)
        except Exception as e:       # noqa: BLE001 - any failure keeps tensors on the GPU
            pin.error = e
        pin.seconds = time.perf_counter() - start

    def wait(self, pin: _Pin) -> None:
        with self.cond:
            self.cond.wait_for(lambda: pin.finished or self.stopped)

    def stop(self) -> None:
        """Stop and join the threads (a pin under way is finished first) and drop what is left,
        slabs to give back included: the device is synchronized by then (the engine's Rule 8,
        or its finalizer)."""
        with self.cond:
            self.stopped = True
            self.todo.clear()
            self.cond.notify_all()
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join()
        self.done.clear()
        self.in_flight = 0


class HostPool:
    """Pinned slabs and their allocators, grown in the background (NOTE [ Pinning ]).

    ``alloc`` returns None when the budget says no, when pinning failed, or while the pin that
    would serve it is under way (unless ``wait=True``): the caller keeps the tensor on the GPU.
    Figures: ``pinned_bytes`` (pins under way included: a figure that does not depend on
    when they land) and the most it ever was (``most_pinned``), ``used_bytes``, ``peak_used``,
    ``refused``, ``pins_in_flight``, and per step (reset by ``new_step``: ``peak_used`` from
    what is in use then) ``pin_seconds``, ``pin_wait_seconds``, ``lagged``,
    ``given_back_bytes``; ``figures()`` reads them for a step's stats.

    Example::

        pool = HostPool(device, budget=8 << 30)
        pool.reserve(3 << 30)              # starts pinning 3 GiB in the background
        slot = pool.alloc(nbytes)          # None: keep the tensor on the GPU
        slot = pool.alloc(nbytes, wait=True)   # blocks for a pin under way
        ...
        pool.free(slot)
        pool.close()
    """

    def __init__(self, device: Device, budget: Optional[int] = None, *,
                 chunk_min: int = _CHUNK_MIN, chunk_max: int = _CHUNK_MAX,
                 idle_steps: int = _IDLE_STEPS, give_back_step: int = _GIVE_BACK_STEP):
        self.device = device
        self.give_back_step = give_back_step
        self.fixed_budget = budget
        self.chunk_min, self.chunk_max, self.idle_steps = chunk_min, chunk_max, idle_steps
        self.slabs: List[_Slab] = []      # oldest first: requests fill them in this order
        self.pinned_bytes = 0     # pinned, or being pinned: what the host has given the pool
        self.most_pinned = 0      # the most that ever was, pins under way included
        self.used_bytes = 0
        self.peak_used = 0
        self.refused = 0          # allocations refused by the budget or by a failed pin
        self.lagged = 0           # allocations answered None while their pin was under way
        self.pin_seconds = 0.0    # pinning time of the pins that finished in this step
        self.pin_wait_seconds = 0.0   # time the caller of alloc waited for pins in this step
        self.given_back_bytes = 0
        self.closed = False
        self._pinner = _Pinner(device, getattr(device, "pin_threads", 0))
        self._stop = weakref.finalize(self, self._pinner.stop)
        self._pending: Deque[_Pin] = collections.deque()  # asked, not yet adopted, oldest first
        self._pending_bytes = 0   # their sizes: the budget reads it per pin
        self.pinned_ahead = 0     # bytes pin_slabs started, less those whose pin failed
        self._step = 0
        self._reserved = 0        # the last reserve's bytes: give-back keeps them pinned
        self._largest = self._largest_before = 0   # largest request of this step, of the last
        self._misses = 0          # pins started for requests in this step
        self._said: set = set()      # warnings given (say_once)
        # The smallest request that could not grow the pool in this step: larger ones are refused
        # without asking again (a budget check reads psutil and cgroup files; a failed pin costs
        # a driver call), until the next step. After a failed pin nothing is tried in the step,
        # and the next step tries a slab half the size.
        self._refused_from: Optional[int] = None
        self._pin_cap: Optional[int] = None

    @property
    def pins_in_flight(self) -> int:
        return self._pinner.in_flight

    def budget(self) -> int:
        """The most this pool may hold, pins under way included. Those have not yet taken
        their bytes from the host's free memory, which the budget reads, so they are taken from
        the share: a burst of pins cannot overrun the host."""
        if self.fixed_budget is not None:
            return self.fixed_budget
        return host_budget(self.pinned_bytes) - self._pending_bytes

    # -- requests ----------------------------------------------------------------------------

    def alloc(self, nbytes: int, wait: bool = False) -> Optional[HostSlot]:
        """Room for ``nbytes``, or None: the budget or a failed pin says no, or (``wait=False``)
        the pin that would serve it is under way. ``wait=True`` blocks until it lands."""
        if nbytes > self._largest:
            self._largest = nbytes
        if self._pinner.done:
            self._adopt()
        slot = self._fit(nbytes)
        return slot if slot is not None else self._alloc_short(nbytes, wait)

    def landed(self, nbytes: int) -> Optional[HostSlot]:
        """Room for ``nbytes`` in what is pinned now (finished pins adopted), or None; claims
        and starts nothing: for a request already answered None while its pin ran."""
        if self._pinner.done:
            self._adopt()
        return self._fit(nbytes)

    def settle(self, nbytes: int) -> Optional[HostSlot]:
        """For a request answered None while its pin ran: room once the pins under way have
        landed (waiting for each, oldest first), else as ``alloc(nbytes, wait=True)``."""
        slot = self.landed(nbytes)
        if slot is not None or self.closed:
            return slot
        started = time.perf_counter()
        try:
            while slot is None and self._pending and not self._pinner.stopped:
                self._pinner.wait(self._pending[0])
                slot = self.landed(nbytes)
        finally:
            self.pin_wait_seconds += time.perf_counter() - started
        return slot if slot is not None else self.alloc(nbytes, wait=True)

    @property
    def pins_landed(self) -> bool:
        """Whether pins have finished that are not yet in the pool."""
        return bool(self._pinner.done)

    def _fit(self, nbytes: int) -> Optional[HostSlot]:
        for slab in self.slabs:
            offset = slab.allocator.alloc(nbytes)
            if offset >= 0:
                self.used_bytes += slab.allocator.size_of(offset)
                self.peak_used = max(self.peak_used, self.used_bytes)
                slab.last_used, slab.used = self._step, True
                return HostSlot(slab, offset, nbytes)
        return None

    def _alloc_short(self, nbytes: int, wait: bool) -> Optional[HostSlot]:
        """No slab has room: claim room in a pin under way (or start one), then answer None or
        wait for it."""
        pin, started = None, None
        try:
            while True:
                if pin is None or pin.finished:
                    self._adopt()
                    slot = self._fit(nbytes)
                    if slot is not None:
                        return slot
                    pin = self._claim(nbytes, wait)
                    if pin is None:
                        self.refused += 1
                        return None
                    if pin.finished:           # pinned on this thread: adopt it and fit
                        continue
                    if not wait:
                        self.lagged += 1
                        return None
                if self._pinner.stopped:
                    self.refused += 1
                    return None
                if started is None:
                    started = time.perf_counter()
                self._pinner.wait(pin)
        finally:
            if started is not None:
                self.pin_wait_seconds += time.perf_counter() - started

    def _claim(self, nbytes: int, wait: bool) -> Optional[_Pin]:
        need = -(-nbytes // _ALIGN) * _ALIGN
        chunk = self._chunk(nbytes)
        small = chunk > nbytes                       # served by a chunk, not a slab of its own
        pin = next((p for p in self._pending if p.size - p.claimed >= need), None)
        if pin is None:
            if self._refused_from is not None and nbytes >= self._refused_from:
                return None
            pin = self._grow(nbytes, chunk)
            if pin is None:
                return None
            self._misses += 1
        pin.claimed += need
        if wait and self._misses > 1 and small and self._pinner.max_threads:
            self._run_ahead(pin)
        return pin

    def _run_ahead(self, claimed: _Pin) -> None:
        """A step outruns its pins: beside the pin just claimed, keep a chunk under way,
        unclaimed (NOTE [ Pinning ], Background)."""
        ahead = self._chunk_of(4)
        if sum(p.size - p.claimed for p in self._pending if p is not claimed) < ahead:
            self._grow(_PAGE, ahead)

    def free(self, slot: HostSlot) -> None:
        """Give ``slot`` back; a second call (a release retried after an interrupt) or one after
        ``close`` does nothing."""
        if slot.base is None or self.closed:
            return
        slot.base = slot._tensor = None   # first: an interrupt below leaks, never frees twice
        allocator = slot.slab.allocator
        self.used_bytes -= allocator.size_of(slot.offset)
        allocator.free(slot.offset)

    # -- steps -------------------------------------------------------------------------------

    def new_step(self) -> None:
        """A new step: growth may be tried again, the per-step figures start from zero, and
        slabs idle for ``idle_steps`` steps are given back (NOTE [ Pinning ], Give-back)."""
        self._refused_from = None
        self.refused = 0
        self.peak_used = self.used_bytes
        self.lagged = self.given_back_bytes = self._misses = 0
        self.pin_seconds = self.pin_wait_seconds = 0.0
        self._largest_before, self._largest = self._largest, 0
        self._step += 1
        self._adopt()
        for pin in self._pending:        # the requests that claimed them were answered
            pin.claimed = 0
        keep = self._reserved + (self._reserved >> 5)     # as reserve pins it: no churn
        self._reserved = 0
        idle_steps = self.idle_steps
        if any(slab.allocator.used_bytes == 0 and self._step - slab.last_used > _SQUEEZED_IDLE_STEPS
               for slab in self.slabs) and self.pinned_bytes > self.budget():
            idle_steps = min(idle_steps, _SQUEEZED_IDLE_STEPS)     # the host needs it back
        for slab in self.slabs[::-1]:
            if self.given_back_bytes >= self.give_back_step:
                break                    # the rest next step (NOTE [ Pinning ], Give-back)
            if (slab.allocator.used_bytes == 0 and self._step - slab.last_used > idle_steps
                    and self.pinned_bytes - slab.size >= keep):
                self.slabs.remove(slab)
                self.pinned_bytes -= slab.size
                self.given_back_bytes += slab.size
                self._pinner.give_back(slab.tensor)
                slab.tensor = None

    def figures(self) -> dict:
        """The pool's figures for a step's stats, by their ``StepStats`` names."""
        return {"host_pinned_bytes": self.pinned_bytes, "host_peak_bytes": self.peak_used,
                "host_refused": self.refused, "host_pin_s": self.pin_seconds,
                "host_pin_wait_s": self.pin_wait_seconds, "host_lagged": self.lagged,
                "host_given_back_bytes": self.given_back_bytes,
                "host_pins_in_flight": self.pins_in_flight}

    def used_slabs(self) -> List[int]:
        """The sizes of the slabs that requests have used, oldest first (a layout for
        ``pin_slabs``)."""
        return [slab.size for slab in self.slabs if slab.used]

    def pin_slabs(self, sizes: List[int]) -> None:
        """Start pinning slabs of these sizes (within the budget), in the background, e.g. the
        layout a run of the same command used (cache.py, NOTE [ Pinning ahead ]); returns at
        once, in time linear in ``len(sizes)``. Kept from give-back like a ``reserve`` of their
        bytes; ``pinned_ahead`` counts those started and not failed."""
        budget = self.budget()     # read once: a pin started adds its size to pinned and pending
        for size in sizes:
            pin = self._grow(size, size, budget)
            if pin is None:
                break
            pin.ahead = True
            self.pinned_ahead += pin.size
        self._reserved = self.pinned_ahead

    def reserve(self, nbytes: int) -> None:
        """Pin ahead of need (e.g. what the plan will move), in the background: start the pins
        that ``nbytes`` (plus 1/32) miss in what is pinned or under way; returns at once."""
        self._reserved = nbytes
        if self.closed:
            return
        self._adopt()
        free = (sum(s.allocator.free_bytes for s in self.slabs)
                + sum(p.size - p.claimed for p in self._pending))
        short = nbytes + (nbytes >> 5) - free
        largest = max(self._largest, self._largest_before)
        roomy = any(s.allocator.largest_free >= largest for s in self.slabs) or any(
            p.size - p.claimed >= largest for p in self._pending)
        while short > 0 and self._refused_from is None:
            size = min(max(short, self.chunk_min), self.chunk_max)
            pin = self._grow(_PAGE, size if roomy else max(size, largest))
            if pin is None:
                return
            roomy = True
            short -= pin.size
            if self._pin_cap is not None:
                break            # pinning failed before: one try a step, not a burst of them

    # -- growth ------------------------------------------------------------------------------

    def _chunk(self, nbytes: int) -> int:
        """The size of the next pin for a request of ``nbytes``: an eighth of what is held
        (a sixteenth once the step has missed: two run at once), within the chunk bounds;
        exactly ``nbytes`` for a request of half that or more, which would leave a tail that
        requests may never fill."""
        chunk = self._chunk_of(4 if self._misses else 3)
        return nbytes if 2 * nbytes >= chunk else chunk

    def _chunk_of(self, shift: int) -> int:
        return min(max(self.pinned_bytes >> shift, self.chunk_min), self.chunk_max)

    def _grow(self, nbytes: int, size: int, budget: Optional[int] = None) -> Optional[_Pin]:
        """Start pinning ``size`` bytes (less if the budget or a failed pin says so, never less
        than ``nbytes``); None if that cannot be. ``budget``: ``budget()`` as the caller read
        it."""
        if self.closed:
            return None
        size = -(-size // _PAGE) * _PAGE
        if self._pin_cap is not None:
            size = max(min(size, self._pin_cap), -(-nbytes // _PAGE) * _PAGE)
        room = (self.budget() if budget is None else budget) - self.pinned_bytes
        if size > room:
            size = room // _PAGE * _PAGE
        if size < nbytes or size <= 0:
            self._refuse(nbytes)
            say_once("pinning", "lmsrt: the host memory budget is reached "
                     f"({format_bytes(self.pinned_bytes)} pinned, "
                     f"{format_bytes(max(room, 0))} more allowed); saved tensors that do "
                     "not fit stay on the GPU (said once). Free host memory, or raise "
                     f"host_budget_gb ({spelled('host_budget_gb')}) if the GPU runs out.",
                     given=self._said, stacklevel=4)
            return None
        pin = _Pin(size)
        self.pinned_bytes += size
        self.most_pinned = max(self.most_pinned, self.pinned_bytes)
        self._pending.append(pin)
        self._pending_bytes += size
        self._pinner.pin(pin)
        return pin

    def _adopt(self) -> None:
        """Take the finished pins into the pool (on the caller's thread, which owns its state)."""
        done = self._pinner.done
        while done:
            pin = done.popleft()
            self._pending.remove(pin)        # the oldest, mostly: a deque finds it at once
            self._pending_bytes -= pin.size
            self.pin_seconds += pin.seconds
            if not self._pinner.max_threads:
                self.pin_wait_seconds += pin.seconds
            if pin.tensor is not None:
                self.slabs.append(_Slab(pin.tensor, pin.size, self._step))
                pin.tensor = None
            else:
                self.pinned_bytes -= pin.size
                self.pinned_ahead -= pin.size if pin.ahead else 0
                self._refused_from, self._pin_cap = 0, max(pin.size // 2, _PAGE)
                say_once("pinning", f"lmsrt: pinning {format_bytes(pin.size)} of host memory "
                         f"failed ({pin.error}); saved tensors that do not fit in what is "
                         "pinned stay on the GPU (said once). Free host memory, or set "
                         f"host_budget_gb ({spelled('host_budget_gb')}) to what can be "
                         "pinned.", given=self._said, stacklevel=4)

    def _refuse(self, nbytes: int) -> None:
        if self._refused_from is None or nbytes < self._refused_from:
            self._refused_from = nbytes

    def close(self) -> None:
        """Stop and join the pinning threads, then give the slabs back (unregistered and unmapped
        as they die) before CUDA tears down; pins no more. The caller has synchronized the
        device (the engine's Rule 8)."""
        self.closed = True
        self._stop()
        self._pending.clear()
        self._pending_bytes = 0
        self.slabs.clear()
        self.pinned_bytes = self.used_bytes = 0
