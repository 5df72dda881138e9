"""The optimizer step with its state in pinned host memory (lmsrt/movers/optimizer.py), beside
the same step with its state on the GPU.

    python benchmarks/optimizer_step.py                          # 1.47B fp32 parameters
    python benchmarks/optimizer_step.py --params-m 355 --caps 6,10 --out results/
    python benchmarks/optimizer_step.py --tiny                   # CPU, simulated device

Parameters of about --params-m million in fp32, as square weights of --width (a transformer's
shapes), gradients random, one AdamW (fused on a GPU, as the Trainer's adamw_torch_fused).
Methods: "gpu", torch's step with the state on the GPU (uncapped: the floor); "host" at each cap
in GiB, ``lmsrt.LMS(optimizer_state="host")`` under the cap (``set_per_process_memory_fraction``):
the state in pinned host memory between steps, the step in parts of a sixteenth of the cap.
Per run: the median step time of --steps after two warm-up steps (the first makes the state), the
peak GPU memory during a step above what was allocated before it, the state's bytes, and the
bytes a second the step moved (its state in and out). The pinned link's bandwidth each way is
probed first: a step whose copies in and out overlap each other cannot beat the state's bytes
over the slower direction ("floor"). Prints a table and writes optimizer_step.json to --out.
Parameters after the steps are compared with the "gpu" run: equal, bit for bit, or the row says
so.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import torch  # noqa: E402

import lmsrt  # noqa: E402
from lmsrt.device import SimulatedDevice, copy_bandwidth  # noqa: E402
from lmsrt.units import format_bytes  # noqa: E402

GiB = 2**30


def _params(count: int, width: int, dev: torch.device, seed: int = 0) -> list:
    """About ``count`` parameters as square weights of ``width``, with random gradients."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, round(count / (width * width)))
    params = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.randn(width, width, generator=g).to(dev))
        p.grad = torch.randn(width, width, generator=g).to(dev) * 1e-3
        params.append(p)
    return params


class _Meter:
    """Step time and the peak above what was allocated before the step, on a GPU or on a
    simulated device (whose own counter sees what lmsrt allocates)."""

    def __init__(self, device):
        self.device = device

    def sync(self) -> None:
        if self.device is None:
            torch.cuda.synchronize()

    def begin(self) -> int:
        self.sync()
        if self.device is None:
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        self.device.reset_peak()
        return self.device.memory_allocated()

    def peak(self) -> int:
        self.sync()
        return (torch.cuda.max_memory_allocated() if self.device is None
                else self.device.peak_allocated())


def run(args, method: str, cap: float | None) -> dict:
    """One method's steps; its figures and final parameters."""
    dev = torch.device("cpu" if args.tiny else "cuda")
    params = _params(args.params, args.width, dev)
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=dev.type == "cuda")
    lms = None
    sim = SimulatedDevice(capacity=int((cap or 1) * GiB)) if args.tiny else None
    if method == "host":
        if args.tiny:
            lms = lmsrt.LMS(device=sim, optimizer_state="host", lms=1)
        else:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total))
            lms = lmsrt.LMS(optimizer_state="host")
    meter = _Meter(sim)
    # What the mover brought in, read from it: a run with no forward under the LMS has no step
    # of the engine's to count it in.
    mover = lms._engine.optimizer_mover if lms is not None else None
    times, peaks, brought = [], [], 0
    try:
        for step in range(args.steps + 2):
            base = meter.begin()
            before = mover.in_bytes if mover else 0
            start = time.perf_counter()
            opt.step()
            peak = meter.peak()
            if step >= 2:
                times.append(time.perf_counter() - start)
                peaks.append(peak - base)
                brought = (mover.in_bytes if mover else 0) - before
    finally:
        if lms is not None:
            lms.close()
        if method == "host" and not args.tiny:
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
    step_s = statistics.median(times)
    return {"method": method, "cap_gib": cap, "step_s": step_s, "peak_bytes": max(peaks),
            "state_bytes": state_bytes, "moved_gb_s": 2 * state_bytes / step_s / 1e9,
            "in_bytes": brought,
            "params": [p.detach().cpu() for p in params]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=1470.0, help="millions of parameters")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--caps", default="16,8", help="GiB, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="on the CPU, simulated device")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    args.params = int(args.params_m * 1e6) if not args.tiny else 64 * 64 * 16
    if args.tiny:
        args.width, caps = 64, [0.004]
    else:
        caps = [float(c) for c in args.caps.split(",") if c]
    bandwidth = ({} if args.tiny else
                 copy_bandwidth(torch.cuda.current_device(), 512 << 20))
    rows = [run(args, "gpu", None)] + [run(args, "host", cap) for cap in caps]
    ref = rows[0].pop("params")
    for row in rows[1:]:
        row["exact"] = all(torch.equal(a, b) for a, b in zip(ref, row.pop("params")))
    slower = min(bandwidth.values()) if bandwidth else 0.0
    floor = rows[0]["state_bytes"] / slower if slower else None
    name = "CPU (simulated)" if args.tiny else torch.cuda.get_device_name()
    print(f"optimizer step, AdamW, {rows[0]['state_bytes'] / 2 / 4 / 1e6:.0f}M fp32 parameters, "
          f"{name}; pinned link "
          + (", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items()) or "n/a"))
    print("| method | cap (GiB) | step (s) | peak in step | state | brought in | moved (GB/s) "
          "| exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['cap_gib'] or '-'} | {r['step_s']:.4f} | "
              f"{format_bytes(r['peak_bytes'])} | {format_bytes(r['state_bytes'])} | "
              f"{format_bytes(r['in_bytes'])} | {r['moved_gb_s']:.1f} | {r.get('exact', '-')} |")
    if floor:
        print(f"- floor of a step in host memory (state over the slower direction): "
              f"{floor:.4f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optimizer_step.json"), "w") as f:
        json.dump({"device": name, "bandwidth": bandwidth, "floor_s": floor, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
