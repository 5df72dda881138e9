"""lm at 30 GiB (fits): per step wall and GPU time of forward/backward, and CPU time inside lmsrt's
pack/unpack. argv[1]: none|lms."""
import sys, time, statistics, contextlib, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(30 * 2**30 / total)
work = build("lm")
mode = sys.argv[1]
import gc
if mode.endswith("nogc"): gc.disable()
gcs = {"n0": 0, "n1": 0, "n2": 0, "gc_ms": 0.0}
_t = [0.0]
def _cb(phase, info):
    if phase == "start": _t[0] = time.perf_counter()
    else:
        gcs["n%d" % info["generation"]] += 1; gcs["gc_ms"] += (time.perf_counter() - _t[0]) * 1e3
gc.callbacks.append(_cb)
lms = lmsrt.LMS(lms=1000, lms_frac="auto", recompute=True) if mode.startswith("lms") else None
ctx = lms if lms else contextlib.nullcontext()
acc = {"pack": 0.0, "unpack": 0.0, "npack": 0, "nunpack": 0}
if lms:
    eng = lms._engine
    pk, up = eng.pack, eng.unpack
    def pack(t):
        t0 = time.perf_counter(); r = pk(t); acc["pack"] += time.perf_counter() - t0; acc["npack"] += 1; return r
    def unpack(r):
        t0 = time.perf_counter(); x = up(r); acc["unpack"] += time.perf_counter() - t0; acc["nunpack"] += 1; return x
    eng.pack, eng.unpack = pack, unpack
rows = []
for i in range(16):
    for k in acc: acc[k] = 0
    for k in gcs: gcs[k] = 0
    if i == 2 and mode.endswith("freeze"): gc.collect(); gc.freeze()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter(); ev[0].record()
    with ctx:
        loss = work.forward()
    ev[1].record(); t1 = time.perf_counter()
    loss.backward()
    ev[2].record(); t2 = time.perf_counter()
    work.update(); torch.cuda.synchronize(); t3 = time.perf_counter()
    r = dict(step=t3 - t0, fwd_cpu=t1 - t0, bwd_cpu=t2 - t1, fwd_gpu=ev[0].elapsed_time(ev[1]) / 1e3,
             bwd_gpu=ev[1].elapsed_time(ev[2]) / 1e3, **acc, **gcs)
    rows.append(r)
    print(i + 1, " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
med = {k: statistics.median(r[k] for r in rows[-8:]) for k in rows[0]}
print("objects", len(gc.get_objects()), gc.get_threshold())
print(mode, "MEDIAN", " ".join(f"{k} {v:.4f}" for k, v in med.items()))
if lms:
    print(lms.summary())
