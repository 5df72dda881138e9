"""Release: give back what dead storages held, and close."""
from __future__ import annotations

from .. import params
from .records import Offloaded

__all__ = ["Release"]      # a room of SwapEngine (core.py)


class Release:
    """Release of a ``SwapEngine``."""

    def _sweep_orphans(self) -> None:
        """Release storages that no handle holds: a pack interrupted before it handed its handle
        to autograd (NOTE [ Interrupts and versions ], b)."""
        for s in self._order:
            if not s.watches and not s.needed_by and not s.dead:
                self._release(s)

    # -- release -----------------------------------------------------------------------------

    def outstanding(self, reap: bool = True) -> dict:
        """What the engine still tracks (``reap``: after giving back what dead storages held):
        ``storages`` swapped or rebuilt since the last step boundary, of which ``released``;
        sources ``held`` on the GPU while their copies run (``held_bytes``) and ``deferred``;
        restored bytes not yet used (``restored_bytes``); handles dropped by autograd and not
        yet reaped (``dead_handles``).

        Example::

            assert engine.outstanding()["held_bytes"] == 0     # after backward, every copy done
        """
        with self._lock:
            if reap:
                self._reap()
            order = self._order
            return {"storages": len(order), "released": sum(s.dead for s in order),
                    "held": len(self._held), "held_bytes": self._held_bytes,
                    "deferred": len(self._deferred), "restored_bytes": self._ahead,
                    "dead_handles": len(self._dead)}

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
            if not s.watches and not s.needed_by:
                self._release(s)
            dead.popleft()

    def _release(self, s: Offloaded) -> None:
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
            self._release_inputs(s)

    def close(self) -> None:
        """Wait for copies in flight and give back pinned memory. The engine is unusable after:
        a graph still alive fails in backward with a clear error (``_fetch``), and its handles
        die harmlessly."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.optimizer_mover.close()        # its state back where the optimizer runs
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
                self._param_rebuilds = {}
                params.unwatch(self)                # the last engine takes torch's patches
                self.state.by_ptr.clear()
                if self.memo is not None:             # the step in flight counts too
                    self.memo.saw(self.host.used_slabs())
                    self.memo.close()
                self.host.close()
