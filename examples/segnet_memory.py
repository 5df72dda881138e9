"""Where did my GPU memory go? A SegNet question, answered with lmsrt.memory_report.

A user's SegNet trained on 4x384x512 inputs in batches of 4 (net A). They moved to 4x769x1025
inputs in batches of 1, with one more conv/BN/ReLU/pool stage in front (net B). Caffe's
"Memory required for data" line said B needs less than their 8 GB GPU has; under Caffe it ran
out (the user saw 9.5 GB in use). This builds both nets in PyTorch (SegNet-basic: 7x7
convolutions with 64 channels, BN, ReLU, max pooling whose indices the decoder's max-unpooling
reuses), reports one training step of each, and prints the answer: where the bytes go, what
Caffe's line leaves out, and what LMS would do. In PyTorch net B needs far less than under Caffe
(a step's peak of about 1.9 GiB, which fits the 8 GB card: the output says so): autograd keeps
only what backward reads, where Caffe keeps a gradient blob beside every data blob and cuDNN
workspaces on top, which the output's "Why Caffe's line fell short" counts.

    PYTHONPATH=. python examples/segnet_memory.py                   # GPU: measured; else estimated
    PYTHONPATH=. python examples/segnet_memory.py --device meta     # from shapes alone, instantly
    PYTHONPATH=. python examples/segnet_memory.py --table --html segnet_b.html

Without a GPU the nets run on the meta device: shapes, saved bytes and parameters are exact, the
peak is the model of NOTE [ The predicted peak ] in lmsrt/profiler/report.py.
"""
from __future__ import annotations

import argparse
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

import lmsrt
from lmsrt.profiler import MemoryReport
from lmsrt.units import format_bytes

GB8 = 8e9 / 2**30      # "8 GB" as a card's box says it, in GiB


class EncoderStage(nn.Module):
    def __init__(self, c_in: int, c: int):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c_in, c, 7, padding=3), nn.BatchNorm2d(c)
        self.relu, self.pool = nn.ReLU(inplace=True), nn.MaxPool2d(2, return_indices=True)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        size = x.shape[-2:]
        x, indices = self.pool(x)
        return x, indices, size


class DecoderStage(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.unpool = nn.MaxUnpool2d(2)
        self.conv, self.bn = nn.Conv2d(c, c, 7, padding=3), nn.BatchNorm2d(c)

    def forward(self, x, indices, size):
        return self.bn(self.conv(self.unpool(x, indices, output_size=size)))


class SegNet(nn.Module):
    """SegNet-basic with ``stages`` encoder stages and as many decoder stages."""

    def __init__(self, stages: int, c_in: int = 4, c: int = 64, classes: int = 12):
        super().__init__()
        self.enc = nn.ModuleList(EncoderStage(c_in if i == 0 else c, c) for i in range(stages))
        self.dec = nn.ModuleList(DecoderStage(c) for _ in range(stages))
        self.classify = nn.Conv2d(c, classes, 1)

    def forward(self, x):
        skips = []
        for stage in self.enc:
            x, indices, size = stage(x)
            skips.append((indices, size))
        for stage, (indices, size) in zip(self.dec, reversed(skips)):
            x = stage(x, indices, size)
        return self.classify(x)


def report_for(stages: int, batch: int, h: int, w: int, args) -> MemoryReport:
    torch.manual_seed(0)
    with torch.device(args.device):
        model = SegNet(stages, c=args.channels, classes=args.classes)
        x = torch.randn(batch, 4, h, w)
        y = torch.randint(0, args.classes, (batch, h, w))
    opt = torch.optim.Adam(model.parameters())
    return lmsrt.memory_report(model, x, optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                               gpu_size=args.gpu_size)


def full_res_saved(report: MemoryReport, stages: int) -> int:
    """Saved bytes of the full-resolution stages: the first encoder and the last decoder stage."""
    return sum(r.saved_bytes for r in report.rows
               if r.name.startswith(("enc.0.", f"dec.{stages - 1}.")) or r.name == "classify")


def caffe_data(report: MemoryReport, input_bytes: int) -> int:
    """What Caffe's "Memory required for data" counts: every blob's data once (in-place layers
    share their blob), the input included; no saved copies, gradients or workspaces."""
    return input_bytes + sum(r.output_bytes for r in report.rows)


def say(text: str) -> None:
    print(textwrap.fill(" ".join(text.split()), width=96, subsequent_indent="  "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "meta",
                    help="cuda (measured), cpu (slow) or meta (from shapes; the default "
                    "without a GPU)")
    ap.add_argument("--gpu-size", type=float, default=GB8, help="GiB of the GPU to judge by "
                    "(default: an 8 GB card)")
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--classes", type=int, default=12)
    ap.add_argument("--table", action="store_true", help="print B's whole report")
    ap.add_argument("--html", help="write B's report as an HTML page")
    args = ap.parse_args()

    nets = {"A": (4, 4, 384, 512), "B": (5, 1, 769, 1025)}     # stages, batch, height, width
    reports = {k: report_for(*v, args) for k, v in nets.items()}
    inputs = {k: b * 4 * h * w for k, (_, b, h, w) in nets.items()}
    verdicts = {k: r.verdict() for k, r in reports.items()}
    caffe = {k: caffe_data(r, inputs[k] * 4) for k, r in reports.items()}
    kind = "measured" if reports["A"].measured else f"estimated on {args.device}"

    def line(label: str, fa, fb) -> None:
        print(f"{label:36}{fa:>24}{fb:>24}")

    print(f"One training step (Adam, cross-entropy), {kind}\n")
    line("", "A: 4 x 4x384x512", "B: 1 x 4x769x1025")
    line("stages (encoder + decoder)", "4 + 4", "5 + 5")
    line("input values", f"{inputs['A']:,}", f"{inputs['B']:,}")
    for label, fn in (
            ("Caffe-style data (each blob once)", lambda k, r: caffe[k]),
            ("saved for backward", lambda k, r: r.saved_bytes),
            ("  of it in full-resolution stages", lambda k, r: full_res_saved(r, nets[k][0])),
            ("params + grads + Adam state", lambda k, r: r.state_bytes),
            ("largest transient", lambda k, r: r.largest_transient_bytes),
            ("predicted peak of a step", lambda k, r: r.predicted_peak_bytes)):
        line(label, *(format_bytes(fn(k, reports[k])) for k in nets))
    if reports["A"].measured:
        line("measured peak of step 1", *(format_bytes(reports[k].measured_peak_bytes)
                                          for k in nets))
    line(f"on a {format_bytes(args.gpu_size * 2**30)} GPU", *(
        "fits" if v.fits else f"LMS moves {format_bytes(v.move_bytes)}" if v.possible
        else "cannot fit" for v in verdicts.values()))

    a, b = reports["A"], reports["B"]
    full_b, full_a = full_res_saved(b, 5), full_res_saved(a, 4)
    more = b.predicted_peak_bytes / a.predicted_peak_bytes - 1
    map_bytes = args.channels * 769 * 1025 * 4
    print()
    say(f"""Why B needs {"more" if more > 0 else "no less"} than A ({more:+.1%}) although its
        batch is a quarter of A's: B's extra stage runs at full resolution, 769x1025, where one
        {args.channels}-channel map is {format_bytes(map_bytes)}, and a training step keeps several
        of them per stage for backward (the conv output BN needs, the BN output ReLU and pooling
        need, int64 pooling indices, the unpooled map the decoder conv needs). B's two
        full-resolution stages and its classifier keep {format_bytes(full_b)},
        {full_b / b.saved_bytes:.0%} of all it saves; A's, on as many pixels (4 x 384x512),
        keep {format_bytes(full_a)}. The four stages B shares with A run on a quarter of A's
        pixels, but the extra stage costs what A's first stage cost at batch 4.""")
    say(f"""Why Caffe's line fell short: "Memory required for data" counts each blob's data
        once, {format_bytes(caffe['B'])} for B. The step's peak is
        {format_bytes(b.predicted_peak_bytes)} ({b.predicted_peak_bytes / caffe['B'] - 1:+.0%}):
        what autograd keeps for backward ({format_bytes(b.saved_bytes)}), the gradients flowing
        back through the largest layer ({format_bytes(b.largest_transient_bytes)}), the logits
        held for the loss ({format_bytes(b.output_bytes)}), parameters with their gradients and
        Adam state ({format_bytes(b.state_bytes)}), and convolution workspaces, which only a GPU
        run measures. Caffe itself also gives every data blob a gradient (diff) blob of the same
        size, and cuDNN workspaces come on top: its true need is more than twice its "data"
        figure.""")
    say(f"What LMS does about it: {verdicts['B']}")
    if args.table:
        print(f"\n{b}")
    if args.html:
        b.save_html(args.html)
        print(f"\nwrote {args.html}")


if __name__ == "__main__":
    main()
