"""One workload's first steps under lmsrt at defaults, primed; timing split, stats, cProfile of step 1.
    python firststep.py WORKLOAD CAP PINSDIR [--profile] [--steps N]"""
import contextlib, cProfile, io, json, os, pstats, sys, time
sys.path[:0] = [os.path.join(os.getcwd(), "benchmarks"), os.getcwd()]
import torch, lmsrt, lmsrt.cache
from workloads import build
GiB = 1 << 30
name, cap, pins = sys.argv[1], float(sys.argv[2]), sys.argv[3]
prof = "--profile" in sys.argv
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 4
lmsrt.cache.pins_dir = lambda: pins
if os.environ.get("TOUCH"):
    import lmsrt.device; lmsrt.device.CudaDevice.touch_threads = int(os.environ["TOUCH"])
work = build(name)
work.step(contextlib.nullcontext()); torch.cuda.synchronize(); torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * GiB / total)
t_create = time.perf_counter()
lms = lmsrt.LMS()
print(f"LMS() {1e3*(time.perf_counter()-t_create):.1f} ms; pinned ahead {lms.stats()['pinned_ahead_bytes']/GiB:.2f} GiB")
for i in range(steps):
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    end = torch.cuda.Event(enable_timing=True)
    p = cProfile.Profile() if (prof and i == 0) else None
    t0 = time.perf_counter()
    if p: p.enable()
    marks[0].record()
    with lms:
        loss = work.forward()
    t1 = time.perf_counter(); marks[1].record()
    if i == 0:
        h = lms._engine.host
        print(f"fwd end: pinned {h.pinned_bytes/GiB:.2f} most {h.most_pinned/GiB:.2f} used {h.used_bytes/GiB:.2f} GiB; slabs (MiB size/used): "
              + " ".join(f"{sl.size>>20}/{sl.allocator.used_bytes>>20}" for sl in h.slabs)
              + " | pending (size/claimed): " + " ".join(f"{p.size>>20}/{p.claimed>>20}" for p in h._pending))
    loss.backward()
    t2 = time.perf_counter(); marks[2].record()
    work.update(); end.record()
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    if p: p.disable()
    st = lms.stats()["last_step"]
    h = lms._engine.host
    print(f"step {i+1}: wall {t4-t0:.3f} s | cpu fwd {t1-t0:.3f} bwd {t2-t1:.3f} opt {t3-t2:.3f} sync {t4-t3:.3f} | "
          f"gpu fwd {marks[0].elapsed_time(marks[1])/1e3:.3f} bwd {marks[1].elapsed_time(marks[2])/1e3:.3f} opt {marks[2].elapsed_time(end)/1e3:.3f} | "
          f"out {st['out_bytes']/GiB:.2f} in {st['in_bytes']/GiB:.2f} kept {st['kept_bytes']/GiB:.2f} GiB | "
          f"pin s {h.pin_seconds:.2f} waited {h.pin_wait_seconds:.2f} lagged {h.lagged} pinned {h.pinned_bytes/GiB:.2f}", flush=True)
    if i == 0:
        print(json.dumps({k: v for k, v in st.items() if not isinstance(v, (list, dict))}, default=str))
    if p:
        s = io.StringIO(); ps = pstats.Stats(p, stream=s); ps.sort_stats("cumulative").print_stats(45)
        ps.sort_stats("tottime").print_stats(30); print(s.getvalue())
print(lms.summary())
lms.close()
