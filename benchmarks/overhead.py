"""lmsrt's own CPU time per settled step: a model trained plain, under the user's own
checkpointing of every block, and under lmsrt with the region plan recomputing its blocks.

    python benchmarks/overhead.py                          # Llama, 24 layers, 30 steps
    python benchmarks/overhead.py --profile 10 --top 30    # and cProfile 10 more settled steps
    python benchmarks/overhead.py --model resnet --profile 10   # resnet152's 50 Bottlenecks
    python benchmarks/overhead.py --cap 0.75 --lms-frac auto --out /tmp

``--model llama`` (the default): transformers' LlamaForCausalLM from a config (hidden 64, 4
heads, MLP 128, vocab 128), batch 2 x 64 tokens, AdamW, against transformers' own
checkpointing. ``--model resnet``: torchvision's ResNet with resnet152's Bottlenecks (3, 8, 36,
3 in ``layer1..layer4``, Sequentials) at width 8 on 2 images of 3x32x32, SGD, against
``torch.utils.checkpoint`` (non-reentrant) around every Bottleneck (overhead_models.py). Both
have tensors small enough that a step's time is mostly Python, as a host-bound GPU step's is;
one thread, on the simulated device. Its capacity is ``--cap`` of the peak of a step that keeps
everything, and its link is made to cost (1 byte/s, as tests/test_regions.py does), so the plan
recomputes regions where they free the excess. At the defaults (0.9, lms_frac 1.0) the Llama's
settled steps recompute every layer and move nothing, as the Trainer's did on an H200.

Settled steps are the last half; each is timed in wall and in process CPU time (which counts no
wait for another process: read it on a busy machine), as the median and the least. lmsrt's
overhead is its step less the plain step less what its reruns cost the model itself (a plain
block's forward, timed by hooks in a run of its own, times the blocks recomputed). ``--profile``
runs more settled steps under cProfile and splits lmsrt's time by where it is entered from outside
lmsrt (the saved-tensor hooks per saved tensor, the module hooks per module call) and by
function; the simulated device's own bookkeeping (it stands in for CUDA's allocator counters) is
shown apart. Read its call counts first: cProfile inflates every Python call, and charges a hook
that a C++ op calls (a Linear's pack) with time a sampling profiler does not see there (py-spy:
benchmarks/results/cpu-2026-11-28-overhead). Prints a table and writes overhead.json.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from overhead_models import MODELS, add_workload_arguments

import lmsrt
from lmsrt.device import SimulatedDevice

LMSRT = os.path.dirname(os.path.abspath(lmsrt.__file__))
SIM = ("device.py", "SimulatedDevice")   # the stand-in's methods, shown apart
# Where lmsrt's time is entered from outside lmsrt, by function name (file, name).
ENTRIES = {
    "saved-tensor pack (engine)": ("engine/forward.py", "pack"),
    "saved-tensor unpack (engine)": ("engine/backward.py", "unpack"),
    "saved-tensor pack (frame, rerun)": ("recompute/frames.py", "pack"),
    "saved-tensor unpack (frame)": ("recompute/frames.py", "unpack"),
    "module pre-hook": ("recompute/regions.py", "pre"),
    "module post-hook": ("recompute/regions.py", "post"),
    "with lms: enter": ("lmsrt/lms.py", "__enter__"),
    "with lms: exit": ("lmsrt/lms.py", "__exit__"),
    "optimizer step pre-hook": ("lmsrt/params.py", "before_step"),
    "rebuild recorder (dispatch mode)": ("recompute/recipes.py", "__torch_dispatch__"),
}


def train(args, steps: int, lms=None, work=None, profile=None, checkpointing=False):
    """Wall and CPU seconds of each of ``steps`` steps, the workload, and the losses."""
    work = work or MODELS[args.model](args)
    if checkpointing:
        work.checkpoint()
    times, cpu, losses = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        with lms if lms is not None else contextlib.nullcontext():
            loss = work.loss()
        loss.backward()
        work.opt.step()
        work.opt.zero_grad(set_to_none=True)
        if profile is not None:
            profile.disable()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss.item())
    return (times, cpu), work, losses


def layer_seconds(args, work, steps: int = 5) -> float:
    """CPU seconds of one block's forward with grad, plain (the median over ``steps`` steps and
    the blocks): what a rerun of one costs the model itself (a rerun that stops at its last
    save runs a little less)."""
    spans, starts = [], {}
    layers = work.blocks
    handles = [layer.register_forward_pre_hook(
        lambda m, a: starts.__setitem__(m, time.process_time())) for layer in layers]
    handles += [layer.register_forward_hook(
        lambda m, a, out: spans.append(time.process_time() - starts[m])) for layer in layers]
    train(args, steps, work=work)
    for h in handles:
        h.remove()
    return statistics.median(spans)


SHAPE = {"llama": ("layers", "hidden", "seq"), "resnet": ("blocks", "width", "size")}
PEER = {"llama": "transformers' checkpointing, all layers",
        "resnet": "torch checkpoint, every block"}


def described(args) -> str:
    if args.model == "llama":
        return (f"Llama {args.layers} layers, hidden {args.hidden}, {args.batch}x{args.seq} "
                "tokens")
    return (f"ResNet of Bottlenecks {args.blocks}, width {args.width}, {args.batch}x3x"
            f"{args.size}x{args.size} images")


def under_lmsrt(args, capacity: int) -> lmsrt.LMS:
    lms = lmsrt.LMS(lms=args.lms_kb, lms_frac=args.lms_frac,
                    device=SimulatedDevice(capacity=capacity),
                    optimizer_state=args.optimizer_state)
    lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    return lms


def _is(func, where) -> bool:
    path, name = where
    return func[2] == name and func[0].endswith(path)


def _own(func) -> bool:
    return func[0].startswith(LMSRT)


def split(stats: pstats.Stats, steps: int) -> dict:
    """lmsrt's time per step: entered from outside lmsrt, by entry point (inclusive, what lmsrt
    calls included; model code run by a rerun is counted by ``recompute_ms`` instead), and by
    lmsrt function (its own time)."""
    raw = stats.stats
    entries = {}
    for label, where in ENTRIES.items():
        calls, seconds = 0, 0.0
        for func, (_, nc, _, ct, callers) in raw.items():
            if not _is(func, where):
                continue
            for caller, (_, ncalls, _, cct) in callers.items():
                if not _own(caller):
                    calls, seconds = calls + ncalls, seconds + cct
            if not callers:         # called first thing after the profiler was enabled
                calls, seconds = calls + nc, seconds + ct
        entries[label] = {"calls_per_step": calls / steps, "us_per_step": seconds / steps * 1e6,
                          "us_per_call": seconds / calls * 1e6 if calls else 0.0}
    funcs = []
    for func, (_, nc, tt, ct, _) in raw.items():
        if _own(func):
            where = os.path.relpath(func[0], os.path.dirname(LMSRT))
            funcs.append({"function": f"{where}:{func[1]}({func[2]})",
                          "calls_per_step": nc / steps, "own_us_per_step": tt / steps * 1e6,
                          "with_callees_us_per_step": ct / steps * 1e6,
                          "simulated_device": func[0].endswith(SIM[0])})
    funcs.sort(key=lambda f: -f["own_us_per_step"])
    own = sum(f["own_us_per_step"] for f in funcs if not f["simulated_device"])
    sim = sum(f["own_us_per_step"] for f in funcs if f["simulated_device"])
    return {"entries": entries, "functions": funcs, "own_us_per_step": own,
            "simulated_device_us_per_step": sim}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(ap, steps=30, layers=24, cap=0.9)
    ap.add_argument("--lms-frac", type=lambda v: v if v == "auto" else float(v), default=1.0,
                    help="lmsrt's lms_frac")
    ap.add_argument("--lms-kb", type=float, default=1, help="lmsrt's lms (least KB swapped)")
    ap.add_argument("--optimizer-state", default="gpu", choices=("gpu", "host", "auto"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="cProfile this many more settled steps")
    ap.add_argument("--top", type=int, default=25, help="lmsrt functions shown")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    # A step that keeps everything: its peak sizes the simulated device.
    kept = lmsrt.LMS(lms=args.lms_kb, lms_frac=1.0, device=SimulatedDevice(capacity=1 << 40))
    train(args, 3, kept)
    peak = kept.stats()["last_step"]["gpu_peak_bytes"]
    kept.close()

    settled = slice(args.steps // 2, None)
    plain, plain_state, plain_losses = train(args, args.steps)
    layer_s = layer_seconds(args, plain_state)
    peer, _, _ = train(args, args.steps, checkpointing=True)
    lms = under_lmsrt(args, int(peak * args.cap))
    times, state, losses = train(args, args.steps, lms)
    if losses != plain_losses:
        raise SystemExit(f"the losses under lmsrt differ from the plain run's: {losses[-3:]} "
                         f"against {plain_losses[-3:]}")
    stats = lms.stats()
    step = stats["history"][-1]
    regions = stats["regions"]
    rerun_ms = step["recomputed_regions"] * layer_s * 1e3
    rows = {}
    for clock, i in (("wall", 0), ("cpu", 1)):
        for stat in ("median", "min"):
            of = getattr(statistics, stat) if stat == "median" else min
            p, u = of(plain[i][settled]), of(times[i][settled])
            rows[f"{clock} {stat}"] = {"plain_ms": p * 1e3,
                                       "checkpointing_ms": of(peer[i][settled]) * 1e3,
                                       "lmsrt_ms": u * 1e3, "reruns_ms": rerun_ms,
                                       "overhead_ms": (u - p) * 1e3 - rerun_ms}
    saved = step["kept_tensors"] + step["out_tensors"] + step["skipped_tensors"]
    result = {
        "model": {"name": args.model, "batch": args.batch,
                  **{k: getattr(args, k) for k in SHAPE[args.model]}},
        "cap": args.cap, "lms_frac": args.lms_frac, "capacity_bytes": int(peak * args.cap),
        "kept_peak_bytes": peak, "steps": args.steps, "torch": torch.__version__,
        "layer_forward_ms": layer_s * 1e3, "step": rows,
        "step_cpu_ms": {name: [round(t * 1e3, 2) for t in run[1]]
                        for name, run in (("plain", plain), ("checkpointing", peer),
                                          ("lmsrt", times))},
        "settled": {"mode": step["mode"], "regions": regions["regions"],
                    "recomputed": step["recomputed_regions"], "moved_bytes": step["out_bytes"],
                    "rebuilt_bytes": step["recipe_bytes"], "engine_saves": saved,
                    "note": regions["note"]},
    }
    print(f"{described(args)}, {args.steps} steps, capacity {args.cap:g} of a kept step's "
          f"peak, lms_frac {args.lms_frac}; settled steps ({step['mode']}): "
          f"{step['recomputed_regions']} of {regions['regions']} regions recomputed, "
          f"{step['out_bytes']} bytes moved, {step['recipe_bytes']} rebuilt, {saved} saves "
          "through the engine")
    print(f"the last {len(times[0][settled])} steps, ms (CPU time is the process's: it counts "
          f"no wait for another)")
    print(f"{'':40} " + " ".join(f"{clock:>11}" for clock in rows))
    for label, key in (("plain", "plain_ms"),
                       (PEER[args.model], "checkpointing_ms"),
                       ("under lmsrt", "lmsrt_ms"),
                       ("  reruns (the model's own time)", "reruns_ms"),
                       ("  lmsrt's overhead", "overhead_ms")):
        print(f"{label:40} " + " ".join(f"{row[key]:11.2f}" for row in rows.values()))

    if args.profile:
        prof = cProfile.Profile()
        train(args, args.profile, lms, work=state, profile=prof)
        found = split(pstats.Stats(prof), args.profile)
        result["profile"] = found
        print(f"\nUnder cProfile, {args.profile} settled steps; per step (inclusive, entered "
              f"from outside lmsrt):")
        print(f"{'entry':36} {'calls':>7} {'us':>9} {'us/call':>8}")
        for label, e in found["entries"].items():
            print(f"{label:36} {e['calls_per_step']:7.0f} {e['us_per_step']:9.0f} "
                  f"{e['us_per_call']:8.1f}")
        print(f"lmsrt's own time {found['own_us_per_step']:.0f} us per step, the simulated "
              f"device's {found['simulated_device_us_per_step']:.0f}; by function:")
        print(f"{'function':70} {'calls':>6} {'own us':>8} {'incl us':>8}")
        for f in found["functions"][:args.top]:
            print(f"{f['function'][-70:]:70} {f['calls_per_step']:6.0f} "
                  f"{f['own_us_per_step']:8.0f} {f['with_callees_us_per_step']:8.0f}")
    lms.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
