"""``lmsrt profile``: where the GPU memory of one training step of a script goes.

The script runs here through runpy, unmodified, as ``python script.py`` would run it, with the
recorder's hooks installed globally (every module's forward, every optimizer's step, a saved-tensors
hook pair on this thread). It is stopped once the profiled step is over, and the report is printed:
per-module table, peak and where it happens, the largest layer, and whether the step fits the GPU
or what LMS settings to start with. A script that fails ends as under python: its traceback (the
frames of lmsrt and runpy left out), the message of ``sys.exit("...")``, its exit status, 130
after Ctrl-C; the report then says where in the step it failed. Output files are checked before
the script starts and written whole (NOTE [ Output files ] in ``lmsrt.launch.output``).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import click
import torch

from ..launch.output import check_output_file, write_atomic
from ..launch.script import check_script, run_script
from ..launch.session import apply_gpu_limit
from ..profiler import render
from ..profiler.recorder import StepDone, StepRecorder
from ..profiler.report import build_report
from ..summary import format_blocks
from ._types import Number

__all__ = ["command"]

# Where autograd's backward starts, in a traceback: an exception that passed one was raised in
# backward, though the recorder may not have seen the backward begin (it sees saved tensors used).
_BACKWARD_ENTRIES = {("torch.autograd", "backward"), ("torch.autograd", "grad"),
                     ("torch._tensor", "backward")}


@click.command("profile", context_settings=dict(allow_interspersed_args=False))
@click.option("--gpu-limit", type=Number(0.0, low_open=True, example="give GiB, e.g. "
                                         "--gpu-limit 8"), metavar="GIB",
              help="Cap this process's GPU memory at GIB, as a smaller GPU would; if the step "
              "runs out of memory the report says where.")
@click.option("--gpu-size", type=Number(0.0, low_open=True, example="give GiB, e.g. "
                                        "--gpu-size 8"), metavar="GIB",
              help="GPU size for the verdict (default: what this process may use of this "
              "GPU). Without a GPU: the size to predict for, e.g. --gpu-size 8.")
@click.option("--steps", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Profile the Nth step (from the 2nd on, optimizer state of earlier steps "
              "is there).")
@click.option("--html", type=click.Path(), metavar="FILE",
              help="Also write the report as a self-contained HTML page.")
@click.option("--png", type=click.Path(), metavar="FILE",
              help="Also write the memory timeline as a PNG (needs matplotlib).")
@click.option("--snapshot", type=click.Path(), metavar="FILE",
              help="Also write PyTorch's memory snapshot of the step, for "
              "pytorch.org/memory_viz (CUDA only).")
@click.argument("target_and_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
def command(gpu_limit: Optional[float], gpu_size: Optional[float], steps: int, html: Optional[str],
            png: Optional[str], snapshot: Optional[str], target_and_args: Sequence[str]) -> None:
    """Run one training step of SCRIPT and report where its memory goes.

    Options go before SCRIPT (or before --); everything after it is the script's own. A step
    ends at the first optimizer step, or at the next forward of the model after a backward;
    the script is stopped there.

    \b
    Examples:
      lmsrt profile train.py --batch-size 4
      lmsrt profile --gpu-limit 8 --html report.html -- train.py
      lmsrt profile --gpu-size 8 --png timeline.png train.py     (no GPU: an estimate)
    """
    if not target_and_args:
        raise click.UsageError("no script given; name it after the options, e.g. "
                               "lmsrt profile --gpu-size 8 train.py")
    script, args = target_and_args[0], list(target_and_args[1:])
    try:
        check_script(script, "lmsrt profile train.py")
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    # Absolute, in case the script changes directory.
    html, png, snapshot = (_output_path(p, flag) for p, flag in
                           ((html, "--html"), (png, "--png"), (snapshot, "--snapshot")))
    _check_outputs_possible(png, snapshot)
    if gpu_limit is not None:
        _apply_gpu_limit(gpu_limit)
    from ..lms import open_lms
    before = {id(lms) for lms in open_lms()}         # the script's LMS objects are the others
    rec, status, where = _run_step(script, args, steps, snapshot)
    if status == 130:
        raise SystemExit(130)          # Ctrl-C: stop, as python would; no report
    if not rec.done:
        click.echo(f"lmsrt profile: {script} ended before step {steps} began (it started "
                   f"{rec.step}). The script must train a module with gradients enabled; ask "
                   "for fewer --steps, or check the script's arguments.", err=True)
        raise SystemExit(status or 1)
    if gpu_size is None and not rec.measured:
        gpu_size = gpu_limit       # no GPU to cap: predict for a GPU of that size instead
    report = build_report(rec, f"{type(rec.root).__name__} in {os.path.basename(script)}",
                          gpu_size)
    report.script = " ".join([script, *args])
    if not rec.backward_seen and not where.startswith(_IN_BACKWARD):
        report.notes.append("no backward was seen: the figures cover forward only.")
    click.echo(f"\n{report}")
    _echo_blocks(before)
    outputs = []
    if png:
        data = report.png_bytes()
        if data is None:
            click.echo(f"lmsrt: {render.MATPLOTLIB_MISSING}", err=True)
        else:
            outputs.append((png, "the timeline", data))
    if html:
        outputs.append((html, "the report", render.html(report).encode()))
    for path, what, data in outputs:
        try:
            write_atomic(path, lambda f: f.write(data), binary=True)
            click.echo(f"wrote {what} to {path}")
        except OSError as e:
            click.echo(f"lmsrt: could not write {what} to {path} ({e}); give a path on a file "
                       "system with room.", err=True)
            status = status or 1
    if snapshot and rec.measured:
        click.echo(f"wrote the memory snapshot to {snapshot} (open it in pytorch.org/memory_viz)")
    raise SystemExit(status)


def _echo_blocks(before: set) -> None:
    """Per block, what the script's own ``lmsrt.LMS`` did with the step's saved tensors (the
    report above measures the step as if without it); ``before``: ids of the LMS objects open
    before the script ran, not its own."""
    from ..lms import open_lms
    for lms in open_lms():
        if id(lms) in before:
            continue
        stats = lms.stats()
        lines = format_blocks(stats["blocks"])
        if lines:
            click.echo(f"\nunder the script's lmsrt.LMS, step {stats['last_step']['step']}:")
            click.echo("\n".join(lines))


def _check_outputs_possible(png: Optional[str], snapshot: Optional[str]) -> None:
    """An output asked for that this machine cannot make exits 2 before the script runs, not
    with status 0 and nothing written after it."""
    if png and not render.have_matplotlib():
        raise click.UsageError(f"--png: {render.MATPLOTLIB_MISSING} (or leave --png out; "
                               "--html draws the timeline without it).")
    if snapshot and not torch.cuda.is_available():
        raise click.UsageError("--snapshot needs a CUDA GPU, and this machine has none: "
                               "PyTorch's memory snapshot records the CUDA allocator. Leave "
                               "--snapshot out, or run on a GPU machine.")


def _apply_gpu_limit(limit_gb: float) -> None:
    if not torch.cuda.is_available():
        click.echo(f"lmsrt: no CUDA GPU to cap, so the report predicts for a GPU of "
                   f"{limit_gb:g} GiB instead.", err=True)
        return
    try:
        apply_gpu_limit(limit_gb)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--gpu-limit'") from None


def _output_path(path: Optional[str], flag: str) -> Optional[str]:
    if not path:
        return None
    try:
        return check_output_file(path)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=f"'{flag}'") from None


_IN_BACKWARD = "in backward"


def _where(rec: StepRecorder, e: BaseException) -> str:
    """Where in the step ``e`` was raised: ``in forward of net.3 (Conv2d)``, ``in backward``..."""
    where = rec.where_failed(e)
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _BACKWARD_ENTRIES:
            return f"in {where}" if where.startswith("backward") else _IN_BACKWARD
        tb = tb.tb_next
    return f"in {where}"


def _run_step(script: str, args: List[str], steps: int,
              snapshot: Optional[str]) -> Tuple[StepRecorder, int, str]:
    """Run ``script`` until step ``steps`` is over; return the recorder, an exit status, and
    where the script failed (``""`` if it did not)."""
    rec = StepRecorder(target=steps, stop=True, snapshot=snapshot)
    click.echo(f"lmsrt profile: running {script} to the end of step {steps}")
    end = run_script(script, args, around=rec, finished=(StepDone,),
                     quiet=(torch.OutOfMemoryError,))
    status, e, where = end.status, end.exception, ""
    if isinstance(e, StepDone) or e is None:
        pass
    elif isinstance(e, SystemExit):
        if status:
            where = _where(rec, e)
            rec.finish(error=f"the script exited with status {status} {where}")
    elif isinstance(e, KeyboardInterrupt):
        where = _where(rec, e)
        click.echo(f"lmsrt profile: interrupted {where}; no report.", err=True)
    elif isinstance(e, torch.OutOfMemoryError):
        where = _where(rec, e)
        said = ". ".join(str(e).split(". ")[:2]) or "CUDA out of memory"
        rec.finish(error=f"ran out of GPU memory {where}: {said}")
    else:
        where = _where(rec, e)
        rec.finish(error=f"the script raised {type(e).__name__} {where}")
    rec.finish()     # a script that ends inside the step (one step, no optimizer) ends it
    return rec, status, where
