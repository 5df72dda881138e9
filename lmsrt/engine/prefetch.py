"""Backward's prefetch: fetch the storages backward needs next, ahead of their use, as far as
the policy's level allows; give back fetched copies when use runs over it, and all of them
when an allocation of backward's fails (``give_back``).

Example::

    window = PrefetchWindow(device, copies, h2d, gauge, lambda: engine.policy, held,
                            window=64 << 20, order_after=engine._order_after,
                            step=lambda: engine.step)
    window.add(s)                     # swapped: in save order, for the walk
    window.from_top()                 # forward ended: backward needs the last saved first
    window.advance(plan, point)       # backward moved on: fetch what it needs next
"""
from __future__ import annotations

from typing import Callable, List

import torch

from ..units import format_bytes
from .records import Offloaded

__all__ = ["PrefetchWindow"]      # held by SwapEngine (core.py) as ``prefetch``


class PrefetchWindow:
    """The swapped storages in save order (``order``), the cursor that walks them down, and the
    restored bytes not yet used (``ahead``), within ``window`` bytes.

    It touches the records in its order (their restored copies: ``gpu``, ``fetch_done``, ...)
    and, through what it is given, nothing else: the device (allocations on a storage's stream),
    the copy path's ``copy_in`` and its H2D stream, the gauge, the engine's policy's fetch levels
    (``policy()``), the
    held sources (let go before fetching: ``HeldSources``), ``order_after`` (makes a storage's
    streams wait on an event: the engine's, swap_out.py) and the step's figures (``step()``)."""

    __slots__ = ("order", "cursor", "ahead", "window", "device", "copies", "h2d", "gauge",
                 "policy", "held", "order_after", "step")

    def __init__(self, device, copies, h2d, gauge, policy: Callable, held, window: int,
                 order_after: Callable, step: Callable):
        self.order: List[Offloaded] = []   # swapped storages in save order, for prefetch
        self.cursor = -1               # next candidate in order to prefetch (walks down)
        self.ahead = 0                 # restored bytes not yet used
        self.window = window
        self.device, self.copies, self.h2d, self.gauge = device, copies, h2d, gauge
        self.policy, self.held, self.order_after, self.step = policy, held, order_after, step

    @property
    def walking(self) -> bool:
        """Whether storages are left to prefetch in this pass."""
        return self.cursor >= 0

    def add(self, s: Offloaded) -> None:
        """``s`` was swapped (or will be, or is rebuilt): it takes its place in save order."""
        s.index = len(self.order)
        self.order.append(s)

    def forget_dead(self) -> None:
        """A step begins: dead storages leave the order (``reindex`` renumbers it)."""
        self.order = order = [s for s in self.order if not s.dead]
        # Recounted at each step, so an interrupt between a restored copy's marking and its
        # count leaves no lasting drift (NOTE [ Interrupts and versions ], b).
        self.ahead = sum(s.nbytes for s in order if s.gpu is not None)

    def reindex(self) -> None:
        """Number the storages by their places in the order."""
        for i, s in enumerate(self.order):
            s.index = i
        self.from_top()                # indices changed: prefetch walks from the top

    def from_top(self) -> None:
        """Walk from the storage saved last, which backward needs first."""
        self.cursor = len(self.order) - 1

    def new_pass(self, s: Offloaded) -> None:
        """A storage already used in this pass is needed again: backward runs once more over a
        retained graph. Prefetch starts over from below it."""
        for other in self.order:
            other.consumed = False
        self.cursor = s.index - 1

    def clear(self) -> None:
        """Forget every storage (``close``)."""
        self.order.clear()
        self.ahead = 0
        self.cursor = -1                    # nothing left to prefetch

    def advance(self, plan, point: int) -> None:
        """Backward moved on (``point``: its unpacks so far): fetch the swapped storages it needs
        next, in reverse save order, while the restored-but-unused bytes stay within ``window``
        and GPU use stays under the policy's level (``fetch_to``). Backward uses saved data faster
        than H2D brings it back, so fetching starts as soon as memory allows, not when the data is
        near. At a level of 0 (``lms_frac=0``) one storage is still fetched ahead, so that a copy
        overlaps compute; above 0 the level holds strictly, since in plan mode the next swapped
        storage is needed only late in backward and fetching it early would land on the peak. A
        learning step (auto's level of 0) fetches that one ahead only while GPU use with it stays
        under a quarter of the limit: it cannot know the model's transients yet, and one that
        fails for lmsrt's copy is not a one-off: cuDNN then runs the next algorithm whose
        workspace fits and keeps it for the run (``policy.lone_fetch_under``; the figures:
        docs/design.md, "Measurements behind the engine's rules"). Backward does not walk the save
        order strictly downwards (inside a block it jumps about), so the walk is by a cursor that
        skips what is resident, used, or alive elsewhere."""
        order, policy, gauge = self.order, self.policy(), self.gauge
        level = policy.fetch_to(plan, point)
        cap = policy.lone_fetch_under(level)
        if self.held:
            # Sources whose copies still run when backward begins (forward ends faster than
            # the last copies go out) are lmsrt's bytes that no prediction counts: backward's
            # first transient (an LM's logits gradient) met them (an LM at 18 GiB, 2 runs in 5).
            # Let them go by the level that leaves room for the peaks to come (Rule 2).
            self.held.release_finished()
            self.held.bound(gauge.use(0, level), level)
        if self.ahead:
            shed = policy.shed_to(plan, level)
            if shed:
                self.shed(shed)
        while self.cursor >= 0:
            s = order[self.cursor]
            if (s.dead or s.consumed or s.gpu is not None or s.source is not None
                    or s.host is None or s.storage_ref() is not None):
                self.cursor -= 1
                continue
            if (self.ahead or level) and (self.ahead + s.nbytes > self.window
                                          or gauge.use(s.nbytes, level) + s.nbytes > level):
                break
            if cap and gauge.use(s.nbytes, cap) + s.nbytes > cap:
                break
            try:
                self.fetch(s)
            except torch.OutOfMemoryError:
                # A prefetch is optional: stop for this pass (each failed allocation empties
                # the allocator's cache) and let backward fetch on demand.
                self.cursor = -1
                break
            self.cursor -= 1

    def shed(self, level: int) -> None:
        """Under lms_frac="auto" the fetch level is what use may be now for the peaks the plan
        predicts further on to fit. Use over it means the model holds more than the plan
        predicted: copies fetched ahead earlier, when it did not, would then meet those peaks and
        make an allocation fail there (cuDNN's workspace, which then falls back to a slower
        algorithm for the rest of the run). Give back the restored copies not yet used, those
        needed last first, until use is within the level; they are fetched again later (clean
        copies: their bytes are still in host memory)."""
        use = self.gauge.use(0, level)
        for k in range(self.cursor + 1, len(self.order)):  # ascending: needed last first
            if use <= level or not self.ahead:
                return
            use -= self._unfetch(k)

    def give_back(self) -> int:
        """An allocation in backward failed (a fetch on demand, a rebuild, a region's rerun):
        give back every restored copy not yet used and fetch none ahead for the rest of this
        pass (backward fetches each on demand). Returns the bytes given back; the caller tries
        its allocation once more if there were any."""
        freed = 0
        for k in range(self.cursor + 1, len(self.order)):
            if not self.ahead:
                break
            freed += self._unfetch(k)
        self.cursor = -1
        return freed

    def _unfetch(self, k: int) -> int:
        """Give back the restored copy of ``order[k]`` if it is one fetched ahead and not yet
        used (its bytes are still in host memory); returns its bytes, else 0."""
        s = self.order[k]
        if (s.gpu is None or s.unpacked or s.consumed or s.source is not None
                or s.fetch_done is None):                      # rebuilt: not a prefetch
            return 0
        self.order_after(s, s.fetch_done)                      # Rule 4
        self.drop(s)
        self.gauge.delta -= s.nbytes
        self.cursor = max(self.cursor, k)
        self.step().prefetch_dropped += 1
        return s.nbytes

    def fetch(self, s: Offloaded) -> None:
        """Bring ``s``'s bytes back from host memory into a block of its stream (Rule 3)."""
        if s.host is None:
            raise RuntimeError(
                "lmsrt: backward needs a saved tensor that this LMS swapped out, but the LMS was "
                "closed (LMS.close(), or interpreter exit) and its host memory given back. Run "
                "backward before closing the LMS.")
        gpu = self._alloc_on(s)                           # Rule 3: allocated on its stream
        try:
            done = self.copies.copy_in(gpu, s.host, s.stream)
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
        self.ahead += s.nbytes
        self.gauge.delta += s.nbytes
        step = self.step()
        step.in_bytes += s.nbytes
        step.in_tensors += 1

    def _alloc_on(self, s: Offloaded) -> torch.Tensor:
        device = self.device
        if s.stream_key == device.stream_key():
            return device.empty(s.nbytes)
        with device.stream(s.stream):
            return device.empty(s.nbytes)

    def arrived(self, s: Offloaded) -> None:
        """``s``'s bytes were made on the GPU (rebuilt): they wait for backward as a fetched copy
        does."""
        self.ahead += s.nbytes

    def drop(self, s: Offloaded) -> None:
        """Let go of ``s``'s restored copy (its streams already ordered after its use)."""
        s.gpu = None
        self.ahead -= s.nbytes
