"""`lmsrt tune` says only what its trials measured: a broken script is broken, differences within
the trials' spread are noise, a trial with too few timed steps is not compared.
"""
import json

import torch
from processes import write
from test_tune import load, script, settings, tune

from lmsrt import __version__
from lmsrt.launch.tune_results import write_results
from lmsrt.launch.tuning import (
    MIN_STEPS,
    Sweep,
    Trial,
    compare_auto,
    faster,
    recommend,
)


def trial(id, frac, times, peak=4 << 30) -> Trial:
    t = Trial(id, 1000, frac, {}, [], gpu_peak_bytes=peak, host_peak_bytes=0, swapped_bytes=0,
              steps=8)
    t.set_times(times)
    return t


# Step times of 0.25-0.45 s and 0.20-0.40 s: 20% apart by median, each within the other's spread.
WIDE_AUTO = [0.25, 0.3, 0.35, 0.4, 0.45]
WIDE_FIXED = [0.2, 0.25, 0.3, 0.35, 0.4]


def test_a_difference_within_the_spread_is_no_recommendation():
    auto, fixed = trial(1, "auto", WIDE_AUTO), trial(2, 0.5, WIDE_FIXED, peak=2 << 30)
    assert fixed.steps_per_s / auto.steps_per_s > 1.15 and not faster(fixed, auto)
    assert recommend([auto, fixed]) is None
    compare = compare_auto([auto, fixed])
    assert not compare["fixed_beats_auto"]
    assert "no fixed setting is measurably faster" in compare["summary"]
    assert "±" in compare["summary"]
    tight = trial(3, 0.5, [0.2, 0.201, 0.202, 0.2, 0.201])
    steady = trial(4, "auto", [0.3, 0.301, 0.3, 0.302, 0.3])
    assert faster(tight, steady) and recommend([steady, tight]) is tight
    assert compare_auto([steady, tight])["fixed_beats_auto"]


def fake_timed(monkeypatch, times):
    """Trials that do not run: ``times[(lms_frac, steps)]`` are their step times after warm-up."""
    ran = []

    def run_trial(sweep, trial, tick, steps):
        ran.append((trial.lms_frac, steps, trial.repeat_of))
        trial.steps_asked, trial.steps = steps, steps
        trial.gpu_peak_bytes, trial.host_peak_bytes, trial.swapped_bytes = 4 << 30, 0, 0
        trial.set_times(times[(trial.lms_frac, steps)])

    monkeypatch.setattr(Sweep, "_run_trial", run_trial)
    return ran


def test_tune_widens_the_window_until_the_difference_is_measured(tmp_path, monkeypatch):
    ran = fake_timed(monkeypatch, {("auto", 8): WIDE_AUTO, (0.5, 8): WIDE_FIXED,
                                   ("auto", 16): [0.3] * 10, (0.5, 16): [0.2] * 10})
    out = tmp_path / "out"
    result = tune("--grid", "--lms", "1000", "--lms-frac", "auto,0.5", "--out", str(out),
                  script(tmp_path, ""))
    assert result.exit_code == 0
    assert ran == [("auto", 8, None), (0.5, 8, None), (0.5, 16, 2), ("auto", 16, 1)]
    data = load(out)
    assert data["recommended"]["id"] == 2 and data["auto"][0]["fixed_beats_auto"]
    assert len(data["trials"][1]["step_times_s"]) == 15      # its own and its repeat's
    assert "repeat of trial 2 with 16 steps" in result.output
    assert "spread" in result.output and "Recommended (trial 2" in result.output


def test_tune_recommends_nothing_when_the_repeats_stay_within_noise(tmp_path, monkeypatch):
    times = {(frac, steps): (WIDE_AUTO if frac == "auto" else WIDE_FIXED) * (steps // 8)
             for frac in ("auto", 0.5) for steps in (8, 16, 32)}
    ran = fake_timed(monkeypatch, times)
    out = tmp_path / "out"
    result = tune("--grid", "--lms", "1000", "--lms-frac", "auto,0.5", "--out", str(out),
                  script(tmp_path, ""))
    assert result.exit_code == 0
    assert [steps for _, steps, _ in ran] == [8, 8, 16, 16, 32, 32]      # two rounds, then stop
    assert "No setting is measurably faster" in result.output
    assert "Recommended" not in result.output and load(out)["recommended"] is None
    assert "no fixed setting is measurably faster" in result.output


# -- real trials -------------------------------------------------------------------------------

def test_the_same_crash_twice_stops_tune_and_blames_the_script(tmp_path):
    out = tmp_path / "out"
    result = tune("--out", str(out), write(tmp_path / "crash.py", "raise ValueError('boom')\n"))
    assert result.exit_code == 1
    assert settings(load(out)) == [(1000, "auto", "crash"), (250, "auto", "crash")]
    assert "the script is broken" in result.output and "memory" not in result.output.split(
        "crashed the same way")[1].replace("not short of memory", "")
    assert load(out)["broken"] == {"first_id": 1, "second_id": 2, "error": "ValueError: boom"}


SHORT = """
import sys, torch
model = torch.nn.Linear(64, 64)
for _ in range(4):
    model(torch.randn(32, 64)).square().mean().backward()
sys.exit(0)
"""


def test_a_script_shorter_than_steps_gets_no_recommendation(tmp_path):
    out = tmp_path / "out"
    result = tune("--grid", "--lms", "1", "--lms-frac", "0", "--out", str(out),
                  write(tmp_path / "short.py", SHORT))
    assert result.exit_code == 1
    t = load(out)["trials"][0]
    assert t["status"] == "ok" and t["steps"] == 4 and t["steps_per_s"] is None
    assert "too few to compare" in t["error"] and "more than 8 steps" in t["error"]
    assert "Recommended" not in result.output and "No trial was timed" in result.output
    assert "memory" not in result.output.split("No trial was timed")[1]


def test_too_few_steps_are_warned_of_before_any_trial(tmp_path):
    result = tune("--steps", "3", "--lms", "1", "--lms-frac", "0", "--grid",
                  "--out", str(tmp_path / "out"), script(tmp_path, ""))
    assert f"give --steps {MIN_STEPS} or more" in result.output


def test_results_carry_version_schema_and_what_ran_them(tmp_path):
    sweep = Sweep("train.py", [], lms_values=[1000], out_dir=str(tmp_path))
    sweep.trials = [trial(1, 0.5, WIDE_FIXED)]
    data = json.loads(open(write_results(sweep)["json"]).read())
    assert data["lmsrt_version"] == __version__ and isinstance(data["schema"], int)
    assert data["torch"] == torch.__version__ and data["cuda"] == torch.version.cuda
    assert data["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
