"""Pinned host memory at lmsrt's default settings (or a given --lms-frac): pinned against used,
first step against settled.

    python benchmarks/pinning.py                                  # gpt at 12 GiB, lm at 14 GiB
    python benchmarks/pinning.py --workloads lm --cap-gib 14 --out results/
    python benchmarks/pinning.py --workloads gpt,seg,gptbig --steps 30

For each workload it first runs the model uncapped without lmsrt (its first and settled step times,
and the pinned D2H/H2D bandwidth), then with ``lmsrt.LMS()`` at its defaults under a GPU cap
(torch.cuda.set_per_process_memory_fraction) twice: "cold", as a command's first run, and "warm",
as its rerun, which pins ahead the slabs the first used (lmsrt/cache.py, NOTE [ Pinning ahead ];
both keep their records in a folder of this benchmark's own). Each run has its own process, with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as benchmarks/offload.py runs them. Per lmsrt step
it records the wall time and the host pool's figures: pinned bytes, the peak in use, seconds
spent pinning (on the pinning threads) and waited for pins (on the training thread), swap-outs
kept on the GPU while their pins ran, bytes given back, pins in flight.

With --prime each lmsrt process first runs one step of the model without lmsrt, uncapped (the
workload's own first-step costs: kernels loaded, library handles, optimizer state), so that its
first step under lmsrt shows what lmsrt adds.

The targets (issue 15): pinned <= 1.15x the peak in use; the first step <= 2x a settled step plus
the copies' own time (the first step's bytes out and in at the measured bandwidth). "settled" is
the median of the last five steps. Run long enough to see give-back (default 25 steps: a slab
idle for 10 steps goes back). Writes pinning.json to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
GiB = 2**30
# A cap per workload at which lmsrt must move gigabytes (the uncapped peaks are in docs/design.md
# and benchmarks/workloads.py): gpt 18.2, lm 27.5, seg 15.7 GiB.
CAPS = {"gpt": 12.0, "lm": 14.0, "seg": 12.0, "gptbig": 16.0, "gptsmall": 2.0}
SETTLED_STEPS = 5
TARGET_RATIO = 1.15


# -- child: one workload, with or without lmsrt, in its own process ----------------------------

def _pool_figures(pool) -> dict:
    """The host pool's figures for the step that just ran (per-step ones reset as a step begins).
    Read from the pool: the engine's stats carry them once it copies them (lmsrt.stats)."""
    return {"pinned_bytes": pool.pinned_bytes, "peak_used_bytes": pool.peak_used,
            "pin_s": pool.pin_seconds, "pin_wait_s": pool.pin_wait_seconds,
            "lagged": pool.lagged, "given_back_bytes": pool.given_back_bytes,
            "pins_in_flight": pool.pins_in_flight, "slabs": len(pool.slabs),
            "most_pinned_bytes": pool.most_pinned}


def child(workload: str, method: str, cap_gib: float, steps: int, lms_frac=None,
          pins_dir: str = "", prime: bool = False) -> dict:
    import torch
    from offload import _bandwidth
    from workloads import build

    import lmsrt
    import lmsrt.cache

    if pins_dir:                 # the records of this benchmark's runs, not the user's
        lmsrt.cache.pins_dir = lambda: pins_dir

    work = build(workload)
    if prime:
        # One step without lmsrt, uncapped: kernels loaded, library handles made, the
        # optimizer's state allocated. What the first step then costs beyond a settled one is
        # lmsrt's own (pins, every eligible tensor out and back, learning).
        work.step(contextlib.nullcontext())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * GiB / total)
    given = {} if lms_frac is None else {"lms_frac": lms_frac}
    lms = lmsrt.LMS(**given) if method == "lmsrt" else None
    ctx = lms if lms is not None else contextlib.nullcontext()
    times, rows = [], []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            work.step(ctx)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if lms is not None:
                last = lms.stats()["last_step"]
                rows.append(dict(_pool_figures(lms._engine.host), out_bytes=last["out_bytes"],
                                 in_bytes=last["in_bytes"], kept_bytes=last["kept_bytes"]))
    except torch.OutOfMemoryError as e:
        return {"outcome": "OOM", "oom_step": len(times) + 1, "error": str(e).splitlines()[0],
                "step_times_s": times, "steps": rows}
    res = {"outcome": "ok", "step_times_s": times, "steps": rows,
           "first_s": times[0], "settled_s": statistics.median(times[-SETTLED_STEPS:])}
    if method == "reference":
        res["bandwidth"] = _bandwidth()
    if lms is not None:
        res["summary"] = lms.summary()
        res["pinned_ahead_bytes"] = lms.stats()["pinned_ahead_bytes"]
        lms.close()
    return res


# -- parent: the runs, the table ---------------------------------------------------------------

def run_child(args, workload: str, method: str, cap: float, pins_dir: str = "",
              run: str = "") -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{workload}:{method}:{cap}",
           "--steps", str(args.steps), "--pins-dir", pins_dir] + (
               ["--lms-frac", args.lms_frac] if args.lms_frac else []) + (
               ["--prime"] if args.prime and method == "lmsrt" else [])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        res = {"outcome": "timeout"}
    except (IndexError, json.JSONDecodeError):
        res = {"outcome": "crash", "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    res.update(workload=workload, method=method, cap_gib=cap, run=run, primed=args.prime,
               wall_s=round(time.time() - t0, 1))
    shown = (f"first {res['first_s']:.2f} s, settled {res['settled_s']:.3f} s"
             if res["outcome"] == "ok" else res["outcome"])
    if "error" in res:
        shown += f": {res['error']}"
    print(f"  {workload:7} {method:9} {run:4} cap={cap or '-':>4} {shown}  ({res['wall_s']} s)",
          flush=True)
    return res


def figures(row: dict, ref: dict) -> dict:
    """What the table shows of an lmsrt run, against its uncapped reference."""
    steps = row["steps"]
    first = steps[0]
    peak = max(s["peak_used_bytes"] for s in steps) or 1
    bw = ref["bandwidth"]
    copies = first["out_bytes"] / bw["d2h"] + first["in_bytes"] / bw["h2d"]
    pin_s = sum(s["pin_s"] for s in steps)
    return {
        "pinned_end_gib": steps[-1]["pinned_bytes"] / GiB,
        # The most pinned at any moment (pins under way included), not only at a step's end.
        "pinned_max_gib": max(s.get("most_pinned_bytes", s["pinned_bytes"]) for s in steps) / GiB,
        "used_peak_gib": peak / GiB,
        "pinned_over_used": steps[-1]["pinned_bytes"] / peak,
        "pinned_max_over_used": max(s.get("most_pinned_bytes", s["pinned_bytes"])
                                    for s in steps) / peak,
        "first_s": row["first_s"], "settled_s": row["settled_s"],
        "first_over_settled": row["first_s"] / row["settled_s"],
        "first_copies_s": copies,
        "first_target_s": 2 * row["settled_s"] + copies,
        "pin_s": pin_s, "pin_wait_s": sum(s["pin_wait_s"] for s in steps),
        "first_pin_wait_s": first["pin_wait_s"],
        # Per pinning thread: the bytes pinned in the run (held at the end, or given back).
        "pin_gib_per_s": (steps[-1]["pinned_bytes"] + sum(s["given_back_bytes"] for s in steps))
        / GiB / pin_s if pin_s else None,
        "lagged": sum(s["lagged"] for s in steps),
        "given_back_gib": sum(s["given_back_bytes"] for s in steps) / GiB,
        "slabs": steps[-1]["slabs"],
        "ref_first_s": ref["first_s"], "ref_settled_s": ref["settled_s"],
        "pinned_ahead_gib": row.get("pinned_ahead_bytes", 0) / GiB,
    }


def table(rows: list) -> str:
    head = (f"{'workload':8} {'cap':>4} {'run':4} {'ahead':>6} {'pinned':>7} {'max':>7} "
            f"{'used pk':>7} {'ratio':>5} "
            f"{'first s':>8} {'settled':>8} {'target':>7} {'ok':>3} {'pin s':>6} {'waited':>6} "
            f"{'lagged':>6} {'back':>6} {'ref 1st':>7} {'ref s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["outcome"] != "ok":
            lines.append(f"{r['workload']:8} {r['cap_gib']:>4g} {r.get('run', ''):4} "
                         f"{r['outcome']} {r.get('error', '')}")
            continue
        f = r["figures"]
        ok = f["pinned_max_over_used"] <= TARGET_RATIO and f["first_s"] <= f["first_target_s"]
        lines.append(
            f"{r['workload']:8} {r['cap_gib']:>4g} {r.get('run', ''):4} "
            f"{f['pinned_ahead_gib']:6.2f} {f['pinned_end_gib']:7.2f} "
            f"{f['pinned_max_gib']:7.2f} {f['used_peak_gib']:7.2f} "
            f"{f['pinned_max_over_used']:5.2f} "
            f"{f['first_s']:8.2f} {f['settled_s']:8.3f} {f['first_target_s']:7.2f} "
            f"{'yes' if ok else 'no':>3} {f['pin_s']:6.2f} {f['pin_wait_s']:6.2f} "
            f"{f['lagged']:6d} {f['given_back_gib']:6.2f} {f['ref_first_s']:7.2f} "
            f"{f['ref_settled_s']:6.3f}")
    lines.append("run: cold (a command's first run) or warm (its rerun, pinning ahead what the "
                 "first used); GiB: pinned ahead at the start, pinned at the end, the most "
                 "pinned at any moment (pins under way included), the peak in use; "
                 "ratio = most / peak "
                 f"(target <= {TARGET_RATIO}); target = 2 x settled + the first step's copies; "
                 "pin s on the pinning threads, waited on the training thread; lagged = swap-outs "
                 "kept on the GPU while their pins ran; back = GiB given back; ref = no lmsrt, "
                 "uncapped." + (" Primed: lmsrt's processes ran one step without lmsrt first."
                                if rows and rows[0].get("primed") else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", "--workload", default="gpt,lm")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="GPU cap in GiB for every workload (default: "
                         + ", ".join(f"{k} {v:g}" for k, v in CAPS.items()) + ")")
    ap.add_argument("--steps", type=int, default=25,
                    help="steps per run (give-back needs more than 10 after the plan settles)")
    ap.add_argument("--lms-frac", default=None,
                    help="lms_frac for lmsrt (default: lmsrt's own); a number or auto")
    ap.add_argument("--prime", action="store_true",
                    help="before lmsrt's runs, one step without lmsrt, uncapped, in the same "
                         "process: the first step's time beyond a settled one is then lmsrt's")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--pins-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        workload, method, cap = args.child.split(":")
        frac = args.lms_frac
        frac = None if frac is None else frac if frac == "auto" else float(frac)
        print(json.dumps(child(workload, method, float(cap), args.steps, frac, args.pins_dir,
                               args.prime)))
        return
    rows = []
    for name in args.workloads.split(","):
        ref = run_child(args, name, "reference", 0)
        if ref["outcome"] != "ok":
            print(f"{name}: the uncapped reference failed ({ref['outcome']}); skipped")
            continue
        cap = args.cap_gib if args.cap_gib is not None else CAPS.get(name, 12.0)
        rows.append(ref)
        with tempfile.TemporaryDirectory() as pins:
            for run in ("cold", "warm"):
                row = run_child(args, name, "lmsrt", cap, pins, run)
                if row["outcome"] == "ok":
                    row["figures"] = figures(row, ref)
                rows.append(row)
    if not rows:
        sys.exit("no workload ran (the benchmark needs a CUDA GPU); nothing written")
    text = table([r for r in rows if r["method"] == "lmsrt"])
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pinning.json"), "w") as f:
        json.dump({"rows": rows, "table": text}, f, indent=1, default=str)
    print(f"\nwrote {args.out}/pinning.json")


if __name__ == "__main__":
    main()
