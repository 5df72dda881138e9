"""CPU time per saved tensor spent in lmsrt's pack and unpack hooks.

    python benchmarks/pack_overhead.py                 # on CUDA if there, else the simulated device
    python benchmarks/pack_overhead.py --tensors 4096 --kb 64 --out benchmarks/results

Three paths: a tensor too small to swap (returned as is), an eligible tensor kept on the GPU
(lms_frac=1, mark at the whole GPU), and a swapped one (lms_frac=0: D2H at pack, H2D at unpack).
On CUDA with the C++ copy path built (`lmsrt build`), each runs twice, side by side: with the
copy calls made through torch's Python bindings, and through csrc/copy_path.cpp.
Each saved tensor has its own storage; the hooks are called directly, as autograd would, so the
figures are the hooks' own bookkeeping plus the copy launches, not kernel time. Also the CPU time
that recompute's recorder (a dispatch mode, on for the whole forward) adds to each op: one that it
passes through, and one whose recipe it notes. Prints a table and writes pack_overhead.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import lmsrt
import lmsrt.copy_path


def measure(device, lms_kb: float, frac: float, n: int, numel: int, rounds: int) -> dict:
    dev = torch.device("cuda") if device == "cuda" else torch.device("cpu")
    lms = lmsrt.LMS(lms=lms_kb, lms_frac=frac, device=device)
    engine = lms._engine
    leaf = torch.randn(numel, device=dev, requires_grad=True)
    pack, unpack = [], []
    for _ in range(rounds + 1):                          # round 0 warms up (pins the slabs)
        # Non-leaf, one storage each, and dropped after the save as activations are (a tensor
        # still alive at backward would be used in place and kept from the next step on).
        tensors = [leaf * 1.0 for _ in range(n)]
        expect = [t.clone() for t in tensors[-3:]]
        engine.begin_forward()
        t0 = time.perf_counter()
        refs = [engine.pack(t) for t in tensors]
        t1 = time.perf_counter()
        del tensors
        if device == "cuda":
            torch.cuda.synchronize()                     # copies done: backward fetches them
        engine.end_forward()
        t2 = time.perf_counter()
        outs = [engine.unpack(r) for r in reversed(refs)]
        t3 = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, reversed(expect)))
        del refs, outs
        pack.append((t1 - t0) / n * 1e6)
        unpack.append((t3 - t2) / n * 1e6)
    step = lms.stats()["last_step"]
    lms.close()
    return {"pack_us": statistics.median(pack[1:]), "unpack_us": statistics.median(unpack[1:]),
            "swapped": step["out_tensors"], "kept": step["kept_tensors"],
            "skipped": step["skipped_tensors"]}


def recording(device, n: int) -> dict:
    """CPU time per op with recompute's recorder on, against without, side by side (tiny
    tensors: the time is the dispatch, not the kernel)."""
    dev = torch.device("cuda") if device == "cuda" else torch.device("cpu")
    recorder = lmsrt.LMS(lms=1, recompute=True, device=device)._engine.rebuilds.recorder()
    x = torch.randn(64, device=dev, requires_grad=True)
    ops = {"add (passed through)": lambda: x + 1,
           "gelu (recipe noted)": lambda: torch.nn.functional.gelu(x)}
    rows = {}
    for name, op in ops.items():
        def each(on: bool) -> float:
            times = []
            for _ in range(5):
                with recorder if on else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    for _ in range(n):
                        op()
                    times.append((time.perf_counter() - t0) / n * 1e6)
            return statistics.median(times)
        plain, recorded = each(False), each(True)
        rows[name] = {"plain_us": plain, "recorded_us": recorded, "added_us": recorded - plain}
    return rows


def primitives(n: int, numel: int) -> dict:
    """CPU time per call of each CUDA operation a swapped tensor's pack and unpack make."""
    dev = torch.device("cuda")
    src = [torch.randn(numel, device=dev) for _ in range(n)]
    host = torch.empty(n * numel * 4, dtype=torch.uint8, pin_memory=True)
    dst = [host[i * numel * 4:(i + 1) * numel * 4] for i in range(n)]
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    from lmsrt.device import CudaDevice
    engine_device = CudaDevice()
    on_side = engine_device.stream(side)
    events = [torch.cuda.Event() for _ in range(n)]
    storages = [t.untyped_storage() for t in src]

    def each(fn, items):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        return (time.perf_counter() - t0) / len(items) * 1e6

    def copy_on_side(i):
        with on_side:
            dst[i].copy_(src[i].view(torch.uint8), non_blocking=True)

    row = {
        "Event()": each(lambda i: torch.cuda.Event(), range(n)),
        "Event().record (first)": each(lambda i: torch.cuda.Event().record(compute), range(n)),
        "event.record (again)": each(lambda i: events[i].record(compute), range(n)),
        "stream.wait_event": each(lambda i: side.wait_event(events[i]), range(n)),
        "event.query": each(lambda i: events[i].query(), range(n)),
        "stream switch there and back": each(lambda i: on_side.__enter__() or on_side.__exit__(),
                                             range(n)),
        "copy_ D2H (non_blocking)": each(lambda i: dst[i].copy_(src[i].view(torch.uint8),
                                                                non_blocking=True), range(n)),
        "copy_ D2H on side stream": each(copy_on_side, range(n)),
        "copy_ H2D (non_blocking)": each(lambda i: src[i].view(torch.uint8).copy_(
            dst[i], non_blocking=True), range(n)),
        "empty(0).set_(storage)": each(lambda i: torch.empty(0, dtype=torch.uint8, device=dev)
                                       .set_(storages[i]), range(n)),
        "empty(nbytes) on GPU": each(lambda i: torch.empty(numel * 4, dtype=torch.uint8,
                                                           device=dev), range(n)),
        "memory stats read": each(lambda i: engine_device.memory_allocated(), range(n)),
        "current_stream()": each(lambda i: torch.cuda.current_stream(), range(n)),
    }
    torch.cuda.synchronize()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=2048)
    ap.add_argument("--kb", type=float, default=64, help="size of each saved tensor")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "sim")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--profile", action="store_true",
                    help="also print where the swapped path spends")
    ap.add_argument("--primitives", action="store_true",
                    help="also time each CUDA call the swapped path makes (CUDA only)")
    args = ap.parse_args()
    numel = int(args.kb * 1024 // 4)
    cases = {"too small (kept as is)": (args.kb * 2, 0.0), "eligible, kept": (1, 1.0),
             "swapped": (1, 0.0)}
    paths = ["python"]
    if args.device == "cuda" and lmsrt.copy_path.load() is not None:
        paths.append("C++")
    rows = {}
    for path in paths:
        lmsrt.copy_path.set_enabled(path != "python")
        for name, (kb, frac) in cases.items():
            label = f"{name} [{path}]" if args.device == "cuda" else name
            rows[label] = measure(args.device, kb, frac, args.tensors, numel, args.rounds)
    lmsrt.copy_path.set_enabled(True)
    print(f"pack/unpack CPU time per saved tensor: {args.tensors} tensors of {args.kb:g} KB on "
          f"{args.device}, median of {args.rounds} rounds")
    print(f"{'path':33} {'pack us':>8} {'unpack us':>10} {'total us':>9}  swapped/kept/skipped")
    for name, r in rows.items():
        print(f"{name:33} {r['pack_us']:8.1f} {r['unpack_us']:10.1f} "
              f"{r['pack_us'] + r['unpack_us']:9.1f}  {r['swapped']}/{r['kept']}/{r['skipped']}")
    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(measure, args.device, 1, 0.0, args.tensors, numel, 2)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    result = {"device": args.device, "tensors": args.tensors, "kb": args.kb, "rows": rows,
              "copy_path": lmsrt.copy_path.status()}
    result["recording_us"] = recording(args.device, args.tensors)
    print("CPU time per op, recompute's recorder off and on:")
    for name, r in result["recording_us"].items():
        print(f"  {name:24} {r['plain_us']:6.1f} us  {r['recorded_us']:6.1f} us  "
              f"(+{r['added_us']:.1f})")
    if args.primitives and args.device == "cuda":
        result["primitives_us"] = primitives(args.tensors, numel)
        print("CPU time per call of what the swapped path calls:")
        for name, us in result["primitives_us"].items():
            print(f"  {name:32} {us:6.2f} us")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pack_overhead.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
