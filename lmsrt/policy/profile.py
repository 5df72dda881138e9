"""``Profile``: what a learning step measured (NOTE [ Auto ], 1, in auto.py)."""
from __future__ import annotations

import collections
import weakref
from typing import List, Optional

__all__ = ["Profile", "NEVER"]

NEVER = 1 << 62


class _Freed(weakref.ref):
    """A profile's reference to saved storage ``index`` (``Profile.watch``)."""

    __slots__ = ("index",)


class Profile:
    """What a learning step measured, relative to GPU use when it began (NOTE [ Auto ], 1)."""

    def __init__(self) -> None:
        self.sizes: List[int] = []       # storage sizes in save order
        self.fwd_own: List[int] = []     # the model's own use at forward point i
        self.fwd_peak: List[int] = []    # its peak in the interval ending at point i
        self.bwd_own: List[int] = []     # the same at backward point j
        self.bwd_peak: List[int] = []
        self.last_use: List[int] = []    # backward point of each storage's last unpack
        self.first_use: List[int] = []   # and of its first
        self.live: set = set()           # storages alive anyway (never worth keeping count of)
        # Storage i counted as the model's own from point owned[i][0] to owned[i][1] (points
        # numbered through forward, then backward): the model held on to it after lmsrt let go.
        self.owned: dict = {}
        self.closed = False
        self._freed: collections.deque = collections.deque()   # _Freed refs, dead, unread
        self._freed_append = self._freed.append     # (one callback for every reference)

    def _point(self) -> int:
        return len(self.fwd_own) + len(self.bwd_own)

    def own_from(self, i: int) -> None:
        if not self.closed:
            self.owned[i] = (self._point(), None)

    def own_in_forward(self, i: int) -> None:
        """Storage i stayed on the GPU through forward without a copy (a deferred swap that
        forward ended without: engine/deferred.py, NOTE [ Deferred copies ]): counted as the
        model's own from its save to forward's end, lmsrt's in backward (``kept_spans``)."""
        if not self.closed:
            self.owned[i] = (i + 1, len(self.fwd_own))

    def watch(self, storage, i: int) -> "_Freed":
        """A weak reference to storage i whose death closes its span in ``held`` at the point
        where it happened. The callback is a deque's C ``append``: no Python frame runs while
        autograd frees a graph, so a Ctrl-C cannot land in one and be lost (NOTE [ Interrupts
        and versions ] in engine/records.py); the next point, or the close, reads the queue. The
        caller keeps the reference (a dead one calls nothing)."""
        ref = _Freed(storage, self._freed_append)
        ref.index = i
        return ref

    def _read_freed(self) -> None:
        freed, point = self._freed, self._point()
        while freed:
            i = freed.popleft().index
            span = self.owned.get(i)
            if span is not None and span[1] is None:
                self.owned[i] = (span[0], point)

    def close(self) -> None:
        """Storages freed from here on tell it nothing."""
        self._read_freed()
        self.closed = True

    def kept_spans(self, k: int, readings: bool = False):
        """The points at which keeping storage k adds its bytes to what was learnt: from its
        save to its last unpack (to there the learning step counted its restored copy as
        lmsrt's; after it, autograd frees it as it frees a kept one), less the span in which
        the model held it anyway: from where lmsrt let go of it (that interval's peak was read
        with it allocated) to the interval in which it was freed (which may have peaked after
        it was: counted). With ``readings``, the points whose reading of GPU use it adds to
        (the swap and fetch levels are readings, not peaks): that last point is counted too,
        since its reading came after the free (leaving it out made a level short by the
        storage there, which swapped one the plan keeps, in every step)."""
        n, p = len(self.fwd_own), len(self.bwd_own)
        start, end = k + 1, n + min(self.last_use[k], p - 1)
        span = self.owned.get(k)
        if span is None:
            return [(start, end)]
        lo, hi = span
        if hi is None:
            hi = end + 1
        elif not readings and (hi > lo or self._peaked_at_start(lo)):
            hi = max(hi, lo + 1)
        return [(a, b) for a, b in ((start, min(end, lo - 1)), (max(start, hi), end)) if a <= b]

    def _peaked_at_start(self, i: int) -> bool:
        """Whether the interval ending at point i peaked no higher than GPU use as it began: a
        storage the model took over and freed within it (``kept_spans``) was allocated at that
        peak. Otherwise the peak may have come after the free (a GELU output freed once the op
        reading it returned, then a 256 MiB workspace before the next save: leaving it out there
        ran a planned step out of memory on the simulated device)."""
        n = len(self.fwd_own)
        if not 0 < i < n + len(self.bwd_own):
            return False
        peak = self.fwd_peak[i] if i < n else self.bwd_peak[i - n]
        return peak <= (self.fwd_own[i - 1] if i <= n else self.bwd_own[i - 1 - n])

    def record(self, backward: bool, used: int, peak: int, lmsrt_before: int, lmsrt_now: int,
               nbytes: int = 0) -> None:
        if self._freed:
            self._read_freed()          # freed in the interval that ends here
        own = used - lmsrt_now
        own_peak = max(peak - lmsrt_before, own)
        if backward:
            self.bwd_own.append(own)
            self.bwd_peak.append(own_peak)
        else:
            self.sizes.append(nbytes)
            self.last_use.append(NEVER)
            self.first_use.append(NEVER)
            self.fwd_own.append(own)
            self.fwd_peak.append(own_peak)

    def used_at(self, i: int, j: int) -> None:
        if 0 <= i < len(self.last_use):
            self.last_use[i] = j
            if i < len(self.first_use) and self.first_use[i] == NEVER:
                self.first_use[i] = j

    def between(self, k: int) -> Optional[tuple]:
        """The points (numbered through forward, then backward) at which storage k, restored,
        waits between its first unpack and its last (a tensor that two backward functions
        read: a convolution's input that a ReLU before it also saved), or None. The learning
        step counted it as lmsrt's there, as it counts a copy fetched ahead; a planned step
        that offloads it holds it all the same (measured on a conv net at a 6 GiB cap: a
        577 MiB activation between its two unpacks made every 1.1 GiB cuDNN workspace of the
        first planned step fail, 79 of them, and cuDNN kept the slower algorithms for the
        run)."""
        if k >= len(self.first_use):
            return None
        first, last, n = self.first_use[k], self.last_use[k], len(self.fwd_own)
        last = min(last, len(self.bwd_own) - 1)
        if first == NEVER or first >= last:
            return None
        return n + first + 1, n + last

    def own_peak(self) -> int:
        """The model's own peak over the step, lmsrt's bytes left out at every point."""
        return max(self.fwd_peak + self.bwd_peak, default=0)

    def growth(self) -> int:
        """The largest rise of the model's own use within one interval."""
        own = self.fwd_own + self.bwd_own
        peak = self.fwd_peak + self.bwd_peak
        return max((p - o for o, p in zip(own, peak[1:])), default=0)

