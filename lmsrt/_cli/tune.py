"""``lmsrt tune``: find the ``--lms``/``--lms-frac`` settings that train a script fastest.

IBM's LMS tuning guide said: start at ``-lms 1000 -lms_frac 0.0``, raise ``-lms`` as far as it
goes, then raise ``-lms_frac`` step by step until memory runs out. This does it for the user,
starting from ``--lms-frac auto`` (the engine finds the fraction) and saying whether any fixed
fraction beats it: each trial is the unmodified script under ``lmsrt run`` in a fresh process,
stopped after ``--steps`` steps; the search and the trials live in ``lmsrt.launch.tuning`` (see
NOTE [ Tuning search ] there). This module parses the options, shows the trials as they go and
writes what they found.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import statistics
import sys
from typing import List, Optional, Sequence, Tuple

import click

from ..launch.script import check_script
from ..launch.tune_results import write_plot, write_results
from ..launch.tuning import (
    BISECT_FRACS,
    GRID_FRACS,
    MIN_STEPS,
    MIN_TIMED,
    WIDEN_ROUNDS,
    Sweep,
    Trial,
    check_out_dir,
    compare_auto,
    pareto_front,
    recommend,
    reference_lms,
    run_command,
    spread_text,
)
from ..options import AUTO, OPTIONS, format_setting, setting_range
from ..units import format_bytes
from ._types import Number

__all__ = ["command"]


class _NumberList(click.ParamType):
    """Comma-separated numbers (or the item's words), each checked as ``item`` checks one;
    repeats dropped."""

    name = "list"

    def __init__(self, item: Number):
        self.item = item

    def convert(self, value, param, ctx) -> Tuple[object, ...]:
        if not isinstance(value, str):
            return value
        items = [v.strip() for v in value.split(",")]
        if not all(items):
            self.fail(f"{value!r} has an empty item; give numbers separated by commas, "
                      f"{self.item.example}", param, ctx)
        return tuple(dict.fromkeys(self.item.convert(v, param, ctx) for v in items))


class _ParamValues(click.ParamType):
    """``NAME=V1,V2,...``: a flag of the script and the values to sweep it over."""

    name = "NAME=V1,V2"

    def convert(self, value, param, ctx) -> Tuple[str, Tuple[str, ...]]:
        if not isinstance(value, str):
            return value
        match = re.fullmatch(r"(-{0,2}[A-Za-z0-9][\w.-]*)=(.*)", value.strip())
        values = [v.strip() for v in match.group(2).split(",")] if match else []
        if not values or not all(values):
            self.fail(f"{value!r} is not NAME=V1,V2,...; give a flag of the script and its "
                      "values, e.g. --param batch-size=8,16,32", param, ctx)
        return match.group(1), tuple(dict.fromkeys(values))


_LMS_FLAG, _FRAC_FLAG = OPTIONS["lms"].flag, OPTIONS["lms_frac"].flag
_LMS = Number(0.0, setting_range("lms")[1], low_open=True,
              example=f"give KiB > 0, e.g. {_LMS_FLAG} 250,1000,4000")
_FRAC = Number(*setting_range("lms_frac"), words=OPTIONS["lms_frac"].words,
               example=f"give fractions of GPU memory or auto, e.g. {_FRAC_FLAG} auto,0,0.5,0.9")


@click.command("tune", context_settings=dict(allow_interspersed_args=False))
@click.option(_LMS_FLAG, "lms_values", type=_NumberList(_LMS), default="250,500,1000,4000",
              show_default=True, metavar="KIB,...", help=f"The {_LMS_FLAG} values to try.")
@click.option(_FRAC_FLAG, "fracs", type=_NumberList(_FRAC), default=None,
              show_default="auto, then 0, 0.05, ..., 1", metavar="auto,F,...",
              help=f"The {_FRAC_FLAG} values. Order of trials: auto (the engine finds the "
              "fraction) at every --lms first; then the largest fraction that fits is bisected "
              "at --lms 1000 (or the first --lms), and every --lms runs at it and at the one "
              "below; then two trials within each other's spread run again with twice the "
              "steps. With --grid: at each --lms, auto and then every fraction (0, 0.1, ..., 1 "
              "by default), lowest first. The summary says whether any fraction beats auto.")
@click.option("--param", "params", type=_ParamValues(), multiple=True, metavar="NAME=V1,V2",
              help="Also sweep a flag of the script, e.g. batch-size=8,16 (repeatable): each "
              "trial's script gets --NAME V, replacing the value in its arguments if there.")
@click.option("--steps", type=click.IntRange(min=1), default=8, show_default=True, metavar="N",
              help=f"Steps per trial; the step time is the median after 2 warm-up steps, its "
              f"spread their interquartile range. Needs {MIN_STEPS} or more to time a trial.")
@click.option("--gpu-limit", type=Number(0.0, low_open=True, example="give GiB, e.g. "
                                          "--gpu-limit 12"),
              metavar="GIB", help="Cap each trial's GPU memory, as a smaller GPU would.")
@click.option("--timeout", type=Number(0.0, low_open=True, example="give seconds, e.g. "
                                        "--timeout 600"),
              default="600", show_default=True, metavar="S", help="Seconds before a trial is "
              "killed (with every process it started).")
@click.option("--out", "out_dir", type=click.Path(), default="lmsrt-tune",
              show_default=True, metavar="DIR", help="Where results.csv, results.json, tune.png "
              "and the trials' logs (trials/) go; checked before the first trial.")
@click.option("--grid", is_flag=True, help="Run every --lms x --lms-frac pair instead of the "
              "bisection.")
@click.argument("target_and_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
def command(lms_values: Tuple[float, ...], fracs: Optional[Tuple[object, ...]],
            params: Sequence[Tuple[str, Tuple[str, ...]]], steps: int, gpu_limit: Optional[float],
            timeout: float, out_dir: str, grid: bool, target_and_args: Sequence[str]) -> None:
    """Find the LMS settings that train SCRIPT fastest, one lmsrt run per trial.

    Options go before SCRIPT (or before --); everything after it is the script's own. Each
    trial stops after --steps steps. At the end: a table, results.csv, results.json, a plot of
    speed against GPU memory, whether a fixed --lms-frac beats auto, and the lmsrt run command
    to use, or that no setting is measurably faster (differences within the trials' spread).
    The same crash in two trials stops it: the script is broken.

    \b
    Examples:
      lmsrt tune -- train.py --epochs 1
      lmsrt tune --gpu-limit 12 --param batch-size=8,16,32 -- train.py
      lmsrt tune --grid --lms 1000,4000 --lms-frac auto,0,0.4,0.8 --steps 12 train.py
    """
    if not target_and_args:
        raise click.UsageError("no script given; name it after the options, e.g. "
                               "lmsrt tune --gpu-limit 12 -- train.py --batch-size 8")
    script, args = target_and_args[0], list(target_and_args[1:])
    try:
        check_script(script, "lmsrt tune -- train.py")
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        raise click.UsageError(f"--param names a flag twice ({', '.join(names)}); give each "
                               "flag once, with all its values: --param NAME=V1,V2,V3")
    try:
        check_out_dir(out_dir)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--out'") from None
    sweep = Sweep(script, args, lms_values=lms_values, fracs=fracs, params=params, grid=grid,
                  steps=steps, gpu_limit=gpu_limit, timeout=timeout, out_dir=out_dir)
    click.echo(f"lmsrt tune: {_describe(sweep)}; {steps} steps a trial, results in {out_dir}",
               err=True)
    if steps < MIN_STEPS:
        click.echo(f"lmsrt tune: warning: --steps {steps} leaves fewer than {MIN_TIMED} timed "
                   f"steps after the warm-up, so no trial can be compared; give --steps "
                   f"{MIN_STEPS} or more.", err=True)
    view = _LiveView(names, expected_trials(sweep))

    def done(trial: Trial) -> None:
        view.done(trial)
        write_results(sweep)   # after every trial: the results so far are there to look at

    interrupted = False
    try:
        sweep.run(on_start=view.start, on_tick=view.tick, on_done=done)
    except KeyboardInterrupt:
        interrupted = True
        view.clear()
        click.echo(f"lmsrt tune: interrupted; keeping the {len(sweep.trials)} finished trials "
                   "(the one running was killed).", err=True)
    raise SystemExit(_finish(sweep, names, interrupted))


def _describe(sweep: Sweep) -> str:
    lms = ",".join(f"{v:g}" for v in sweep.lms_values)
    auto = AUTO in sweep.fracs
    numbers = sorted(f for f in sweep.fracs if f != AUTO)
    fracs = ",".join(f"{v:g}" for v in numbers)
    if numbers in (list(BISECT_FRACS), list(GRID_FRACS)):
        fracs = f"{min(numbers):g}..{max(numbers):g}"
    if sweep.grid:
        what = f"grid of lms {lms} x lms_frac {'auto,' if auto else ''}{fracs}".rstrip(",")
    else:
        bisect = (f"bisecting lms_frac {fracs} at lms {reference_lms(sweep.lms_values):g}, then "
                  f"lms {lms} near the best")
        what = (f"auto at lms {lms}" + (f", then {bisect}" if numbers else "") if auto
                else bisect)
    for name, values in sweep.params:
        what += f", for each {name} in {','.join(values)}"
    return what


def _bytes(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def _table(trials: Sequence[Trial], names: List[str], marks: Optional[dict] = None) -> List[str]:
    """Rows of the trial table, a header first; ``marks`` puts a mark before some trial ids."""
    head = ["#", *names, "lms", "lms_frac", "status", "steps/s", "spread", "GPU peak",
            "pinned peak", "swapped/step"]
    widths = [4, *(max(len(n), 6) for n in names), 6, 8, 7, 8, 6, 10, 11, 12]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)) + "  note"]
    for t in trials:
        mark = (marks or {}).get(t.id, "")
        cells = [f"{mark}{t.id}", *(t.params[n] for n in names), f"{t.lms:g}",
                 format_setting(t.lms_frac),
                 t.status, "-" if t.steps_per_s is None else f"{t.steps_per_s:.3f}",
                 spread_text(t) or "-",
                 _bytes(t.gpu_peak_bytes), _bytes(t.host_peak_bytes), _bytes(t.swapped_bytes)]
        row = "  ".join(c.rjust(w) for c, w in zip(cells, widths))
        lines.append(f"{row}  {t.error}".rstrip())
    return lines


def expected_trials(sweep: Sweep) -> int:
    """About how many trials ``sweep`` runs, repeats left out: a grid runs every pair; a
    bisection runs auto at every --lms, halves the fractions, then tries each other --lms at the
    best fraction and the one below (NOTE [ Tuning search ])."""
    numbers = [f for f in sweep.fracs if f != AUTO]
    autos = len(sweep.lms_values) if AUTO in sweep.fracs else 0
    if sweep.grid:
        each = len(sweep.lms_values) * len(numbers) + autos
    else:
        each = autos + (math.ceil(math.log2(len(numbers) + 1)) + 2 * (len(sweep.lms_values) - 1)
                        if numbers else 0)
    return max(1, each) * len(sweep.combinations())


class _LiveView:
    """The trial in flight on one line of stderr, with how many are left and about how long
    they take (redrawn on a terminal), finished ones as rows of a table on stdout."""

    def __init__(self, names: List[str], expected: int):
        self.names = names
        self.redraw = sys.stderr.isatty()
        self.rows = 0
        self.expected = expected
        self.walls: List[float] = []

    def _label(self, t: Trial) -> str:
        params = "".join(f" {k}={v}" for k, v in t.params.items())
        total = max(self.expected, t.id)
        left = ""
        if self.walls:
            seconds = statistics.mean(self.walls) * (total - t.id + 1)
            left = f", about {seconds / 60:.0f} min left" if seconds >= 90 else \
                f", about {seconds:.0f} s left"
        return (f"trial {t.id} of ~{total}{left}: lms={t.lms:g} "
                f"lms_frac={format_setting(t.lms_frac)}{params}")

    def start(self, trial: Trial) -> None:
        if self.redraw:
            self.tick(trial, 0.0)
        else:
            click.echo(f"lmsrt tune: {self._label(trial)} ...", err=True)

    def tick(self, trial: Trial, seconds: float) -> None:
        if self.redraw:
            click.echo(f"\r\033[K{self._label(trial)}, running {seconds:.0f} s", err=True, nl=False)

    def clear(self) -> None:
        if self.redraw:
            click.echo("\r\033[K", err=True, nl=False)

    def done(self, trial: Trial) -> None:
        self.walls.append(trial.wall_s or 0.0)
        self.clear()
        lines = _table([trial], self.names)
        click.echo("\n".join(lines if self.rows == 0 else lines[1:]))
        self.rows += 1


def _finish(sweep: Sweep, names: List[str], interrupted: bool) -> int:
    """Write the outputs, print the ranked table and the recommendation; return the exit status."""
    paths = write_results(sweep, interrupted)
    png = os.path.join(sweep.out_dir, "tune.png")
    why_not = write_plot(sweep, png)
    if why_not:
        click.echo(f"lmsrt tune: {why_not}", err=True)
    written = [paths["csv"], paths["json"], *([] if why_not else [png])]
    order = [tuple(p.items()) for p in sweep.combinations()]
    trials = sorted(sweep.trials, key=lambda t: (order.index(tuple(t.params.items())),
                                                 not t.ranked, -(t.steps_per_s or 0), t.id))
    best = recommend(sweep.trials)
    marks = {i: "*" for i in pareto_front(sweep.trials)}
    if best:
        marks[best.id] = ">"
    if trials:
        each = f" for each {', '.join(names)}" if names else ""
        click.echo(f"\n{len(trials)} trials, fastest first{each} (> recommended, * Pareto front: "
                   "nothing else both faster and smaller; spread: half the interquartile range "
                   "of the step times):")
        click.echo("\n".join(_table(trials, names, marks)))
    click.echo(f"\nwrote {', '.join(written)}")
    end = 130 if interrupted else 1
    if sweep.broken:
        first, second, error = sweep.broken
        click.echo(f"\nTrials {first} and {second} crashed the same way ({error}), so tune "
                   "stopped: the script is broken, whatever the settings, not short of memory. "
                   f"Run it alone to see the whole error: "
                   f"{shlex.join(['python', sweep.script, *sweep.args])}; the trials' "
                   f"logs are in {sweep.log_dir}.")
        return end
    ranked = [t for t in sweep.trials if t.ranked]
    if not ranked:
        oom = any(t.status == "oom" for t in sweep.trials)
        click.echo(f"\nNo trial was timed (the table's notes say why; logs in {sweep.log_dir})"
                   + ("; those that ran out of memory need a higher --gpu-limit or smaller "
                      "--param values." if oom else "."))
        return end
    if len(sweep.combinations()) > 1:
        click.echo("\nFastest for each " + ", ".join(names) + " (steps/s compare settings at one "
                   "value; across values, weigh the work per step):")
        for params in sweep.combinations():
            group = [t for t in sweep.trials if t.params == params]
            own = recommend(group)
            label = " ".join(f"{k}={v}" for k, v in params.items())
            click.echo(f"  {label}: " + (f"{own.steps_per_s:.3f} steps/s {spread_text(own)}, "
                                         f"{_bytes(own.gpu_peak_bytes)}: "
                                         f"{run_command(own, sweep.script, sweep.gpu_limit)}"
                                         if own else "no setting is measurably faster"
                                         if any(t.ranked for t in group) else "nothing fit"))
    _say_auto(sweep, names)
    if best is None:
        low = min(ranked, key=lambda t: t.steps_per_s)
        high = max(ranked, key=lambda t: t.steps_per_s)
        click.echo(f"\nNo setting is measurably faster: the {len(ranked)} timed trials ran "
                   f"{low.steps_per_s:.3f}-{high.steps_per_s:.3f} steps/s, each within the "
                   f"others' spread (after up to {WIDEN_ROUNDS} longer repeats), so nothing is "
                   "recommended. Any of them will do; a longer --steps narrows the spread.")
        return 130 if interrupted else 0
    click.echo(f"\nRecommended (trial {best.id}: {best.steps_per_s:.3f} steps/s "
               f"{spread_text(best)}, {_bytes(best.gpu_peak_bytes)} GPU peak):")
    click.echo(f"  {run_command(best, sweep.script, sweep.gpu_limit)}")
    return 130 if interrupted else 0


def _say_auto(sweep: Sweep, names: List[str]) -> None:
    """Whether a fixed lms_frac beats auto, for each --param combination that ran auto."""
    said = []
    for params in sweep.combinations():
        compare = compare_auto([t for t in sweep.trials if t.params == params])
        if compare:
            label = " ".join(f"{k}={v}" for k, v in params.items())
            said.append(f"{label + ': ' if label else ''}{compare['summary']}")
    if len(said) == 1 and not names:
        click.echo(f"\n{said[0]}")
    elif said:
        click.echo(f"\nauto against the fastest fixed setting, for each {', '.join(names)}:")
        click.echo("\n".join(f"  {line}" for line in said))
