"""Where the GPU memory of a training step goes, module by module, and what LMS would do about it.

``memory_report(model, x, optimizer=opt)`` runs one step and returns a ``MemoryReport``: a table
in forward order (output shape, bytes saved for backward, parameters, gradients, optimizer
state, transient peak), the step's peak and where it happens, the largest single-layer working
set, and for a GPU size a verdict: fits, or how many bytes LMS must move and the ``lms`` /
``lms_frac`` to start with. ``lmsrt profile`` makes the same report for one step of a script.
The measuring is in ``recorder.py`` (NOTE [ Where memory is attributed ]); the text, the PNG and
the HTML in ``render.py``.

NOTE [ The predicted peak ]
  predicted = max(turn, optimizer step), where
    turn = params + buffers + grads + optimizer state + every byte saved for backward
           + the step's outputs the caller still holds (when nothing saved them)
           + the largest transient of any module,
    optimizer step = params + buffers + grads + optimizer state + the optimizer's transient.
  Assumptions: the peak comes where forward turns into backward, when everything saved is still
  alive, plus the working memory of one module (in backward: the gradients it is producing and
  its workspaces); the steady state, in which the optimizer state of earlier steps is there
  and gradients of the whole model are counted (an upper bound: with ``zero_grad(set_to_none=
  True)`` they grow while the saved tensors are freed). On CUDA the transients are measured.
  Elsewhere (CPU, meta) they are estimated: a module's transient as its inputs plus its outputs
  (the gradients of both are alive during its backward), the optimizer's as one more copy of
  the parameters (what a foreach update allocates). Memory outside PyTorch's allocator (the
  CUDA context, library handles) and fragmentation are left to the verdict's headroom.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional

import torch
from torch.utils._pytree import tree_leaves

from ..options import OPTIONS
from ..units import GiB, MiB, format_bytes
from . import render
from .recorder import ModuleStats, Sample, StepRecorder

__all__ = ["memory_report", "MemoryReport", "ModuleRow", "Verdict", "build_report", "headroom"]

_LMS_KB = 1000          # Caffe LMS's customary threshold; lowered only when big tensors are few


def headroom(gpu_size: int) -> int:
    """Bytes of a GPU the allocator cannot use: the CUDA context and library handles (about
    256 MiB) and fragmentation (about 5%), at most a tenth of the GPU.

    Example::

        headroom(8 * GiB)       # 666 MiB of an 8 GiB GPU
    """
    return int(min(0.10 * gpu_size, 256 * MiB + 0.05 * gpu_size))


@dataclasses.dataclass(frozen=True)
class ModuleRow:
    """One module's line of the report. Figures are the module's own, not its children's,
    except ``transient``, which includes what its children allocate and free again."""

    name: str
    type: str
    depth: int
    calls: int
    output_shape: str
    saved_bytes: int            # storages it saved first; each storage counts once in the step
    saved_used_bytes: int       # every storage its backward reads, shared ones included
    output_bytes: int           # storages its outputs created (each counted once)
    io_bytes: int               # tensor inputs plus outputs of its largest call
    param_bytes: int            # its own parameters and buffers
    grad_bytes: int
    optimizer_bytes: int
    transient_bytes: Optional[int]    # measured on CUDA; None elsewhere
    is_leaf: bool

    @property
    def working_set_bytes(self) -> int:
        """What its backward needs at once: parameters, gradients, the saved tensors it reads,
        and its transient (estimated as inputs plus outputs where none was measured)."""
        transient = self.io_bytes if self.transient_bytes is None else self.transient_bytes
        return self.param_bytes + self.grad_bytes + self.saved_used_bytes + transient

    @classmethod
    def from_stats(cls, s: ModuleStats) -> "ModuleRow":
        leaf = s.module is None or next(iter(s.module.children()), None) is None
        return cls(s.name, s.type, s.depth, s.calls, s.output_shape, s.saved, s.used,
                   s.output_bytes, s.io_bytes, s.params, s.grads, s.optimizer, s.transient, leaf)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a step fits a GPU of ``gpu_size_bytes``, and the LMS settings to start with."""

    gpu_size_bytes: int
    headroom_bytes: int
    predicted_peak_bytes: int
    fits: bool
    move_bytes: int             # bytes LMS must keep in host memory at the peak; 0 if it fits
    floor_bytes: int            # parameters, gradients and the largest layer (or three parts
                                # of the optimizer's step): LMS cannot go lower
    possible: bool              # fits, or LMS can make it fit
    lms_kb: Optional[int]
    lms_frac: Optional[float]
    largest_layer: str
    script: str = "train.py"
    state_moves_bytes: int = 0  # optimizer state that must live in host memory between steps

    def __str__(self) -> str:
        size, usable = format_bytes(self.gpu_size_bytes), self.gpu_size_bytes - self.headroom_bytes
        if self.fits:
            return (f"fits a GPU of {size}: predicted peak "
                    f"{format_bytes(self.predicted_peak_bytes)}, "
                    f"{format_bytes(usable - self.predicted_peak_bytes)} to spare after "
                    f"{format_bytes(self.headroom_bytes)} of headroom. LMS is not needed.")
        text = (f"does not fit a GPU of {size}: predicted peak "
                f"{format_bytes(self.predicted_peak_bytes)} > {format_bytes(usable)} usable "
                f"({size} less {format_bytes(self.headroom_bytes)} headroom for the CUDA context "
                f"and fragmentation).")
        if not self.possible:
            return (f"{text}\n  Not even LMS can fit it: the floor is "
                    f"{format_bytes(self.floor_bytes)} (parameters and gradients, which LMS "
                    f"does not move, plus the working set of {self.largest_layer} or three parts "
                    f"of the optimizer's step), or too few saved tensors to move. Use a smaller "
                    f"batch or input, activation checkpointing, or a GPU with more than "
                    f"{format_bytes(self.floor_bytes + self.headroom_bytes)}.")
        lms, frac = OPTIONS["lms"].flag, OPTIONS["lms_frac"].flag
        state = (f" Its optimizer state ({format_bytes(self.state_moves_bytes)}) must live in "
                 f"host memory between steps, which {OPTIONS['optimizer_state'].flag} auto (the "
                 "default) does." if self.state_moves_bytes else "")
        return (f"{text}\n  LMS must move {format_bytes(self.move_bytes)} to host memory.{state} "
                f"Start with:\n    lmsrt run {lms} {self.lms_kb} {frac} "
                f"{self.lms_frac:.2f} {self.script}   (lmsrt.LMS(lms={self.lms_kb}, "
                f"lms_frac={self.lms_frac:.2f}))")


@dataclasses.dataclass
class MemoryReport:
    """The memory of one training step. ``print(report)`` shows the table and the verdict.

    Example::

        report = lmsrt.memory_report(model, x, optimizer=opt, gpu_size=8)
        print(report)
        report.verdict(16).fits
        report.save_html("memory.html")
    """

    title: str
    device: str
    measured: bool                  # figures from the CUDA allocator; False: an estimate
    step: int
    rows: List[ModuleRow]
    saved_sizes: List[int]          # every storage saved for backward, once
    output_bytes: int               # outputs the caller held at backward start, not saved
    optimizer_transient_bytes: Optional[int]
    measured_peak_bytes: Optional[int]
    measured_peak_where: str
    baseline_bytes: Optional[int]   # allocated when the step began (measured only)
    timeline: List[Sample]
    gpu_size_bytes: Optional[int]   # the size ``verdict()`` uses by default
    notes: List[str] = dataclasses.field(default_factory=list)
    script: str = "train.py"        # the command line the verdict's `lmsrt run` line names

    def _total(self, field: str) -> int:
        return sum(getattr(r, field) for r in self.rows)

    @property
    def saved_bytes(self) -> int:
        return self._total("saved_bytes")

    @property
    def param_bytes(self) -> int:
        return self._total("param_bytes")

    @property
    def grad_bytes(self) -> int:
        return self._total("grad_bytes")

    @property
    def optimizer_bytes(self) -> int:
        return self._total("optimizer_bytes")

    @property
    def state_bytes(self) -> int:
        """Parameters, buffers, gradients and optimizer state: what LMS leaves on the GPU."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def largest_transient(self) -> ModuleRow:
        """The module with the largest transient (measured), or the largest inputs plus outputs
        of a leaf module (the estimate, where nothing was measured)."""
        if self.measured:
            return max(self.rows, key=lambda r: r.transient_bytes or 0)
        return max(self.rows, key=lambda r: r.io_bytes if r.is_leaf else 0)

    @property
    def largest_transient_bytes(self) -> int:
        row = self.largest_transient
        return (row.transient_bytes or 0) if self.measured else row.io_bytes

    @property
    def largest_layer(self) -> ModuleRow:
        """The largest single-layer working set: the floor below which not even LMS can go."""
        layers = [r for r in self.rows if r.is_leaf or r.saved_used_bytes]
        return max(layers, key=lambda r: r.working_set_bytes)

    @property
    def update_transient_bytes(self) -> int:
        """Temporaries of the optimizer step: measured, or estimated as one more copy of the
        parameters (what a foreach update allocates) where there is optimizer state."""
        if self.optimizer_transient_bytes is not None:
            return self.optimizer_transient_bytes
        return self.param_bytes if self.optimizer_bytes else 0

    @property
    def turn_bytes(self) -> int:
        """Predicted use where forward turns into backward (NOTE [ The predicted peak ])."""
        return (self.state_bytes + self.saved_bytes + self.output_bytes
                + self.largest_transient_bytes)

    @property
    def optimizer_step_bytes(self) -> int:
        """Predicted use during the optimizer step (NOTE [ The predicted peak ])."""
        return self.state_bytes + self.update_transient_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """NOTE [ The predicted peak ]."""
        return max(self.turn_bytes, self.optimizer_step_bytes)

    @property
    def predicted_peak_where(self) -> str:
        if self.optimizer_step_bytes > self.turn_bytes:
            return "in the optimizer step"
        return "at the turn from forward to backward"

    def verdict(self, gpu_size: Optional[float] = None) -> Optional[Verdict]:
        """Fit on a GPU of ``gpu_size`` GiB (default: the report's GPU); None if no size is known.

        ``lms_frac`` puts the mark (``lms_frac * size``, the use below which LMS moves nothing)
        where backward still fits on top of it: backward adds the gradients and the largest
        layer's working set (the saved tensors it brings back and its transient), and all of it
        must stay within the usable memory, so
        ``lms_frac = (size - headroom - grads - largest layer) / size``, rounded down to a
        hundredth. ``lms`` is 1000 KB when the saved tensors of at least 1000 KB hold the bytes
        to move, else the size of the smallest saved tensor needed to reach them.

        Example::

            v = report.verdict(8)
            print(v.fits, v.move_bytes, v.lms_kb, v.lms_frac)
        """
        size = int(gpu_size * GiB) if gpu_size is not None else self.gpu_size_bytes
        if size is None:
            return None
        room = headroom(size)
        usable, peak = size - room, self.predicted_peak_bytes
        layer = self.largest_layer
        layer_need = layer.working_set_bytes - layer.param_bytes - layer.grad_bytes
        # Parameters, gradients and one layer's backward stay on the GPU whatever LMS does; the
        # optimizer state can live on the host, its step run in parts of a sixteenth of the
        # size, three of them (with their share of the update's temporaries) on the GPU at once
        # (movers/optimizer.py, NOTE [ Optimizer state on the host ]).
        model = self.param_bytes + self.grad_bytes
        state = self.optimizer_bytes
        in_step = min(state, 3 * (size >> 4))
        temporaries = self.update_transient_bytes
        if state:
            temporaries = temporaries * in_step // state
        floor = max(model + layer_need, model + in_step + temporaries)
        move = max(0, peak - usable)
        # Where the state on the GPU leaves no room for a layer's backward or for the whole
        # update, it moves; the saved tensors make up the rest at the turn.
        moves_state = state if move and (model + state + layer_need > usable
                                         or self.optimizer_step_bytes > usable) else 0
        if moves_state:
            move = moves_state + max(0, self.turn_bytes - moves_state - usable)
        saved_move = move - moves_state
        lms_kb = (_choose_lms_kb(self.saved_sizes, saved_move) if saved_move
                  else _LMS_KB if move else None)
        possible = move == 0 or (floor <= usable and lms_kb is not None)
        frac = None
        if move and possible:
            frac = max(0.0, math.floor((usable - self.grad_bytes - layer_need) / size * 100) / 100)
        return Verdict(size, room, peak, move == 0, move, floor, possible, lms_kb, frac,
                       f"{layer.name} ({layer.type})", self.script, moves_state)

    def format(self) -> str:
        """The report as text: the table, the totals, the peaks and the verdict."""
        return render.format_text(self)

    def __str__(self) -> str:
        return self.format()

    def png_bytes(self) -> Optional[bytes]:
        """The memory timeline as a PNG, or None when matplotlib is not installed."""
        return render.png_bytes(self)

    def save_png(self, path: str) -> bool:
        """Write the timeline PNG; False (and nothing written) when matplotlib is missing."""
        data = self.png_bytes()
        if data is None:
            return False
        with open(path, "wb") as f:
            f.write(data)
        return True

    def save_html(self, path: str) -> None:
        """Write the report as one self-contained HTML page (table and embedded timeline)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(render.html(self))


def _choose_lms_kb(sizes: List[int], need: int) -> Optional[int]:
    if sum(s for s in sizes if s >= _LMS_KB * 1024) >= need:
        return _LMS_KB
    total = 0
    for s in sorted(sizes, reverse=True):
        total += s
        if total >= need:
            return max(1, s // 1024)
    return None


def build_report(rec: StepRecorder, title: str, gpu_size: Optional[float] = None) -> MemoryReport:
    """Turn a finished ``StepRecorder`` into a report; ``gpu_size`` in GiB (default: the
    memory the recorded GPU lets this process use, or none without a GPU).

    Example::

        rec = StepRecorder(target=2, stop=True)
        with rec:
            runpy.run_path("train.py", run_name="__main__")    # stopped by StepDone
        print(build_report(rec, "train.py", gpu_size=8))
    """
    size = int(gpu_size * GiB) if gpu_size is not None else None
    device = str(rec.device) if rec.device is not None else "cpu"
    if rec.measured:
        device = f"{device} ({rec.meter.name})"
        # The total, or less under a per-process cap (lmsrt profile --gpu-limit).
        size = size if size is not None else rec.meter.memory_limit()
    notes = []
    if rec.error:
        notes.append(f"partial: {rec.error}")
    if not rec.optimizers_seen:
        notes.append("no optimizer step was seen in the step, so optimizer state is not counted "
                     "(memory_report: pass optimizer=).")
    if not rec.measured:
        notes.append(f"ESTIMATE: ran on {device}, not a GPU. Saved bytes, parameters and shapes "
                     "are exact; transients and the peak are modelled (NOTE [ The predicted "
                     "peak ] in lmsrt/profiler/report.py). Run on a GPU for measured figures.")
    return MemoryReport(
        title=title, device=device, measured=rec.measured, step=rec.step,
        rows=[ModuleRow.from_stats(s) for s in rec.modules()],
        saved_sizes=list(rec.saved_sizes), output_bytes=rec.output_bytes,
        optimizer_transient_bytes=rec.optimizer_transient,
        measured_peak_bytes=rec.peak if rec.measured else None,
        measured_peak_where=rec.peak_where, baseline_bytes=rec.baseline if rec.measured else None,
        timeline=list(rec.timeline), gpu_size_bytes=size, notes=notes)


def _default_loss(output) -> torch.Tensor:
    parts = [t.sum() for t in tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not parts:
        raise ValueError("the model's output does not require grad, so there is no backward to "
                         "measure: check that its parameters require grad, or pass loss_fn=.")
    return sum(parts[1:], parts[0])


def memory_report(model: torch.nn.Module, *example_inputs,
                  optimizer: Optional[torch.optim.Optimizer] = None,
                  loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                  gpu_size: Optional[float] = None) -> MemoryReport:
    """Run one training step of ``model`` on ``example_inputs`` and report where memory goes.

    The step is real: forward, ``loss_fn(output)`` (default: the sum of the outputs, which
    saves nothing), backward, and ``optimizer.step()`` if one is given, which updates the
    parameters. Gradients are set to None afterwards. On CUDA the figures are measured; on the
    CPU or the meta device (build the model under ``torch.device("meta")`` to size a model too
    big for this machine) saved bytes and parameters are exact and the peak is an estimate.

    Args:
        model: the module to step, on the device where it will train.
        example_inputs: its positional inputs.
        optimizer: stepped once, so its state is counted.
        loss_fn: ``output -> scalar loss``, e.g. ``lambda out: F.cross_entropy(out, y)``.
        gpu_size: GiB of the GPU for the verdict (default: this GPU's total memory).

    Example::

        model = SegNet().cuda()
        opt = torch.optim.Adam(model.parameters())
        report = lmsrt.memory_report(model, x, optimizer=opt,
                                     loss_fn=lambda out: F.cross_entropy(out, y), gpu_size=8)
        print(report)                 # table, peak, largest layer, verdict with --lms/--lms-frac
    """
    rec = StepRecorder(target=1)
    rec.add_root(model)
    with rec:
        output = model(*example_inputs)
        loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
        loss.backward()
        del loss
        if optimizer is not None:
            optimizer.step()
        rec.finish()
    report = build_report(rec, type(model).__name__, gpu_size)
    model.zero_grad(set_to_none=True)
    return report
