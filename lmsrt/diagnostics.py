"""What the swap engine tells a user: its one-time warnings and what it adds to an out-of-memory
error.

The engine keeps one ``Diagnostics`` and calls it where it notices something; the texts live here,
apart from the mechanism. Each message says what happened, whether gradients are affected, and
what to change next, naming settings by their flag and variable (``options.spelled``).

Example::

    diagnostics = Diagnostics()
    diagnostics.alloc_retries(step)           # a RuntimeWarning the first time, then nothing
    "retries" in diagnostics.given            # True
    diagnostics.annotate_oom(exc, "in forward", config=..., policy=..., step=..., ...)
"""
from __future__ import annotations

import re
from typing import Set, Tuple

import torch

from .config import LMSConfig
from .options import spelled
from .recompute.compiled import made_regions
from .say import say_once
from .stats import StepStats
from .units import GiB, MiB, format_bytes

__all__ = ["Diagnostics"]


class Diagnostics:
    """The one-time warnings an engine has given (``given``: their keys), and the messages it
    gives."""

    def __init__(self) -> None:
        self.given: Set[str] = set()

    def unswappable(self, t: torch.Tensor) -> None:
        """A saved tensor the engine cannot copy as one flat storage stays on the GPU."""
        kind = "nested" if t.is_nested else type(t).__name__
        say_once("kind", f"lmsrt: saved tensors of kind {kind} stay on the GPU: the "
                        "engine swaps plain strided tensors only. Gradients are unaffected; only "
                        "the memory they hold is not saved.", given=self.given, stacklevel=4)

    def copy_out_failed(self, nbytes: int, e: Exception) -> None:
        """A copy to host memory raised; the tensor stays on the GPU (engine/__init__.py,
        NOTE [ Stream lifetimes ], Rule 7)."""
        say_once("d2h", f"lmsrt: copying a saved tensor ({format_bytes(nbytes)}) to host "
                        f"memory failed ({type(e).__name__}: {e}); it stays on the GPU, as will "
                        "any other whose copy fails, and gradients are unaffected. If the GPU "
                        "then runs out, the error says what to change.", given=self.given,
                 stacklevel=4)

    def alloc_retries(self, s: StepStats) -> None:
        """Say once that the allocator ran out of room in a planned step. Measured on an H100 with
        a segmentation net at a 16 GiB cap: two such retries a step made it 2.2x slower than
        uncapped, with nothing swapped."""
        say_once("retries", (
            f"lmsrt: in step {s.step} the CUDA caching allocator ran out of room "
            f"{s.alloc_retries} time{'s' if s.alloc_retries > 1 else ''} and freed its cache to go "
            "on. Each time it synchronizes the device, which stalls the copies lmsrt overlaps "
            "with compute, and cuDNN falls back to slower convolution algorithms when their "
            "workspace does not fit. A lower lms_frac leaves that room: `lmsrt tune` finds the "
            "fastest; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True fragments less. "
            "LMS.stats() counts these retries per step (alloc_retries)."), given=self.given,
            stacklevel=3)

    def alloc_failures(self, s: StepStats) -> None:
        """Say once that allocations failed at the limit and their callers went on with less.
        Measured on an H200 with a segmentation net at a 12 GiB cap: cuDNN's backward took 1.42 s
        a step instead of 0.22 s for the rest of the run, after one step in which its workspaces
        did not fit."""
        say_once("failures", (
            f"lmsrt: in step {s.step}, {s.alloc_failures} GPU allocation"
            f"{'s' if s.alloc_failures > 1 else ''} failed at the memory limit and the library "
            "that asked went on with less: cuDNN then runs a slower convolution algorithm and "
            "keeps it for the rest of the run. GPU use was too close to the limit there; a lower "
            "lms_frac (or lms_frac=\"auto\") leaves room. LMS.stats() counts these per step "
            "(alloc_failures)."), given=self.given, stacklevel=3)

    def rebuild_mismatch(self, ops) -> None:
        """Rebuilding a saved tensor did not give back its bits (engine/recipes.py, NOTE [ Rebuilt
        storages ]): the check ran beside the copy, so no gradient used the rebuild."""
        say_once("rebuild", (
            f"lmsrt: rebuilding the output of {', '.join(ops)} on this device did not give back "
            "the original bit for bit, so those tensors are moved instead, as without "
            "recompute; gradients are unaffected (the check ran beside the copy). Please report "
            "it with the model and the torch version."), given=self.given, stacklevel=3)

    def compiled_region(self, frame) -> None:
        """The storage being saved comes from an autograd.Function called from ``frame``: say
        once if that Function is a torch.compile'd region (AOTAutograd's), whose saves arrive
        only after its forward. Not when lmsrt split a model into regions itself: it said so."""
        if made_regions():
            return
        for _ in range(3):
            if frame is None:
                return
            if "_aot_autograd" in frame.f_code.co_filename:
                break
            frame = frame.f_back
        else:
            return
        say_once("compile", "lmsrt: a torch.compile'd region saves its tensors for "
                        "backward all at once after its forward and takes them back all at once "
                        "when its backward starts, so swapping lowers GPU memory only between "
                        "compiled regions, never inside one. Gradients are unaffected. To save "
                        "more, compile smaller regions (each transformer block, say) or leave "
                        "the largest layers uncompiled.", given=self.given, stacklevel=3)

    def annotate_oom(self, exc: BaseException, where: str, *, config: LMSConfig, policy,
                     step: StepStats, allocated: int, peak: int, limit: int,
                     largest: Tuple[int, int], host_refused: int,
                     optimizer_on_host: int = 0, optimizer_stepped: bool = True) -> None:
        """Add what lmsrt knows to an out-of-memory error raised while it is active, once: GPU
        use (``allocated`` now, ``peak`` this step, of ``limit``), the policy's level, what this
        step swapped and kept, its ``largest`` saved storage (bytes, save index), tensors the
        host pool refused, the optimizer state it keeps on the host (``optimizer_stepped``:
        whether an optimizer has stepped under lmsrt yet, so that there is any), and what to
        change."""
        if getattr(exc, "_lmsrt_annotated", False):
            return
        exc._lmsrt_annotated = True
        level = policy.oom_level(config)
        largest_bytes, largest_index = largest
        lines = [
            f"lmsrt: out of GPU memory with LMS on, {where}.",
            f"  GPU: {format_bytes(allocated)} allocated now, {format_bytes(peak)} peak this "
            f"step, of {format_bytes(limit)} this process may use; {level}.",
            f"  This step: {format_bytes(step.out_bytes)} swapped out ({step.out_tensors} "
            f"storages), {format_bytes(step.kept_bytes)} eligible but kept on the GPU; largest "
            f"saved storage {format_bytes(largest_bytes)} (saved {largest_index + 1}"
            f"{_ordinal(largest_index + 1)} in forward).",
        ]
        lines += policy.oom_lines()
        if host_refused:
            lines.append(f"  {host_refused} saved tensors stayed on the GPU because the host "
                         "memory budget was reached or pinning failed: raise host_budget_gb "
                         f"({spelled('host_budget_gb')}) or free host memory.")
        asked = _asked(exc)
        # (about: torch says it to two decimals)
        if "backward" in where and largest_bytes and abs(asked - largest_bytes) <= (
                largest_bytes >> 4):
            lines.append(
                f"  Backward asked for {format_bytes(asked)} at once, as much as the largest saved "
                "storage: the backward of the op that saved it holds that tensor, the gradient "
                f"coming in and the one going out together (about {format_bytes(3 * largest_bytes)}"
                "), which no swapping lowers. A loss over a large vocabulary in float32 is the "
                "usual such op: computed in chunks of the batch (or from bf16 logits) it needs a "
                "fraction of that.")
        if "d2h" in self.given:
            lines.append("  Copies to host memory failed (see the warning given then), so those "
                         "tensors stayed on the GPU.")
        lms = f"lower lms ({spelled('lms')}, now {config.lms:g} KiB) so smaller tensors go too"
        if policy.swaps_everything() and config.min_bytes <= MiB:
            state = (", gradients and what optimizer state is on the GPU." if optimizer_on_host
                     else ", gradients and optimizer state." if config.optimizer_state == "host"
                     else ", gradients and any optimizer state loaded (no optimizer has stepped "
                     "under lmsrt yet: none made)." if not optimizer_stepped
                     else ", gradients and optimizer state, which can live in host memory between "
                     f"optimizer steps from the first ({spelled('optimizer_state', 'host')}).")
            lines.append("  Swapping is already at its most (every eligible tensor, lms<=1024 "
                         "KiB): what is left is one layer's working set, parameters"
                         f"{state} Lower the batch size, checkpoint activations "
                         "(torch.utils.checkpoint), or run `lmsrt profile` to see the largest "
                         "layer.")
        else:
            lines.append(policy.oom_to_fit(config, lms))
        message = "\n".join(lines)
        first = str(exc.args[0]) if exc.args else ""
        exc.args = (f"{first}\n{message}" if first else message,) + tuple(exc.args[1:])


def _asked(exc: BaseException) -> int:
    """The bytes the failed allocation asked for, as torch's message says them; 0 if it does
    not."""
    found = re.search(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|bytes)\b", str(exc))
    if found is None:
        return 0
    unit = {"GiB": GiB, "MiB": MiB, "KiB": 1024, "bytes": 1}[found.group(2)]
    return int(float(found.group(1)) * unit)


def _ordinal(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
