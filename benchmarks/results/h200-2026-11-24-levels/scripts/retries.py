"""Which allocations make the allocator retry: memory history of one settled step."""
import sys, time, pickle, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
cap = float(sys.argv[1]); name = sys.argv[2]; frac = sys.argv[3]; out = sys.argv[4]
frac = frac if frac == "auto" else float(frac)
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac=frac)
def r(): return torch.cuda.memory_stats().get("num_alloc_retries", 0)
for i in range(12):
    r0 = r(); torch.cuda.synchronize(); t = time.perf_counter(); work.step(lms); torch.cuda.synchronize()
    print(f"step {i+1} {time.perf_counter()-t:.3f} s retries {r()-r0}", flush=True)
torch.cuda.memory._record_memory_history(max_entries=200000, context="all", stacks="python")
r0 = r(); torch.cuda.synchronize(); t = time.perf_counter(); work.step(lms); torch.cuda.synchronize()
print(f"recorded step {time.perf_counter()-t:.3f} s retries {r()-r0}", flush=True)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
with open(out, "wb") as f:
    pickle.dump(snap, f)
# timing of retries: events around a step with and without
