"""Step time at a GPU memory cap: no offload, save_on_cpu, and lmsrt, against the transfer floor.

    python benchmarks/offload.py                                  # gpt, seg, gptbig at CAPS
    python benchmarks/offload.py --workloads gpt --caps 12,16 --out results/
    python benchmarks/offload.py --workloads lm --caps 14,18,22 --search fastest \\
        --fracs auto,0.9,0.7,0.5                                  # lm, auto beside the grid

For each workload it first measures, uncapped and without offload, the step time, the forward and
backward times and the peak, and the pinned D2H/H2D bandwidth. Then, for each cap (set with
torch.cuda.set_per_process_memory_fraction, so a big GPU stands in for a small one), each method
runs in its own process, all with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: no offload
(expect OOM), save_on_cpu(pin_memory=True), and lmsrt at the highest lms_frac of a descending grid
that fits (OOM is monotone in lms_frac), or with --search fastest the fastest of the whole grid.
The word auto in --fracs adds a row of its own at every cap: lmsrt with lms_frac="auto" (a version
of lmsrt that refuses it gets the outcome "unsupported"). --recompute both runs every lmsrt row
again with recompute=True (method "lmsrt+rb": cheap saved tensors rebuilt in backward, not moved),
and prints each against its twin. --compile compiles the workload's model as a user would,
``torch.compile(model)`` (the loss and optimizer stay eager); under lmsrt that model is compiled
block by block (lmsrt/recompute/compiled.py), from its second step, under the recompute budget lmsrt
chooses where memory is short. Compare with a run without --compile for the eager rows.
--memory-budget B sets torch._functorch.config.activation_memory_budget (the compiled graphs'
recompute budget, a fraction of what they would save) in every method, as a user would; under
lmsrt a lower budget of its own still applies to the blocks.

The method ckpt is activation checkpointing as a user writes it (torch.utils.checkpoint,
use_reentrant=False): one checkpoint per block of the transformer stacks (gpt, gptbig, lm), and
torch.utils.checkpoint.checkpoint_sequential over the segmentation net's layers with the fastest
of --segments (2, 4, 8, 16) that fits, its last segment run plainly as checkpoint_sequential does.
Its lms_frac column shows the segments.

The floor: X = uncapped peak - cap bytes must leave the GPU in forward and come back in backward,
so no swap-only method beats max(t_fwd, X/BW_d2h) + max(t_bwd, X/BW_h2d) (+ t_opt, the optimizer
step, for workloads that have one). Efficiency is floor / step. With recompute the bytes rebuilt
instead of moved (R) come off X: "floor'" is the same formula at X - R, the floor of the bytes that
still cross the link. "settled" counts the steps before
the step time stays within 5% of the timed steps' median. Writes offload.json and offload.png (step
time against cap, floor dashed) to --out.
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
import traceback
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
GiB = 2**30
FRAC_GRID = (0.95, 0.93, 0.91, 0.89, 0.87, 0.85, 0.8, 0.7, 0.5, 0.0)
SETTLED_TOLERANCE = 0.05
# Caps (GiB) per workload when --caps is not given: down to where checkpointing per block fits.
CAPS = {"gpt": (5, 6, 8, 12, 16), "gptbig": (8, 12, 16), "seg": (9, 10, 12, 16),
        "lm": (10, 12, 14, 18, 22)}


# -- child: one method at one cap, in its own process -------------------------------------------

def _bandwidth() -> dict:
    from lmsrt.device import copy_bandwidth
    return copy_bandwidth(0, 256 << 20, reps=8)


def _phases(work, steps: int) -> tuple:
    """Median forward, backward and optimizer-step times of the workload, without offload."""
    import torch
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = work.forward()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        work.update()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return tuple(statistics.median(t) for t in zip(*times))


def settled_after(times: list, median: float) -> Optional[int]:
    """How many steps pass before the step time stays within SETTLED_TOLERANCE of ``median``
    (0: from the first step); None if the last step is still outside."""
    n = len(times)
    while n and abs(times[n - 1] - median) <= SETTLED_TOLERANCE * median:
        n -= 1
    return n if n < len(times) else None


def checkpointed(work, segments: int) -> None:
    """Checkpoint ``work``'s model as a user would, in place: each block of a transformer stack,
    or ``segments`` segments of a Sequential conv net (checkpoint_sequential)."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential
    model = work.model
    net = getattr(model, "net", None)
    if net is not None:
        net.forward = lambda x: checkpoint_sequential(net, segments, x, use_reentrant=False)
        return
    blocks = getattr(model, "blocks", model)
    block_list = list(blocks)

    def run(x):
        for block in block_list:
            x = checkpoint(block, x, use_reentrant=False)
        return x
    blocks.forward = run


def child(workload: str, method: str, cap_gib: float, frac, steps: int, warmup: int,
          recompute: bool = False, compiled: bool = False,
          memory_budget: Optional[float] = None) -> dict:
    """One method at one cap; ``frac`` is a number or "auto", passed to lmsrt as it is (ckpt:
    the number of segments of a Sequential conv net)."""
    import torch
    from workloads import build

    import lmsrt

    if memory_budget is not None:
        import torch._functorch.config
        torch._functorch.config.activation_memory_budget = memory_budget

    if cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * GiB / total)
    work = build(workload)
    if compiled:
        work.model = torch.compile(work.model)
    lms = None
    if method == "lmsrt":
        try:
            ctx = lms = lmsrt.LMS(lms=1000, lms_frac=frac, recompute=recompute)
        except (ValueError, TypeError) as e:
            if frac != "auto" and not recompute:
                raise
            return {"outcome": "unsupported", "error": str(e)}
    elif method == "save_on_cpu":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    elif method == "ckpt":
        checkpointed(work, int(frac))
        ctx = contextlib.nullcontext()
    else:
        ctx = contextlib.nullcontext()
    times, peaks, phases, retries, failures = [], [], [], [], []
    try:
        for i in range(warmup + steps):
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            stats = torch.cuda.memory_stats()
            before = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
            t0 = time.perf_counter()
            work.step(ctx, marks)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated())
            # Retries: the allocator hit the cap, freed its cache and synchronised the device.
            stats = torch.cuda.memory_stats()
            retries.append(stats.get("num_alloc_retries", 0) - before[0])
            # Failed allocations a caller caught (cuDNN then runs a slower algorithm).
            failures.append(stats.get("num_ooms", 0) - before[1])
            phases.append((marks[0].elapsed_time(marks[1]) / 1e3,
                           marks[1].elapsed_time(marks[2]) / 1e3))
    except torch.OutOfMemoryError as e:
        where = "".join(traceback.format_tb(e.__traceback__))
        phase = "backward" if "backward" in where else "forward"
        return {"outcome": "OOM", "oom_step": len(times) + 1, "oom_phase": phase,
                "allocated_gib": torch.cuda.memory_allocated() / GiB,
                "reserved_gib": torch.cuda.memory_reserved() / GiB,
                "history": lms.stats()["history"] if lms else []}
    step_s = statistics.median(times[warmup:])
    res = {"outcome": "ok", "step_s": step_s, "settled_after": settled_after(times, step_s),
           "peak_gib": max(peaks[warmup:]) / GiB, "step_times_s": times,
           "gpu_fwd_s": statistics.median(p[0] for p in phases[warmup:]),
           "gpu_bwd_s": statistics.median(p[1] for p in phases[warmup:]),
           "alloc_retries_per_step": statistics.median(retries[warmup:]),
           "alloc_failures_per_step": failures,
           "moved_gib": None if method == "save_on_cpu" else 0.0}
    if lms is not None:
        last = lms.stats()["last_step"]
        res.update(moved_gib=last["out_bytes"] / GiB, rebuilt_gib=last.get("recipe_bytes", 0) / GiB,
                   stats=last, summary=lms.summary(), regions=lms.stats().get("regions"),
                   compile_advice=lms.stats().get("compiled"), history=lms.stats()["history"])
    if method == "reference":
        res["t_fwd"], res["t_bwd"], res["t_opt"] = _phases(work, steps)
        res["bandwidth"] = _bandwidth()
    return res


# -- parent: the sweep, the table, the plot ----------------------------------------------------

def parse_fracs(text: str) -> tuple:
    """The numeric lms_frac grid, high to low, and whether the word auto was among them."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    return sorted((float(w) for w in words if w != "auto"), reverse=True), "auto" in words


def run_child(args, workload: str, method: str, cap: float, frac=0.0,
              recompute: bool = False) -> dict:
    # Every method runs with expandable segments: less fragmentation, so a cap means the same
    # thing for all of them (and it is what lmsrt turns on itself).
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    cmd = [sys.executable, os.path.abspath(__file__), "--child",
           f"{workload}:{method}:{cap}:{frac}:{int(recompute)}:{int(args.compile)}",
           *(["--memory-budget", str(args.memory_budget)] if args.memory_budget is not None
             else []), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        res = {"outcome": "timeout"}
    except (IndexError, json.JSONDecodeError):
        res = {"outcome": "crash", "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    res.update(workload=workload, method=method, cap_gib=cap, lms_frac=frac,
               recompute=recompute, compiled=args.compile,
               memory_budget=args.memory_budget, wall_s=round(time.time() - t0, 1))
    shown = f"{res['step_s']:.3f} s" if res["outcome"] == "ok" else res["outcome"]
    if "error" in res:
        shown += f": {res['error']}"
    print(f"  {workload:7} {_label(res):12} cap={cap or '-':>4} lms_frac={frac:<4} {shown}"
          f"  ({res['wall_s']} s)", flush=True)
    if res.get("regions"):
        print(f"    regions: {res['regions']['note']}", flush=True)
    return res


def checkpoint_row(args, workload: str, cap: float) -> dict:
    """The ckpt row: per block for a transformer stack; for the conv net, the fastest of
    --segments that fits, as a user tuning it would pick (the others under "attempts")."""
    if workload != "seg":
        return run_child(args, workload, "ckpt", cap)
    tried = [run_child(args, workload, "ckpt", cap, int(n)) for n in args.segments.split(",") if n]
    fits = [t for t in tried if t["outcome"] == "ok"]
    best = min(fits, key=lambda t: t["step_s"]) if fits else tried[-1]
    best["attempts"] = [t for t in tried if t is not best]
    return best


def _label(row: dict) -> str:
    return (row["method"] + ("+rb" if row.get("recompute") else "")
            + ("+c" if row.get("compiled") else ""))


def floor_s(ref: dict, cap: float, rebuilt_gib: float = 0.0) -> float:
    """The transfer floor at ``cap`` GiB, from the reference's phases and bandwidths; with
    ``rebuilt_gib`` rebuilt instead of moved, the floor of the bytes that still cross."""
    if not cap:
        return ref["step_s"]
    x = max(0.0, ref["peak_gib"] - cap - rebuilt_gib) * GiB
    bw = ref["bandwidth"]
    return max(ref["t_fwd"], x / bw["d2h"]) + max(ref["t_bwd"], x / bw["h2d"]) + ref["t_opt"]


def table(rows: list, refs: dict) -> str:
    head = (f"{'workload':8} {'cap':>4} {'method':12} {'frac':>5} {'step s':>11} {'vs ref':>7} "
            f"{'peak GiB':>8} {'moved GiB':>9} {'floor s':>7} {'effic.':>6} {'settled':>7} "
            f"{'rebuilt':>7} " + "{:>7}".format("floor'"))
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = refs[r["workload"]]
        fl = floor_s(ref, r["cap_gib"])
        cells = [""] * 6
        if r["outcome"] == "ok":
            moved, settled = r.get("moved_gib"), r.get("settled_after")
            cells = [f"{r['step_s']:.3f}", f"{r['step_s'] / ref['step_s']:.2f}x",
                     f"{r['peak_gib']:.2f}", "all" if moved is None else f"{moved:.2f}",
                     f"{fl / r['step_s']:.2f}", "no" if settled is None else str(settled)]
        else:
            cells[0] = r["outcome"]
        frac = r["lms_frac"] if r["method"] in ("lmsrt", "ckpt") else "-"
        rebuilt = r.get("rebuilt_gib") if r.get("recompute") and r["outcome"] == "ok" else None
        extra = ("" if rebuilt is None else
                 f" {rebuilt:7.2f} {floor_s(ref, r['cap_gib'], rebuilt):7.3f}")
        lines.append(f"{r['workload']:8} {r['cap_gib'] or '-':>4} {_label(r):12} {frac:>5} "
                     f"{cells[0]:>11} {cells[1]:>7} {cells[2]:>8} {cells[3]:>9} {fl:7.3f} "
                     f"{cells[4]:>6} {cells[5]:>7}{extra}")
    return "\n".join(lines)


def auto_against_grid(rows: list) -> str:
    """One line per workload and cap: auto's step time over the grid's best."""
    lines = []
    for auto in (r for r in rows if r["method"] == "lmsrt" and r["lms_frac"] == "auto"):
        best = next((r for r in rows if r["method"] == "lmsrt" and r["lms_frac"] != "auto"
                     and r["workload"] == auto["workload"] and r["cap_gib"] == auto["cap_gib"]
                     and r.get("recompute") == auto.get("recompute")), None)
        if auto["outcome"] != "ok" or best is None or best["outcome"] != "ok":
            verdict = f"auto {auto['outcome']}, grid {best['outcome'] if best else 'not run'}"
        else:
            verdict = (f"auto {auto['step_s']:.3f} s = {auto['step_s'] / best['step_s']:.2f}x the "
                       f"grid's {best['step_s']:.3f} s (lms_frac {best['lms_frac']})")
        rb = " +rb" * bool(auto.get("recompute"))
        lines.append(f"{auto['workload']} at {auto['cap_gib']:g} GiB{rb}: "
                     f"{verdict}")
    return "\n".join(lines)


def rebuilt_against_moved(rows: list) -> str:
    """One line per recompute row: its step time over its twin's without recompute."""
    lines = []
    for on in (r for r in rows if r.get("recompute")):
        off = next((r for r in rows if r["method"] == "lmsrt" and not r.get("recompute")
                    and r["workload"] == on["workload"] and r["cap_gib"] == on["cap_gib"]
                    and (r["lms_frac"] == "auto") == (on["lms_frac"] == "auto")), None)
        where = f"{on['workload']} at {on['cap_gib']:g} GiB, lms_frac {on['lms_frac']}"
        if off is not None and off["lms_frac"] != on["lms_frac"]:
            where += f" (without: {off['lms_frac']}, the grid's best)"
        if on["outcome"] != "ok" or off is None or off["outcome"] != "ok":
            lines.append(f"{where}: recompute {on['outcome']}, without "
                         f"{off['outcome'] if off else 'not run'}")
            continue
        lines.append(f"{where}: {off['step_s'] / on['step_s']:.2f}x faster with recompute "
                     f"({on['step_s']:.3f} s against {off['step_s']:.3f} s; "
                     f"{on.get('rebuilt_gib', 0):.2f} GiB rebuilt, {on['moved_gib']:.2f} GiB moved "
                     f"against {off['moved_gib']:.2f})")
    return "\n".join(lines)


def against_checkpoint(rows: list) -> str:
    """One line per lmsrt row that has a ckpt twin: its step time over checkpointing's."""
    lines = []
    for ck in (r for r in rows if r["method"] == "ckpt"):
        for lm in (r for r in rows if r["method"] == "lmsrt" and r["workload"] == ck["workload"]
                   and r["cap_gib"] == ck["cap_gib"]):
            where = f"{ck['workload']} at {ck['cap_gib']:g} GiB, lmsrt {lm['lms_frac']}"
            if lm["outcome"] != "ok" or ck["outcome"] != "ok":
                lines.append(f"{where}: lmsrt {lm['outcome']}, checkpointing {ck['outcome']}")
                continue
            regions = lm.get("regions") or {}
            lines.append(f"{where}: {lm['step_s'] / ck['step_s']:.2f}x checkpointing's step "
                         f"({lm['step_s']:.3f} s against {ck['step_s']:.3f} s; recomputed "
                         f"{regions.get('recomputed', 0)} of {regions.get('regions', 0)} regions)")
    return "\n".join(lines)


def plot(rows: list, refs: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    names = list(refs)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        ref = refs[name]
        caps = sorted({r["cap_gib"] for r in rows if r["workload"] == name and r["cap_gib"]})
        for label, style, method, auto in (("save_on_cpu", "s-", "save_on_cpu", False),
                                           ("lmsrt", "o-", "lmsrt", False),
                                           ("lmsrt auto", "^-", "lmsrt", True),
                                           ("checkpoint", "x-", "ckpt", False)):
            pts = [(r["cap_gib"], r["step_s"]) for r in rows if r["workload"] == name
                   and r["method"] == method and (r["lms_frac"] == "auto") == auto
                   and r["outcome"] == "ok" and r["cap_gib"]]
            if pts:
                ax.plot(*zip(*sorted(pts)), style, label=label)
        ax.plot(caps, [floor_s(ref, c) for c in caps], "k--", label="floor")
        ax.axhline(ref["step_s"], color="gray", lw=0.8, label="no offload, uncapped")
        ax.set_title(f"{name} (uncapped peak {ref['peak_gib']:.1f} GiB)")
        ax.set_xlabel("GPU cap (GiB)")
        ax.set_ylabel("step time (s)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="gpt,seg,gptbig")
    ap.add_argument("--caps", help="GPU caps in GiB, comma-separated (default: each workload's "
                                   "CAPS, down to checkpointing's own peak)")
    ap.add_argument("--fracs", default=",".join(map(str, FRAC_GRID)),
                    help="lms_frac grid, tried from high to low until one fits; the word auto "
                         "adds lms_frac=\"auto\" as a row of its own at every cap")
    ap.add_argument("--methods", default="none,save_on_cpu,lmsrt,ckpt")
    ap.add_argument("--segments", default="2,4,8,16",
                    help="ckpt on the conv net: checkpoint_sequential's segments, each tried; the "
                         "fastest that fits is the row")
    ap.add_argument("--search", choices=("highest", "fastest"), default="highest",
                    help="lmsrt: the highest lms_frac that fits, or the fastest of the whole grid "
                         "(convolutions can need free memory for fast cuDNN algorithms)")
    ap.add_argument("--recompute", choices=("off", "on", "both"), default="on",
                    help="lmsrt's recompute setting (on, as lmsrt's default); both: every lmsrt "
                         "row twice")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile(model) in every method, as a training script would")
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="torch._functorch.config.activation_memory_budget for compiled graphs")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=8, help="steps before timing (the plan settles)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        workload, method, cap, frac, recompute, compiled = args.child.split(":")
        frac = frac if frac == "auto" else float(frac)
        print(json.dumps(child(workload, method, float(cap), frac, args.steps, args.warmup,
                               recompute == "1", compiled == "1", args.memory_budget)))
        return
    given = [float(c) for c in args.caps.split(",") if c] if args.caps else None
    fracs, auto = parse_fracs(args.fracs)
    methods = args.methods.split(",")
    recomputes = {"off": (False,), "on": (True,), "both": (False, True)}[args.recompute]
    rows, refs = [], {}
    for name in args.workloads.split(","):
        ref = run_child(args, name, "reference", 0)
        if ref["outcome"] != "ok":
            print(f"{name}: the uncapped reference failed ({ref['outcome']}); skipped")
            continue
        refs[name] = ref
        rows.append(ref)
        for cap in given or CAPS.get(name, (8, 12, 16)):
            if "none" in methods:
                rows.append(run_child(args, name, "none", cap))
            if "save_on_cpu" in methods:
                rows.append(run_child(args, name, "save_on_cpu", cap))
            if "ckpt" in methods:
                rows.append(checkpoint_row(args, name, cap))
            for recompute in recomputes if "lmsrt" in methods else ():
                if fracs:
                    tried = []
                    for frac in fracs:
                        tried.append(run_child(args, name, "lmsrt", cap, frac, recompute))
                        if tried[-1]["outcome"] == "ok" and args.search == "highest":
                            break
                    fits = [t for t in tried if t["outcome"] == "ok"]
                    best = min(fits, key=lambda t: t["step_s"]) if fits else tried[-1]
                    rows.append(best)
                    best["attempts"] = [t for t in tried if t is not best]
                if auto:
                    rows.append(run_child(args, name, "lmsrt", cap, "auto", recompute))
    if not refs:
        sys.exit("no workload ran (the benchmark needs a CUDA GPU); nothing written")
    os.makedirs(args.out, exist_ok=True)
    text = table(rows, refs)
    bw = {n: {k: round(v / 1e9, 1) for k, v in r["bandwidth"].items()} for n, r in refs.items()}
    print(f"\npinned bandwidth GB/s: {bw}")
    for n, r in refs.items():
        print(f"{n}: uncapped step {r['step_s']:.3f} s (forward {r['t_fwd']:.3f}, backward "
              f"{r['t_bwd']:.3f}, optimizer {r['t_opt']:.3f}), peak {r['peak_gib']:.2f} GiB")
    print("\n" + text)
    if auto:
        print("\n" + auto_against_grid(rows))
    if True in recomputes:
        print("\n" + rebuilt_against_moved(rows))
    if "ckpt" in methods:
        print("\n" + against_checkpoint(rows))
    with open(os.path.join(args.out, "offload.json"), "w") as f:
        json.dump({"rows": rows, "table": text}, f, indent=1, default=str)
    plot(rows, refs, os.path.join(args.out, "offload.png"))
    print(f"\nwrote {args.out}/offload.json and offload.png")


if __name__ == "__main__":
    main()
