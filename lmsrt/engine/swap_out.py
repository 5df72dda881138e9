"""Swap-out: a storage's copy to host memory (its GPU source held until the copy is done:
release.py), and the stream orders that let go of a block once a copy is done (Rules 2 and 4)."""
from __future__ import annotations

from typing import Optional

import torch

from .records import Offloaded

__all__ = ["SwapOut"]      # a room of SwapEngine (core.py)


class SwapOut:
    """Swap-out of a ``SwapEngine``."""

    def _swap_out(self, t: torch.Tensor, storage, nbytes: int, seq: int, ref,
                  version: int) -> Optional[Offloaded]:
        key = self.device.stream_key()
        stream = self.compute if key == self._compute_key else self.device.stream_of(key)
        # A swap waits for a pin under way where keeping the tensor would undo what the policy
        # counts on: a planned step; a step that must hold the least (the first, in which cuDNN
        # picks its algorithms for the run by the memory free then), or near the limit: the
        # policy says (``must_wait``). Where the policy allows it, outside a planned step (whose
        # pins were started at its beginning, and whose plan counts on each source's drop), it
        # is deferred instead (NOTE [ Deferred copies ]). Elsewhere (a later reactive step with
        # room) the tensor stays on the GPU while its pin runs (host.py, NOTE [ Pinning ]).
        use, policy = self.gauge.estimate(), self.policy      # no new reading
        planned = self.plan.mode == "plan"
        wait = planned or policy.must_wait(self.plan, use)
        if (wait and not planned and self._forward_open and key == self._compute_key
                and policy.may_defer(use)):
            refused = self.host.refused
            # A policy may forbid a deferral to start a pin (NOTE [ Deferred copies ]).
            slot = (self.host.alloc(nbytes, wait=False) if policy.pins_for_deferred
                    else self.host.landed(nbytes))
            if slot is None:
                return None if self.host.refused != refused else self.deferred.defer(
                    t, nbytes, seq, ref, version, stream, key)
        else:
            if wait and self.deferred:
                self.deferred.start(wait=True)             # copies go out in save order
            slot = self.host.alloc(nbytes, wait=wait)
            if slot is None:
                return None
        order, held = self.prefetch.order, self.held
        try:
            s = Offloaded(nbytes, seq, ref, version, stream, key)
            s.copy_done = self.copies.copy_out(storage, slot, stream)      # Rule 1
            s.source, s.host = t.detach(), slot    # Rule 2; also shares t's version counter
            self.prefetch.add(s)     # from here the step boundary releases it if orphaned
        except BaseException as e:                         # Rule 7: keep it on the GPU
            if order and order[-1].host is slot:           # interrupted once committed
                held.hold(order[-1])
                held.copying(order[-1])
                raise
            self.host.free(slot)
            if not isinstance(e, Exception):
                raise
            self.diagnostics.copy_out_failed(nbytes, e)
            return None
        held.hold(s)
        held.copying(s)
        self.step.count_out(nbytes, seq)
        return s

    def _wait_out(self, s: Offloaded) -> None:
        """Order the reuse of ``s``'s block after its copy; where the copy is still running, the
        compute stream's wait is timed (``swapout_wait_ms``: the copy time forward did not hide)."""
        if s.copy_done.query():
            self._order_after(s, s.copy_done)
            return
        start, end = self.device.new_event(timing=True), self.device.new_event(timing=True)
        start.record(self.compute)
        self._order_after(s, s.copy_done)
        end.record(self.compute)
        self._timed_waits.append(("swapout_wait_ms", start, end))

    def _order_after(self, s: Offloaded, event) -> None:
        """Make the streams that may reuse ``s``'s GPU block wait on ``event``: its own stream,
        and the compute stream too for a side-stream storage (its block may be the compute
        stream's, if the script did not record it on the side stream)."""
        event.wait(s.stream)
        if s.stream_key != self._compute_key:
            event.wait(self.compute)
