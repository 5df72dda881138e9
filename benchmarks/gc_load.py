"""What a training step gives Python's cyclic collector to do: plain, and under lmsrt.

    python benchmarks/gc_load.py                        # Llama, 8 layers, 10 steps
    python benchmarks/gc_load.py --layers 24 --steps 20 --out /tmp
    python benchmarks/gc_load.py --model resnet --blocks 3,4,6,3

The models are overhead.py's (overhead_models.py), on the simulated device, one thread. Each run
trains the model in a plain loop, ``with lms:`` around forward: plain,
under lmsrt with ``lms_frac="auto"`` at ``--cap`` of a kept step's peak, and the same with its
link made to cost (1 byte/s, as tests/test_regions.py does), so the plan recomputes regions as
the Trainer's did on an H200. Two passes over the same steps, first steps included, each in a
process of its own:

  collector on (as the user has it): collections per step by generation, and the objects that
    the young collections promoted to the oldest generation (a full collection runs once those
    exceed a quarter of what it holds: on a big heap, such as transformers' Trainer's, each one
    costs tenths of a second);
  collector off: the GC-tracked objects a step's forward leaves alive until backward, counted
    after a young collection (which stops tracking tuples of atomics, as any collection would),
    the objects the finished step leaves alive, and the cyclic garbage the step made (what only
    the collector frees).

Prints a table and writes gc_load.json.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUNS = ("plain", "auto", "recompute")


def _run(args) -> dict:
    """One run (``args.run``), in this process."""
    import torch
    from overhead_models import MODELS

    import lmsrt
    from lmsrt.device import SimulatedDevice
    torch.set_num_threads(1)
    lms = None
    if args.run != "plain":
        kept = lmsrt.LMS(lms=1, lms_frac=1.0, device=SimulatedDevice(capacity=1 << 40))
        work = MODELS[args.model](args)
        for _ in range(2):
            with kept:
                loss = work.loss()
            loss.backward()
        peak = kept.stats()["last_step"]["gpu_peak_bytes"]
        kept.close()
        lms = lmsrt.LMS(lms=1, lms_frac="auto",
                        device=SimulatedDevice(capacity=int(peak * args.cap)))
        if args.run == "recompute":
            lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    work = MODELS[args.model](args)

    def forward():
        with lms if lms is not None else contextlib.nullcontext():
            return work.loss()

    def rest(loss):
        loss.backward()
        work.opt.step()
        work.opt.zero_grad(set_to_none=True)

    counts = collections.Counter()
    young = [0]

    def watch(phase, info):
        g = info["generation"]
        if phase == "start" and g == 1:
            young[0] = len(gc.get_objects(0)) + len(gc.get_objects(1))
        elif phase == "stop":
            counts[g] += 1
            if g == 1:
                counts["promoted"] += young[0] - info["collected"]

    def mode():
        return lms.stats()["last_step"]["mode"] if lms else "plain"

    steps = []
    if args.collector == "on":
        gc.callbacks.append(watch)
        try:
            for _ in range(args.steps):
                counts.clear()
                rest(forward())
                steps.append({"collections": [counts[g] for g in range(3)],
                              "promoted": counts["promoted"], "mode": mode()})
        finally:
            gc.callbacks.remove(watch)
        return {"steps": steps}

    gc.disable()
    try:
        for _ in range(args.steps):
            gc.collect()
            before = {id(o) for o in gc.get_objects()}
            loss = forward()
            garbage = gc.collect(0)
            alive = [o for o in gc.get_objects() if id(o) not in before]
            kinds = collections.Counter(type(o).__name__ for o in alive)
            del alive
            rest(loss)
            del loss
            left = sum(1 for o in gc.get_objects() if id(o) not in before)
            steps.append({"forward_alive": sum(kinds.values()), "step_left": left,
                          "garbage": garbage + gc.collect(), "mode": mode(),
                          "kinds": dict(kinds.most_common(args.top))})
    finally:
        gc.enable()
    return {"steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from overhead_models import add_workload_arguments
    add_workload_arguments(ap, steps=10, layers=8, cap=0.75)
    ap.add_argument("--top", type=int, default=8, help="types shown per step in the JSON")
    # One run and pass, in this process:
    ap.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--collector", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.run:
        json.dump(_run(args), sys.stdout)
        return
    results = {"model": args.model, "steps": args.steps, "cap": args.cap, "runs": {}}
    for run in RUNS:
        passes = []
        for collector in ("on", "off"):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--run", run,
                                  "--collector", collector],
                                 check=True, capture_output=True, text=True).stdout
            passes.append(json.loads(out.strip().splitlines()[-1])["steps"])
        results["runs"][run] = {"steps": [{**on, **off} for on, off in zip(*passes)]}

    print(f"{args.model}, {args.steps} steps; per step: collections by generation (0/1/2), "
          "objects promoted to the oldest, and with the collector off: tracked objects alive "
          "from forward to backward, left by the finished step, cyclic garbage")
    print(f"{'run':10} {'step':>4} {'mode':9} {'collections':>11} {'promoted':>8} "
          f"{'fwd alive':>9} {'left':>6} {'garbage':>7}")
    for run, result in results["runs"].items():
        for i, s in enumerate(result["steps"]):
            print(f"{run:10} {i:4} {s['mode']:9} {'/'.join(map(str, s['collections'])):>11} "
                  f"{s['promoted']:8} {s['forward_alive']:9} {s['step_left']:6} "
                  f"{s['garbage']:7}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gc_load.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
