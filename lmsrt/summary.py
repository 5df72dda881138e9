"""What a run of LMS did, for people: one headline line, and the full table behind it.

The headline says what a user asks first: how long a step took once settled, the GPU peak
against the limit, what a step moved, rebuilt and recomputed, and what lmsrt changed. The table
(``LMS.summary()``, ``lmsrt run --summary full``) has every counter; each of its labels is
explained in docs/run.md ("The summary, term by term"), and tests/test_docs.py keeps ``LABELS``
and that page together.

A "step" is one forward and the backward after it (one micro-batch): with gradient accumulation
over 2 micro-batches, 6 optimizer steps are 12 steps. ``lmsrt run`` also counts optimizer steps
(torch.optim's step hook) and shows both.

Example::

    from lmsrt.summary import format_headline, format_summary
    print(format_headline(lms.stats()))    # 'lmsrt: 12 steps (12 optimizer steps), ...'
    print(format_summary(lms.stats()))     # the headline and the table
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from .units import format_bytes

__all__ = ["format_blocks", "format_headline", "format_summary", "format_off", "moved",
           "retries_a_step", "HEADLINE", "LABELS"]

# The headline's start: how ``lmsrt tune`` finds where a trial's summary begins in its stderr.
HEADLINE = re.compile(r"^lmsrt: \d+ steps? ")

# label -> (field of the step and total stats, unit); units: B bytes, n a count, ms, s, text.
# Indented labels belong to the one above them.
_ROWS: Tuple[Tuple[str, str, str], ...] = (
    ("steps", "steps", "n"),
    ("plan", "mode", "text"),
    ("swapped out", "out_bytes", "B"),
    ("  tensors", "out_tensors", "n"),
    ("  over the plan", "beyond_plan_bytes", "B"),
    ("swapped in", "in_bytes", "B"),
    ("  fetched ahead", "prefetch_hits", "n"),
    ("  fetched on demand", "prefetch_misses", "n"),
    ("  fetched, unused", "prefetch_dropped", "n"),
    ("  failed, tried again", "backward_retries", "n"),
    ("  waited for (ms)", "swapin_wait_ms", "ms"),
    ("rebuilt, not moved", "recipe_bytes", "B"),
    ("  rebuilt in backward", "rebuilt_bytes", "B"),
    ("  rebuild GPU (ms)", "rebuild_ms", "ms"),
    ("  checked bit for bit", "rebuild_checks", "n"),
    ("regions recomputed", "recomputed_regions", "n"),
    ("  freed in forward", "recomputed_bytes", "B"),
    ("  recompute GPU (ms)", "recompute_ms", "ms"),
    ("optimizer state on host", "optimizer_host_bytes", "B"),
    ("  brought in", "optimizer_in_bytes", "B"),
    ("  written back", "optimizer_out_bytes", "B"),
    ("  update GPU (ms)", "optimizer_update_ms", "ms"),
    ("kept on GPU", "kept_bytes", "B"),
    ("  held by the script", "live_bytes", "B"),
    ("too small or params", "skipped_tensors", "n"),
    ("forward waited", "swapout_waits", "n"),
    ("  waited for (ms)", "swapout_wait_ms", "ms"),
    ("host refusals", "host_refused", "n"),
    ("allocator retries", "alloc_retries", "n"),
    ("  failed, caught", "alloc_failures", "n"),
    ("host CPU (s)", "cpu_s", "s"),
    ("GPU peak allocated", "gpu_peak_bytes", "B"),
    ("host pinned peak", "host_peak_bytes", "B"),
    ("host pinned", "host_pinned_bytes", "B"),
    ("  pinning (s)", "host_pin_s", "s"),
    ("  waited for pins (s)", "host_pin_wait_s", "s"),
    ("  kept, pins late", "host_lagged", "n"),
    ("  pinned ahead", "pinned_ahead_bytes", "B"),
)
_REBUILD = {"rebuilt, not moved", "  rebuilt in backward", "  rebuild GPU (ms)",
            "  checked bit for bit"}
_REGIONS = {"regions recomputed", "  freed in forward", "  recompute GPU (ms)"}
_OPTIMIZER = {"optimizer state on host", "  brought in", "  written back",   # once it moved
              "  update GPU (ms)"}
# Every label of the table, and of the lines above it: each is explained in docs/run.md.
LABELS = ("settings", "swap above", "auto", "regions", "not rebuilt", "per block",
          *(label.strip() for label, _, _ in _ROWS))


def moved(stats: Dict[str, object]) -> bool:
    """Whether LMS swapped, rebuilt or recomputed anything, or moved optimizer state, in the run
    ``stats`` (``LMS.stats()``) describes."""
    t = stats["total"]
    return bool(t["out_bytes"] or t["recipe_bytes"] or t["recomputed_regions"]
                or t.get("optimizer_out_bytes"))


def _steps(stats: Dict[str, object]) -> str:
    n = stats["total"]["steps"]
    text = f"{n} step{'' if n == 1 else 's'}"
    optimizer = stats.get("optimizer_steps")
    return text if optimizer is None else f"{text} ({optimizer} optimizer steps)"


def _changed(stats: Dict[str, object]) -> str:
    """What lmsrt did to the run once settled (the last step), in a few words."""
    last, regions = stats["last_step"], stats.get("regions") or {}
    said = []
    if last["out_bytes"]:
        said.append(f"swapped {last['out_tensors']} saved tensors a step to host memory")
    if last["recipe_bytes"]:
        said.append("rebuilt cheap ones in backward")
    if last["recomputed_regions"]:
        said.append(f"recomputed {last['recomputed_regions']} of {regions.get('regions', '?')} "
                    "blocks a step")
    if last.get("optimizer_out_bytes"):
        said.append(f"kept {format_bytes(last['optimizer_out_bytes'])} of optimizer state in "
                    "host memory between optimizer steps")
    if said:
        return "lmsrt " + ", ".join(said)
    if moved(stats):
        return "lmsrt changed nothing once settled (its first steps moved some while learning)"
    return "lmsrt changed nothing: the saved tensors fit"


def format_headline(stats: Dict[str, object]) -> str:
    """The run in one line: ``'lmsrt: 12 steps (6 optimizer steps), 0.301 s a step settled;
    GPU peak 10.0 MiB of 10.2 MiB (98%); a step swapped 4.00 MiB out, rebuilt 6.00 MiB,
    recomputed 0 B; lmsrt swapped 2 saved tensors a step to host memory, rebuilt cheap ones in
    backward'``: the last step's bytes (and where the GPU stood still for copies, for how long),
    and what lmsrt changed once settled.

    ``stats`` is ``LMS.stats()``; the step time and optimizer steps are there under
    ``lmsrt run`` (``step_time_median_s``, ``optimizer_steps``), else left out."""
    t, last = stats["total"], stats["last_step"]
    parts = [_steps(stats)]
    median = stats.get("step_time_median_s")
    if median:
        parts[0] += f", {median:.3f} s a step settled"
    limit = stats.get("limit_bytes") or 0
    peak = f"GPU peak {format_bytes(t['gpu_peak_bytes'])}"
    if limit:
        peak += f" of {format_bytes(limit)} ({t['gpu_peak_bytes'] / limit:.0%})"
    retried = retries_a_step(stats)
    if retried:
        peak += (f", the allocator freeing its cache {retried} time{'s' if retried > 1 else ''} "
                 "a step to go on (a device sync each)")
    parts.append(peak)
    waited = last.get("swapout_wait_ms", 0.0) + last.get("swapin_wait_ms", 0.0)
    stalled = f" (the GPU waited {waited:.0f} ms for copies)" if waited >= 1 else ""
    parts.append(f"a step swapped {format_bytes(last['out_bytes'])} out{stalled}, rebuilt "
                 f"{format_bytes(last['recipe_bytes'])}, recomputed "
                 f"{format_bytes(last['recomputed_bytes'])}")
    parts.append(_changed(stats))
    return "lmsrt: " + "; ".join(parts)


def retries_a_step(stats: Dict[str, object]) -> int:
    """The caching allocator's retries a step: the median (the lower of two) of the last ten
    planned steps'; 0 where no step was planned."""
    planned = [h.get("alloc_retries", 0) for h in (stats.get("history") or [])
               if h.get("mode") == "plan"][-10:]
    return sorted(planned)[(len(planned) - 1) // 2] if planned else 0


def format_off(why: str) -> str:
    """The one line for a run where LMS was off (``why``: no GPU, ``lms <= 0``)."""
    return f"lmsrt: LMS was off ({why}), so nothing was swapped and there is no summary"


def _cell(value, unit: str) -> str:
    if value is None:
        return f"{'':>14}"
    if unit == "text":
        return f"{value:>14}"
    if unit == "B":
        return f"{format_bytes(value):>14}"
    if unit == "s":
        return f"{value:14.2f}"
    if unit == "ms":
        return f"{value:14.1f}"
    return f"{int(value):14d}"


def _table(stats: Dict[str, object], recomputed: bool) -> List[str]:
    t, last = stats["total"], stats["last_step"]
    rebuilding = stats["config"].get("recompute")
    lines = [f"{'':22}{'last step':>14}{'total':>14}"]
    for label, field, unit in _ROWS:
        if ((label in _REBUILD and not rebuilding) or (label in _REGIONS and not recomputed)
                or (label in _OPTIMIZER and not t["optimizer_out_bytes"])):
            continue
        if field == "steps":
            a, b = None, t["steps"]
        elif field == "mode":
            a, b = {"reactive": "learning", "plan": "planned"}.get(last[field], last[field]), None
        elif field == "pinned_ahead_bytes":
            if not stats.get(field):
                continue
            a, b = None, stats[field]
        else:
            a, b = last[field], t[field]
        lines.append(f"{label:22}{_cell(a, unit)}{_cell(b, unit)}")
    return lines


def format_blocks(blocks: List[Dict[str, object]]) -> List[str]:
    """``LMS.stats()["blocks"]`` as a table: a line a block and one for what was saved outside
    them, with what its saved tensors became in the last step; no lines where no block was
    found (only the row outside)."""
    if len(blocks) < 2:
        return []
    width = max(22, *(len(str(b["block"])) + 2 for b in blocks))
    lines = [f"{'per block: last step':{width}}{'kept':>11}{'moved':>11}{'rebuilt':>11}"
             f"{'rerun':>11}{'rerun ms':>10}"]
    for b in blocks:
        ms = b["rerun_ms"]
        lines.append(f"{'  ' + str(b['block']):{width}}"
                     + "".join(f"{format_bytes(b[k]):>11}" for k in
                               ("kept_bytes", "moved_bytes", "rebuilt_bytes", "rerun_bytes"))
                     + ("" if ms is None else f"{ms:10.1f}"))
    return lines


def format_summary(stats: Dict[str, object], full: bool = True) -> str:
    """The headline of ``LMS.stats()`` and, with ``full``, the table: the settings, what auto
    and the region plan decided, and every counter of the last step and of the run. A run with
    LMS off gets one line (``format_off``) instead of a table of zeros."""
    if not stats.get("enabled", True):
        return format_off(stats.get("off_reason") or "no CUDA device, or lms <= 0")
    lines = [format_headline(stats)]
    if not full:
        return lines[0]
    t, last = stats["total"], stats["last_step"]
    frac = stats["config"]["lms_frac"]
    frac = frac if isinstance(frac, str) else f"{frac:g}"
    lines.append(f"settings: lms={stats['config']['lms']:g} KiB  lms_frac={frac}  "
                 f"device={stats['device']}  allocator={stats['allocator']}  "
                 f"copy path={stats['copy_path']}")
    lines.append(f"swap above: {format_bytes(stats['mark_bytes'])} of GPU use")
    if last.get("policy_note"):
        lines.append(f"auto: use kept under {format_bytes(last['bound_bytes'])} (headroom "
                     f"{format_bytes(last['headroom_bytes'])}), predicted peak "
                     f"{format_bytes(last['predicted_peak_bytes'])}; {last['policy_note']}")
    regions: Optional[dict] = stats.get("regions")
    recomputed = bool(regions and (regions["planned"] or regions["phase"] == "timing"
                                   or t["recomputed_regions"]))
    if recomputed:
        lines.append(f"regions: {last['recomputed_regions']} of {regions['regions']} recomputed "
                     f"last step ({format_bytes(last['recomputed_bytes'])} freed in forward, "
                     f"{last['recompute_ms']:.1f} ms GPU rerunning them); {regions['note']}")
    lines.extend(_table(stats, recomputed))
    for op, why in stats.get("rebuild_refused", {}).items():
        lines.append(f"not rebuilt: {op} ({why})")
    lines.extend(format_blocks(stats.get("blocks") or []))
    return "\n".join(lines)
