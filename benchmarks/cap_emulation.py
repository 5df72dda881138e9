"""How the way a GPU is capped changes what runs under the cap: kernels' speed and the caching
allocator's retries, each way in a fresh process.

    python benchmarks/cap_emulation.py --cap 14
    python benchmarks/cap_emulation.py --cap 14 --ways fraction,hold-chunks --out results/

``lmsrt run --gpu-limit`` (and the client matrix's peers) cap a GPU with torch's per-process
memory fraction unless ``LMSRT_GPU_CAP=hold`` (lmsrt/gpu_cap.py, NOTE [ Capping a GPU ]). Under
the fraction the caching allocator refuses a request that no free block holds whenever the bytes
reserved plus the *whole* request pass the cap, even where its expandable segment lacks only a
few pages of it: it frees its whole cache, synchronises and maps again (a retry). A GPU of the
cap's size would map the missing pages. Measured on an H200
(benchmarks/results/h200-2026-11-29-session30 and -session31): transformers' Trainer with its
checkpointing at 14 GiB retried once a step under lmsrt for want of 116 MiB, Lightning's GPT at
14.2 once or twice. Run at 14 GiB (session 31), this benchmark found no cost in holding: a matmul
and a copy 1.005x under ``hold``, 0.975x under ``hold-chunks``, and the scenario's 2 GiB request
one retry (14.1 ms) under the fraction against none (2.3 ms) held. Per way:

- ``none``: no cap;
- ``fraction``: torch's per-process memory fraction (as today);
- ``hold``: the memory above the cap taken from the driver (``cuMemAlloc``) in one allocation;
- ``hold-chunks``: the same in allocations of ``--chunk-gib`` GiB.

and measures, after the cap: a bf16 matmul's TFLOP/s, a device-to-device copy's GB/s (both on
tensors made after the cap, from the allocator's expandable segments), and the scenario behind
the retries: with the cap less 4.75 GiB allocated, a 1.5 GiB block freed between allocated ones
and another freed at the segment's end (1.5 GiB under the cap reserved), a 2 GiB request: no free
block holds it, reserved + 2 GiB passes the cap by 0.5 GiB, while the 0.5 GiB the end block lacks
leaves 1 GiB under it: its retries and its milliseconds, run before the kernels (whose tensors
and cuBLAS workspace would leave gaps the scenario's blocks could fill), and ``laid_out``: whether
its three blocks lay next to each other as meant (where not, its retries say nothing). Under the
held ways, what CUDA maps after the hold (kernels, library handles; 240-313 MiB in the runs
above) counts against the cap, as on a GPU of that size; under the fraction it does not.
Prints a table and writes cap_emulation.json to ``--out``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

GiB = 1 << 30
WAYS = ("none", "fraction", "hold", "hold-chunks")


# -- the child: one way, measured ----------------------------------------------------------------

def take(nbytes: int, chunk: Optional[int]) -> List[int]:
    """``nbytes`` of device memory from the driver, in one allocation or in ``chunk``-byte ones;
    the pointers (held until the process ends)."""
    lib = ctypes.CDLL("libcuda.so.1")
    pointers = []
    left = nbytes
    while left > 0:
        size = left if chunk is None else min(chunk, left)
        pointer = ctypes.c_uint64(0)
        err = lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size))
        if err != 0:
            raise RuntimeError(f"cuMemAlloc of {size} bytes: CUDA driver error {err}")
        pointers.append(pointer.value)
        left -= size
    return pointers


def cap(way: str, limit: int, chunk: int) -> Dict[str, float]:
    """Apply ``way`` at ``limit`` bytes; what it took (seconds, bytes held)."""
    import torch
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    held = 0
    if way == "fraction":
        torch.cuda.set_per_process_memory_fraction(limit / total)
    elif way in ("hold", "hold-chunks"):
        held = free - limit
        if held > 0:
            take(held, chunk if way == "hold-chunks" else None)
    return {"cap_s": time.perf_counter() - t0, "held_gib": max(held, 0) / GiB}


def timed(fn, repeats: int) -> float:
    """Seconds a call of ``fn`` takes on the GPU, the median of ``repeats`` after one warm-up."""
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def kernels(repeats: int) -> Dict[str, float]:
    """A bf16 matmul's TFLOP/s and a 1 GiB device copy's GB/s."""
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    matmul = timed(lambda: a @ b, repeats)
    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = timed(lambda: y.copy_(x), repeats)
    return {"matmul_tflops": 2 * n ** 3 / matmul / 1e12, "copy_gbs": 2 * GiB / copy / 1e9}


def scenario(limit: int, rounds: int) -> Dict[str, float]:
    """The retry behind the measured runs (the module's docstring), ``rounds`` times: retries
    and seconds of the 2 GiB request, the most reserved after it."""
    import torch
    stats = torch.cuda.memory_stats
    persistent = torch.empty(limit - 19 * GiB // 4, dtype=torch.uint8, device="cuda")
    retries, seconds, reserved, laid_out = 0, [], 0, True
    for _ in range(rounds):
        hole = torch.empty(3 * GiB // 2, dtype=torch.uint8, device="cuda")
        beside = torch.empty(GiB // 4, dtype=torch.uint8, device="cuda")
        tail = torch.empty(3 * GiB // 2, dtype=torch.uint8, device="cuda")
        laid_out = laid_out and (hole.data_ptr() + hole.numel() == beside.data_ptr()
                                 and beside.data_ptr() + beside.numel() == tail.data_ptr())
        del hole, tail
        torch.cuda.synchronize()
        before = stats().get("num_alloc_retries", 0)
        t0 = time.perf_counter()
        request = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        retries += stats().get("num_alloc_retries", 0) - before
        reserved = max(reserved, torch.cuda.memory_reserved())
        del request, beside
        torch.cuda.empty_cache()
    del persistent
    return {"retries_per_round": retries / rounds,
            "request_ms": 1e3 * sorted(seconds)[len(seconds) // 2],
            "reserved_gib": reserved / GiB, "laid_out": laid_out}


def child(way: str, limit_gib: float, chunk_gib: float, repeats: int, rounds: int) -> dict:
    import torch
    if not torch.cuda.is_available():
        return {"way": way, "error": "no CUDA device"}
    limit = int(limit_gib * GiB)
    row = {"way": way, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        row.update(cap(way, limit, int(chunk_gib * GiB)))
        row.update(scenario(limit, rounds))
        torch.cuda.empty_cache()
        row.update(kernels(repeats))
    except (RuntimeError, OSError) as e:           # out of memory, no driver library
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


# -- the parent: each way in its own process ---------------------------------------------------

def run_way(way: str, args) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    command = [sys.executable, os.path.abspath(__file__), "--child", way, "--cap", str(args.cap),
               "--chunk-gib", str(args.chunk_gib), "--repeats", str(args.repeats),
               "--rounds", str(args.rounds)]
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"way": way, "error": f"over --timeout {args.timeout:g} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"way": way, "error": f"exit {out.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def table(rows: List[dict]) -> str:
    """The rows as a markdown table, each figure also against the first row without an error."""
    base = next((r for r in rows if "error" not in r), None)
    lines = ["| way | held GiB | cap s | matmul TFLOP/s | copy GB/s | retries a round | "
             "2 GiB request ms | reserved GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['way']} | {r['error']} | | | | | | |")
            continue

        def rel(key):
            value = r[key]
            if base is None or base is r or not base.get(key):
                return f"{value:.1f}"
            return f"{value:.1f} ({value / base[key]:.3f}x)"
        retries = f"{r['retries_per_round']:.2f}" + (
            "" if r.get("laid_out", True) else " (blocks not laid out as meant)")
        lines.append(f"| {r['way']} | {r['held_gib']:.1f} | {r['cap_s']:.2f} | "
                     f"{rel('matmul_tflops')} | {rel('copy_gbs')} | {retries} | "
                     f"{r['request_ms']:.1f} | {r['reserved_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", type=float, default=14.0, help="GiB (default 14)")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"of {', '.join(WAYS)}")
    ap.add_argument("--chunk-gib", type=float, default=1.0, help="hold-chunks' allocations")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each kernel")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the retry scenario")
    ap.add_argument("--timeout", type=float, default=180, help="seconds a way may take")
    ap.add_argument("--out", default="benchmarks/results", help="folder for cap_emulation.json")
    ap.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.cap > 5:
        ap.error(f"--cap {args.cap:g}: give more than 5 GiB (the scenario holds the cap less "
                 "4.75)")
    if args.child:
        print(json.dumps(child(args.child, args.cap, args.chunk_gib, args.repeats,
                               args.rounds)), flush=True)
        return
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = sorted(set(ways) - set(WAYS))
    if not ways:
        ap.error("--ways: name at least one way")
    if unknown:
        ap.error(f"--ways: {', '.join(unknown)} not among {', '.join(WAYS)}")
    rows = []
    for way in ways:
        print(f"{way} at {args.cap:g} GiB ...", file=sys.stderr, flush=True)
        rows.append(run_way(way, args))
    text = table(rows)
    print(f"cap {args.cap:g} GiB; {rows[0].get('device', '')} {rows[0].get('torch', '')}\n")
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cap_emulation.json")
    with open(path, "w") as f:
        json.dump({"cap_gib": args.cap, "chunk_gib": args.chunk_gib, "rows": rows}, f, indent=1)
    print(f"\nwrote {path}")
    if all("error" in r for r in rows):
        sys.exit("cap_emulation: no way could be measured (a CUDA GPU is needed)")


if __name__ == "__main__":
    main()
