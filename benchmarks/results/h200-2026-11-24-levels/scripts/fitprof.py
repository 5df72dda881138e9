"""lm at 30 GiB (fits): none vs lms (C++ hooks) alternated; per-step lmsrt Python timed; cProfile."""
import sys, time, statistics, contextlib, cProfile, pstats, io, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
cap = float(sys.argv[1]) if len(sys.argv) > 1 else 30
name = sys.argv[2] if len(sys.argv) > 2 else "lm"
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac="auto")
assert lms._hooks is not None
eng = lms._engine
# time the per-step Python entry points
acc = {}
def timed(obj, attr, key):
    f = getattr(obj, attr)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
            acc[key + "#"] = acc.get(key + "#", 0) + 1
    setattr(obj, attr, w)
for a in ("begin_forward", "end_forward", "_finish_step", "_take_over", "_unpack", "_arm", "_absorb", "_begin_plan"):
    timed(eng, a, a)
modes = {"none": contextlib.nullcontext(), "lms": lms}
rows = {m: [] for m in modes}
for rnd in range(40):
    for m, ctx in modes.items():
        if m == "lms" and rnd == 20:
            acc.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx:
            loss = work.forward()
        t1 = time.perf_counter()
        loss.backward()
        work.update()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows[m].append((t2 - t0, t1 - t0))
base = statistics.median(r[0] for r in rows["none"][-20:])
for m in modes:
    st = statistics.median(r[0] for r in rows[m][-20:]); fw = statistics.median(r[1] for r in rows[m][-20:])
    print(f"{name}@{cap:g} {m:5s} step {st:.4f} s ({st/base:.3f}x) fwd_cpu {fw:.4f}")
print("per-step lmsrt Python over the last 20 lms steps (us/step, calls/step):")
for k in sorted(k for k in acc if not k.endswith("#")):
    print(f"  {k:14s} {1e6*acc[k]/20:8.1f} us  {acc[k+'#']/20:6.1f} calls")
s = lms.stats()["last_step"]
print({k: s[k] for k in ("mode", "kept_tensors", "skipped_tensors", "out_bytes", "alloc_retries")})
# cProfile of 10 lms steps
pr = cProfile.Profile()
pr.enable()
for i in range(10):
    with lms:
        loss = work.forward()
    loss.backward(); work.update()
torch.cuda.synchronize()
pr.disable()
o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats("tottime").print_stats(30); print(o.getvalue()[-7000:])
o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats("cumtime").print_stats("lmsrt", 30); print(o.getvalue()[-6000:])
# micro: the Keeper's pack against identity, on a non-leaf CUDA tensor
k = lms._hooks
x = torch.randn(1024, 1024, device="cuda", requires_grad=True) * 2
N = 20000
for label, fn in (("ident", lambda t: t), ("detach", lambda t: (t.detach(), t._version)), ("keeper(unarmed->python)", None)):
    if fn is None:
        break
    t = time.perf_counter()
    for _ in range(N): fn(x)
    print(f"micro {label}: {1e6*(time.perf_counter()-t)/N:.2f} us")
