"""Backward's prefetch: fetch the storages backward needs next, ahead of their use, as far as
the policy's level allows; give back fetched copies when use runs over it."""
from __future__ import annotations

import torch

__all__ = ["Prefetch"]      # a room of SwapEngine (core.py)


class Prefetch:
    """Prefetch of a ``SwapEngine``."""

    def _advance(self) -> None:
        """Backward moved on: fetch the swapped storages it needs next, in reverse save
        order, while the restored-but-unused bytes stay within ``window`` and GPU use stays under
        the policy's level (``fetch_to``). Backward uses saved data faster than H2D brings it back,
        so fetching starts as soon as memory allows, not when the data is near. At a level of 0
        (``lms_frac=0``) one storage is still fetched ahead, so that a copy overlaps compute; above
        0 the level holds strictly, since in plan mode the next swapped storage is needed only late
        in backward and fetching it early would land on the peak. A learning step (auto's level of
        0) fetches that one ahead only while GPU use with it stays under a quarter of the limit: it
        cannot know the model's transients yet, and one that fails for lmsrt's copy is not a
        one-off: cuDNN then runs the next algorithm whose workspace fits and keeps it for the run
        (``policy.lone_fetch_under``; the figures: docs/design.md, "Measurements behind the engine's
        rules"). Backward does not walk the save order strictly downwards (inside a block it jumps
        about), so the walk is by a cursor that skips what is resident, used, or alive elsewhere."""
        order, policy = self._order, self.policy
        level = policy.fetch_to(self.plan, self.state.bwd_point)
        cap = policy.lone_fetch_under(level)
        if self._held:
            # Sources whose copies still run when backward begins (forward ends faster than
            # the last copies go out) are lmsrt's bytes that no prediction counts: backward's
            # first transient (an LM's logits gradient) met them (an LM at 18 GiB, 2 runs in 5).
            # Let them go by the level that leaves room for the peaks to come (Rule 2).
            self._release_finished()
            self._bound_held(self.gauge.use(0, level), level)
        if self._ahead:
            shed = policy.shed_to(self.plan, level)
            if shed:
                self._shed(shed)
        while self._cursor >= 0:
            s = order[self._cursor]
            if (s.dead or s.consumed or s.gpu is not None or s.source is not None
                    or s.host is None or s.storage_ref() is not None):
                self._cursor -= 1
                continue
            if (self._ahead or level) and (self._ahead + s.nbytes > self.window
                                           or self.gauge.use(s.nbytes, level) + s.nbytes > level):
                break
            if cap and self.gauge.use(s.nbytes, cap) + s.nbytes > cap:
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
        use = self.gauge.use(0, level)
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
            self.gauge.delta -= s.nbytes
            use -= s.nbytes
            self._cursor = max(self._cursor, k)
            self.step.prefetch_dropped += 1

