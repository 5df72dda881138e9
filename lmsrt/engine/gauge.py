"""The GPU-use gauge: what the engine reads of GPU use, and estimates between readings.

Example::

    gauge = GpuGauge(device, every=8)
    gauge.restart(device.memory_allocated())
    gauge.delta += nbytes                  # lmsrt added a storage
    used = gauge.use(nbytes, level)        # exact near ``level``, estimated far under it
"""
from __future__ import annotations

__all__ = ["GpuGauge", "EXACT_EVERY"]

# An exact GPU-use reading costs ~10-20 us (the allocator builds a stats dict). Between readings
# the engine estimates: the last reading plus what lmsrt itself added since (saved storages,
# restored copies), never minus what it dropped (another reference may keep a dropped block
# alive), so the estimate errs high on lmsrt's part. It reads again after this many estimates, or
# as soon as the estimate comes within 1/16 of the level at hand, where decisions change. It
# cannot see the model's own allocations (activations not saved, transients), so a decision about
# a storage of _EXACT_BYTES or more, whose copy takes 100x a reading, always reads (the figures:
# docs/design.md, "Measurements behind the engine's rules"). The C++ copy path reads exactly in
# ~0.3 us and never estimates.
EXACT_EVERY = 8
_EXACT_BYTES = 64 << 20


class GpuGauge:
    """GPU use as of the last exact reading (``read``), plus what lmsrt added (+) or released
    (-) since (``delta``), read afresh after ``every`` estimates (``age``: those given since)."""

    __slots__ = ("device", "every", "read", "delta", "age")

    def __init__(self, device, every: int):
        self.device, self.every = device, every
        self.read = self.delta = 0
        self.age = every                  # the first decision reads

    def restart(self, used: int) -> None:
        """``used`` was just read exactly."""
        self.read, self.delta, self.age = used, 0, 0

    def read_now(self) -> int:
        self.read, self.delta, self.age = self.device.memory_allocated(), 0, 0
        return self.read

    def stale(self) -> None:
        """Something the gauge did not see changed use: the next decision reads afresh."""
        self.age = self.every

    def estimate(self) -> int:
        """The estimate, without a new reading."""
        return self.read + self.delta

    def use(self, nbytes: int, level: int) -> int:
        """GPU use, exact near ``level`` (the policy's level for the decision at hand) or for a
        decision about ``nbytes`` >= _EXACT_BYTES, estimated otherwise (see EXACT_EVERY). At a
        level of 0 any use is over it, so no reading is needed."""
        estimate = self.read + self.delta
        if level == 0 or (self.age < self.every and nbytes < _EXACT_BYTES
                          and estimate < level - (level >> 4)):
            self.age += 1
            return estimate
        self.read, self.delta, self.age = self.device.memory_allocated(), 0, 0
        return self.read
