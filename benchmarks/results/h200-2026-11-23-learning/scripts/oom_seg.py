"""seg at a cap: every failed allocation in steps 1-2 with reserved, lmsrt's holdings, and (first
few in backward) the allocator's segments per stream. python oom_seg.py <cap> <frac|auto> [steps]"""
import sys, time, torch, collections
sys.path.insert(0, "benchmarks")
import lmsrt
from workloads import build
GiB = 2**30; MiB = 2**20
cap = float(sys.argv[1]); frac = sys.argv[2]; steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
frac = frac if frac == "auto" else float(frac)
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * GiB / total)
work = build("seg")
lms = lmsrt.LMS(lms=1000, lms_frac=frac)
e = lms._engine
shown = [0]
def segs():
    by = collections.defaultdict(lambda: [0, 0, 0, 0])
    for sg in torch.cuda.memory_snapshot():
        k = (sg["stream"], sg["segment_type"], sg.get("is_expandable", False))
        v = by[k]; v[0] += 1; v[1] += sg["total_size"]; v[2] += sg["allocated_size"]; v[3] += sg["active_size"]
    return " ; ".join(f"stream {k[0]:#x} {k[1]}{' exp' if k[2] else ''}: n{v[0]} total {v[1]/MiB:.0f} alloc {v[2]/MiB:.0f} active {v[3]/MiB:.0f}" for k, v in by.items())
def obs(device, alloc, allocated, free):
    st = torch.cuda.memory_stats()
    restored = [(s.index, s.nbytes >> 20, s.unpacked, s.consumed) for s in e._order if s.gpu is not None]
    print(f"OOM step {e.step.step} {'fwd' if e._forward_open else 'bwd'} pt {getattr(e, '_bwd_point', None)} req {alloc/MiB:.0f} MiB alloc {allocated/MiB:.0f} reserved {st['reserved_bytes.all.current']/MiB:.0f} drvfree {free/MiB:.0f} held {e._held_bytes>>20} ahead {e._ahead>>20} restored {restored}", flush=True)
    if not e._forward_open and shown[0] < 3:
        shown[0] += 1
        print("   segs:", segs(), flush=True)
torch._C._cuda_attach_out_of_memory_observer(obs)
def ms():
    s = torch.cuda.memory_stats(); return s.get("num_ooms", 0), s.get("num_alloc_retries", 0)
print("streams: compute", hex(torch.cuda.current_stream().cuda_stream), "d2h", hex(e.d2h.cuda_stream), "h2d", hex(e.h2d.cuda_stream))
for i in range(steps):
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    o0, r0 = ms(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter(); work.step(lms, marks); torch.cuda.synchronize(); dt = time.perf_counter() - t
    o1, r1 = ms()
    print(f"step {i+1}: {dt:.3f}s fwd {marks[0].elapsed_time(marks[1])/1e3:.3f} bwd {marks[1].elapsed_time(marks[2])/1e3:.3f} ooms {o1-o0} retries {r1-r0} peak {torch.cuda.max_memory_allocated()/GiB:.2f} reserved {torch.cuda.memory_reserved()/GiB:.2f}", flush=True)
    print("   end segs:", segs(), flush=True)
