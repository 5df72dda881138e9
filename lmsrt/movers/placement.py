"""How much of an optimizer's state leaves the device, and when: NOTE [ Optimizer state on the
host ], Rule 1 (movers/optimizer.py). The decision, apart from its effect (the mover's copies),
asked in the policy's fractions of the limit."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Set

__all__ = ["Placement"]


class Placement:
    """Rule 1's answers for ``mode`` ("auto" or "host"), from the policy's ``fits(peak)`` and
    ``room(peak)`` and the size of a part of a step in parts.

    Example::

        placement = Placement("auto", policy.step_fits, policy.room_beside, part_bytes=1 << 30)
        if placement.moves_before(allocated, state=6 << 30, temporaries=3 << 30):
            ...                      # the step that makes the state makes it on the host
    """

    def __init__(self, mode: str, fits: Callable[[int], bool], room: Callable[[int], int],
                 part_bytes: int):
        self.mode, self.fits, self.room, self.part_bytes = mode, fits, room, part_bytes

    def moves_before(self, allocated: int, state: int, temporaries: int) -> bool:
        """At the step that makes (or first finds) the state, where it may run in parts: whether
        it must be on the host for the step, which would not fit whole with ``state`` (to make;
        0 where found, already ``allocated``) and the update's ``temporaries``."""
        return self.mode == "host" or not self.fits(allocated + state + temporaries)

    def moves_after(self, peak: int, made: int) -> bool:
        """At the end of the step that made ``made`` bytes of state on the device, whose forward
        and backward peaked at ``peak`` without it: whether the next forward would not fit with
        it."""
        return self.mode == "host" or (made > 0 and not self.fits(peak + made))

    def part_size(self, allocated: int) -> int:
        """Bytes of state a part of a step in parts holds, the step beginning with ``allocated``
        (Rule 9): a fifth of the room beside it (three parts held, the update's temporaries,
        the allocator's slack), ``part_bytes`` at most, an eighth of that at least."""
        return min(self.part_bytes, max(self.part_bytes >> 3, self.room(allocated) // 5))

    def depth(self, allocated: int, largest: int) -> int:
        """How many parts before the one running a part's copies in wait for (Rule 9): 2
        (three parts held) where the room beside ``allocated`` holds four of the ``largest``
        (three and the update's temporaries); else 1 (two held: a part's state is one
        parameter's, larger than a fifth of the room) where it holds two; else 0 (none
        comes ahead: one held)."""
        room = self.room(allocated)
        return 2 if room >= 4 * largest else 1 if room >= 2 * largest else 0

    def stays(self, sizes: Dict[int, int], peak: int, began: Optional[int] = None) -> Set[int]:
        """Of the state just moved (``sizes``: bytes by id of parameter), the parameters whose
        state stays on the device from now on: none under "host"; under "auto" the smallest,
        up to what fits beside ``peak`` with a margin, and where the step ran in parts, also
        beside what it ``began`` with and the next step's parts."""
        if self.mode == "host":
            return set()
        keep = self.room(peak)
        if began is not None:
            keep = min(keep, self.room(began + 4 * self.part_bytes))
        kept, stays = 0, set()
        for pid, nbytes in sorted(sizes.items(), key=lambda item: item[1]):
            if kept + nbytes > keep:
                break
            stays.add(pid)
            kept += nbytes
        return stays
