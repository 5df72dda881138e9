"""What ``lmsrt run`` does inside each process it runs a script in.

LMS is enabled on the main thread before the script starts and stays active until it ends (the
engine finds the step boundaries itself); the GPU cap is applied first, since LMS reads the memory
it may use when it is created; at exit the stats go to a JSON file and the summary to stderr. The
stats file is checked before anything starts and written whole or not at all (``output.py``).
SIGTERM ends the script as ``sys.exit(143)`` would, so that its ``finally`` blocks run and the
stats are written, with the status a shell reports for a process SIGTERM killed (128 + 15).

``lmsrt run`` calls ``start()`` in its own process for a single-process run. For a torchrun run,
each worker calls ``start()`` from the bootstrap ``sitecustomize`` that the launcher puts first on
the workers' PYTHONPATH (``BOOTSTRAP_DIR``: ``bootstrap/`` beside this file), with everything
passed in the environment:

    LMSRT_LMS, LMSRT_LMS_FRAC, ...   the LMS settings (``lmsrt.options.OPTIONS``)
    LMSRT_STATS                      JSON stats file; rank r > 0 writes ``FILE.rank{r}``
    LMSRT_GPU_LIMIT_GB               the most GPU memory each process may allocate, GiB
    LMSRT_MAX_STEPS=N                end the script, as if it called ``sys.exit(0)``, when step
                                     N + 1 would start (``lmsrt tune`` sets it for its trials)
    LMSRT_ACTIVE=1                   set by ``start()``: a script that enables LMS itself reads it
                                     and does not enable it a second time (see examples/)
    LMSRT_SUMMARY=line|full|off      the summary at exit (rank 0, stderr): ``line`` (the default)
                                     its headline, ``full`` the headline and the table (``lmsrt
                                     run --summary full``; after the script's traceback the
                                     headline only), ``off`` nothing (``lmsrt run --quiet``)
    LMSRT_BOOTSTRAP, LMSRT_LAUNCHER_PID   tell the bootstrap which processes are workers

lmsrt's notes (the ``lmsrt`` logger, ``lmsrt/say.py``) print on stderr as one ``lmsrt: ...`` line
each, through the handler ``start()`` installs, unless the script configures logging itself.
Warnings whose message starts with ``lmsrt:`` print as that one line, without the source line
of lmsrt's that raised them (a launcher user did not write it); the script's own warnings print
as python prints them.

Example (what the bootstrap does)::

    session = lmsrt.launch.session.start()     # reads the variables above
    atexit.register(session.finish)
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
import warnings
from typing import Callable, Dict, List, Mapping, Optional

from .. import __version__, gpu_cap
from ..options import OPTIONS, spelled
from ..say import install_stderr_handler, say
from ..summary import format_off, format_summary
from ..units import GiB
from .output import check_output_file, write_atomic

__all__ = ["BOOTSTRAP_DIR", "ENV_ACTIVE", "ENV_STATS", "ENV_GPU_LIMIT", "ENV_MAX_STEPS",
           "ENV_SUMMARY", "SUMMARY_MODES", "STATS_SCHEMA", "ENV_BOOTSTRAP", "ENV_LAUNCHER_PID",
           "STATS_STDOUT", "Session", "StepClock", "check_environment", "check_gpu_limit",
           "apply_gpu_limit", "start", "stats_path_for_rank"]

ENV_ACTIVE = "LMSRT_ACTIVE"
ENV_STATS = "LMSRT_STATS"
ENV_GPU_LIMIT = "LMSRT_GPU_LIMIT_GB"
ENV_MAX_STEPS = "LMSRT_MAX_STEPS"
ENV_SUMMARY = "LMSRT_SUMMARY"
SUMMARY_MODES = ("line", "full", "off")
ENV_BOOTSTRAP = "LMSRT_BOOTSTRAP"
ENV_LAUNCHER_PID = "LMSRT_LAUNCHER_PID"

# Put first on the PYTHONPATH of torchrun's workers: holds only the sitecustomize.py that starts
# a session in each of them. A directory of files, never imported as a package.
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")

# Steps left out of the median step time: the first ones pin host slabs, autotune kernels and
# record the plan, and are slower than every step after.
WARMUP_STEPS = 2

# The version of the layout of the --stats file; raised when a field changes meaning or goes.
STATS_SCHEMA = 1


class StepClock:
    """Wall-clock time at the start of every step after the first, as a step listener of an LMS
    (``LMS.add_step_listener``).

    Times are host-side: without a device sync they equal GPU step times only in the steady
    state, where the host cannot run further ahead of the GPU, hence the median after warm-up.

    With ``max_steps`` N, the start of step N + 1 raises ``SystemExit(0)`` instead: the script
    ends there as if it had called ``sys.exit(0)``, and the session writes its stats as at any end.
    The exception leaves through the saved-tensor hook that found the new step, before the engine
    starts it, so the stats are those of N whole steps and of N - 1 timed ones.
    """

    def __init__(self, max_steps: Optional[int] = None) -> None:
        self.starts: List[float] = []
        self.max_steps = max_steps

    def __call__(self, step: int) -> None:
        self.starts.append(time.perf_counter())
        if self.max_steps is not None and step > self.max_steps:
            raise SystemExit(0)

    def step_times(self) -> List[float]:
        """Seconds between successive step starts: ``[i]`` is step ``i + 2``."""
        return [b - a for a, b in zip(self.starts, self.starts[1:])]

    def steady_times(self) -> List[float]:
        """The step times after the first ``WARMUP_STEPS`` (all of them if there are no more)."""
        times = self.step_times()
        return times[WARMUP_STEPS:] or times


# ``--stats -`` (or /dev/stdout): the stats go to standard output, every rank's to its own.
STATS_STDOUT = ("-", "/dev/stdout")


def stats_path_for_rank(path: str, rank: int) -> str:
    """Rank 0 writes ``path`` itself, rank r writes ``path.rank{r}`` (stdout: its own)."""
    return path if rank == 0 or path in STATS_STDOUT else f"{path}.rank{rank}"


def _write_stats(path: str, data: Dict[str, object]) -> None:
    if path in STATS_STDOUT:
        sys.stdout.flush()
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
        sys.stdout.flush()
    else:
        write_atomic(path, lambda f: json.dump(data, f, indent=1))


class Session:
    """One LMS kept active on the main thread for a whole script, and what it writes at the end.

    Example::

        session = Session(lmsrt.LMS.from_env(), stats_path="stats.json")
        session.start()
        try:
            runpy.run_path("train.py", run_name="__main__")
        finally:
            session.finish()
    """

    def __init__(self, lms, stats_path: Optional[str] = None, rank: int = 0, world_size: int = 1,
                 max_steps: Optional[int] = None, summary: str = "line"):
        self.lms = lms
        self.summary = summary
        self.stats_path = stats_path
        self.max_steps = max_steps
        self.rank = rank
        self.world_size = world_size
        self.clock: Optional[StepClock] = None
        self._finished = False
        self._sigterm = None         # the SIGTERM handler to put back, when start() replaced it
        self._formatwarning = None   # warnings.formatwarning to put back, when start() replaced it
        self.optimizer_steps = 0     # torch.optim steps taken (a step of LMS is a micro-batch)
        self._optimizer_hook = None

    def start(self) -> "Session":
        self.lms.__enter__()
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        if self.lms.enabled:
            # After __enter__, so the first time taken is the start of step 2: step 1 also holds
            # the script's set-up, which is no step time.
            self.clock = StepClock(self.max_steps)
            self.lms.add_step_listener(self.clock)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._optimizer_hook = register_optimizer_step_post_hook(self._count_optimizer_step)
        os.environ[ENV_ACTIVE] = "1"
        return self

    def _count_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1

    def stats(self) -> Dict[str, object]:
        """``LMS.stats()`` plus ``step_times_s`` (from step 2 on), ``step_time_median_s`` (without
        the first ``step_time_warmup`` of them), ``rank``, ``world_size``, ``lmsrt_version`` and
        ``schema`` (``STATS_SCHEMA``)."""
        data = {"lmsrt_version": __version__, "schema": STATS_SCHEMA, **self.lms.stats()}
        if not data["history"] and not _saved_any(data["last_step"]):
            # The session opened step 1 before the script started; a script that saved no
            # tensor for backward (no forward, or only under no_grad) ran no step.
            data["total"]["steps"] = 0
        times = self.clock.step_times() if self.clock else []
        steady = self.clock.steady_times() if self.clock else []
        data["step_times_s"] = times
        data["step_time_median_s"] = statistics.median(steady) if steady else None
        data["step_time_warmup"] = len(times) - len(steady)
        data["optimizer_steps"] = self.optimizer_steps
        data["rank"] = self.rank
        data["world_size"] = self.world_size
        return data

    def finish(self, failed: Optional[bool] = None) -> bool:
        """Turn LMS off, write the stats file, print the summary (rank 0, as ``summary`` says),
        free pinned memory.

        Runs once, whether the script returned, raised, called ``sys.exit`` or got SIGTERM.
        ``failed``: the script's traceback was printed (None: python's record of an uncaught
        exception says, as at exit in a torchrun worker). Returns False when the stats file could
        not be written (the reason is printed).
        """
        if self._finished:
            return True
        self._finished = True
        if failed is None:
            failed = getattr(sys, "last_value", None) is not None
        if self._formatwarning is not None:
            warnings.formatwarning = self._formatwarning
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        if self._sigterm is not None and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, self._sigterm)   # a second SIGTERM ends it at once
        written = True
        try:
            self.lms.__exit__(None, None, None)
        except Exception as e:   # noqa: BLE001 - the script left other hooks on the stack
            say(f"could not remove the LMS hooks cleanly ({e})")
        try:
            if self.stats_path:
                path = stats_path_for_rank(self.stats_path, self.rank)
                try:
                    _write_stats(path, self.stats())
                except OSError as e:
                    written = False
                    say(f"could not write the stats to {path} ({e}); give --stats a path on "
                        "a file system with room, that nothing else writes.",
                        level=logging.ERROR)
            text = self._summary(failed) if self.rank == 0 and self.summary != "off" else ""
            if text:
                sys.stdout.flush()
                print(text, file=sys.stderr, flush=True)
        finally:
            self.lms.close()
        return written

    def _summary(self, failed: bool) -> str:
        """The headline; with ``summary`` full the table too, unless the script failed (its
        traceback stays the last thing printed, but for this line). LMS off: one line, asked
        for only (the warning that it is off was given as it started)."""
        if not self.lms.enabled:
            data = self.lms.stats()
            return format_off(data["off_reason"]) if self.summary == "full" else ""
        return format_summary(self.stats(), full=self.summary == "full" and not failed)


def _saved_any(step: Mapping[str, object]) -> bool:
    """Whether a step's counters show a tensor saved for backward while LMS was on."""
    return any(step[k] for k in ("out_tensors", "kept_tensors", "skipped_tensors",
                                 "live_tensors", "recipe_tensors"))


def _plain_lmsrt_warnings() -> Callable:
    """Make lmsrt's own warnings print as their one line; return the formatter to put back."""
    original = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        if str(message).startswith("lmsrt:"):
            return f"{message}\n"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    return original


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _cuda_index(device: Optional[str]) -> Optional[int]:
    """The CUDA device index a device spec names; None for the current device or no CUDA."""
    if device and device.startswith("cuda:"):
        return int(device.split(":", 1)[1])
    return None


def check_gpu_limit(limit_gb: float, index: Optional[int] = None) -> Optional[float]:
    """The per-process memory fraction for a cap of ``limit_gb`` GiB on one GPU.

    Returns None (after a warning) when there is no CUDA GPU; raises ValueError when the cap is
    not positive or exceeds the GPU.
    """
    if not (math.isfinite(limit_gb) and limit_gb > 0):
        raise ValueError(f"{limit_gb!r} GiB is not a GPU memory cap; give a positive number of "
                         "GiB, e.g. --gpu-limit 12")
    import torch

    if not torch.cuda.is_available():
        say(f"no CUDA GPU, so --gpu-limit {limit_gb:g} is ignored (under "
            f"{spelled('device', 'sim')} it is the simulated GPU's size).")
        return None
    index = torch.cuda.current_device() if index is None else index
    return limit_gb * GiB / gpu_cap.check(limit_gb * GiB, index)


def apply_gpu_limit(limit_gb: float, index: Optional[int] = None,
                    environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Cap GPU ``index`` (the current one if None) at ``limit_gb`` GiB as ``--gpu-limit`` does
    (lmsrt/gpu_cap.py): the way it was done, or None without a CUDA GPU; ValueError as
    ``check_gpu_limit`` and ``gpu_cap.apply`` raise it."""
    if check_gpu_limit(limit_gb, index) is None:
        return None
    import torch

    index = torch.cuda.current_device() if index is None else index
    return gpu_cap.apply(int(limit_gb * GiB), index, environ)


def start(environ: Optional[Mapping[str, str]] = None, *, lms_overrides: Optional[dict] = None,
          stats_path: Optional[str] = None, gpu_limit_gb: Optional[float] = None,
          summary: Optional[str] = None) -> Session:
    """Cap the GPU, enable LMS on this thread for good, and return the session to ``finish()``.

    Arguments left None come from ``environ`` (``LMSRT_STATS``, ``LMSRT_GPU_LIMIT_GB``,
    ``LMSRT_SUMMARY``, and the LMS settings through ``LMS.from_env``). The device is
    ``LMSRT_DEVICE`` if set, else ``cuda:LOCAL_RANK`` under torchrun (made the current device),
    else the current CUDA device.
    Raises ValueError, before anything starts, for a bad setting or a stats file that cannot be
    written.

    Example::

        session = start(lms_overrides={"lms": 1000, "lms_frac": 0.5}, stats_path="s.json")
    """
    install_stderr_handler()
    original = _plain_lmsrt_warnings()
    try:
        session = _session(os.environ if environ is None else environ, lms_overrides,
                           stats_path, gpu_limit_gb, summary)
    except BaseException:
        warnings.formatwarning = original
        raise
    session._formatwarning = original
    return session.start()


def _session(environ: Mapping[str, str], lms_overrides: Optional[dict],
             stats_path: Optional[str], gpu_limit_gb: Optional[float],
             summary: Optional[str]) -> Session:
    import torch

    from ..config import LMSConfig
    from ..device import SimulatedDevice
    from ..lms import LMS

    max_steps = _max_steps(environ)
    summary = summary or _summary_mode(environ)
    rank = int(environ.get("RANK", 0) or 0)
    stats_path = stats_path or environ.get(ENV_STATS) or None
    if stats_path and stats_path not in STATS_STDOUT:
        try:
            check_output_file(stats_path_for_rank(stats_path, rank))
        except ValueError as e:
            raise ValueError(f"--stats {e}") from None
    overrides = dict(lms_overrides or {})
    local_rank = environ.get("LOCAL_RANK")
    device_env = OPTIONS["device"].env
    if ("device" not in overrides and not environ.get(device_env) and local_rank is not None
            and int(local_rank) < torch.cuda.device_count()):
        overrides["device"] = f"cuda:{int(local_rank)}"
        # What the script will do anyway; done now, because pinning host memory before the script
        # picks its device would create a CUDA context on GPU 0 in every rank.
        torch.cuda.set_device(int(local_rank))
    device = overrides.get("device") or environ.get(device_env)
    if gpu_limit_gb is None:
        gpu_limit_gb = _env_gpu_limit(environ)
    simulated = None
    if gpu_limit_gb is not None and device in ("sim", "simulated"):
        # The simulated GPU is as big as the cap, so swapping shows without a GPU.
        simulated = SimulatedDevice(capacity=int(gpu_limit_gb * GiB))
    elif gpu_limit_gb is not None:
        index = _cuda_index(device)
        apply_gpu_limit(gpu_limit_gb, index, environ)
    lms = LMS(config=LMSConfig.from_env(environ, **overrides), device=simulated)
    return Session(lms, stats_path=stats_path, rank=rank,
                   world_size=int(environ.get("WORLD_SIZE", 1) or 1), max_steps=max_steps,
                   summary=summary)


def check_environment(environ: Optional[Mapping[str, str]] = None,
                      lms_overrides: Optional[dict] = None) -> None:
    """Raise ValueError, saying what to set instead, for ``LMSRT_*`` variables that ``start()``
    would refuse: what ``lmsrt run`` checks before it hands over to torchrun, whose workers would
    each fail alone."""
    from ..config import LMSConfig
    from ..device import sim_capacity

    environ = os.environ if environ is None else environ
    LMSConfig.from_env(environ, **(lms_overrides or {}))
    sim_capacity(environ)
    _max_steps(environ)
    _env_gpu_limit(environ)
    gpu_cap.way(environ)
    gpu_cap.spare(environ)
    _summary_mode(environ)


def _summary_mode(environ: Mapping[str, str]) -> str:
    raw = environ.get(ENV_SUMMARY) or "line"
    if raw not in SUMMARY_MODES:
        raise ValueError(f"{ENV_SUMMARY}={raw!r} is not one of {', '.join(SUMMARY_MODES)}; set "
                         f"it to e.g. {ENV_SUMMARY}=off, or unset it")
    return raw


def _env_gpu_limit(environ: Mapping[str, str]) -> Optional[float]:
    raw = environ.get(ENV_GPU_LIMIT)
    if not raw:
        return None
    try:
        limit = float(raw)
    except ValueError:
        limit = math.nan
    if not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"{ENV_GPU_LIMIT}={raw!r} is not a number of GiB > 0; set it to e.g. "
                         f"{ENV_GPU_LIMIT}=12, or unset it")
    return limit


def _max_steps(environ: Mapping[str, str]) -> Optional[int]:
    raw = environ.get(ENV_MAX_STEPS)
    if not raw:
        return None
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(f"{ENV_MAX_STEPS}={raw!r} is not a number of steps; set it to a whole "
                         f"number >= 1, e.g. {ENV_MAX_STEPS}=8, or unset it")
    return steps
