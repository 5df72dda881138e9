"""How much of what each workload saves for backward a recipe could rebuild instead of moving.

For each workload, one forward runs with lmsrt's recipe recorder on (lmsrt/recompute/recipes.py,
NOTE [ Recipes ]); the table gives the bytes saved (eligible storages of 1 MB or more, each once),
the bytes whose recipe's inputs stay available (rebuildable: they need not cross PCIe), by op, and
checks that every recipe rebuilds its tensor bit for bit. On a GPU the workloads run at the
benchmark's sizes; on a CPU (``--device cpu``), scaled down, for the shares only.

    python benchmarks/rebuild_census.py                 # gpt, lm, seg on the GPU
    python benchmarks/rebuild_census.py --device cpu    # the same models, small
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workloads import GPT2LM, GPTBlock, SegNet, build

from lmsrt.recompute.recipes import census, view_of

MB = 1 << 20


def _small(name: str):
    """The workload's model at a size a CPU runs in a second: (forward, autocast)."""
    torch.manual_seed(0)
    if name == "gpt":
        model = torch.nn.Sequential(*[GPTBlock(256, 2) for _ in range(2)])
        x = torch.randn(2, 128, 256, dtype=torch.bfloat16)
        model = model.to(torch.bfloat16)
        return (lambda: model(x).float().square().mean()), False
    if name == "lm":
        model = GPT2LM(vocab=1024, seq=128, d=128, layers=2, heads=2)
        idx = torch.randint(1024, (2, 128))
        return (lambda: torch.nn.functional.cross_entropy(
            model(idx).float().flatten(0, 1), idx.flatten())), True
    if name == "seg":
        model = SegNet(c=16)
        x = torch.randn(2, 4, 128, 128)
        return (lambda: model(x).float().square().mean()), True
    raise ValueError(f"unknown workload {name!r}")


def run(name: str, device: str) -> dict:
    if device == "cpu":
        forward, autocast = _small(name)
        min_bytes = 0
    else:
        work = build(name)
        forward, autocast, min_bytes = work.model_loss, work.autocast, MB

    def fwd():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            return forward()

    t0 = time.perf_counter()
    found = census(fwd, min_bytes=min_bytes)
    seconds = time.perf_counter() - t0
    exact = all(torch.equal(view_of(r.rebuild(), t), t) for t, r in found["saved"] if r is not None)
    return {"workload": name, "device": device, "saved_bytes": found["saved_bytes"],
            "rebuildable_bytes": found["rebuildable_bytes"], "by_op": found["by_op"],
            "bit_exact": exact, "forward_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="gpt,lm,seg")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = [run(name, args.device) for name in args.workloads.split(",")]
    print("| workload | saved (MB) | rebuildable (MB) | share | by op | bit-exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ops = ", ".join(f"{op} {b / MB:.1f}" for op, b in sorted(r["by_op"].items()))
        share = r["rebuildable_bytes"] / r["saved_bytes"] if r["saved_bytes"] else 0.0
        print(f"| {r['workload']} | {r['saved_bytes'] / MB:.1f} "
              f"| {r['rebuildable_bytes'] / MB:.1f} "
              f"| {share:.0%} | {ops or '-'} | {'yes' if r['bit_exact'] else 'NO'} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rebuild_census_{args.device}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
