"""A swapping workload at a cap under auto: where the CPU's time goes (cProfile over 5 settled steps)."""
import sys, time, cProfile, pstats, io, statistics, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
cap = float(sys.argv[1]); name = sys.argv[2]; rc = sys.argv[3] == "rb" if len(sys.argv) > 3 else True
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac="auto", recompute=rc)
ts = []
for i in range(16):
    torch.cuda.synchronize(); t = time.perf_counter()
    with lms:
        loss = work.forward()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    work.update(); torch.cuda.synchronize(); t3 = time.perf_counter()
    ts.append((t3 - t, t1 - t, t2 - t1))
    s = lms.stats()["last_step"]
print(f"{name}@{cap:g} recompute={rc}: step {statistics.median(x[0] for x in ts[-8:]):.3f} fwd_cpu {statistics.median(x[1] for x in ts[-8:]):.3f} bwd_cpu {statistics.median(x[2] for x in ts[-8:]):.3f}  out {s['out_bytes']/2**30:.2f} GiB rebuilt {s.get('recipe_bytes',0)/2**30:.2f}")
pr = cProfile.Profile(); pr.enable()
for i in range(5):
    with lms:
        loss = work.forward()
    loss.backward(); work.update()
torch.cuda.synchronize(); pr.disable()
o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats("tottime").print_stats(45); print(o.getvalue()[-12000:])
o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats("cumtime").print_stats("lmsrt", 45); print(o.getvalue()[-12000:])
