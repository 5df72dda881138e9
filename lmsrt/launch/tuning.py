"""The sweep behind ``lmsrt tune``: trials of a script under ``lmsrt run``, and which to run next.

Each trial is one fresh ``python -m lmsrt run --lms L --lms-frac F --stats FILE SCRIPT ARGS``
process, in a session (process group) of its own, so that an out-of-memory error, a fragmented
allocator or a stray data-loader worker never reaches the next trial. ``LMSRT_MAX_STEPS`` ends it
after ``steps`` steps (see ``session.py``); its stats file gives the median step time after
warm-up, the GPU and pinned host peaks and the bytes swapped per step.

Example::

    sweep = Sweep("train.py", ["--epochs", "1"], lms_values=(1000,), fracs=None,
                  params=[("batch-size", ("8", "16"))], steps=8, out_dir="lmsrt-tune")
    sweep.run()
    best = best_trial(sweep.trials)
    print(run_command(best, "train.py"))
    print(compare_auto(sweep.trials)["summary"])

NOTE [ Tuning search ]
``lms_frac="auto"`` comes first: the engine finds the fraction itself, so the sweep runs it at
every ``lms`` (the one the bisection uses first) and then asks whether any fixed fraction beats it
(``compare_auto``). An auto trial says nothing about the fixed fractions, so it does not steer
their search. Out of memory is monotone in a fixed ``lms_frac``: a higher fraction keeps more on
the GPU. So the default search bisects the fractions (0, 0.05, ..., 1, or the values given) at one
``lms`` (1000 if listed, else the first value listed) for the largest that does not run out of
memory: about 5 trials instead of 21. Then it tries every ``lms`` value at that fraction and at
the one below it, which
leaves headroom for allocator slack and cuDNN workspaces and is sometimes faster. When even the
lowest fraction runs out of memory, every ``lms`` is tried there: a smaller one swaps more. A
crash or a timeout during the bisection ends the search for that parameter value: it says nothing
about memory, and more trials would fail the same way; the same crash in two trials ends the whole
sweep (the script is broken, whatever the settings). The grid search runs every fraction at
every ``lms``, auto and then the lowest fraction first, and skips the fractions above one that
ran out of memory (they would too).

NOTE [ Timing noise ]
A trial is timed by its step times after the warm-up (at least ``MIN_TIMED`` of them, else it is
not compared), and its spread is half their interquartile range over the median. One trial is
measurably faster than another only when its median is more than ``TIE`` faster and its slow
quartile is faster than the other's fast quartile (``faster``). When the fastest trial of a search
and a rival are apart by more than ``TIE`` but not measurably, both run again with twice the
steps, up to ``WIDEN_ROUNDS`` times, their new step times joining the old ones; the rival is auto
when the fastest is a fixed setting (that is the claim the summary makes), else the slowest trial
within the fastest's spread. What is still within noise after that is said to be: no
recommendation when no trial is measurably slower than the fastest, and no "fixed beats auto"
unless it does measurably.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Generator, List, Optional, Sequence, Tuple, Union

from ..options import AUTO, OPTIONS, format_setting, spelled
from ..summary import HEADLINE
from .output import check_output_dir, check_output_file
from .session import WARMUP_STEPS

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["Trial", "Sweep", "BISECT_FRACS", "GRID_FRACS", "reference_lms", "bisect_search",
           "grid_search", "classify", "with_param", "pareto_front", "best_trial", "recommend",
           "faster", "compare_auto", "MIN_TIMED", "MIN_STEPS", "RESULTS_SCHEMA",
           "run_command", "check_out_dir"]

BISECT_FRACS = tuple(round(i * 0.05, 2) for i in range(21))   # bisected: 0, 0.05, ..., 1
GRID_FRACS = tuple(round(i * 0.1, 1) for i in range(11))   # --grid without a list: 0, ..., 1
REFERENCE_LMS = 1000.0
TIE = 0.01   # step rates within 1% are timing noise: the trial with less GPU memory wins
MIN_TIMED = 3      # step times after warm-up a trial needs to be compared (NOTE [ Timing noise ])
MIN_STEPS = WARMUP_STEPS + MIN_TIMED + 1   # --steps that gives them (the last step is not timed)
WIDEN_ROUNDS = 2   # reruns, each with twice the steps, of two trials within each other's spread
RESULTS_SCHEMA = 1  # the layout of results.json; raised when a field changes meaning or goes

_OOM = re.compile(r"out of (GPU )?memory|OutOfMemoryError", re.IGNORECASE)
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b")
# `lmsrt run` prints the LMS summary's headline (``summary.HEADLINE``) after the traceback.
_TAIL_BYTES = 64 << 10
# A trial runs this lmsrt, not one that its working directory holds (a clone, a folder named
# lmsrt): `python -m lmsrt` would put that directory first on sys.path.
_TRIAL_MAIN = (f"import runpy, sys; sys.path[0] = {_ROOT!r}; "
               "runpy.run_module('lmsrt', run_name='__main__', alter_sys=True)")
_LOG_NAME = re.compile(r"^\d{3,}\.(out|err|stats\.json)$")   # trials/001.out, 001.stats.json, ...
_OUTPUTS = ("results.json", "results.csv", "tune.png")          # in the out dir, beside trials/

Fraction = Union[float, str]   # a fraction, or AUTO
# A search yields the (lms, lms_frac) to try next and is sent the finished trial.
Search = Generator[Tuple[float, Fraction], "Trial", None]


@dataclasses.dataclass
class Trial:
    """One run of the script: its settings and what came of it.

    ``status`` is ``ok`` (the script ended with status 0, or was ended after ``steps`` steps),
    ``oom``, ``crash`` or ``timeout``; ``error`` is the line that says why, or a note on an ok one.
    ``step_times_s`` are the timed steps after warm-up (a repeat's join them), ``spread`` half
    their interquartile range over the median; ``repeat_of`` is the trial a repeat times again.
    """

    id: int
    lms: float
    lms_frac: Fraction
    params: Dict[str, str]
    args: List[str]
    status: str = "ok"
    error: str = ""
    returncode: Optional[int] = None
    wall_s: float = 0.0
    steps: Optional[int] = None
    step_time_s: Optional[float] = None
    steps_per_s: Optional[float] = None
    gpu_peak_bytes: Optional[int] = None
    host_peak_bytes: Optional[int] = None
    swapped_bytes: Optional[int] = None
    steps_asked: Optional[int] = None
    step_times_s: List[float] = dataclasses.field(default_factory=list)
    spread: Optional[float] = None
    repeat_of: Optional[int] = None

    @property
    def ranked(self) -> bool:
        """Whether the trial competes for the recommendation: it ran, and was timed (a repeat's
        times count for the trial it repeats)."""
        return self.status == "ok" and self.steps_per_s is not None and self.repeat_of is None

    @property
    def auto(self) -> bool:
        """Whether the engine chose the fraction (``lms_frac="auto"``)."""
        return self.lms_frac == AUTO

    def set_times(self, times: Sequence[float]) -> None:
        """Time the trial by ``times`` (seconds of steps after warm-up, at least two)."""
        self.step_times_s = list(times)
        self.step_time_s = statistics.median(times)
        self.steps_per_s = 1.0 / self.step_time_s
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        self.spread = (q3 - q1) / 2 / self.step_time_s

    def rates(self) -> Tuple[float, float]:
        """Steps/s at its slow and its fast quartile (the median both, without step times)."""
        if len(self.step_times_s) < 2:
            return self.steps_per_s, self.steps_per_s
        q1, _, q3 = statistics.quantiles(self.step_times_s, n=4, method="inclusive")
        return 1.0 / q3, 1.0 / q1


def faster(a: Trial, b: Trial) -> bool:
    """Whether timed trial ``a`` is measurably faster than ``b``: its median more than ``TIE``
    faster, and its slow quartile faster than ``b``'s fast one (NOTE [ Timing noise ])."""
    return a.steps_per_s > b.steps_per_s * (1 + TIE) and a.rates()[0] > b.rates()[1]


def spread_text(t: Trial) -> str:
    """``'±4%'``: half the trial's interquartile range over its median; empty if unknown."""
    return "" if t.spread is None else f"±{t.spread:.0%}"


def reference_lms(lms_values: Sequence[float]) -> float:
    """The ``lms`` the bisection runs at: 1000 if listed, else the first value listed."""
    return REFERENCE_LMS if REFERENCE_LMS in lms_values else lms_values[0]


def _fixed(fracs: Sequence[Fraction]) -> List[float]:
    """The fixed fractions of ``fracs`` (not auto), lowest first."""
    return sorted({f for f in fracs if f != AUTO})


def bisect_search(lms_values: Sequence[float], fracs: Sequence[Fraction]) -> Search:
    """Auto at every ``lms`` if ``fracs`` holds it; then bisect the fixed ``fracs`` at one
    ``lms`` and try every ``lms`` near the best fraction.

    See NOTE [ Tuning search ]. Example::

        search = bisect_search([250, 1000], [AUTO, *BISECT_FRACS])
        lms, frac = next(search)          # (1000, 'auto'), then (250, 'auto'), then (1000, 0.5)
        lms, frac = search.send(trial)    # the next one, given how that trial ended
    """
    reference = reference_lms(lms_values)
    if AUTO in fracs:
        for lms in dict.fromkeys([reference, *lms_values]):
            yield lms, AUTO
    fracs = _fixed(fracs)
    if not fracs:
        return
    tried = set()
    fits, too_much = -1, len(fracs)    # indices: the highest that fit, the lowest that did not
    while too_much - fits > 1:
        middle = (fits + too_much) // 2
        trial = yield reference, fracs[middle]
        tried.add((reference, fracs[middle]))
        if trial.status == "ok":
            fits = middle
        elif trial.status == "oom":
            too_much = middle
        else:
            return
    best = max(fits, 0)
    for index in (best, best - 1):
        for lms in lms_values:
            if index >= 0 and (lms, fracs[index]) not in tried:
                tried.add((lms, fracs[index]))
                yield lms, fracs[index]


def grid_search(lms_values: Sequence[float], fracs: Sequence[Fraction]) -> Search:
    """Every fraction at every ``lms``: auto (if in ``fracs``) and then the lowest fraction first,
    skipping fixed fractions above an OOM."""
    for lms in lms_values:
        if AUTO in fracs:
            yield lms, AUTO
        for frac in _fixed(fracs):
            trial = yield lms, frac
            if trial.status == "oom":
                break


def with_param(args: Sequence[str], name: str, value: str) -> List[str]:
    """``args`` with the script flag ``name`` set to ``value``: replaced where it is, else added.

    Example::

        with_param(["--batch-size", "4", "--lr", "0.1"], "batch-size", "8")
        # ['--batch-size', '8', '--lr', '0.1']
    """
    flag = name if name.startswith("-") else f"--{name}"
    out: List[str] = []
    found = False
    i = 0
    while i < len(args):
        if args[i] == flag and i + 1 < len(args):    # --flag VALUE
            out += [flag, value]
            i += 2
            found = True
        elif args[i].startswith(f"{flag}="):          # --flag=VALUE
            out.append(f"{flag}={value}")
            i += 1
            found = True
        else:
            out.append(args[i])
            i += 1
    return out if found else [*out, flag, value]


def _settings(lms: float, frac: Fraction, gpu_limit: Optional[float]) -> List[str]:
    limit = ["--gpu-limit", f"{gpu_limit:g}"] if gpu_limit is not None else []
    return [OPTIONS["lms"].flag, format_setting(lms), OPTIONS["lms_frac"].flag,
            format_setting(frac), *limit]


def run_command(trial: Trial, script: str, gpu_limit: Optional[float] = None) -> str:
    """The ``lmsrt run`` command line that trains as ``trial`` ran (without the step limit)."""
    return shlex.join(["lmsrt", "run", *_settings(trial.lms, trial.lms_frac, gpu_limit), script,
                       *trial.args])


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
        return f.read().decode(errors="replace")


def classify(returncode: int, stdout: str, stderr: str) -> Tuple[str, str]:
    """``(status, error line)`` of a trial that ended by itself, from its exit status and output.

    Out of memory is recognized in stderr or stdout (a script may catch the error and say so).

    Example::

        classify(1, "", "torch.OutOfMemoryError: CUDA out of memory. Tried ...")
        # ('oom', 'torch.OutOfMemoryError: CUDA out of memory. Tried ...')
    """
    if returncode == 0:
        return "ok", ""
    for text in (stderr, stdout):
        hits = [line.strip() for line in text.splitlines() if _OOM.search(line)]
        if hits:
            return "oom", hits[-1]
    if returncode < 0:
        return "crash", f"killed by {signal.Signals(-returncode).name}"
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if HEADLINE.match(line)]
    lines = lines[:starts[-1]] if starts else lines
    errors = [line.strip() for line in lines if _EXCEPTION.match(line)]
    rest = [line.strip() for line in lines + stdout.splitlines() if line.strip()]
    return "crash", (errors or rest or [f"exit status {returncode}"])[-1]


def _read_stats(trial: Trial, path: str, steps: int) -> None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        trial.error = "no stats file: the script ended in a way lmsrt run could not see"
        return
    total, last = data["total"], data["last_step"]
    trial.steps = total["steps"]
    trial.gpu_peak_bytes = total["gpu_peak_bytes"]
    trial.host_peak_bytes = total["host_peak_bytes"]
    trial.swapped_bytes = last["out_bytes"]
    timed = data["step_times_s"][WARMUP_STEPS:]
    if not data["enabled"]:
        trial.error = f"LMS was off: no GPU ({spelled('device', 'sim')} simulates one)"
    elif len(timed) < MIN_TIMED:
        more = (f"give the script more than {steps} steps" if trial.steps < steps else
                f"give --steps {MIN_STEPS} or more")
        trial.error = (f"{len(timed)} timed steps after {WARMUP_STEPS} warm-up ones (it ran "
                       f"{trial.steps} of {steps}): too few to compare, so not ranked; {more}")
    else:
        trial.set_times(timed)
        if trial.steps < steps:
            trial.error = f"the script ended by itself after {trial.steps} of {steps} steps"


def check_out_dir(out_dir: str) -> None:
    """Raise ValueError, saying what to give instead, unless a sweep can write all its outputs
    in ``out_dir`` (created if missing): see NOTE [ Output files ] in ``output.py``."""
    check_output_dir(out_dir)
    check_output_dir(os.path.join(out_dir, "trials"))
    for name in _OUTPUTS:
        check_output_file(os.path.join(out_dir, name),
                          instead="Move it away, or give another --out directory")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        # The whole group: torchrun's workers and data-loader workers hold GPU memory too.
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Sweep:
    """The trials of one ``lmsrt tune``: for each parameter combination, one search.

    ``fracs`` None means the default: auto, then ``BISECT_FRACS`` bisected (``GRID_FRACS`` with
    ``grid``).
    ``trials`` holds the finished ones, also after an interrupt. Example at the top of the module.
    """

    def __init__(self, script: str, args: Sequence[str], *, lms_values: Sequence[float],
                 fracs: Optional[Sequence[Fraction]] = None,
                 params: Sequence[Tuple[str, Sequence[str]]] = (), grid: bool = False,
                 steps: int = 8, gpu_limit: Optional[float] = None, timeout: float = 600.0,
                 out_dir: str = "lmsrt-tune"):
        self.script, self.args = script, list(args)
        self.lms_values = list(lms_values)
        self.fracs = list(fracs) if fracs else [AUTO, *(GRID_FRACS if grid else BISECT_FRACS)]
        self.params = [(name, list(values)) for name, values in params]
        self.grid, self.steps, self.gpu_limit, self.timeout = grid, steps, gpu_limit, timeout
        self.out_dir = out_dir
        self.log_dir = os.path.join(out_dir, "trials")
        self.trials: List[Trial] = []
        # (first trial, second trial, error) when two trials crashed the same way: the sweep stops
        self.broken: Optional[Tuple[int, int, str]] = None

    def combinations(self) -> List[Dict[str, str]]:
        """Every combination of the ``--param`` values, in the order given."""
        names = [name for name, _ in self.params]
        return [dict(zip(names, values))
                for values in itertools.product(*(values for _, values in self.params))]

    def run(self, on_start: Callable[[Trial], None] = lambda t: None,
            on_tick: Callable[[Trial, float], None] = lambda t, s: None,
            on_done: Callable[[Trial], None] = lambda t: None) -> List[Trial]:
        """Run every search to its end; ``on_tick`` gets the seconds a running trial has taken."""
        os.makedirs(self.log_dir, exist_ok=True)
        # An earlier sweep's logs would mislead; only files of lmsrt's naming go.
        for name in os.listdir(self.log_dir):
            if _LOG_NAME.match(name):
                os.remove(os.path.join(self.log_dir, name))
        for params in self.combinations():
            args = self.args
            for name, value in params.items():
                args = with_param(args, name, value)
            make = grid_search if self.grid else bisect_search
            search = make(self.lms_values, self.fracs)
            finished: Optional[Trial] = None
            while True:
                try:
                    lms, frac = search.send(finished)
                except StopIteration:
                    break
                trial = Trial(len(self.trials) + 1, lms, frac, params, args)
                self._run(trial, self.steps, on_start, on_tick)
                on_done(trial)
                if self.broken:
                    return self.trials
                finished = trial
            self._widen(params, on_start, on_tick, on_done)
            if self.broken:
                return self.trials
        return self.trials

    def _run(self, trial: Trial, steps: int, on_start, on_tick) -> None:
        on_start(trial)
        self._run_trial(trial, lambda seconds: on_tick(trial, seconds), steps)
        self.trials.append(trial)
        if trial.status == "crash":
            same = next((t for t in self.trials[:-1]
                         if t.status == "crash" and t.error == trial.error), None)
            if same is not None:
                self.broken = (same.id, trial.id, trial.error)

    def _widen(self, params: Dict[str, str], on_start, on_tick, on_done) -> None:
        """Run two trials within each other's spread again, with twice the steps, until one is
        measurably faster or ``WIDEN_ROUNDS`` are spent (NOTE [ Timing noise ])."""
        for round_ in range(1, WIDEN_ROUNDS + 1):
            pair = _undecided([t for t in self.trials if t.params == params and t.ranked])
            if pair is None:
                return
            steps = self.steps * 2 ** round_
            for original in pair:
                repeat = Trial(len(self.trials) + 1, original.lms, original.lms_frac, params,
                               original.args, repeat_of=original.id)
                self._run(repeat, steps, on_start, on_tick)
                timed = repeat.status == "ok" and repeat.step_times_s
                if timed:
                    original.set_times(original.step_times_s + repeat.step_times_s)
                    repeat.error = (f"repeat of trial {original.id} with {steps} steps: its step "
                                    f"times join that trial's ({spread_text(original)} now)")
                on_done(repeat)
                if self.broken or not timed:
                    return       # it did not time again: the first timing stands

    def _run_trial(self, trial: Trial, tick: Callable[[float], None], steps: int) -> None:
        base = os.path.join(self.log_dir, f"{trial.id:03d}")
        stats = f"{base}.stats.json"
        command = [sys.executable, "-c", _TRIAL_MAIN, "run",
                   *_settings(trial.lms, trial.lms_frac, self.gpu_limit), "--stats", stats,
                   self.script, *trial.args]
        # The settings go in the environment too, so the script can tell which trial it is in;
        # unbuffered, so the log of a trial killed at the timeout holds all it printed.
        trial.steps_asked = steps
        env = dict(os.environ, LMSRT_MAX_STEPS=str(steps), PYTHONUNBUFFERED="1")
        env[OPTIONS["lms"].env] = format_setting(trial.lms)
        env[OPTIONS["lms_frac"].env] = format_setting(trial.lms_frac)
        start = time.monotonic()
        timed_out = False
        with open(f"{base}.out", "wb") as out, open(f"{base}.err", "wb") as err:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=env, start_new_session=True)
            try:
                while True:
                    try:
                        proc.wait(timeout=0.25)
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() - start >= self.timeout:
                            timed_out = True
                            break
                        tick(time.monotonic() - start)
            finally:   # also on Ctrl-C: no trial outlives the sweep
                _kill_group(proc)
        trial.wall_s = time.monotonic() - start
        trial.returncode = proc.returncode
        if timed_out:
            trial.status, trial.error = "timeout", f"no end within --timeout {self.timeout:g} s"
            return
        trial.status, trial.error = classify(proc.returncode, _tail(f"{base}.out"),
                                             _tail(f"{base}.err"))
        if trial.status == "ok":
            _read_stats(trial, stats, steps)


def pareto_front(trials: Sequence[Trial]) -> List[int]:
    """Ids of the timed trials that no other trial of the same parameters beats in both speed and
    GPU memory."""
    ranked = [t for t in trials if t.ranked]

    def beats(a: Trial, b: Trial) -> bool:
        return (a.params == b.params and a.steps_per_s >= b.steps_per_s
                and a.gpu_peak_bytes <= b.gpu_peak_bytes
                and (a.steps_per_s > b.steps_per_s or a.gpu_peak_bytes < b.gpu_peak_bytes))

    return [t.id for t in ranked if not any(beats(o, t) for o in ranked)]


def best_trial(trials: Sequence[Trial]) -> Optional[Trial]:
    """The fastest timed trial; among those not measurably slower (``faster``), the one with
    least memory."""
    ranked = [t for t in trials if t.ranked]
    if not ranked:
        return None
    fastest = _fastest(ranked)
    close = [t for t in ranked if not faster(fastest, t)]
    return min(close, key=lambda t: (t.gpu_peak_bytes, -t.steps_per_s, t.id))


def recommend(trials: Sequence[Trial]) -> Optional[Trial]:
    """``best_trial``, unless no timed trial is measurably slower than the fastest: then no
    setting is measurably faster, and nothing is recommended (None)."""
    ranked = [t for t in trials if t.ranked]
    if len(ranked) > 1 and not any(faster(_fastest(ranked), t) for t in ranked):
        return None
    best = best_trial(ranked)
    autos = [t for t in ranked if t.auto and t.params == best.params]
    if autos and not best.auto and not faster(best, _fastest(autos)):
        return _fastest(autos)     # a fixed setting only where it beats auto, as compare_auto says
    return best


def _undecided(ranked: Sequence[Trial]) -> Optional[Tuple[Trial, Trial]]:
    """The fastest trial and a rival more than ``TIE`` slower by median but not measurably; None
    if there is none (NOTE [ Timing noise ])."""
    if not ranked:
        return None
    fastest = _fastest(ranked)
    rivals = [t for t in ranked if t is not fastest and not faster(fastest, t)
              and fastest.steps_per_s > t.steps_per_s * (1 + TIE)]
    autos = [t for t in rivals if t.auto]
    if autos and not fastest.auto:
        return fastest, _fastest(autos)
    return (fastest, min(rivals, key=lambda t: (t.steps_per_s, t.id))) if rivals else None


def _fastest(trials: Sequence[Trial]) -> Optional[Trial]:
    ranked = [t for t in trials if t.ranked]
    return max(ranked, key=lambda t: (t.steps_per_s, -t.id)) if ranked else None


def compare_auto(trials: Sequence[Trial]) -> Optional[Dict[str, object]]:
    """Whether a fixed ``lms_frac`` beats auto among ``trials`` (of one parameter combination),
    and by how much: the fastest auto trial against the fastest fixed one; None without auto
    trials. A fixed setting beats auto only when measurably faster (``faster``: more than 1%,
    and beyond both trials' spread).

    Example::

        compare_auto(sweep.trials)["summary"]
        # 'auto: 3.100 steps/s (lms 1000); the fastest fixed setting (lms 1000, lms_frac 0.9)
        #  is 4% faster'
    """
    autos = [t for t in trials if t.auto]
    if not autos:
        return None
    fixed = [t for t in trials if not t.auto]
    auto, best = _fastest(autos), _fastest(fixed)
    gain = (best.steps_per_s / auto.steps_per_s - 1) if auto and best else None
    beats = gain is not None and faster(best, auto)
    if best:
        named = f"lms {best.lms:g}, lms_frac {format_setting(best.lms_frac)}"
    if auto is None:
        first = autos[0]
        summary = (f"auto did not run to a step time ({first.status}"
                   f"{': ' + first.error if first.error else ''})")
        if best:
            summary += (f"; the fastest fixed setting ({named}) ran {best.steps_per_s:.3f} "
                        "steps/s")
    else:
        summary = f"auto: {auto.steps_per_s:.3f} steps/s (lms {auto.lms:g}); "
        if best is None:
            summary += ("no fixed setting was tried" if not fixed else
                        "no fixed setting ran to a step time")
        elif beats:
            summary += (f"the fastest fixed setting ({named}) is {gain:.0%} faster (spread: auto "
                        f"{spread_text(auto)}, it {spread_text(best)})")
        elif gain > TIE:
            summary += (f"no fixed setting is measurably faster: the fastest fixed setting "
                        f"({named}) ran {gain:.0%} faster by its median, within the trials' "
                        f"spread (auto {spread_text(auto)}, it {spread_text(best)})")
        elif gain >= -TIE:
            summary += (f"no fixed setting beats auto (the fastest fixed setting, {named}, is "
                        "within 1%, timing noise)")
        elif faster(auto, best):
            summary += (f"no fixed setting beats auto (the fastest fixed setting, {named}, is "
                        f"{-gain:.0%} slower)")
        else:
            summary += (f"no fixed setting beats auto (the fastest fixed setting, {named}, ran "
                        f"{-gain:.0%} slower by its median, within the trials' spread: auto "
                        f"{spread_text(auto)}, it {spread_text(best)})")
    return {"auto_id": auto and auto.id, "fixed_id": best and best.id,
            "fixed_faster": gain, "fixed_beats_auto": beats, "summary": summary}
