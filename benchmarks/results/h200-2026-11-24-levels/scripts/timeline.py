"""A workload at a cap under auto: after warm-up, a torch.profiler trace of 3 steps (CUDA streams)."""
import sys, os, time, torch, json
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
cap = float(sys.argv[1]); name = sys.argv[2]; out = sys.argv[3]
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac="auto")
for i in range(14):
    torch.cuda.synchronize(); t = time.perf_counter(); work.step(lms); torch.cuda.synchronize()
    s = lms.stats()["last_step"]
    print(f"step {i+1} {time.perf_counter()-t:.3f} s out {s['out_bytes']/2**30:.2f} rebuilt {s.get('recipe_bytes',0)/2**30:.2f} retries {s['alloc_retries']} | {s.get('policy_note','')}", flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        torch.cuda.synchronize(); t = time.perf_counter(); work.step(lms); torch.cuda.synchronize()
        print(f"profiled step {time.perf_counter()-t:.3f}", flush=True)
prof.export_chrome_trace(out)
print(lms.summary())
