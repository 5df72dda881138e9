"""``lmsrt run``: an unmodified training script with LMS enabled, in one process or under torchrun.

One process: the script runs here through runpy, as ``python script.py`` would run it, with LMS
active on the main thread from its first line to its last. With any torchrun option (say
``--nproc-per-node 2``) this process becomes ``python -m torch.distributed.run``, and each worker
enables LMS at start through the bootstrap in ``lmsrt/launch/bootstrap/sitecustomize.py``; the
settings travel in ``LMSRT_*`` environment variables (see ``lmsrt.launch.session``).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import click

from ..launch.output import check_output_file
from ..launch.script import check_script, run_script
from ..launch.session import (
    BOOTSTRAP_DIR,
    ENV_ACTIVE,
    ENV_BOOTSTRAP,
    ENV_GPU_LIMIT,
    ENV_LAUNCHER_PID,
    ENV_STATS,
    ENV_SUMMARY,
    STATS_STDOUT,
    check_environment,
    check_gpu_limit,
    start,
)
from ..options import OPTIONS, env_value, spelled
from ._types import Choice, Number, setting_options, settings_given

__all__ = ["command"]

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


_STD = Choice(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", "0-3 or LOCAL_RANK:N,... (N in 0-3); e.g. 3 "
              "or 0:3,1:0")

# torchrun's options come from its own parser (torch.distributed.run.get_args_parser), so that
# lmsrt run takes what the installed torchrun takes. Each is checked before the hand-over, so
# that a bad value exits 2 instead of ending torchrun in a traceback: these by lmsrt's stricter
# rules (click type, metavar), the others by their argparse type and choices. Their underscore
# spellings (--nproc_per_node) work too: the context normalizes "_" to "-".
_CHECKED = {
    "nproc-per-node": (Choice(r"[1-9]\d*|auto|cpu|gpu|xpu", "a number of workers >= 1, or "
                              "auto, cpu, gpu; e.g. --nproc-per-node 2", _nproc_available), "N"),
    "nnodes": (Choice(r"\d+(:\d+)?", "N or MIN:MAX; e.g. --nnodes 2 or 1:4", _nnodes_ordered),
               "N"),
    "node-rank": (click.IntRange(min=0), "N"),
    "master-port": (click.IntRange(0, 65535), "N"),
    "max-restarts": (click.IntRange(min=0), "N"),
    "monitor-interval": (Number(0.0, low_open=True, example="give seconds, e.g. "
                                "--monitor-interval 0.1"), "S"),
    "log-dir": (str, "DIR"),
    "redirects": (_STD, "VALUE"),
    "tee": (_STD, "VALUE"),
    "local-ranks-filter": (Choice(r"\d+(,\d+)*", "local ranks separated by commas; e.g. 0 or "
                                  "0,1"), "RANKS"),
}
# Not taken: -m is lmsrt run's own (passed on), --no-python would run the script without Python
# and so without LMS, and --run-path runs it inside torchrun's worker function, which the
# bootstrap has not been checked with. lmsrt run's own options win over any of the same name.
_NOT_TAKEN = {"help", "module", "no-python", "run-path", "gpu-limit", "stats", "quiet", "summary",
              *(option.flag[2:] for option in OPTIONS.values() if option.flag)}


def _torchrun_actions() -> Iterator[Tuple[str, str, object]]:
    """``(name, spelling, argparse action)`` of each torchrun option lmsrt run takes: ``name``
    dashed, ``spelling`` the one passed on to torchrun."""
    try:
        from torch.distributed.run import get_args_parser
    except ImportError:          # a torch built without torch.distributed: no torchrun
        return
    for action in get_args_parser()._actions:
        spellings = [s for s in action.option_strings if s.startswith("--")]
        name = spellings[0][2:].replace("_", "-") if spellings else ""
        if name and name not in _NOT_TAKEN:
            yield name, spellings[0], action


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    return re.split(r"(?<!e\.g)(?<!i\.e)\.\s", text, maxsplit=1)[0].rstrip(".") + "."


def _click_type(name: str, action) -> Tuple[object, str]:
    if name in _CHECKED:
        return _CHECKED[name]
    if action.choices:
        return click.Choice([str(c) for c in action.choices]), "|".join(map(str, action.choices))
    if action.type is int:
        return click.INT, "N"
    if action.type is float:
        return Number(example=f"give a number, e.g. --{name} {action.default}"), "X"
    return str, "VALUE"


_TORCHRUN_OPTIONS = list(_torchrun_actions())


def _torchrun_options(f):
    for name, _, action in reversed(_TORCHRUN_OPTIONS):
        dest = "torchrun_" + name.replace("-", "_")
        short = [s for s in action.option_strings if len(s) == 2]     # -r, -t
        help_text = f"[torchrun] {_first_sentence(action.help or name)}"
        if action.nargs == 0:
            f = click.option(f"--{name}", *short, dest, is_flag=True, help=help_text)(f)
        else:
            kind, metavar = _click_type(name, action)
            f = click.option(f"--{name}", *short, dest, type=kind, default=None,
                             metavar=metavar, help=help_text)(f)
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
@setting_options
@click.option("--gpu-limit", type=Number(0.0, low_open=True, example="give GiB, e.g. "
                                         "--gpu-limit 12"),
              metavar="GIB", help="Cap each process's GPU memory, as a smaller GPU would.")
@click.option("--stats", type=click.Path(), metavar="FILE",
              help="Write LMS stats and step times as JSON at exit, also after SIGTERM (rank "
              "r>0: FILE.rank{r}); - or /dev/stdout: to standard output. FILE must be a regular "
              "file or new, not a symlink; it is replaced whole, and kept as it was if writing "
              "fails.")
@click.option("-q", "--quiet", is_flag=True,
              help="No summary at exit (--stats still writes the stats).")
@click.option("--summary", "summary_mode", type=click.Choice(["line", "full"]), default=None,
              help="At exit: line (the default) prints the headline: steps, settled step time, "
              "GPU peak against the limit, what a step swapped, rebuilt and recomputed; full "
              "adds the table of every counter (docs/run.md explains each).")
@click.option("-m", "--module", "as_module", is_flag=True,
              help="Run a module, as python -m does: lmsrt run -m pkg.train ARGS.")
@_torchrun_options
@click.argument("target_and_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
def command(gpu_limit: Optional[float], stats: Optional[str], quiet: bool,
            summary_mode: Optional[str],
            as_module: bool, target_and_args: Sequence[str], **options: object) -> None:
    """Run SCRIPT with LMS enabled from its first line to its last, unmodified.

    Options go before SCRIPT; everything after it is the script's own (--help included).
    Any torchrun option runs it under torch.distributed.run, LMS enabled in every worker.
    A bad option, LMSRT_* variable or --stats path exits 2 before SCRIPT starts; after
    that the exit status is the script's (130 after Ctrl-C, 143 after SIGTERM).

    \b
    Examples:
      lmsrt run --lms 1000 --lms-frac 0.75 train.py --epochs 3
      lmsrt run --lms-frac auto train.py
      lmsrt run --gpu-limit 12 --stats stats.json -m mypkg.train --lr 1e-3
      LMSRT_DEVICE=sim lmsrt run --gpu-limit 0.5 --summary full train.py
      lmsrt run --nproc-per-node 8 --lms-frac 0.6 train.py --batch-size 16
    """
    if not target_and_args:
        raise click.UsageError("no script given; name the script to run after the options, e.g. "
                               "lmsrt run --lms 1000 train.py (or -m pkg.module).")
    if quiet and summary_mode:
        raise click.UsageError("--quiet and --summary ask for opposite things; give one.")
    target, args = target_and_args[0], list(target_and_args[1:])
    if args[:1] == ["--"]:
        args = args[1:]        # as torchrun does: `lmsrt run train.py -- --flag` passes --flag
    _check_target(target, as_module)
    settings = settings_given(options)
    summary = "off" if quiet else summary_mode
    try:
        check_environment(lms_overrides=settings)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    stats_path = None
    if stats in STATS_STDOUT:
        stats_path = stats
    elif stats:
        try:
            stats_path = check_output_file(stats)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--stats'") from None
    forwarded = _forwarded_torchrun_args(options)
    device = settings.get("device") or os.environ.get(OPTIONS["device"].env)
    if gpu_limit is not None and not _gpu_limit_applies(gpu_limit, device):
        gpu_limit = None
    if forwarded:
        _exec_torchrun(forwarded, target, args, as_module, settings, stats_path, gpu_limit,
                       summary)
    raise SystemExit(_run_here(target, args, as_module, settings, stats_path, gpu_limit,
                               summary))


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
    else:
        try:
            check_script(target, "lmsrt run train.py (or -m pkg.module for a module)")
        except ValueError as e:
            raise click.UsageError(str(e)) from None


def _gpu_limit_applies(limit_gb: float, device: Optional[str]) -> bool:
    """Validate --gpu-limit against the GPU; False (after a warning) without one. Under
    LMSRT_DEVICE=sim it is the simulated GPU's size (``session.start``)."""
    if device in ("sim", "simulated"):
        return True
    import torch

    if not torch.cuda.is_available():
        click.echo(f"lmsrt: warning: no CUDA GPU, so --gpu-limit {limit_gb:g} is ignored "
                   f"(under {spelled('device', 'sim')} it is the simulated GPU's size).", err=True)
        return False
    try:
        check_gpu_limit(limit_gb)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--gpu-limit'") from None
    return True


def _forwarded_torchrun_args(torchrun: Dict[str, object]) -> List[str]:
    out = []
    for name, spelling, action in _TORCHRUN_OPTIONS:
        value = torchrun["torchrun_" + name.replace("-", "_")]
        if action.nargs == 0 and value:
            out.append(spelling)
        elif action.nargs != 0 and value is not None:
            out.append(f"{spelling}={value}")
    return out


def _exec_torchrun(forwarded: List[str], target: str, args: List[str], as_module: bool,
                   settings: Dict[str, object], stats_path: Optional[str],
                   gpu_limit: Optional[float], summary: Optional[str]) -> None:
    """Become ``python -m torch.distributed.run``; the bootstrap enables LMS in each worker.

    exec, not a child process: this process then holds no CUDA context (checking --gpu-limit may
    have made one) and signals reach torchrun directly.
    """
    env = os.environ
    for name, value in settings.items():
        env[OPTIONS[name].env] = env_value(value)
    if stats_path:
        env[ENV_STATS] = stats_path
    if gpu_limit is not None:
        env[ENV_GPU_LIMIT] = repr(gpu_limit)
    if summary is not None:
        env[ENV_SUMMARY] = summary
    env[ENV_BOOTSTRAP] = "1"
    env[ENV_LAUNCHER_PID] = str(os.getpid())
    env.pop(ENV_ACTIVE, None)   # a launch from inside an lmsrt run script starts afresh
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOTSTRAP_DIR, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "torch.distributed.run", *forwarded,
            *(["-m"] if as_module else []), target, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _run_here(target: str, args: List[str], as_module: bool, settings: Dict[str, object],
              stats_path: Optional[str], gpu_limit: Optional[float],
              summary: Optional[str]) -> int:
    """Run the script in this process with LMS on; return its exit status."""
    saved_active = os.environ.get(ENV_ACTIVE)
    try:
        session = start(lms_overrides=settings, stats_path=stats_path, gpu_limit_gb=gpu_limit,
                        summary=summary)
    except ValueError as e:   # e.g. a bad LMSRT_* variable in the environment
        raise click.UsageError(f"{e}") from None
    status, failed = 1, True
    try:
        end = run_script(target, args, as_module=as_module)
        # A traceback was printed: anything that ended it but SystemExit.
        status, failed = end.status, end.status != 0 and not isinstance(end.exception,
                                                                        SystemExit)
    finally:
        if not session.finish(failed) and status == 0:
            status = 1       # asked for stats and got none: no success to report
        if saved_active is None:
            os.environ.pop(ENV_ACTIVE, None)
        else:
            os.environ[ENV_ACTIVE] = saved_active
    return status
