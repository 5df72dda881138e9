"""Held sources: the GPU sources of swapped storages, held by lmsrt while their copies to host
memory run, and let go once each copy is done or waited on (NOTE [ Stream lifetimes ], Rule 2).

Bounding what forward holds (docs/design.md, "Freeing memory in forward"): copies run at ~55 GB/s
and forward makes activations several times faster, so sources still being copied pile up. When held
sources would keep GPU use over the mark, the compute stream waits on the oldest copy and its source
is dropped at once (Rule 2).

Example::

    held = HeldSources(lambda: engine.policy, limit, wait_out, step=lambda: engine.step,
                       profile=lambda: engine.state.rec)
    held.hold(s)
    held.copying(s)                 # its copy runs: the source goes once it is done
    held.release_finished()
    held.bound(used, level)         # wait on the oldest copies while use stands over ``level``
"""
from __future__ import annotations

import collections
from typing import Callable

from .records import Offloaded, counter_only

__all__ = ["HeldSources"]      # held by SwapEngine (core.py) as ``held``


class HeldSources:
    """Sources held on the GPU while their copies run (``queue``, oldest first), and the bytes
    lmsrt holds as sources (``bytes``: also deferred ones, NOTE [ Deferred copies ]).

    It touches the records it is given (their ``source``, ``counter`` and ``kept``) and, through
    what it is given, nothing else: the engine's policy's ``overlap`` (``policy()``), the GPU's
    ``limit``, ``wait_out``
    (makes the storage's streams wait on its copy, timed: the engine's, swap_out.py), the step's
    figures (``step()``: ``swapout_waits``) and the profile of a recorded step (``profile()``:
    None when the step is not recorded)."""

    __slots__ = ("queue", "bytes", "policy", "limit", "wait_out", "step", "profile")

    def __init__(self, policy: Callable, limit: int, wait_out: Callable[[Offloaded], None],
                 step: Callable, profile: Callable):
        self.queue: collections.deque = collections.deque()   # swapped, source still on the GPU
        self.bytes = 0
        self.policy, self.limit, self.wait_out = policy, limit, wait_out
        self.step, self.profile = step, profile

    def __len__(self) -> int:
        return len(self.queue)

    def hold(self, s: Offloaded) -> None:
        """``s``'s source is lmsrt's from here: counted in ``bytes`` until it is dropped (or,
        kept for backward, until backward has every view of it: ``used``)."""
        self.bytes += s.nbytes

    def copying(self, s: Offloaded) -> None:
        """``s``'s copy runs: its source goes once the copy is seen done or waited on."""
        self.queue.append(s)

    def used(self, s: Offloaded) -> None:
        """A source forward kept (NOTE [ Deferred copies ]) is the model's own from here: backward
        has every view of it."""
        s.kept = "used"
        self.bytes -= s.nbytes

    def release_finished(self) -> None:
        queue = self.queue
        while queue and (queue[0].source is None or queue[0].copy_done.query()):
            self.drop(queue.popleft())                     # Rule 2: copy seen complete

    def bound(self, used: int, level: int) -> None:
        """Let go of held sources, oldest first, while use stands over ``level``; at a level of
        0, while more than the policy's overlap is held or use would pass the limit."""
        queue, overlap = self.queue, self.policy().overlap
        while queue and (used > level if level else (self.bytes > overlap
                                                     or used + overlap > self.limit)):
            s = queue.popleft()
            if s.source is None:
                continue
            self.wait_out(s)                               # Rule 2: wait, then drop at once
            self.drop(s)
            used -= s.nbytes
            self.step().swapout_waits += 1

    def drop(self, s: Offloaded) -> None:
        """Drop ``s``'s source (its copy is done, or ordered before any reuse of its block)."""
        source = s.source
        if source is not None:
            s.source = None
            if s.kept != "used":
                self.bytes -= s.nbytes
            s.counter = counter_only(source)   # NOTE [ Interrupts and versions ], c
            del source
            rec = self.profile()
            if rec is not None and s.kept is None and s.storage_ref() is not None:
                rec.own_from(s.seq)       # held on by the model: its own use from here

    def clear(self) -> None:
        """Forget every source (``close``, once the device is synchronized: Rule 8)."""
        self.queue.clear()
        self.bytes = 0
