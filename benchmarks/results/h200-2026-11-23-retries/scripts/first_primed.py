"""Primed first step under the profiler: where lmsrt's own first-step time goes (issue 15).
usage: first_primed.py <workload> <cap>"""
import sys, time, contextlib, torch
sys.path.insert(0, "benchmarks")
import lmsrt
from workloads import build
name, cap = sys.argv[1], float(sys.argv[2])
work = build(name)
work.step(contextlib.nullcontext()); torch.cuda.synchronize(); torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
lms = lmsrt.LMS()
from torch.profiler import profile, ProfilerActivity, record_function
for i in range(4):
    torch.cuda.synchronize(); t = time.perf_counter()
    if i == 0:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            work.step(lms); torch.cuda.synchronize()
    else:
        work.step(lms); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    s = lms.stats()["last_step"]
    print(f"step {i+1}: {dt:.3f}s out {s['out_bytes']/2**30:.2f} in {s['in_bytes']/2**30:.2f} GiB pin {s['host_pin_s']:.2f} pinwait {s['host_pin_wait_s']:.2f} lagged {s['host_lagged']} checks {s['rebuild_checks']} swapin_wait_ms {s['swapin_wait_ms']:.1f} swapout_waits {s.get('swapout_waits', '?')} deferred {s.get('deferred_tensors','?')}", flush=True)
    if i == 0:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
