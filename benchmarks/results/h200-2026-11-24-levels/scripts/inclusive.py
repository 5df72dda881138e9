"""Inclusive wall time per step of lmsrt's Python entry points (no cProfile), a swapping workload."""
import sys, time, statistics, threading, collections, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt, lmsrt.rebuild as rb
from workloads import build
cap = float(sys.argv[1]); name = sys.argv[2]; rc = (sys.argv[3] == "rb") if len(sys.argv) > 3 else True
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac="auto", recompute=rc)
eng = lms._engine
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(obj, attr, key=None):
    key = key or attr
    f = getattr(obj, attr)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t; cnt[key] += 1
    setattr(obj, attr, w)
for a in ("pack", "unpack", "_rebuild", "_advance", "_fetch", "_swap_out", "_as_recipe", "_offload", "_check_now",
          "_release_finished", "_resident", "_take_over", "begin_forward", "end_forward", "_copy_out", "_bound_held", "_shed"):
    if hasattr(eng, a): wrap(eng, a)
if eng.rebuilds is not None:
    wrap(eng.rebuilds, "run", "rebuilds.run")
    orig = rb.Recorder._note
    def note(self, *a, **k):
        t = time.perf_counter()
        try: return orig(self, *a, **k)
        finally: acc["Recorder._note"] += time.perf_counter() - t; cnt["Recorder._note"] += 1
    rb.Recorder._note = note
ts = []
for i in range(14):
    if i == 8: acc.clear(); cnt.clear()
    torch.cuda.synchronize(); t = time.perf_counter()
    with lms:
        loss = work.forward()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    work.update(); torch.cuda.synchronize(); t3 = time.perf_counter()
    ts.append((t3 - t, t1 - t, t2 - t1))
s = lms.stats()["last_step"]
n = 6
print(f"{name}@{cap:g} recompute={rc}: step {statistics.median(x[0] for x in ts[-n:]):.3f} fwd_cpu {statistics.median(x[1] for x in ts[-n:]):.3f} bwd_cpu {statistics.median(x[2] for x in ts[-n:]):.3f}  out {s['out_bytes']/2**30:.2f} GiB rebuilt {s.get('recipe_bytes',0)/2**30:.2f}")
for k in sorted(acc, key=lambda k: -acc[k]):
    print(f"   {k:20s} {1e3*acc[k]/n:8.2f} ms/step  {cnt[k]/n:7.1f} calls/step  {1e6*acc[k]/max(1,cnt[k]):8.1f} us/call")
