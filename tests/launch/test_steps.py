"""`lmsrt steps`: a run's steps one by one from its --stats file (lmsrt/_cli/steps.py)."""
import json

import pytest
from processes import write
from test_cli import MLP_SCRIPT, invoke

from lmsrt._cli.steps import format_steps, learning_cost, step_rows
from lmsrt.summary import retries_a_step


@pytest.fixture
def stats_file(tmp_path):
    path = tmp_path / "stats.json"
    result = invoke("run", "-q", "--lms", "1", "--lms-frac", "0", "--stats", str(path),
                    write(tmp_path / "train.py", MLP_SCRIPT), "7")
    assert result.exit_code == 0, result.output
    return path


def test_each_finished_step_is_a_line_with_its_own_figures(stats_file):
    stats = json.loads(stats_file.read_text())
    rows = step_rows(stats)
    history = stats["history"]
    assert [r["step"] for r in rows] == [s["step"] for s in history] and len(rows) >= 5
    # Step i's time is step_times_s[i - 2]; step 1 has none.
    assert rows[0]["step"] == 1 and rows[0]["time"] is None
    assert [r["time"] for r in rows[1:]] == stats["step_times_s"][:len(rows) - 1]
    assert all(r["out"] == s["out_bytes"] and r["mode"] == s["mode"]
               and r["rerun"] == s["recompute_ms"] + s["rebuild_ms"]
               and r["cpu"] == s["cpu_s"]
               for r, s in zip(rows, history))
    result = invoke("steps", str(stats_file))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:5] == ["step", "mode", "time", "s", "CPU"]
    assert all(s["cpu_s"] > 0 for s in history[1:]), history     # each step ran Python
    body = [ln.split() for ln in lines[1:1 + len(rows)]]
    assert [int(b[0]) for b in body] == [r["step"] for r in rows]
    assert [b[1] for b in body] == [r["mode"] for r in rows]
    assert "settled step" in result.output


def test_last_n_steps_and_the_changes_of_plan_said_once(stats_file):
    stats = json.loads(stats_file.read_text())
    for s in stats["history"]:
        s["policy_note"] = "learnt" if s["step"] < 3 else "offloads 2 of 8"
    text = format_steps(stats, last=4)
    body = text.split("\n\n")[0].splitlines()[1:]
    assert len(body) == 4 and body[-1].split()[0] == str(stats["history"][-1]["step"])
    assert sum("offloads 2 of 8" in line for line in body) == 1     # said where it changed


def test_optimizer_state_brought_in_is_a_column_where_it_moved(stats_file):
    stats = json.loads(stats_file.read_text())
    header = format_steps(stats).splitlines()[0]
    assert "state in" not in header                       # the MLP script's state stayed
    for s in stats["history"]:
        s["optimizer_in_bytes"] = 3 << 20 if s["step"] > 1 else 0
        s["optimizer_update_ms"] = 41.6 if s["step"] > 1 else 0.0
    text = format_steps(stats)
    lines = text.splitlines()
    assert "state in" in lines[0] and "state in: optimizer state" in text
    assert "update ms" in lines[0] and all(" 42 " in line for line in lines[2:4])
    assert "0 B" in lines[1] and all("3.00 MiB" in line for line in lines[2:len(stats["history"])])


def test_what_the_learning_steps_cost_is_said():
    history = [dict(step=i, mode="reactive" if i in (1, 2, 4) else "plan", out_bytes=0,
                    in_bytes=0, recipe_bytes=0, recomputed_regions=0, recomputed_bytes=0,
                    swapin_wait_ms=0.0, alloc_retries=0, gpu_peak_bytes=0) for i in range(1, 41)]
    times = [0.5 if i in (2, 4) else 0.2 for i in range(2, 41)]    # [i] is step i + 2
    stats = dict(history=history, step_times_s=times, step_time_median_s=0.2)
    said = learning_cost(stats)
    assert "steps that learnt (2, 4) cost +0.60 s" in said
    assert f"steps 2-31 took {(28 * 0.2 + 2 * 0.5) / 6.0:.2f}x thirty settled" in said
    assert learning_cost(dict(stats, step_times_s=times[:10])).count("x thirty") == 0
    assert learning_cost(dict(stats, step_time_median_s=None)) == ""


def test_allocator_retries_of_settled_steps_are_said_under_the_table(stats_file):
    stats = json.loads(stats_file.read_text())
    assert "allocator retr" not in format_steps(stats).split("\n\n")[1].splitlines()[0]
    for s in stats["history"]:
        s["alloc_retries"] = 1 if s["mode"] == "plan" else 0
    text = format_steps(stats)
    assert "with 1 allocator retry a planned step" in text.split("\n\n")[1].splitlines()[0]
    assert "retries: the caching allocator freed its cache" in text


def test_what_is_not_a_stats_file_is_refused_in_one_line(tmp_path):
    bad = write(tmp_path / "bad.json", "[1, 2]")
    result = invoke("steps", bad)
    assert result.exit_code == 1 and "not a stats file" in result.output
    garbage = write(tmp_path / "garbage.json", "{")
    result = invoke("steps", garbage)
    assert result.exit_code == 1 and "cannot read" in result.output
    assert invoke("steps", str(tmp_path / "none.json")).exit_code == 2


def test_plot_draws_the_steps(stats_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "steps.png"
    result = invoke("steps", str(stats_file), "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(stats_file, tmp_path, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = invoke("steps", str(stats_file), "--plot", str(tmp_path / "x.png"))
    assert result.exit_code == 1 and "pip install matplotlib" in result.output
    assert not (tmp_path / "x.png").exists()


def test_retries_a_step_are_the_median_of_the_last_ten_planned_steps():
    def history(modes_retries):
        return dict(history=[dict(step=i, mode=m, alloc_retries=r)
                             for i, (m, r) in enumerate(modes_retries, 1)])

    # learning steps retry most, and are not counted; nor planned steps before the last ten
    runs = [("reactive", 9)] * 3 + [("plan", 5)] * 6 + [("plan", 1)] * 6 + [("reactive", 7)] * 4
    assert retries_a_step(history(runs + [("plan", 0)] * 4)) == 1
    assert retries_a_step(history(runs + [("plan", 0)] * 5)) == 0      # the lower of two
    assert retries_a_step(history([("reactive", 3)] * 5)) == 0
