"""How a ``MemoryReport`` is shown: text table, PNG timeline (matplotlib, optional), HTML page."""
from __future__ import annotations

import base64
import html as _html
import io
from typing import TYPE_CHECKING, List, Optional

from ..units import GiB, MiB, format_bytes

if TYPE_CHECKING:       # for the annotations only: report.py imports this module to show itself
    from .report import MemoryReport

__all__ = ["format_text", "summary_lines", "png_bytes", "html",
           "MATPLOTLIB_MISSING"]

MATPLOTLIB_MISSING = "matplotlib is not installed, so no timeline PNG: pip install matplotlib"
_COLUMNS = ("saved", "params", "grads", "optim", "transient")
_PHASE_COLORS = {"forward": "#e8f0fe", "backward": "#fdecea", "optimizer": "#e6f4ea"}


def _cells(report: "MemoryReport", row) -> List[str]:
    def b(n: int) -> str:
        return format_bytes(n) if n else "-"
    transient = format_bytes(row.transient_bytes) if report.measured else "n/a"
    return [b(row.saved_bytes), b(row.param_bytes), b(row.grad_bytes), b(row.optimizer_bytes),
            transient]


def _output(row) -> str:
    return row.output_shape + (f" x{row.calls}" if row.calls > 1 else "")


def _table(report: "MemoryReport") -> List[List[str]]:
    """Header, one row per module, and the totals, as cells."""
    rows = [["module", "type", "output", *_COLUMNS]]
    for r in report.rows:
        rows.append(["  " * r.depth + r.name, r.type, _output(r), *_cells(report, r)])
    top = report.largest_transient_bytes if report.measured else None
    rows.append(["total", "", "", format_bytes(report.saved_bytes),
                 format_bytes(report.param_bytes), format_bytes(report.grad_bytes),
                 format_bytes(report.optimizer_bytes),
                 format_bytes(top) if report.measured else "n/a"])
    return rows


def summary_lines(report: "MemoryReport") -> List[str]:
    """Everything below the table: peaks, the largest layer, the verdict, notes."""
    fb = format_bytes
    lines = []
    if report.measured_peak_bytes is not None:
        lines.append(f"measured peak    {fb(report.measured_peak_bytes)} in "
                     f"{report.measured_peak_where}; {fb(report.baseline_bytes)} was allocated "
                     "when the step began")
    lines += [
        f"predicted peak   {fb(report.predicted_peak_bytes)} {report.predicted_peak_where}"
        + ("" if report.measured else " (estimate)") + ":",
        f"                 params+buffers {fb(report.param_bytes)} + grads {fb(report.grad_bytes)}"
        f" + optimizer {fb(report.optimizer_bytes)}"]
    if report.optimizer_step_bytes > report.turn_bytes:
        how = ("measured" if report.optimizer_transient_bytes is not None else
               "estimated: a copy of the parameters")
        lines[-1] += f" + the update's temporaries {fb(report.update_transient_bytes)} ({how})"
    else:
        how = "measured" if report.measured else "estimated: its inputs + outputs"
        lines[-1] += f" + saved {fb(report.saved_bytes)}"
        lines.append(f"                 + outputs held {fb(report.output_bytes)} + largest "
                     f"transient {fb(report.largest_transient_bytes)} "
                     f"({report.largest_transient.name}, {how})")
    layer = report.largest_layer
    transient = layer.io_bytes if layer.transient_bytes is None else layer.transient_bytes
    lines.append(f"largest layer    {layer.name} ({layer.type}): working set "
                 f"{fb(layer.working_set_bytes)} = saved tensors it reads "
                 f"{fb(layer.saved_used_bytes)} + transient {fb(transient)} + params and grads "
                 f"{fb(layer.param_bytes + layer.grad_bytes)}")
    verdict = report.verdict()
    if verdict is None:
        lines.append("verdict          no GPU here: pass gpu_size= (GiB) to memory_report, or "
                     "--gpu-size to lmsrt profile, for a verdict.")
    else:
        lines.append("verdict          " + str(verdict))
    lines += [f"note: {n}" for n in report.notes]
    return lines


def format_text(report: "MemoryReport") -> str:
    table = _table(report)
    widths = [min(48, max(len(r[i]) for r in table)) for i in range(3)]
    out = [f"lmsrt memory report: step {report.step} of {report.title} on {report.device}"]
    for i, r in enumerate(table):
        left = "  ".join(c[:w].ljust(w) for c, w in zip(r[:3], widths))
        out.append(left + "".join(c.rjust(11) for c in r[3:]))
        if i == 0 or i == len(table) - 2:
            out.append("-" * (sum(widths) + 4 + 11 * len(_COLUMNS)))
    return "\n".join(out + [""] + summary_lines(report))


def _marks(report: "MemoryReport"):
    """(index, name) of the forward starts to label: modules of the shallowest depth that has 3
    or more of them, thinned to at most 24 labels."""
    forward = [(i, s) for i, s in enumerate(report.timeline) if s.phase == "forward" and s.depth]
    depths = sorted({s.depth for _, s in forward})
    for depth in depths:
        first: dict = {}
        for i, s in forward:
            if s.depth == depth:
                first.setdefault(s.where, max(0, i - 1))
        if len(first) >= 3 or depth == depths[-1]:
            marks = sorted((i, name) for name, i in first.items())
            return marks[::max(1, -(-len(marks) // 24))]
    return []


def have_matplotlib() -> bool:
    """Whether the timeline PNG can be drawn (matplotlib imports)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png_bytes(report: "MemoryReport") -> Optional[bytes]:
    """The timeline PNG, or None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    samples = report.timeline
    fig = Figure(figsize=(12, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = list(range(len(samples)))
    unit, scale = ("GiB", GiB) if max((s.peak for s in samples), default=0) >= GiB else (
        "MiB", MiB)
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].phase != samples[start].phase:
            ax.axvspan(start - 0.5, i - 0.5, color=_PHASE_COLORS.get(samples[start].phase, "#eee"),
                       label=samples[start].phase)
            start = i
    ax.step(x, [s.allocated / scale for s in samples], where="post", color="#1a73e8",
            label="allocated" if report.measured else "saved tensors alive")
    if report.measured:
        ax.plot(x, [s.peak / scale for s in samples], ".", color="#d93025", markersize=3,
                label="peak within segment")
    for i, name in _marks(report):
        ax.axvline(i, color="#999", linewidth=0.6)
        ax.annotate(name, (i, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                    fontsize=7, va="top", ha="right")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8)
    ax.set_xlabel("module boundary (forward, then backward, then the optimizer step)")
    ax.set_ylabel(unit)
    kind = "measured" if report.measured else "estimate: no GPU, saved-for-backward bytes only"
    ax.set_title(f"{report.title}: memory over step {report.step} ({kind})")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def html(report: "MemoryReport") -> str:
    """One self-contained page: the summary, the table and the timeline as an inline PNG."""
    esc = _html.escape
    table = _table(report)
    head = "".join(f"<th>{esc(c)}</th>" for c in table[0])
    body = []
    for i, r in enumerate(table[1:], 1):
        cls = ' class="total"' if i == len(table) - 1 else ""
        cells = [f'<td class="l">{"&nbsp;" * 2 * (len(r[0]) - len(r[0].lstrip()))}'
                 f'{esc(r[0].strip())}</td>', f'<td class="l">{esc(r[1])}</td>',
                 f'<td class="l">{esc(r[2])}</td>'] + [f"<td>{esc(c)}</td>" for c in r[3:]]
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    png = png_bytes(report)
    img = (f'<img alt="memory timeline" src="data:image/png;base64,'
           f'{base64.b64encode(png).decode()}">' if png else f"<p>{esc(MATPLOTLIB_MISSING)}</p>")
    title = f"lmsrt memory report: step {report.step} of {report.title} on {report.device}"
    return (
        "<!doctype html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{esc(title)}</title><style>"
        "body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse;font-size:13px}"
        "th,td{padding:2px 10px;text-align:right;border-bottom:1px solid #eee}"
        "th{background:#f4f4f4} td.l,th:nth-child(-n+3){text-align:left;font-family:monospace}"
        "tr.total{font-weight:bold} pre{background:#f8f8f8;padding:.8em;white-space:pre-wrap}"
        "img{max-width:100%}"
        f"</style></head><body>\n<h1>{esc(title)}</h1>\n"
        f"<pre>{esc(chr(10).join(summary_lines(report)))}</pre>\n{img}\n"
        f"<table><tr>{head}</tr>\n" + "\n".join(body) + "</table>\n</body></html>\n")
