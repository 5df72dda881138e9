"""Auto's planner, as data: which storages a step offloads, and the levels of GPU use that follow
(policy/auto.py, NOTE [ Auto ], 2 and 3). Pure functions of what the learning step measured.

Example::

    offload, peaks, between = choose_offloads(profile, live, rebuildable, budget)
    swap, hold, fetch = levels(profile, live, offload, between, peaks, budget, slack)
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

from .profile import Profile

__all__ = ["choose_offloads", "levels"]


def choose_offloads(prof: Profile, live: set, rebuildable: set,
                    budget: int) -> Tuple[List[bool], List[int], list]:
    """Which storages to offload (one bool per forward point) so that the predicted peaks stay
    under ``budget``; the predicted peak at each point (through forward, then backward); and
    each storage's wait between its first unpack and its last (``Profile.between``), or None.

    Keep storages from the last saved down (backward needs them first), each one whose bytes fit
    under the budget at every point from its save to its last use; offload the rest. (Keeping a
    plain suffix would have to keep the last storages first, which are often the largest and
    alive at the peak: an LM's fp32 log-softmax output.) Storages the engine can rebuild cost no
    copy to offload: they are kept only with the room that the others leave."""
    n, p = len(prof.sizes), len(prof.bwd_own)
    peaks = prof.fwd_peak + prof.bwd_peak        # points through forward, then backward
    # A storage restored for backward waits between its first unpack and its last, kept or
    # not (Profile.between): use the learning step counted as lmsrt's.
    between = [None if k in live else prof.between(k) for k in range(n)]
    waits = [0] * (n + p + 1)
    for k, span in enumerate(between):
        if span is not None:
            waits[span[0]] += prof.sizes[k]
            waits[span[1] + 1] -= prof.sizes[k]
    waits = list(itertools.accumulate(waits))[:n + p]
    peaks = [v + w for v, w in zip(peaks, waits)]
    offload = [False] * n
    down = range(n - 1, -1, -1)
    for k in [k for k in down if k not in rebuildable] + [k for k in down if k in rebuildable]:
        size = prof.sizes[k]
        if k in live or not size:
            continue
        spans = _without(prof.kept_spans(k), between[k])
        if all(max(peaks[a:b + 1], default=0) + size <= budget for a, b in spans):
            for a, b in spans:
                peaks[a:b + 1] = [v + size for v in peaks[a:b + 1]]
        else:
            offload[k] = True
    return offload, peaks, between


def levels(prof: Profile, live: set, offload: List[bool], between: list, peaks: List[int],
           budget: int, slack: int) -> Tuple[List[int], List[int], List[int]]:
    """The swap level at each forward point, the hold level at each, and the fetch level at each
    backward point, relative to use at the step's first save (NOTE [ Auto ], 3)."""
    n, p = len(prof.sizes), len(prof.bwd_own)
    bwd = peaks[n:]
    fwd_own, bwd_own = prof.fwd_own, prof.bwd_own
    # What the kept storages add to each point's reading of use, and the restored ones
    # waiting between two unpacks (a difference array).
    kept = [0] * (n + p + 1)
    for k, size in enumerate(prof.sizes):
        if k in live or not size:
            continue
        spans = [] if offload[k] else _without(prof.kept_spans(k, readings=True), between[k])
        if between[k] is not None:
            spans.append(between[k])
        for a, b in spans:
            kept[a] += size
            kept[b + 1] -= size
    kept = list(itertools.accumulate(kept))
    kept_fwd, kept_bwd = kept[:n], kept[n:n + p]
    swap = [fwd_own[i] + kept_fwd[i] + slack for i in range(n)]
    nxt = prof.fwd_peak[1:] + prof.bwd_peak[:1]
    hold = [budget - max(0, nxt[i] - fwd_own[i]) if i < len(nxt) else budget for i in range(n)]
    # Highest predicted use in backward after point j, against predicted use at j.
    fetch: List[int] = [0] * p
    later = None
    for j in range(p - 1, -1, -1):
        now = bwd_own[j] + kept_bwd[j]
        fetch[j] = budget - max(0, later - now) if later is not None else budget
        later = bwd[j] if later is None else max(later, bwd[j])
    return swap, hold, fetch


def _without(spans: list, gap: Optional[tuple]) -> list:
    """``spans`` (inclusive (first, last) point pairs) less the points of ``gap``."""
    if gap is None:
        return list(spans)
    lo, hi = gap
    out = []
    for a, b in spans:
        if a < lo:
            out.append((a, min(b, lo - 1)))
        if b > hi:
            out.append((max(a, hi + 1), b))
    return out
