"""lm at a cap where it fits: per-step time of no hooks, identity hooks, minimal checked hooks,
lmsrt auto with its Python hooks, and with its C++ hooks, alternated step by step in one process."""
import sys, time, statistics, contextlib, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
cap = float(sys.argv[1]) if len(sys.argv) > 1 else 30
name = sys.argv[2] if len(sys.argv) > 2 else "lm"
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
work = build(name)
def ident(t): return t
def mpack(t):
    fn = t.grad_fn
    return (t if fn is None else t.detach(), t._version)
def munpack(r):
    t, v = r
    if t._version != v: raise RuntimeError("modified")
    return t
py = lmsrt.LMS(lms=1000, lms_frac="auto")
py._hooks = None                                  # the Python hooks
cpp = lmsrt.LMS(lms=1000, lms_frac="auto")
assert cpp._hooks is not None, lmsrt.copy_path.status()
modes = {"none": contextlib.nullcontext(), "ident": torch.autograd.graph.saved_tensors_hooks(ident, ident),
         "minimal": torch.autograd.graph.saved_tensors_hooks(mpack, munpack), "lms-py": py, "lms-cpp": cpp}
rows = {m: [] for m in modes}
for rnd in range(18):
    for m, ctx in modes.items():
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
        if rnd < 2 or rnd == 17:
            extra = ""
            if m.startswith("lms"):
                s = ctx.stats()["last_step"]; extra = f" mode {s['mode']} kept {s['kept_tensors']} skipped {s['skipped_tensors']} out {s['out_bytes']/2**30:.2f} GiB"
            print(f"round {rnd+1} {m}: step {t2-t0:.4f} fwd_cpu {t1-t0:.4f}{extra}", flush=True)
base = statistics.median(r[0] for r in rows["none"][-12:])
print(f"{name} at {cap:g} GiB, median of the last 12 rounds (steps alternated):")
for m in modes:
    st = statistics.median(r[0] for r in rows[m][-12:]); fw = statistics.median(r[1] for r in rows[m][-12:])
    print(f"  {m:8s} step {st:.4f} s ({st/base:.3f}x)  forward on the CPU {fw:.4f} s")
print(cpp.summary())
