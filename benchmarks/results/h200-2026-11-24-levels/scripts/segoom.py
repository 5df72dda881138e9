"""examples/train_segnet.py --gpu-limit 6 --lms 1000 with the allocator's OOM observer: which requests fail, when."""
import sys, runpy, traceback, collections, torch
sys.path.insert(0, ".")
import lmsrt
inst = []
orig = lmsrt.LMS.__init__
def init(self, *a, **k):
    orig(self, *a, **k); inst.append(self)
lmsrt.LMS.__init__ = init
seen = collections.Counter()
def obs(device, alloc, allocated, free):
    e = inst[-1]._engine if inst else None
    where = (e.step.step, "fwd" if e._forward_open else "bwd", e._held_bytes >> 20, e._ahead >> 20, e._bwd_point if hasattr(e, "_bwd_point") else -1, e._index) if e else None
    key = (where[0] if where else 0, round(alloc / 2**20))
    seen[key] += 1
    if seen[key] <= 2:
        st = traceback.extract_stack(limit=12)
        print(f"OOM obs: req {alloc/2**20:.1f} MiB allocated {allocated/2**30:.2f} GiB free {free/2**30:.2f} at (step, phase, held MiB, ahead MiB, bwd_point, fwd_index)={where} | " + " <- ".join(f"{f.name}:{f.lineno}" for f in st[-6:-1][::-1]), flush=True)
torch._C._cuda_attach_out_of_memory_observer(obs)
sys.argv = ["examples/train_segnet.py", "--gpu-limit", "6", "--lms", "1000", "--steps", "6"]
try:
    runpy.run_path("examples/train_segnet.py", run_name="__main__")
finally:
    print("failures by (step, MiB):", sorted(seen.items()))
    e = inst[-1]._engine
    pol = e.policy
    for s in list(e.run_stats.history):
        print(s.step, s.mode, "out", s.out_bytes >> 20, "fail", s.alloc_failures, "retries", s.alloc_retries, "peak", s.gpu_peak_bytes >> 20, "pred", s.predicted_peak_bytes >> 20, "bound", s.bound_bytes >> 20, "head", s.headroom_bytes >> 20, "|", s.policy_note)
    p = pol.profile
    if p is not None:
        print("fwd_peak MiB", [x >> 20 for x in p.fwd_peak]); print("bwd_peak MiB", [x >> 20 for x in p.bwd_peak])
        print("sizes MiB", [x >> 20 for x in p.sizes])
        print("between (k, MiB, span):", [(k, p.sizes[k] >> 20, p.between(k)) for k in range(len(p.sizes)) if hasattr(p, "between") and p.between(k)])
        print("offloaded:", [k for k, c in enumerate(e.plan.chosen) if c])
