"""Run examples/train_gpt.py with per-step policy figures and an OOM observer.
usage: python .base/dbg/exgpt.py <example args>   (or under lmsrt run)"""
import gc, sys, traceback, torch
import lmsrt
src = open("examples/train_gpt.py").read()
def find_lms():
    for o in gc.get_objects():
        if isinstance(o, lmsrt.LMS):
            return o
def show():
    lms = find_lms()
    if lms is None: return
    st = lms.stats()
    s = st["history"][-1] if st.get("history") else None
    ms = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    extra = "" if not ms else None
    if ms: extra = "reserved %.2f inact %.2f segs %d retries %d" % (ms["reserved_bytes.all.current"]/2**30, ms["inactive_split_bytes.all.current"]/2**30, ms["segment.all.current"], ms["num_alloc_retries"])
    if s:
        print("   ", s["step"], s["mode"], "out %.2f kept %.2f peak %.2f pred %.2f bound %.2f head %.2f retr %d fail %d drop %d" % (
            s["out_bytes"]/2**30, s["kept_bytes"]/2**30, s["gpu_peak_bytes"]/2**30, s["predicted_peak_bytes"]/2**30,
            s["bound_bytes"]/2**30, s["headroom_bytes"]/2**30, s["alloc_retries"], s["alloc_failures"], s["prefetch_dropped"]), extra, "|", s["policy_note"][:160], flush=True)
def obs(device, alloc, allocated, free):
    ms = torch.cuda.memory_stats()
    print(f"OOM obs: req {alloc/2**30:.2f} allocated {allocated/2**30:.2f} free {free/2**30:.2f} reserved {ms['reserved_bytes.all.current']/2**30:.2f} inactive {ms['inactive_split_bytes.all.current']/2**30:.2f} segs {ms['segment.all.current']}", flush=True)
    lms = find_lms()
    if lms is not None:
        e = lms._engine
        print(f"   step {e.step.step} fwd {e._forward_open} held {e._held_bytes/2**30:.2f} ahead {e._ahead/2**30:.2f} bwd_point {e._bwd_point}", flush=True)
    print("   ", " <- ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=12)[-8:][::-1]), flush=True)
    try:
        import pickle
        segs = torch.cuda.memory_snapshot()
        big = sorted(((s["total_size"], s["allocated_size"], s.get("is_expandable")) for s in segs), reverse=True)[:12]
        print("    segments (total, allocated, expandable):", [(round(a/2**20), round(b/2**20), c) for a, b, c in big], flush=True)
    except Exception as ex:
        print("snapshot failed", ex)
src = src.replace("    times.append(time.perf_counter() - t0)", "    times.append(time.perf_counter() - t0); show()")
src = src.replace("lms = None\n", "lms = None\ntorch._C._cuda_attach_out_of_memory_observer(obs) if torch.cuda.is_available() else None\n", 1)
assert "show()" in src and "observer" in src
sys.argv[0] = "examples/train_gpt.py"
exec(compile(src, "examples/train_gpt.py", "exec"), {"__name__": "__main__", "show": show, "obs": obs})
