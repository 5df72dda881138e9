"""What ``lmsrt tune`` writes: results.json and results.csv (``RESULTS_SCHEMA``), and the plot.

Example::

    paths = write_results(sweep)           # {"json": ..., "csv": ...} in sweep.out_dir
    why_not = write_plot(sweep, png)       # None, or why no plot (no matplotlib)
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from typing import Dict, List, Optional

from ..options import format_setting
from ..units import GiB, MiB
from .output import write_atomic
from .tuning import RESULTS_SCHEMA, Sweep, Trial, compare_auto, pareto_front, recommend, run_command

__all__ = ["write_results", "write_plot"]


def _provenance() -> Dict[str, object]:
    """What ran the trials: lmsrt, torch and CUDA versions and the GPU (None without one)."""
    import torch

    from .. import __version__

    return {"lmsrt_version": __version__, "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _best_per_params(sweep: Sweep) -> List[Trial]:
    bests = (recommend([t for t in sweep.trials if t.params == p]) for p in sweep.combinations())
    return [t for t in bests if t is not None]


def write_results(sweep: Sweep, interrupted: bool = False) -> Dict[str, str]:
    """Write ``results.json`` and ``results.csv`` into ``sweep.out_dir``; return their paths."""
    front = set(pareto_front(sweep.trials))
    best = recommend(sweep.trials)

    def command(t: Optional[Trial]) -> Optional[str]:
        return run_command(t, sweep.script, sweep.gpu_limit) if t else None

    data = {
        **_provenance(), "schema": RESULTS_SCHEMA,
        "script": sweep.script, "args": sweep.args, "steps": sweep.steps,
        "gpu_limit_gib": sweep.gpu_limit, "timeout_s": sweep.timeout,
        "search": "grid" if sweep.grid else "bisect", "lms": sweep.lms_values,
        "lms_frac": sweep.fracs, "params": dict(sweep.params), "interrupted": interrupted,
        "broken": sweep.broken and dict(zip(("first_id", "second_id", "error"), sweep.broken)),
        "recommended": best and {"id": best.id, "command": command(best)},
        "best_per_params": [{"params": t.params, "id": t.id, "command": command(t)}
                            for t in _best_per_params(sweep)],
        "pareto": sorted(front),
        "auto": [compare | {"params": p} for p in sweep.combinations()
                 if (compare := compare_auto([t for t in sweep.trials if t.params == p]))],
        "trials": [dataclasses.asdict(t) | {"command": command(t)} for t in sweep.trials],
    }
    paths = {"json": os.path.join(sweep.out_dir, "results.json"),
             "csv": os.path.join(sweep.out_dir, "results.csv")}
    write_atomic(paths["json"], lambda f: json.dump(data, f, indent=1))

    names = [name for name, _ in sweep.params]

    def rows(f) -> None:
        w = csv.writer(f)
        w.writerow(["id", *names, "lms", "lms_frac", "status", "steps_per_s", "spread",
                    "step_time_s", "gpu_peak_bytes", "host_peak_bytes", "swapped_bytes", "steps",
                    "wall_s", "pareto", "recommended", "error", "command"])
        for t in sweep.trials:
            numbers = (t.steps_per_s and f"{t.steps_per_s:.4f}",
                       None if t.spread is None else f"{t.spread:.4f}",
                       t.step_time_s and f"{t.step_time_s:.5f}", t.gpu_peak_bytes,
                       t.host_peak_bytes, t.swapped_bytes, t.steps)
            w.writerow([t.id, *(t.params[n] for n in names), f"{t.lms:g}",
                        format_setting(t.lms_frac),
                        t.status, *("" if n is None else n for n in numbers), f"{t.wall_s:.1f}",
                        int(t.id in front), int(best is not None and t.id == best.id), t.error,
                        command(t)])

    write_atomic(paths["csv"], rows, newline="")
    return paths


def write_plot(sweep: Sweep, path: str) -> Optional[str]:
    """Steps/s against peak GPU memory, the Pareto front joined, the recommendation starred.

    Returns None when written, else why not (no matplotlib, or nothing timed).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed, so no plot: pip install matplotlib"
    ranked = [t for t in sweep.trials if t.ranked]
    if not ranked:
        return "no trial was timed, so no plot"
    front, best = set(pareto_front(ranked)), recommend(ranked)
    unit, scale = ("GiB", GiB) if max(t.gpu_peak_bytes for t in ranked) >= GiB else ("MiB", MiB)
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for params in sweep.combinations():
        group = [t for t in ranked if t.params == params]
        if not group:
            continue
        label = ", ".join(f"{k}={v}" for k, v in params.items()) or "trials"
        dots = ax.scatter([t.gpu_peak_bytes / scale for t in group],
                          [t.steps_per_s for t in group], label=label, zorder=3)
        edge = sorted((t for t in group if t.id in front), key=lambda t: t.gpu_peak_bytes)
        ax.plot([t.gpu_peak_bytes / scale for t in edge], [t.steps_per_s for t in edge], "--",
                marker="o", markersize=11, markerfacecolor="none",
                color=dots.get_facecolor()[0], label=f"{label}: Pareto front")
        for t in group:
            ax.annotate(f"{t.lms:g}/{format_setting(t.lms_frac)}",
                        (t.gpu_peak_bytes / scale, t.steps_per_s),
                        fontsize=7, xytext=(4, 4), textcoords="offset points")
    autos = [t for t in ranked if t.auto]
    if autos:
        ax.scatter([t.gpu_peak_bytes / scale for t in autos], [t.steps_per_s for t in autos],
                   marker="D", s=110, facecolors="none", edgecolors="tab:red",
                   label="lms_frac auto", zorder=4)
    if best is not None:
        ax.scatter([best.gpu_peak_bytes / scale], [best.steps_per_s], marker="*", s=250,
                   facecolors="none", edgecolors="black", label="recommended", zorder=4)
    ax.set_xlabel(f"peak GPU memory ({unit})")
    ax.set_ylabel("steps/s")
    ax.set_title(f"lmsrt tune: {os.path.basename(sweep.script)} (labels: lms/lms_frac)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    write_atomic(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"), binary=True)
    return None
