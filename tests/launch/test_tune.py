"""`lmsrt tune` on the CPU: the search, how trials end, the outputs, Ctrl-C and bad flags.

The search and the output writers are checked on made-up trials; the sweeps run tiny scripts
under `lmsrt run` on the simulated device (LMSRT_DEVICE=sim). The scripts read their trial's
settings from LMSRT_LMS / LMSRT_LMS_FRAC and pretend to run out of memory, crash or hang on cue;
they train forever otherwise, so every one that ends was ended by `--steps` (LMSRT_MAX_STEPS).
Each trial is a process that imports torch (about 2 s): keep the trials few.
"""
import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from processes import clean_env, write

from lmsrt._cli import main
from lmsrt.launch.tune_results import write_plot, write_results
from lmsrt.launch.tuning import (
    BISECT_FRACS,
    Sweep,
    Trial,
    best_trial,
    bisect_search,
    classify,
    compare_auto,
    grid_search,
    pareto_front,
    recommend,
    with_param,
)

# Reads its trial's settings, then does what CUE says for them; else trains until stopped.
SCRIPT = """
import os, subprocess, sys, time
import torch
lms, frac = float(os.environ["LMSRT_LMS"]), float(os.environ["LMSRT_LMS_FRAC"])
print("ARGV=" + " ".join(sys.argv[1:]), flush=True)

def hang():
    sleeper = subprocess.Popen(["sleep", "600"])       # must die with the trial
    with open(os.path.join(os.path.dirname(__file__), f"sleeper{frac:g}.pid"), "w") as f:
        f.write(str(sleeper.pid))
    time.sleep(600)

CUE

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
x = torch.randn(32, 64)
while True:
    model(x).square().mean().backward()
"""

OOM_ABOVE_0_6 = """
if frac > 0.6:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
"""

EVERY_ENDING = """
if (lms, frac) == (1, 0.5):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
if (lms, frac) == (2, 0):
    raise ValueError(f"boom at lms {lms:g}")
if (lms, frac) == (2, 0.5):
    print("step 0: CUDA out of memory, caught by the script")
    sys.exit(1)
"""

HANG_ABOVE_0 = """
if frac > 0:
    hang()
"""


def script(tmp_path, cue: str) -> str:
    return write(tmp_path / "train.py", SCRIPT.replace("CUE", cue))


def tune(*args: str):
    result = CliRunner().invoke(main, ["tune", *args], env=clean_env())
    print(result.output)   # shown when a test fails
    return result


def load(out) -> dict:
    return json.loads((out / "results.json").read_text())


def settings(data: dict) -> list:
    return [(t["lms"], t["lms_frac"], t["status"]) for t in data["trials"]]


def gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):   # killed, not yet reaped
                    return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.1)
    return False


# -- the search, on made-up trials ----------------------------------------------------------------

def drive(search, outcome) -> list:
    """Run a search against ``outcome(lms, frac) -> status``; the (lms, frac, status) it tried."""
    tried, trial = [], None
    while True:
        try:
            lms, frac = search.send(trial)
        except StopIteration:
            return tried
        trial = Trial(len(tried) + 1, lms, frac, {}, [], status=outcome(lms, frac))
        tried.append((lms, frac, trial.status))


def oom_above(limit: float):
    return lambda lms, frac: "oom" if frac != "auto" and frac > limit else "ok"


def test_bisection_finds_the_largest_frac_then_tries_every_lms_near_it():
    tried = drive(bisect_search([250, 1000, 4000], BISECT_FRACS), oom_above(0.62))
    assert tried == [(1000, 0.5, "ok"), (1000, 0.75, "oom"), (1000, 0.6, "ok"),
                     (1000, 0.65, "oom"),                       # bisected at lms 1000: 0.6
                     (250, 0.6, "ok"), (4000, 0.6, "ok"),        # the other lms at 0.6
                     (250, 0.55, "ok"), (1000, 0.55, "ok"), (4000, 0.55, "ok")]   # one step below


@pytest.mark.parametrize("limit, bisected, near", [
    (2.0, [0.5, 0.75, 0.9, 0.95, 1.0], [(1, 1.0), (1, 0.95)]),    # everything fits
    (-1.0, [0.5, 0.2, 0.05, 0.0], [(1, 0.0)]),              # nothing fits: every lms at 0
])
def test_bisection_at_the_ends(limit, bisected, near):
    tried = drive(bisect_search([1, 1000], BISECT_FRACS), oom_above(limit))
    assert [frac for _, frac, _ in tried[:len(bisected)]] == bisected
    assert {lms for lms, _, _ in tried[:len(bisected)]} == {1000}
    assert [(lms, frac) for lms, frac, _ in tried[len(bisected):]] == near


def test_bisection_of_a_given_list_and_its_first_lms():
    tried = drive(bisect_search([64, 8], [0.9, 0.0, 0.3, 0.6]), oom_above(0.4))
    assert tried == [(64, 0.3, "ok"), (64, 0.6, "oom"), (8, 0.3, "ok"),
                     (64, 0.0, "ok"), (8, 0.0, "ok")]


def test_bisection_stops_at_a_failure_that_is_not_memory():
    crash = drive(bisect_search([1000], BISECT_FRACS), lambda lms, f: "crash")
    assert crash == [(1000, 0.5, "crash")]
    tried = drive(bisect_search([1000], BISECT_FRACS),
                  lambda lms, f: "timeout" if f < 0.5 else "oom")
    assert tried == [(1000, 0.5, "oom"), (1000, 0.2, "timeout")]


def test_grid_skips_fractions_above_an_oom():
    tried = drive(grid_search([1, 2], [0.5, 0.0, 1.0]),
                  lambda lms, f: "oom" if lms * f >= 1 else "ok")
    assert tried == [(1, 0.0, "ok"), (1, 0.5, "ok"), (1, 1.0, "oom"),
                     (2, 0.0, "ok"), (2, 0.5, "oom")]


@pytest.mark.parametrize("args, name, expected", [
    (["--lr", "1"], "batch-size", ["--lr", "1", "--batch-size", "8"]),          # appended
    (["--batch-size", "3", "--lr", "1"], "batch-size", ["--batch-size", "8", "--lr", "1"]),
    (["--batch-size=3"], "--batch-size", ["--batch-size=8"]),
    (["-b", "3"], "-b", ["-b", "8"]),
    (["--batch-size-max", "3"], "batch-size", ["--batch-size-max", "3", "--batch-size", "8"]),
])
def test_param_substitution(args, name, expected):
    assert with_param(args, name, "8") == expected


SUMMARY = ("lmsrt: 3 steps (3 optimizer steps), 0.100 s a step settled; GPU peak 1.00 GiB; a "
           "step swapped 1.00 GiB out, rebuilt 0 B, recomputed 0 B; lmsrt changed nothing\n")


@pytest.mark.parametrize("code, out, err, expected", [
    (0, "", SUMMARY, ("ok", "")),
    (1, "", "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB\n" + SUMMARY,
     ("oom", "torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB")),
    (1, "step 3: out of GPU memory. Enable LMS\n", "",
     ("oom", "step 3: out of GPU memory. Enable LMS")),
    (1, "", "Traceback ...\n  raise ValueError('boom')\nValueError: boom\n" + SUMMARY,
     ("crash", "ValueError: boom")),
    (2, "", "usage: train.py [-h]\ntrain.py: error: unrecognized arguments: --bs 4\n" + SUMMARY,
     ("crash", "train.py: error: unrecognized arguments: --bs 4")),
    (-9, "", "", ("crash", "killed by SIGKILL")),
    (3, "", "", ("crash", "exit status 3")),
])
def test_classify(code, out, err, expected):
    assert classify(code, out, err) == expected


def timed(id: int, speed: float, peak: int, **params) -> Trial:
    return Trial(id, 1000, 0.5, params, [], steps_per_s=speed, step_time_s=1 / speed,
                 gpu_peak_bytes=peak, host_peak_bytes=0, swapped_bytes=0, steps=8)


def test_pareto_front_and_recommendation():
    trials = [timed(1, 10.0, 8 << 30), timed(2, 9.95, 6 << 30), timed(3, 5.0, 4 << 30),
              timed(4, 4.0, 5 << 30), Trial(5, 1000, 1.0, {}, [], status="oom"),
              timed(6, 20.0, 1 << 30, bs="2")]
    assert pareto_front(trials) == [1, 2, 3, 6]    # 4 is slower and larger than 3; 6 is its own
    assert best_trial(trials[:5]).id == 2          # within 1% of the fastest, with less memory
    assert best_trial(trials[:2] + [timed(7, 11.0, 9 << 30)]).id == 7
    assert best_trial([trials[4]]) is None


def test_auto_runs_first_at_every_lms_and_does_not_steer_the_bisection():
    without = drive(bisect_search([250, 1000], BISECT_FRACS), oom_above(0.62))
    tried = drive(bisect_search([250, 1000], ["auto", *BISECT_FRACS]),
                  lambda lms, frac: "crash" if frac == "auto" else oom_above(0.62)(lms, frac))
    assert tried == [(1000, "auto", "crash"), (250, "auto", "crash"), *without]
    assert drive(bisect_search([1, 2], ["auto"]), oom_above(0)) == [(1, "auto", "ok"),
                                                                    (2, "auto", "ok")]


def test_grid_runs_auto_first_at_each_lms():
    tried = drive(grid_search([1, 2], [0.5, "auto", 0.0]), oom_above(0.2))
    assert tried == [(1, "auto", "ok"), (1, 0.0, "ok"), (1, 0.5, "oom"),
                     (2, "auto", "ok"), (2, 0.0, "ok"), (2, 0.5, "oom")]


def auto_trial(id: int, speed, **kwargs) -> Trial:
    trial = timed(id, speed, 4 << 30) if speed else Trial(id, 1000, "auto", {}, [], **kwargs)
    trial.lms_frac = "auto"
    return trial


@pytest.mark.parametrize("trials, summary, beats", [
    ([auto_trial(1, 3.0), timed(2, 3.12, 6 << 30), timed(3, 2.0, 2 << 30)],
     "auto: 3.000 steps/s (lms 1000); the fastest fixed setting (lms 1000, lms_frac 0.5) is 4% "
     "faster", True),
    ([auto_trial(1, 3.0), timed(2, 2.4, 6 << 30)],
     "auto: 3.000 steps/s (lms 1000); no fixed setting beats auto (the fastest fixed setting, "
     "lms 1000, lms_frac 0.5, is 20% slower)", False),
    ([auto_trial(1, 3.0), timed(2, 3.02, 6 << 30)], "is within 1%, timing noise)", False),
    ([auto_trial(1, 3.0), Trial(2, 1000, 0.5, {}, [], status="oom")],
     "auto: 3.000 steps/s (lms 1000); no fixed setting ran to a step time", False),
    ([auto_trial(1, 3.0)], "auto: 3.000 steps/s (lms 1000); no fixed setting was tried", False),
    ([auto_trial(1, None, status="crash", error="ValueError: no"), timed(2, 2.5, 6 << 30)],
     "auto did not run to a step time (crash: ValueError: no); the fastest fixed setting "
     "(lms 1000, lms_frac 0.5) ran 2.500 steps/s", False),
])
def test_compare_auto(trials, summary, beats):
    compare = compare_auto(trials)
    assert summary in compare["summary"] and compare["fixed_beats_auto"] == beats
    assert compare_auto(trials[1:]) is None                  # no auto trial, nothing to say


def fake_trials(monkeypatch, speeds):
    """Trials that do not run: ``speeds[(lms, frac)]`` steps/s, or their status."""
    def run_trial(sweep, trial, tick, steps):
        outcome = speeds[(trial.lms, trial.lms_frac)]
        if isinstance(outcome, str):
            trial.status, trial.error = outcome, f"{outcome} at {trial.lms_frac}"
            return
        trial.steps, trial.steps_per_s, trial.step_time_s = sweep.steps, outcome, 1 / outcome
        trial.gpu_peak_bytes, trial.host_peak_bytes, trial.swapped_bytes = 5 << 30, 1 << 30, 0

    monkeypatch.setattr(Sweep, "_run_trial", run_trial)


def test_tune_starts_from_auto_and_says_whether_a_fixed_setting_beats_it(tmp_path, monkeypatch):
    fake_trials(monkeypatch, {(1000, "auto"): 3.0, (1000, 0.0): 2.0, (1000, 0.5): 3.3,
                              (1000, 1.0): "oom"})
    out = tmp_path / "out"
    result = tune("--lms", "1000", "--lms-frac", "auto,0,0.5,1", "--out", str(out),
                  script(tmp_path, ""))
    assert result.exit_code == 0
    assert ("auto: 3.000 steps/s (lms 1000); the fastest fixed setting (lms 1000, lms_frac 0.5) "
            "is 10% faster") in result.output
    assert "lmsrt tune: auto at lms 1000, then bisecting lms_frac 0,0.5,1" in result.output
    assert "trial 1 of ~3: lms=1000 lms_frac=auto" in result.output
    data = load(out)
    assert settings(data)[0] == (1000, "auto", "ok") and data["lms_frac"][0] == "auto"
    assert data["auto"][0]["fixed_beats_auto"] and data["auto"][0]["auto_id"] == 1
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert rows[0]["lms_frac"] == "auto" and "--lms-frac auto" in rows[0]["command"]
    table = [line.split() for line in result.output.splitlines() if line.strip().startswith("1 ")]
    assert table and table[0][2] == "auto"


def test_tune_by_default_runs_auto_then_bisects(tmp_path, monkeypatch):
    speeds = {(lms, frac): 2.0 for lms in (1000, 4000) for frac in BISECT_FRACS}
    speeds[(1000, "auto")] = speeds[(4000, "auto")] = 2.5
    fake_trials(monkeypatch, speeds)
    result = tune("--lms", "1000,4000", "--out", str(tmp_path / "out"), script(tmp_path, ""))
    assert result.exit_code == 0
    tried = settings(load(tmp_path / "out"))
    assert tried[:3] == [(1000, "auto", "ok"), (4000, "auto", "ok"), (1000, 0.5, "ok")]
    assert "no fixed setting beats auto (the fastest fixed setting, lms 1000, lms_frac 0.5, is " \
           "20% slower)" in result.output
    assert "--lms-frac auto" in result.output.splitlines()[-1]       # recommended


def test_auto_summary_for_each_param(tmp_path, monkeypatch):
    fake_trials(monkeypatch, {(1, "auto"): 2.0, (1, 0.5): 1.0})
    result = tune("--lms", "1", "--lms-frac", "auto,0.5", "--param", "bs=2,4",
                  "--out", str(tmp_path / "out"), script(tmp_path, ""))
    assert result.exit_code == 0
    assert "auto against the fastest fixed setting, for each bs:" in result.output
    assert "  bs=4: auto: 2.000 steps/s (lms 1)" in result.output


def test_outputs_of_made_up_trials(tmp_path, monkeypatch):
    sweep = Sweep("train.py", ["--bs", "2"], lms_values=[1000], out_dir=str(tmp_path),
                  params=[("bs", ["2"])], gpu_limit=6)
    sweep.trials = [timed(1, 10.0, 8 << 30, bs="2"), timed(2, 5.0, 4 << 30, bs="2"),
                    Trial(3, 1000, 1.0, {"bs": "2"}, ["--bs", "2"], status="oom", error="OOM")]
    for t in sweep.trials:
        t.args = ["--bs", "2"]
    paths = write_results(sweep)
    data = json.loads(open(paths["json"]).read())
    assert data["recommended"] == {
        "id": 1, "command": "lmsrt run --lms 1000 --lms-frac 0.5 --gpu-limit 6 train.py --bs 2"}
    assert data["pareto"] == [1, 2] and len(data["trials"]) == 3 and not data["interrupted"]
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [r["status"] for r in rows] == ["ok", "ok", "oom"] and rows[0]["bs"] == "2"
    assert rows[0]["gpu_peak_bytes"] == str(8 << 30) and rows[2]["steps_per_s"] == ""
    assert [r["recommended"] for r in rows] == ["1", "0", "0"]

    png = tmp_path / "tune.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert "pip install matplotlib" in write_plot(sweep, str(png))
    else:
        assert write_plot(sweep, str(png)) is None and png.read_bytes()[:4] == b"\x89PNG"
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)        # as if not installed
    png.unlink(missing_ok=True)
    assert "pip install matplotlib" in write_plot(sweep, str(png)) and not png.exists()


# -- sweeps of real trials ------------------------------------------------------------------------

def test_bisection_sweep_end_to_end(tmp_path):
    train, out = script(tmp_path, OOM_ABOVE_0_6), tmp_path / "out"
    result = tune("--lms", "1,4", "--lms-frac", "0,0.25,0.5,0.75,1", "--steps", "6",
                  "--out", str(out), "--", train, "--epochs", "1")
    assert result.exit_code == 0
    data = load(out)
    searched = [t for t in data["trials"] if t["repeat_of"] is None]   # not the longer repeats
    assert [(t["lms"], t["lms_frac"], t["status"]) for t in searched] == [
        (1, 0.5, "ok"), (1, 0.75, "oom"), (4, 0.5, "ok"), (1, 0.25, "ok"), (4, 0.25, "ok")]
    ok = [t for t in searched if t["status"] == "ok"]
    assert all(t["steps"] == 6 and t["steps_per_s"] > 0 and t["gpu_peak_bytes"] > 0
               and t["swapped_bytes"] is not None and t["host_peak_bytes"] is not None for t in ok)
    oom = data["trials"][1]
    assert "OutOfMemoryError" in oom["error"] and oom["steps_per_s"] is None
    if data["recommended"] is None:   # the simulated device: often all alike, within noise
        assert "No setting is measurably faster" in result.output
    else:
        best = next(t for t in ok if t["id"] == data["recommended"]["id"])
        command = data["recommended"]["command"]
        assert command == (f"lmsrt run --lms {best['lms']:g} --lms-frac {best['lms_frac']:g} "
                           f"{train} --epochs 1")
        assert result.output.rstrip().endswith(command)             # the last line printed
    assert "trial 5 of ~5, about " in result.output           # progress, then the table
    assert len(list(csv.DictReader(open(out / "results.csv")))) == len(data["trials"])
    assert (out / "tune.png").exists() or "pip install matplotlib" in result.output
    # The trial's logs: what the script printed, and the stats of lmsrt run.
    assert (out / "trials" / "001.out").read_text().startswith("ARGV=--epochs 1")
    assert json.loads((out / "trials" / "001.stats.json").read_text())["total"]["steps"] == 6


def test_every_way_a_trial_ends(tmp_path):
    out = tmp_path / "out"
    result = tune("--grid", "--lms", "1,2", "--lms-frac", "0,0.5", "--steps", "6",
                  "--timeout", "60", "--out", str(out), script(tmp_path, EVERY_ENDING))
    assert result.exit_code == 0
    trials = load(out)["trials"]
    assert [(t["lms"], t["lms_frac"], t["status"]) for t in trials] == [
        (1, 0, "ok"), (1, 0.5, "oom"), (2, 0, "crash"), (2, 0.5, "oom")]
    assert trials[0]["steps"] == 6 and trials[0]["error"] == ""
    assert trials[1]["error"].startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert trials[2]["error"] == "ValueError: boom at lms 2" and trials[2]["returncode"] == 1
    assert trials[3]["error"] == "step 0: CUDA out of memory, caught by the script"


def test_timeout_kills_the_trial_and_what_it_started(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    # 6 s: the trial imports torch (2 s or more on a loaded 2-core machine) before it hangs.
    result = tune("--grid", "--lms", "1", "--lms-frac", "0.5", "--timeout", "6",
                  "--out", str(out), script(tmp_path, HANG_ABOVE_0))
    assert result.exit_code == 1                               # no trial ran to a step time
    assert "No trial was timed" in result.output and "memory" not in result.output
    [trial] = load(out)["trials"]
    assert trial["status"] == "timeout" and "--timeout 6 s" in trial["error"]
    assert 6 <= trial["wall_s"] < 16 and time.monotonic() - start < 40
    assert gone(int((tmp_path / "sleeper0.5.pid").read_text()))


def test_param_sweep_substitutes_the_scripts_flag(tmp_path):
    out = tmp_path / "out"
    result = tune("--grid", "--lms", "1", "--lms-frac", "0", "--steps", "6", "--param",
                  "batch-size=2,4", "--out", str(out), "--",
                  script(tmp_path, ""), "--batch-size", "9", "--lr", "1")
    assert result.exit_code == 0
    data = load(out)
    assert [t["params"] for t in data["trials"]] == [{"batch-size": "2"}, {"batch-size": "4"}]
    for i, size in ((1, 2), (2, 4)):
        argv = (out / "trials" / f"00{i}.out").read_text().splitlines()[0]
        assert argv == f"ARGV=--batch-size {size} --lr 1"
    assert [b["params"] for b in data["best_per_params"]] == [{"batch-size": "2"},
                                                              {"batch-size": "4"}]
    assert "batch-size=4: " in result.output and "--batch-size 4 --lr 1" in result.output


def test_ctrl_c_keeps_the_finished_trials(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmsrt", "tune", "--grid", "--lms", "1", "--lms-frac", "0,0.5,1",
         "--steps", "6", "--out", str(out), script(tmp_path, HANG_ABOVE_0)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    pid_file = tmp_path / "sleeper0.5.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)                       # trial 1 is done and trial 2 hangs
    assert (out / "results.json").exists() and len(load(out)["trials"]) == 1
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    print(stdout, stderr)
    assert proc.returncode == 130
    data = load(out)
    assert data["interrupted"] and settings(data) == [(1, 0, "ok")]
    assert "interrupted; keeping the 1 finished trials" in stderr
    assert "lmsrt run --lms 1 --lms-frac 0 " in stdout                 # the recommendation
    assert gone(int(pid_file.read_text()))


# -- bad flags: exit status 2 before any trial ----------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--lms", "1000,abc"], "'abc' is not a number"),
    (["--lms", "0"], "0 is not in (0, 9.0072e+15]"),
    (["--lms", "1,,2"], "has an empty item"),
    (["--lms", "1000,inf"], "inf is not a finite number"),
    (["--lms", "nan"], "nan is not a finite number"),
    (["--lms", "1,1e308"], "1e308 is not in (0, 9.0072e+15]"),    # each trial's lmsrt run exit 2
    (["--lms-frac", "0,1.5"], "1.5 is not in [0, 1]"),
    (["--lms-frac", "-0.5"], "-0.5 is not in [0, 1]"),
    (["--lms-frac", "0,nan"], "nan is not a finite number"),
    (["--lms-frac", "inf"], "inf is not a finite number"),
    (["--lms-frac", "lots"], "'lots' is not a number or auto"),
    (["--lms-frac", "auto,Auto"], "'Auto' is not a number or auto"),
    (["--param", "batch-size"], "is not NAME=V1,V2"),
    (["--param", "batch-size="], "is not NAME=V1,V2"),
    (["--param", "=8"], "is not NAME=V1,V2"),
    (["--param", "bs=1", "--param", "bs=2"], "names a flag twice"),
    (["--steps", "0"], "0 is not in the range"),
    (["--steps", "2.5"], "'2.5' is not a valid integer"),
    (["--timeout", "0"], "is not > 0"),
    (["--timeout", "nan"], "nan is not a finite number"),
    (["--gpu-limit", "-1"], "is not > 0"),
    (["--gpu-limit", "inf"], "inf is not a finite number"),
])
def test_bad_flags_exit_2(tmp_path, args, message):
    out = tmp_path / "out"
    result = tune(*args, "--out", str(out), script(tmp_path, ""))
    assert result.exit_code == 2 and message in result.output
    assert not out.exists()


@pytest.mark.parametrize("what, message", [
    ("/dev/null", "/dev/null is a character device, not a directory"),
    ("a file", "out is a file, not a directory; give a directory, or a path where one can be"),
    ("under a file", "file is a file, not a directory"),
    ("fifo results", "results.json is a FIFO, not a regular file; lmsrt writes only regular "
                     "files, replacing them whole. Move it away, or give another --out"),
    ("symlink plot", "tune.png is a symlink; lmsrt does not write through links"),
    ("file trials", "trials is a file, not a directory"),
])
def test_out_that_cannot_take_the_results_exits_2_before_any_trial(tmp_path, what, message):
    out = tmp_path / "out"
    if what == "/dev/null":
        out = "/dev/null"
    elif what == "a file":
        out.write_text("keep")
    elif what == "under a file":
        (tmp_path / "file").write_text("keep")
        out = tmp_path / "file" / "out"
    else:
        out.mkdir()
        if what == "fifo results":
            os.mkfifo(out / "results.json")
        elif what == "symlink plot":
            (out / "tune.png").symlink_to(tmp_path / "elsewhere.png")
        else:
            (out / "trials").write_text("keep")
    result = tune("--timeout", "5", "--out", str(out), script(tmp_path, ""))
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--out'" in result.output and message in result.output
    assert "trial 1" not in result.output


@pytest.mark.parametrize("args, message", [
    ([], "no script given"),
    (["missing.py"], "script 'missing.py' does not exist"),
])
def test_missing_script_exits_2(args, message):
    result = tune(*args)
    assert result.exit_code == 2 and message in result.output


# -- LMSRT_MAX_STEPS in lmsrt run -----------------------------------------------------------------

def test_max_steps_ends_a_script_after_n_steps(tmp_path):
    stats = tmp_path / "stats.json"
    result = CliRunner().invoke(main, ["run", "--lms", "1", "--lms-frac", "0", "--stats",
                                       str(stats), script(tmp_path, "")],
                                env=clean_env(LMSRT_LMS="1", LMSRT_LMS_FRAC="0",
                                              LMSRT_MAX_STEPS="5"))
    assert result.exit_code == 0, result.output
    data = json.loads(stats.read_text())
    assert data["total"]["steps"] == 5 and len(data["step_times_s"]) == 4
    assert data["last_step"]["out_bytes"] > 0


def test_bad_max_steps_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["run", script(tmp_path, "")],
                                env=clean_env(LMSRT_MAX_STEPS="many"))
    assert result.exit_code == 2 and "LMSRT_MAX_STEPS='many' is not a number of steps" in \
        result.output


# -- from any folder, with progress, one conclusion --------------------------------------------

def test_recommends_auto_where_no_fixed_setting_beats_it():
    # The fixed setting is within 1% of auto with less GPU memory; it does not beat auto, so
    # recommending it would contradict "no fixed setting beats auto".
    trials = [auto_trial(1, 3.0), timed(2, 3.02, 2 << 30), timed(3, 2.0, 8 << 30)]
    assert not compare_auto(trials)["fixed_beats_auto"]
    assert recommend(trials).id == 1
    beaten = [auto_trial(1, 3.0), timed(2, 3.3, 2 << 30)]
    assert compare_auto(beaten)["fixed_beats_auto"] and recommend(beaten).id == 2


def test_tune_runs_from_a_folder_that_holds_another_lmsrt(tmp_path, monkeypatch):
    # A clone, or any folder named lmsrt, in the working directory: the trials must still run
    # the lmsrt that tune is, not import that folder (`python -m lmsrt` would).
    write(tmp_path / "lmsrt" / "__init__.py", "raise ImportError('the folder lmsrt/')\n")
    write(tmp_path / "lmsrt" / "__main__.py", "raise SystemExit('the folder lmsrt/')\n")
    script(tmp_path, "")
    monkeypatch.chdir(tmp_path)
    result = tune("--grid", "--lms", "1", "--lms-frac", "0,0.5", "--steps", "6", "--out", "out",
                  "train.py")
    assert result.exit_code == 0, result.output
    trials = load(tmp_path / "out")["trials"]
    # (Two trials within each other's spread, on a loaded machine, run again: not searched.)
    assert [t["status"] for t in trials if t["repeat_of"] is None] == ["ok", "ok"], trials
    assert all(t["status"] == "ok" for t in trials), trials
    assert "trial 1 of ~2: lms=1 lms_frac=0" in result.output            # the progress line
    assert "trial 2 of ~2, about " in result.output and " s left: " in result.output
