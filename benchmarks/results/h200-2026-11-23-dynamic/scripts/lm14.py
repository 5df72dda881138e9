"""lm at 14 GiB, lmsrt defaults, per-step policy figures; the full OOM message."""
import sys, time, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]) * 2**30 / total)
work = build("lm")
lms = lmsrt.LMS()
import traceback
def obs(device, alloc, allocated, free):
    e = lms._engine
    print(f"OOM obs: req {alloc/2**30:.2f} GiB allocated {allocated/2**30:.2f} free {free/2**30:.2f} step {e.step.step} fwd {e._forward_open} held {e._held_bytes/2**30:.2f} ahead {e._ahead/2**30:.2f} bwd_point {e._bwd_point} reserved {torch.cuda.memory_reserved()/2**30:.2f} fetch_to {e.policy.fetch_to(e.plan, e._bwd_point)/2**30:.2f}", flush=True)
    print("   ", " <- ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=10)[-6:][::-1]), flush=True)
torch._C._cuda_attach_out_of_memory_observer(obs)
def show():
    st = lms.stats()
    for s in st["history"][-1:]:
        print(s["step"], s["mode"], "out %.2f kept %.2f peak %.2f pred %.2f bound %.2f head %.2f retr %d fail %d drop %d" % (
            s["out_bytes"]/2**30, s["kept_bytes"]/2**30, s["gpu_peak_bytes"]/2**30, s["predicted_peak_bytes"]/2**30,
            s["bound_bytes"]/2**30, s["headroom_bytes"]/2**30, s["alloc_retries"], s["alloc_failures"], s["prefetch_dropped"]), "|", s["policy_note"][:150], flush=True)
try:
    for i in range(int(sys.argv[2])):
        torch.cuda.synchronize(); t = time.perf_counter()
        work.step(lms)
        torch.cuda.synchronize()
        if i: show()
        print("  t %.3f" % (time.perf_counter() - t), flush=True)
except torch.OutOfMemoryError as e:
    print("OOM at step", i + 1); print(str(e)[-2500:])
    st = lms.stats()["last_step"]
    print("in flight: peak %.2f pred %.2f bound %.2f head %.2f" % (st["gpu_peak_bytes"]/2**30, st["predicted_peak_bytes"]/2**30, st["bound_bytes"]/2**30, st["headroom_bytes"]/2**30))
