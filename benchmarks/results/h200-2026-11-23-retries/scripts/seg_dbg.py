"""seg (or any workload) at a cap: per-step figures, OOMs caught by libraries, phase times."""
import sys, time, torch
sys.path.insert(0, "benchmarks")
import lmsrt
from workloads import build
GiB = 2**30; MiB = 2**20
cap = float(sys.argv[1]); name = sys.argv[2]; frac = sys.argv[3]; steps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
frac = frac if frac == "auto" else float(frac)
total = torch.cuda.get_device_properties(0).total_memory
if cap:
    torch.cuda.set_per_process_memory_fraction(cap * GiB / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac=frac) if frac != 0 else None
import contextlib
ctx = lms or contextlib.nullcontext()
pol = lms._engine.policy if lms else None
trace = []
if pol is not None:
    oh, of = pol.hold_to, pol.fetch_to
    seen = set()
    def hold_to(plan, i):
        if ("f", i) not in seen:
            seen.add(("f", i)); st = torch.cuda.memory_stats(); trace.append(("f", i, st["allocated_bytes.all.current"] - lms._engine._held_bytes, st.get("num_ooms", 0)))
        return oh(plan, i)
    def fetch_to(plan, j):
        if ("b", j) not in seen:
            seen.add(("b", j)); st = torch.cuda.memory_stats(); trace.append(("b", j, st["allocated_bytes.all.current"], st.get("num_ooms", 0)))
        return of(plan, j)
    pol.hold_to, pol.fetch_to = hold_to, fetch_to
def ms():
    s = torch.cuda.memory_stats(); return s.get("num_ooms", 0), s.get("num_alloc_retries", 0)
for i in range(steps):
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    o0, r0 = ms(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter(); work.step(ctx, marks); torch.cuda.synchronize(); dt = time.perf_counter() - t
    o1, r1 = ms()
    if trace and i in (0, 1):
        n = len(pol.profile.sizes) if getattr(pol, 'profile', None) else 0
        print("  trace (phase point alloc-MiB pred-MiB ooms):", " ".join(f"{ph}{pt}:{a/MiB:.0f}/{((getattr(pol, '_base', 0) + pol.predicted[pt + (n if ph == 'b' else 0)])/MiB if getattr(pol, "predicted", None) and pt + (n if ph == 'b' else 0) < len(pol.predicted) else 0):.0f}/{oo-o0}" for ph, pt, a, oo in trace))
    trace.clear(); seen.clear() if trace is not None and pol is not None else None
    line = f"step {i+1}: {dt:.3f}s fwd {marks[0].elapsed_time(marks[1])/1e3:.3f} bwd {marks[1].elapsed_time(marks[2])/1e3:.3f} ooms {o1-o0} retries {r1-r0} peak {torch.cuda.max_memory_allocated()/GiB:.2f} reserved {torch.cuda.memory_reserved()/GiB:.2f}"
    if lms:
        last = lms.stats()["last_step"]
        line += f" | out {last['out_bytes']/GiB:.2f} kept {last['kept_bytes']/GiB:.2f} pred {last.get('predicted_peak_bytes',0)/GiB:.2f} bound {last.get('bound_bytes',0)/GiB:.2f} head {last.get('headroom_bytes',0)/GiB:.2f} lag {last['host_lagged']} pinwait {last['host_pin_wait_s']:.2f} | {last.get('policy_note','')}"
        if pol and pol.auto:
            line += f" corr {pol.correction/GiB:+.2f}"
    print(line, flush=True)
    if pol is not None and pol.auto and pol.profile is not None and i == 1:
        p = pol.profile
        print("  sizes MiB", [round(s / MiB) for s in p.sizes])
        print("  fwd_own", [round(x / MiB) for x in p.fwd_own]); print("  fwd_peak", [round(x / MiB) for x in p.fwd_peak])
        print("  bwd_own", [round(x / MiB) for x in p.bwd_own]); print("  bwd_peak", [round(x / MiB) for x in p.bwd_peak])
        print("  last_use", p.last_use, "live", sorted(p.live), "held", p.held)
