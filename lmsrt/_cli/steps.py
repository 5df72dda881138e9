"""``lmsrt steps``: a run's steps one by one, from the stats file ``lmsrt run --stats`` wrote.

Where the summary gives the settled step, this shows how the run got there: which steps learnt
(``reactive``, swapping all they could) and which followed a plan, each step's time and the
CPU time of the process's threads in it, what it moved, rebuilt and recomputed and the GPU time
those reruns took, how long the GPU waited for copies, the allocator's retries, the peak, and
what the plan changed after it. With ``--plot FILE`` the same as a picture (matplotlib, where
installed): step times, learning steps marked, and the bytes moved.

Example::

    lmsrt run --stats stats.json train.py
    lmsrt steps stats.json                  # one line a step
    lmsrt steps stats.json --plot steps.png
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

import click

from ..summary import retries_a_step
from ..units import GiB, format_bytes

__all__ = ["command", "format_steps", "learning_cost", "step_rows"]

_COLUMNS = ("step", "mode", "time s", "CPU s", "out", "in", "rebuilt", "recomputed",
            "rerun ms", "waited ms", "retries", "GPU peak", "after it")


def step_rows(stats: Dict[str, object]) -> List[Dict[str, object]]:
    """One dict a finished step (``stats["history"]``, the last 200 at most), with its time
    (``step_times_s``: [i] is step i + 2; step 1 and the last step have none)."""
    times = stats.get("step_times_s") or []
    rows = []
    for s in stats.get("history") or []:
        i = s["step"] - 2
        rows.append(dict(
            step=s["step"], mode=s["mode"],
            time=times[i] if 0 <= i < len(times) else None, cpu=s.get("cpu_s"),
            out=s["out_bytes"], into=s["in_bytes"], rebuilt=s["recipe_bytes"],
            regions=s["recomputed_regions"], recomputed=s["recomputed_bytes"],
            rerun=s.get("recompute_ms", 0.0) + s.get("rebuild_ms", 0.0),
            waited=s.get("swapout_wait_ms", 0.0) + s["swapin_wait_ms"],
            retries=s["alloc_retries"], peak=s["gpu_peak_bytes"], note=s.get("policy_note", ""),
            state=s.get("optimizer_in_bytes", 0), update=s.get("optimizer_update_ms", 0.0)))
    return rows


def format_steps(stats: Dict[str, object], last: Optional[int] = None) -> str:
    """The table ``lmsrt steps`` prints: a line a step, a note where the plan changed."""
    rows = step_rows(stats)
    if last:
        rows = rows[-last:]
    if not rows:
        return "no finished step in this stats file (a run of one step, or none)"
    # The optimizer state's bytes brought in for the step (and written back after it), and the
    # GPU time of the update with its copies in, where any step moved it (movers/optimizer.py).
    state = any(r["state"] for r in rows)
    columns = list(_COLUMNS[:-2]) + ["state in", "update ms"] * state + list(_COLUMNS[-2:])
    table = [columns]
    said = None
    for r in rows:
        note = r["note"] if r["note"] != said else ""
        said = r["note"] or said
        table.append([
            str(r["step"]), r["mode"], "-" if r["time"] is None else f"{r['time']:.3f}",
            "-" if r["cpu"] is None else f"{r['cpu']:.3f}",
            format_bytes(r["out"]), format_bytes(r["into"]), format_bytes(r["rebuilt"]),
            f"{r['regions']} ({format_bytes(r['recomputed'])})" if r["regions"] else "0",
            f"{r['rerun']:.1f}", f"{r['waited']:.0f}", str(r["retries"])]
            + [format_bytes(r["state"]), f"{r['update']:.0f}"] * state
            + [format_bytes(r["peak"]), note])
    widths = [max(len(row[c]) for row in table) for c in range(len(columns) - 1)]
    lines = ["  ".join([cell.rjust(w) if c != 1 else cell.ljust(w)
                        for c, (cell, w) in enumerate(zip(row, widths))] + [row[-1]]).rstrip()
             for row in table]
    median = stats.get("step_time_median_s")
    regions = stats.get("regions") or {}
    tail = [f"settled step (median after warm-up): {median:.3f} s" if median else
            "settled step: too few steps timed"]
    retried = retries_a_step(stats)
    if retried:
        tail[0] += (f", with {retried} allocator retr{'y' if retried == 1 else 'ies'} a planned "
                    "step (scripts/alloc_trace.py shows where the allocator ran short; under "
                    "--gpu-limit, torch's cap counts a request whole where a free block lacks "
                    "part of it, so a GPU of that size may not retry there)")
    cost = learning_cost(stats)
    if cost:
        tail.append(cost)
    if regions.get("note"):
        tail.append(f"regions: {regions['note']}")
    tail.append("mode: reactive = a step that learnt (it swaps all it can), plan = one that "
                "followed the plan; CPU: seconds of the process's threads in the step (near "
                "its time, the host is the limit); rerun: GPU time of the regions recomputed "
                "and the tensors rebuilt in backward; waited: GPU time forward and backward "
                "stood still for copies; retries: the caching allocator freed its cache and "
                "tried again (a device sync each)"
                + ("; state in: optimizer state brought in for the optimizer's step, and "
                   "written back after it; update: GPU time of that step, copies in included"
                   if state else ""))
    return "\n".join(lines + [""] + tail)


def learning_cost(stats: Dict[str, object]) -> str:
    """What the steps that learnt cost beyond settled ones, and the first 30 timed steps
    against 30 settled ones (steps 2 to 31: step 1 has no time), in words; "" where too few
    steps were timed."""
    median = stats.get("step_time_median_s")
    times = stats.get("step_times_s") or []
    if not median or len(times) < 2:
        return ""
    learnt = [r for r in step_rows(stats) if r["mode"] != "plan" and r["time"] is not None]
    words = []
    if learnt:
        extra = sum(r["time"] - median for r in learnt)
        words.append(f"steps that learnt ({', '.join(str(r['step']) for r in learnt)}) cost "
                     f"{extra:+.2f} s over settled ones")
    if len(times) >= 30:
        words.append(f"steps 2-31 took {sum(times[:30]) / (30 * median):.2f}x thirty settled "
                     "steps")
    return "; ".join(words)


def plot_steps(stats: Dict[str, object], path: str) -> None:
    """Step times (learning steps marked) and the bytes moved a step, as an image at ``path``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib") from None
    rows = [r for r in step_rows(stats) if r["time"] is not None]
    if not rows:
        raise click.ClickException("no timed step to plot (step times start at step 2)")
    fig, ax = plt.subplots(figsize=(9, 4))
    steps = [r["step"] for r in rows]
    colors = ["tab:orange" if r["mode"] != "plan" else "tab:blue" for r in rows]
    ax.bar(steps, [r["time"] for r in rows], color=colors)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    moved = ax.twinx()
    moved.plot(steps, [r["out"] / GiB for r in rows], color="black", marker=".", linewidth=1)
    moved.set_ylabel("moved out a step (GiB)")
    moved.set_ylim(bottom=0)
    median = stats.get("step_time_median_s")
    if median:
        ax.axhline(median, color="gray", linestyle="--", linewidth=1)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="tab:orange", label="learning step"),
                       Patch(color="tab:blue", label="planned step"),
                       Line2D([], [], color="gray", linestyle="--", label="settled (median)"),
                       Line2D([], [], color="black", marker=".", label="moved out")],
              loc="upper right", fontsize="small")
    ax.set_title(f"lmsrt steps ({stats.get('device') or 'device'})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@click.command("steps")
@click.argument("stats_file", type=click.Path(exists=True, dir_okay=False), metavar="STATS")
@click.option("--last", type=click.IntRange(min=1), metavar="N", help="Only the last N steps.")
@click.option("--plot", "plot", metavar="FILE", help="Also draw the steps into FILE (.png, "
              ".svg, .pdf; needs matplotlib).")
def command(stats_file: str, last: Optional[int], plot: Optional[str]) -> None:
    """Show each step of a run from the stats file `lmsrt run --stats` wrote: learning or
    planned, time, bytes moved, rebuilt and recomputed, waits, retries, peak."""
    try:
        with open(stats_file) as f:
            stats = json.load(f)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot read {stats_file} as a stats file: {e}") from None
    if not isinstance(stats, dict) or "history" not in stats:
        raise click.ClickException(f"{stats_file} is not a stats file of `lmsrt run --stats` "
                                   "(no step history in it)")
    click.echo(format_steps(stats, last=last))
    if plot:
        plot_steps(stats, plot)
        click.echo(f"wrote {plot}")
