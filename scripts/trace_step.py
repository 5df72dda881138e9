"""Profile a few steps of a benchmark workload and print where GPU time goes.

    PYTHONPATH=. python scripts/trace_step.py --workload seg --cap-gib 12 --lms-frac 0.5 \
        [--trace out.json]

Without --lms-frac it runs without lmsrt. Prints the top CUDA kernels and copies by total time.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]

import torch  # noqa: E402
from workloads import build  # noqa: E402

import lmsrt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="seg")
    ap.add_argument("--cap-gib", type=float, default=0)
    ap.add_argument("--lms-frac", type=float)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--trace")
    args = ap.parse_args()
    if args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    work = build(args.workload)
    ctx = lmsrt.LMS(lms=1000, lms_frac=args.lms_frac) if args.lms_frac is not None \
        else contextlib.nullcontext()
    for _ in range(args.warmup):
        work.step(ctx)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        work.step(ctx)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                    max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
