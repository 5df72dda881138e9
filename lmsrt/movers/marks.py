"""What an optimizer step tells the engine (NOTE [ Optimizer state on the host ], Rule 9,
movers/optimizer.py): the training pass's peak, read where the optimizer's update begins, and
the GPU time of the updates whose state moved."""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["StepMarks"]


class StepMarks:
    """One engine step's marks, read by the mover's hooks; ``new_step()`` at each step.

    Example::

        marks = StepMarks(device, step_peak=engine.step_peak)
        began = marks.pass_ends()          # the optimizer's first read: forward, backward done
        ...                                # the update, its state in and out
        marks.update_ends(began)           # timed, where its state moved
        marks.update_over()                # at the step's post-hook
        policy_peak = marks.pass_peak      # what the engine's policy is judged by
    """

    def __init__(self, device, step_peak: Callable[[], int]):
        self.device, self.step_peak = device, step_peak
        self.pass_peak: Optional[int] = None    # the training pass's peak
        self.peak_seen: Optional[int] = None    # the step's, at that mark or an update's end
        self.update_ms = 0.0                    # this step's updates' GPU time, as read in
        self._timed: list = []                  # (began, ended) events not yet read

    def pass_ends(self):
        """The training pass ended here (the first optimizer's read, or a later one that finds
        the step's peak past the one seen: a backward after one optimizer's step, as a GAN's
        loop has); the event the update begins at, on the compute stream."""
        peak = self.step_peak()
        if self.pass_peak is None or peak > self.peak_seen:
            self.pass_peak = self.peak_seen = peak
        began = self.device.new_event(timing=True)
        began.record(self.device.current_stream())
        return began

    def update_ends(self, began) -> None:
        """The update begun at ``began`` is queued: its GPU time, read once it has run."""
        ended = self.device.new_event(timing=True)
        ended.record(self.device.current_stream())
        self._timed.append((began, ended))

    def update_over(self) -> None:
        """An optimizer's post-hook ran: a later read past this peak ends another pass."""
        self.peak_seen = self.step_peak()

    def read_update_ms(self) -> float:
        """This step's updates' GPU time, those whose events have passed read in now."""
        pending = []
        for began, ended in self._timed:
            if ended.query():
                self.update_ms += began.elapsed_time(ended)
            else:
                pending.append((began, ended))
        self._timed = pending
        return self.update_ms

    def new_step(self) -> None:
        self.update_ms = 0.0
        self.pass_peak = self.peak_seen = None
