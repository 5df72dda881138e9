"""The region plan as data (regions.py, NOTE [ Region plan ]): what a step's figures say about
which regions to recompute.

Example::

    step = StepFigures(excess=12 << 30, saved=15 << 30, rebuilt=0, t_fwd=0.05, t_bwd=0.1,
                       bandwidth=55e9)
    choose_regions([(1 << 30, 0.003)] * 16, step)
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

__all__ = ["StepFigures", "choose_regions"]


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What the region plan knows of a step (NOTE [ Region plan ]), in bytes and seconds."""

    excess: int         # over the bound, were every saved tensor kept
    saved: int          # saved in all (eligible storages)
    rebuilt: int        # of which the engine rebuilds rather than moves
    t_fwd: float
    t_bwd: float
    bandwidth: float    # of the link, each way

    def swap_seconds(self, freed: int) -> float:
        """Step time the swaps cost where recomputed regions free ``freed`` bytes: the copy
        time that compute does not hide (out: forward's; in: backward's). Rebuilt storages (the
        same share of what remains) cross no link."""
        share = self.rebuilt / self.saved if self.saved else 0.0
        moved = max(0.0, self.excess - freed - share * max(0, self.saved - freed))
        t = moved / self.bandwidth
        return max(0.0, t - self.t_fwd) + max(0.0, t - self.t_bwd)


def choose_regions(regions: Sequence[Tuple[int, float]], step: StepFigures) -> List[int]:
    """NOTE [ Region plan ]: the indices (in forward order) of the regions to recompute.

    ``regions`` are (bytes a recompute frees, seconds its forward takes). Recomputing a region
    costs its forward time and frees its bytes; swaps cost ``step.swap_seconds``. Regions are
    taken from the last in forward (backward needs them first, where their copies would hide
    worst), skipping any whose forward takes longer than a copy of its bytes (moving them never
    costs more); the count taken is the one of least predicted time, the fewest on a tie (none
    where the swaps hide already).

    Example::

        step = StepFigures(excess=12 << 30, saved=15 << 30, rebuilt=0, t_fwd=0.05, t_bwd=0.1,
                           bandwidth=55e9)
        choose_regions([(1 << 30, 0.003)] * 16, step)   # the last ones, as many as pay
    """
    best, best_cost = 0, step.swap_seconds(0)
    freed, spent, taken = 0, 0.0, []
    for i in range(len(regions) - 1, -1, -1):
        nbytes, seconds = regions[i]
        if not best_cost:
            break
        if seconds * step.bandwidth >= nbytes:
            continue
        freed, spent = freed + nbytes, spent + seconds
        taken.append(i)
        cost = spent + step.swap_seconds(freed)
        if cost < best_cost:
            best, best_cost = len(taken), cost
        if cost == spent:
            break                      # nothing left to move that does not hide
    return sorted(taken[:best])
