"""Which StepStats fields add up over steps is marked on the field (``stats.SUMMED``), and
``RunStats`` sums exactly those."""
import dataclasses

from lmsrt.stats import SUMMED, RunStats, StepStats

# Fields that are not counts of a step: its number and mode, peaks and levels (the run keeps the
# highest peak instead), figures read at its end, and what the policy said.
NOT_SUMMED = {"step", "mode", "plan_target_bytes", "gpu_peak_bytes", "forward_end_bytes",
              "host_pinned_bytes", "host_peak_bytes", "host_pins_in_flight", "bound_bytes",
              "headroom_bytes", "predicted_peak_bytes", "policy_note", "optimizer_host_bytes"}


def test_every_field_is_marked_summed_or_named_here():
    """A new counter must be marked summed (or named above): else the run's totals would lose
    it without a word."""
    names = {f.name for f in dataclasses.fields(StepStats)}
    assert set(SUMMED) | NOT_SUMMED == names
    assert not set(SUMMED) & NOT_SUMMED
    assert "out_bytes" in SUMMED and "gpu_peak_bytes" not in SUMMED


def test_totals_sum_the_marked_fields_and_take_the_highest_peak():
    run = RunStats()
    for k in (1, 2):
        step = StepStats(step=k, **{name: k for name in SUMMED}, gpu_peak_bytes=10 * k)
        run.add(step)
    current = StepStats(step=3, **{name: 4 for name in SUMMED}, gpu_peak_bytes=5)
    totals = run.totals(current)
    assert {name: totals[name] for name in SUMMED} == {name: 1 + 2 + 4 for name in SUMMED}
    assert totals["steps"] == 3 and totals["gpu_peak_bytes"] == 20


def test_count_kept_counts_kept_and_live_apart():
    s = StepStats()
    s.count_kept(100)
    s.count_kept(50, tensors=2, live=True)
    assert (s.kept_bytes, s.kept_tensors, s.live_bytes, s.live_tensors) == (100, 1, 50, 2)
