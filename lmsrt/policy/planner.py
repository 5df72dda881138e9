"""Auto's planner, as data: which storages a step offloads, and the levels of GPU use that follow
(policy/auto.py, NOTE [ Auto ], 2 and 3). Pure functions of what the learning step measured.

Example::

    offload, peaks, between, swapped = choose_offloads(profile, live, rebuildable, budget)
    swap, hold, fetch = levels(profile, live, offload, between, peaks, budget, slack)
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

from .profile import Profile

__all__ = ["choose_offloads", "levels"]


def choose_offloads(prof: Profile, live: set, rebuildable,
                    budget: int) -> Tuple[List[bool], List[int], list, set]:
    """Which storages to offload (one bool per forward point) so that the predicted peaks stay
    under ``budget``; the predicted peak at each point (through forward, then backward); each
    storage's wait between its first unpack and its last (``Profile.between``), or None; and
    the rebuildable storages offloaded that are to be moved rather than rebuilt.

    Keep storages from the last saved down (backward needs them first), each one whose bytes fit
    under the budget at every point from its save to its last use; offload the rest. (Keeping a
    plain suffix would have to keep the last storages first, which are often the largest and
    alive at the peak: an LM's fp32 log-softmax output.) Storages the engine can rebuild
    (``rebuildable``: each with the indices its recipe reads, or a set of them) cost no copy to
    offload: they are kept only with the room that the others leave. A rebuild runs at the
    storage's first unpack and reads its inputs there, before their own first unpack, where
    moving would have brought them back (a convolution's output is read in backward before
    its input, a stage's first input last of all): those bytes are counted from the rebuild
    on, and where they would not fit, the storage is moved instead (measured on an H200: a
    conv net at 85% of its peak ran out of memory in the first step that rebuilt a 256 MiB
    convolution output, its 256 MiB input brought back early for it)."""
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
    swapped: set = set()
    reads = rebuildable if isinstance(rebuildable, dict) else {}
    kept: set = set()
    down = range(n - 1, -1, -1)
    for k in [k for k in down if k not in rebuildable] + [k for k in down if k in rebuildable]:
        size = prof.sizes[k]
        if k in live or not size:
            continue
        spans = _without(prof.kept_spans(k), between[k])
        if _fits(peaks, spans, size, budget):
            _add(peaks, spans, size)
            kept.add(k)
            continue
        offload[k] = True
        if k in rebuildable:
            early = _read_early(prof, k, reads.get(k, ()), live, kept)
            if _fit_together(peaks, early, budget):
                for span, nbytes in early:
                    _add(peaks, [span], nbytes)
            else:
                swapped.add(k)
    return offload, peaks, between, swapped


def _fits(peaks: List[int], spans: list, size: int, budget: int) -> bool:
    return all(max(peaks[a:b + 1], default=0) + size <= budget for a, b in spans)


def _fit_together(peaks: List[int], extra: list, budget: int) -> bool:
    """Whether ``extra`` (((first, last) point, bytes) pairs, whose spans may overlap: a
    rebuild's inputs all start at its first unpack) fits on ``peaks`` under ``budget`` at once."""
    if not extra:
        return True
    lo = min(a for (a, _), _ in extra)
    hi = max(b for (_, b), _ in extra)
    added = [0] * (hi - lo + 1)
    for (a, b), nbytes in extra:
        for j in range(a, b + 1):
            added[j - lo] += nbytes
    return all(peaks[j] + add <= budget for j, add in zip(range(lo, hi + 1), added) if add)


def _add(peaks: List[int], spans: list, size: int) -> None:
    for a, b in spans:
        peaks[a:b + 1] = [v + size for v in peaks[a:b + 1]]


def _read_early(prof: Profile, k: int, inputs, live: set, kept: set) -> list:
    """((first point, last point), bytes) for each input of storage k's recipe that a rebuild
    at k's first unpack reads before its own first unpack (one neither alive anyway nor kept)."""
    n, p = len(prof.sizes), len(prof.bwd_own)
    first = prof.first_use[k] if k < len(prof.first_use) else p
    out = []
    for i in set(inputs):
        if i in live or i in kept or i >= n or first >= p:
            continue
        own = min(prof.first_use[i], p - 1)
        if own > first:
            out.append(((n + first + 1, n + own), prof.sizes[i]))
    return out


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
