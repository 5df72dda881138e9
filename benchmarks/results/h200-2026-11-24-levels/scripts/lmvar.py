"""lm at 18 GiB under auto: per-step policy figures (why bytes moved vary run to run)."""
import sys, time, torch
sys.path[:0] = ["benchmarks", "."]
import lmsrt
from workloads import build
GiB = 2**30
cap = float(sys.argv[1]); name = sys.argv[2]; steps = int(sys.argv[3])
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * GiB / total)
work = build(name)
lms = lmsrt.LMS(lms=1000, lms_frac="auto")
pol = lms._engine.policy
print('sdpa flash/mem/cudnn', torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
for i in range(steps):
    torch.cuda.synchronize(); t = time.perf_counter(); work.step(lms); torch.cuda.synchronize(); dt = time.perf_counter() - t
    s = lms.stats()["last_step"]
    print(f"step {i+1}: {dt:.3f}s out {s['out_bytes']/GiB:.2f} rb {s.get('recipe_bytes',0)/GiB:.2f} kept {s['kept_bytes']/GiB:.2f} peak {s['gpu_peak_bytes']/GiB:.2f} "
          f"pred {s.get('predicted_peak_bytes',0)/GiB:.2f} bound {s.get('bound_bytes',0)/GiB:.2f} head {s.get('headroom_bytes',0)/GiB:.2f} "
          f"corr {pol.correction/GiB:+.2f} retries {s['alloc_retries']} fail {s['alloc_failures']} target {s.get('plan_target_bytes',0)/GiB:.2f} beyond {s.get('beyond_plan_bytes',0)/GiB:.2f} fwd_end {s.get('forward_end_bytes',0)/GiB:.2f} | {s.get('policy_note','')}", flush=True)
p = pol.profile
if p is not None:
    MiB = 2**20
    print("sizes", [round(x/MiB) for x in p.sizes][:40], "n", len(p.sizes))
    print("max fwd_peak %.2f max bwd_peak %.2f GiB; base %.2f" % (max(p.fwd_peak)/GiB, max(p.bwd_peak)/GiB, pol._base/GiB))
    print("bwd_peak head", [round(x/MiB) for x in p.bwd_peak[:12]])
    print("held", p.held, "live", sorted(p.live))
    print("sizes tail", [round(x/MiB) for x in p.sizes[-8:]], "last_use tail", p.last_use[-8:])
    print("fwd_own tail", [round(x/MiB) for x in p.fwd_own[-6:]], "fwd_peak tail", [round(x/MiB) for x in p.fwd_peak[-6:]])
    print("bwd_own head", [round(x/MiB) for x in p.bwd_own[:12]])
    print("offloaded", [i for i, c in enumerate(lms._engine.plan.chosen) if c][-20:], "n chosen", sum(lms._engine.plan.chosen))
    print("rebuildable n", len(lms._engine.plan.rebuildable), "kept big", [(i, round(x/MiB)) for i, x in enumerate(p.sizes) if x > 256*MiB and not lms._engine.plan.chosen[i]])
