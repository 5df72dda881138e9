"""Step time and peak memory of one workload with and without LMS, each setting in its own process.

    PYTHONPATH=. python scripts/stepcheck.py --workload gpt --cap-gib 12 --fracs auto,0.6,0.7,0.8
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))


def _frac(text: str):
    """An lms_frac as given: the word auto, or a number."""
    return text if text == "auto" else float(text)


def run_one(workload: str, method: str, cap_gib: float, frac, steps: int, warmup: int) -> dict:
    import torch
    from workloads import build

    import lmsrt

    if cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)
    step = build(workload).step
    if method == "lms":
        ctx = lmsrt.LMS(lms=1000, lms_frac=frac)
    elif method == "save_on_cpu":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    else:
        ctx = contextlib.nullcontext()
    times, peaks = [], []
    try:
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            step(ctx)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                peaks.append(torch.cuda.max_memory_allocated())
    except torch.OutOfMemoryError:
        return {"outcome": "OOM"}
    out = {"outcome": "ok", "step_s": statistics.median(times), "peak_gib": max(peaks) / 2**30}
    if method == "lms":
        last = ctx.stats()["last_step"]
        out.update(out_gib=last["out_bytes"] / 2**30, mode=last["mode"],
                   hits=last["prefetch_hits"], misses=last["prefetch_misses"],
                   wait_ms=last["swapin_wait_ms"])
        out["summary"] = ctx.summary()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpt")
    ap.add_argument("--cap-gib", type=float, default=12)
    ap.add_argument("--fracs", default="auto,0.6,0.7,0.8", help="lms_frac values (auto or numbers)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--save-on-cpu", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        method, cap, frac = args.child.split(":")
        print(json.dumps(run_one(args.workload, method, float(cap), _frac(frac), args.steps,
                                 args.warmup)))
        return
    cases = [("none", 0, 0), ("none", args.cap_gib, 0), ("lms", args.cap_gib, 0.0)]
    cases += [("lms", args.cap_gib, _frac(f)) for f in args.fracs.split(",") if f]
    if args.save_on_cpu:
        cases.append(("save_on_cpu", args.cap_gib, 0))
    rows = []
    for method, cap, frac in cases:
        proc = subprocess.run([sys.executable, __file__, "--workload", args.workload, "--steps",
                               str(args.steps), "--warmup", str(args.warmup),
                               "--child", f"{method}:{cap}:{frac}"], capture_output=True, text=True)
        try:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            res = {"outcome": "crash", "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        res.update(method=method, cap_gib=cap, lms_frac=frac)
        rows.append(res)
        print(f"  {method:12} cap={cap or '-':>4} frac={frac!s:<4} -> {res.get('outcome')}",
              flush=True)
    ref = next((r["step_s"] for r in rows if r["method"] == "none" and not r["cap_gib"]
                and r["outcome"] == "ok"), None)
    print(f"\n{args.workload}: step time and peak allocated (median of {args.steps} steps)")
    print(f"{'method':12} {'cap GiB':>8} {'lms_frac':>8} {'outcome':>8} {'step s':>8} {'ratio':>6} "
          f"{'peak GiB':>9} {'out GiB':>8} {'mode':>9} {'hit/miss':>9}")
    for r in rows:
        ok = r["outcome"] == "ok"
        ratio = f"{r['step_s'] / ref:6.2f}" if ok and ref else f"{'-':>6}"
        frac = r["lms_frac"] if r["method"] == "lms" else "-"
        print(f"{r['method']:12} {r['cap_gib'] or '-':>8} {frac:>8} "
              f"{r['outcome']:>8} {r['step_s'] if ok else float('nan'):8.3f} {ratio} "
              f"{r.get('peak_gib', float('nan')):9.2f} {r.get('out_gib', 0):8.2f} "
              f"{r.get('mode', '-'):>9} "
              f"{str(r.get('hits', '-')) + '/' + str(r.get('misses', '-')):>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.splitext(args.json)[0] + "-summaries.txt", "w") as f:
            for r in rows:
                if "summary" in r:
                    f.write(f"== {r['method']} cap={r['cap_gib']} lms_frac={r['lms_frac']}\n"
                            f"{r['summary']}\n\n")


if __name__ == "__main__":
    main()
