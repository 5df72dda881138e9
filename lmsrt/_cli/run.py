"""``lmsrt run``: an unmodified training script with LMS enabled, in one process or under torchrun.

One process: the script runs here through runpy, as ``python script.py`` would run it, with LMS
active on the main thread from its first line to its last. With any torchrun option (say
``--nproc-per-node 2``) this process becomes ``python -m torch.distributed.run``, and each worker
enables LMS at start through the bootstrap in ``_bootstrap/sitecustomize.py``; the settings travel
in ``LMSRT_*`` environment variables (see ``lmsrt._launch``).
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import runpy
import sys
import traceback
from typing import Dict, List, Optional, Sequence

import click

from .. import _launch
from .._output import check_output_file
from ..config import setting_range

__all__ = ["command"]

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


class _Number(click.ParamType):
    """A finite float within bounds, whose error message says what to give instead."""

    name = "number"

    def __init__(self, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False, example: str = ""):
        self.low, self.high, self.low_open, self.example = low, high, low_open, example

    @classmethod
    def setting(cls, field: str, example: str) -> "_Number":
        """The values an LMS setting accepts (``lmsrt.config.setting_range``)."""
        low, high = setting_range(field)
        return cls(low, high, example=example)

    def convert(self, value, param, ctx) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number; {self.example}", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value} is not a finite number; {self.example}", param, ctx)
        too_low = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        too_high = self.high is not None and x > self.high
        if too_low or too_high:
            self.fail(f"{value} is not {self._range()}; {self.example}", param, ctx)
        return x

    def _range(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:.6g}, {self.high:.6g}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:.6g}"
        return f"<= {self.high:.6g}"


class _Choice(click.ParamType):
    """A string matching ``pattern``, whose error message says what to give instead."""

    name = "text"

    def __init__(self, pattern: str, example: str, check=None):
        self.pattern, self.example, self.check = re.compile(pattern), example, check

    def convert(self, value, param, ctx) -> str:
        value = str(value)
        if not self.pattern.fullmatch(value):
            self.fail(f"{value!r} is not {self.example}", param, ctx)
        why_not = self.check(value) if self.check else None
        if why_not:
            self.fail(why_not, param, ctx)
        return value


def _nproc_available(value: str) -> Optional[str]:
    if value in ("gpu", "xpu"):
        import torch

        backend = getattr(torch, "cuda" if value == "gpu" else "xpu", None)
        if backend is None or not backend.is_available():
            return (f"{value!r} starts one worker per {value.upper()}, and this machine has "
                    "none; give a number of workers, e.g. --nproc-per-node 2, or cpu")
    return None


def _nnodes_ordered(value: str) -> Optional[str]:
    low, _, high = value.partition(":")
    if int(low) < 1 or (high and int(high) < int(low)):
        return f"{value!r} is not N or MIN:MAX with 1 <= MIN <= MAX; e.g. --nnodes 2 or 1:4"
    return None


_STD = _Choice(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", "0-3 or LOCAL_RANK:N,... (N in 0-3); e.g. 3 "
              "or 0:3,1:0")

# The torchrun options accepted before the script: (name, click type, metavar, help); type None
# is a flag. Each is checked here as torchrun would check it, so that a bad value exits 2 before
# the hand-over instead of ending torchrun in a traceback. Their underscore spellings
# (--nproc_per_node) work too: the context normalizes "_" to "-".
_TORCHRUN_OPTIONS = (
    ("nproc-per-node", _Choice(r"[1-9]\d*|auto|cpu|gpu|xpu", "a number of workers >= 1, or "
                               "auto, cpu, gpu; e.g. --nproc-per-node 2", _nproc_available),
     "N", "Worker processes per node: a number, or gpu, cpu, auto."),
    ("nnodes", _Choice(r"\d+(:\d+)?", "N or MIN:MAX; e.g. --nnodes 2 or 1:4", _nnodes_ordered),
     "N", "Number of nodes, or MIN:MAX."),
    ("node-rank", click.IntRange(min=0), "N", "Rank of this node."),
    ("master-addr", str, "VALUE", "Address of the rank-0 node (static rendezvous)."),
    ("master-port", click.IntRange(0, 65535), "N", "Port on the rank-0 node (static "
     "rendezvous)."),
    ("rdzv-backend", str, "VALUE", "Rendezvous backend, e.g. c10d."),
    ("rdzv-endpoint", str, "VALUE", "Rendezvous endpoint, HOST:PORT."),
    ("rdzv-id", str, "VALUE", "Rendezvous (job) id."),
    ("rdzv-conf", str, "VALUE", "Rendezvous settings, KEY=VALUE,..."),
    ("standalone", None, None, "Single node with a local rendezvous on a free port."),
    ("max-restarts", click.IntRange(min=0), "N", "Worker group restarts before failing."),
    ("monitor-interval", _Number(0.0, low_open=True, example="give seconds, e.g. "
                                 "--monitor-interval 0.1"),
     "S", "Seconds between checks of the workers."),
    ("log-dir", str, "DIR", "Directory for the workers' logs."),
    ("redirects", _STD, "VALUE", "Redirect worker std streams to log files (0-3, or RANK:N,...)."),
    ("tee", _STD, "VALUE", "Tee worker std streams to log files and the console (0-3)."),
    ("local-ranks-filter", _Choice(r"\d+(,\d+)*", "local ranks separated by commas; e.g. 0 or "
                                   "0,1"),
     "RANKS", "Show the output of these local ranks only, e.g. 0."),
    ("local-addr", str, "VALUE", "Address of this node."),
)


def _torchrun_options(f):
    for name, kind, metavar, help_text in reversed(_TORCHRUN_OPTIONS):
        dest = "torchrun_" + name.replace("-", "_")
        if kind is None:
            f = click.option(f"--{name}", dest, is_flag=True, help=f"[torchrun] {help_text}")(f)
        else:
            f = click.option(f"--{name}", dest, type=kind, default=None, metavar=metavar,
                             help=f"[torchrun] {help_text}")(f)
    return f


class _RunCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            e.message = (f"no such option {e.option_name!r} for lmsrt run. Its options go before "
                         "the script and the script's own after it: lmsrt run --lms 1000 "
                         f"train.py {e.option_name} ...")
            raise


@click.command("run", cls=_RunCommand, context_settings=dict(
    ignore_unknown_options=False, allow_interspersed_args=False,
    token_normalize_func=lambda name: name.replace("_", "-")))
@click.option("--lms", type=_Number.setting("lms", "give the size threshold in KB, e.g. --lms "
                                            "1000 (0 turns swapping off)"),
              metavar="KB", help="Saved tensors smaller than this stay on the GPU [LMSRT_LMS].")
@click.option("--lms-frac", type=_Number(0.0, 1.0, example="give the fraction of GPU memory used "
                                         "before swapping starts, e.g. --lms-frac 0.75"),
              metavar="F", help="No swapping while GPU use is under F times what the process "
              "may use [LMSRT_LMS_FRAC].")
@click.option("--prefetch-mb", type=_Number.setting("prefetch_mb", "give MiB, e.g. "
                                                    "--prefetch-mb 4096"),
              metavar="MB", help="Most bytes brought back ahead of backward [LMSRT_PREFETCH_MB].")
@click.option("--host-budget-gb", type=_Number.setting("host_budget_gb", "give GiB per "
                                                       "process, e.g. --host-budget-gb 64"),
              metavar="G", help="Most pinned host memory per process [LMSRT_HOST_BUDGET_GB].")
@click.option("--gpu-limit", type=_Number(0.0, low_open=True, example="give GiB, e.g. "
                                          "--gpu-limit 12"),
              metavar="GIB", help="Cap each process's GPU memory, as a smaller GPU would.")
@click.option("--stats", type=click.Path(), metavar="FILE",
              help="Write LMS stats and step times as JSON at exit, also after SIGTERM (rank "
              "r>0: FILE.rank{r}). FILE must be a regular file or new, not a symlink; it is "
              "replaced whole, and kept as it was if writing fails.")
@click.option("-m", "--module", "as_module", is_flag=True,
              help="Run a module, as python -m does: lmsrt run -m pkg.train ARGS.")
@_torchrun_options
@click.argument("target_and_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
def command(lms: Optional[float], lms_frac: Optional[float], prefetch_mb: Optional[float],
            host_budget_gb: Optional[float], gpu_limit: Optional[float], stats: Optional[str],
            as_module: bool, target_and_args: Sequence[str], **torchrun: object) -> None:
    """Run SCRIPT with LMS enabled from its first line to its last, unmodified.

    Options go before SCRIPT; everything after it is the script's own (--help included).
    Any torchrun option runs it under torch.distributed.run, LMS enabled in every worker.
    A bad option, LMSRT_* variable or --stats path exits 2 before SCRIPT starts; after
    that the exit status is the script's (130 after Ctrl-C, 143 after SIGTERM).

    \b
    Examples:
      lmsrt run --lms 1000 --lms-frac 0.75 train.py --epochs 3
      lmsrt run --gpu-limit 12 --stats stats.json -m mypkg.train --lr 1e-3
      lmsrt run --nproc-per-node 8 --lms-frac 0.6 train.py --batch-size 16
    """
    if not target_and_args:
        raise click.UsageError("no script given; name the script to run after the options, e.g. "
                               "lmsrt run --lms 1000 train.py (or -m pkg.module).")
    target, args = target_and_args[0], list(target_and_args[1:])
    _check_target(target, as_module)
    settings = {"lms": lms, "lms_frac": lms_frac, "prefetch_mb": prefetch_mb,
                "host_budget_gb": host_budget_gb}
    settings = {k: v for k, v in settings.items() if v is not None}
    try:
        _launch.check_environment(lms_overrides=settings)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    stats_path = None
    if stats:
        try:
            stats_path = check_output_file(stats)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--stats'") from None
    forwarded = _forwarded_torchrun_args(torchrun)
    if gpu_limit is not None and not _gpu_limit_applies(gpu_limit):
        gpu_limit = None
    if forwarded:
        _exec_torchrun(forwarded, target, args, as_module, settings, stats_path, gpu_limit)
    raise SystemExit(_run_here(target, args, as_module, settings, stats_path, gpu_limit))


def _check_target(target: str, as_module: bool) -> None:
    if as_module:
        sys.path.insert(0, os.getcwd())   # where python -m looks first
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise click.UsageError(f"no module named {target!r}; run from the directory that "
                                   "holds it, or add that directory to PYTHONPATH.")
    elif not os.path.isfile(target):
        raise click.UsageError(f"script {target!r} does not exist; give the path of a Python "
                               "file (or -m pkg.module for a module).")


def _gpu_limit_applies(limit_gb: float) -> bool:
    """Validate --gpu-limit against the GPU; False (after a warning) without one."""
    import torch

    if not torch.cuda.is_available():
        click.echo(f"lmsrt: warning: no CUDA GPU, so --gpu-limit {limit_gb:g} is ignored.",
                   err=True)
        return False
    try:
        _launch.check_gpu_limit(limit_gb)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--gpu-limit'") from None
    return True


def _forwarded_torchrun_args(torchrun: Dict[str, object]) -> List[str]:
    out = []
    for name, kind, _, _ in _TORCHRUN_OPTIONS:
        value = torchrun["torchrun_" + name.replace("-", "_")]
        if kind is None and value:
            out.append(f"--{name}")
        elif kind is not None and value is not None:
            out.append(f"--{name}={value}")
    return out


def _exec_torchrun(forwarded: List[str], target: str, args: List[str], as_module: bool,
                   settings: Dict[str, float], stats_path: Optional[str],
                   gpu_limit: Optional[float]) -> None:
    """Become ``python -m torch.distributed.run``; the bootstrap enables LMS in each worker.

    exec, not a child process: this process then holds no CUDA context (checking --gpu-limit may
    have made one) and signals reach torchrun directly.
    """
    from ..config import ENV_VARS

    env = os.environ
    field_to_var = {field: var for var, field in ENV_VARS.items()}
    for field, value in settings.items():
        env[field_to_var[field]] = repr(value)
    if stats_path:
        env[_launch.ENV_STATS] = stats_path
    if gpu_limit is not None:
        env[_launch.ENV_GPU_LIMIT] = repr(gpu_limit)
    env[_launch.ENV_BOOTSTRAP] = "1"
    env[_launch.ENV_LAUNCHER_PID] = str(os.getpid())
    env.pop(_launch.ENV_ACTIVE, None)   # a launch from inside an lmsrt run script starts afresh
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOTSTRAP_DIR, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "torch.distributed.run", *forwarded,
            *(["-m"] if as_module else []), target, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _run_here(target: str, args: List[str], as_module: bool, settings: Dict[str, float],
              stats_path: Optional[str], gpu_limit: Optional[float]) -> object:
    """Run the script in this process with LMS on; return its exit status."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_active = os.environ.get(_launch.ENV_ACTIVE)
    try:
        session = _launch.start(lms_overrides=settings, stats_path=stats_path,
                                gpu_limit_gb=gpu_limit)
    except ValueError as e:   # e.g. a bad LMSRT_* variable in the environment
        raise click.UsageError(f"{e}") from None
    status: object = 0
    try:
        # sys.path[0] and sys.argv as `python script.py` / `python -m module` would set them.
        if as_module:
            sys.argv = [target, *args]      # run_module replaces argv[0] with the module's file
            sys.path[0:1] = [os.getcwd()]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0:1] = [os.path.dirname(os.path.abspath(target))]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        status = e.code      # a message (sys.exit("msg")) is printed as python prints it, at exit
    except KeyboardInterrupt as e:
        _print_script_traceback(e)
        status = 130
    except BaseException as e:
        _print_script_traceback(e)
        status = 1
    finally:
        if not session.finish() and status in (0, None):
            status = 1       # asked for stats and got none: no success to report
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_active is None:
            os.environ.pop(_launch.ENV_ACTIVE, None)
        else:
            os.environ[_launch.ENV_ACTIVE] = saved_active
    return status


def _print_script_traceback(e: BaseException) -> None:
    """The traceback python would print: without the frames of lmsrt's CLI and of runpy (frozen
    or not) above the script."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_globals.get("__name__") or "").startswith(
            ("lmsrt._cli.", "runpy")):
        tb = tb.tb_next
    sys.stdout.flush()
    traceback.print_exception(type(e), e, tb, file=sys.stderr)
