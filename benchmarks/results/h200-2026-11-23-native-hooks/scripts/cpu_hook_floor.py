import sys, time, statistics, torch, contextlib
import lmsrt, lmsrt.copy_path
from lmsrt.device import SimulatedDevice
torch.set_num_threads(1)
layers = [torch.nn.Linear(64, 64) for _ in range(200)]
model = torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.Tanh())])
x = torch.randn(16, 64)
def ident(t): return t
def mpack(t):
    fn = t.grad_fn
    return (t if fn is None else t.detach(), t._version)
def munpack(r):
    t, v = r
    if t._version != v: raise RuntimeError
    return t
m = lmsrt.copy_path.load()
def mk(memory, minb=1024):
    return m.Keeper(torch.device("cpu"), minb, lambda t: None, lambda r: None, set(), memory, None)
class Raw:
    def __init__(self, k): self.k = k
    def __enter__(self):
        self.k.arm([4096]*201, [1<<40]*201, [], 0); self.k.backward(True)
        torch._C._autograd._push_saved_tensors_default_hooks(self.k.pack, self.k.unpack)
    def __exit__(self, *a): torch._C._autograd._pop_saved_tensors_default_hooks(); self.k.take(False)
ctxs = {"none": contextlib.nullcontext(), "ident": torch.autograd.graph.saved_tensors_hooks(ident, ident),
        "minimal": torch.autograd.graph.saved_tensors_hooks(mpack, munpack),
        "raw_pymem": Raw(mk(lambda: 0)), "raw_allskip": Raw(mk(lambda: 0, 1 << 30))}
def fwd(c):
    with c: return model(x).sum()
for i in range(10):
    for c in ctxs.values(): fwd(c).backward()
ts = {k_: [] for k_ in ctxs}; bs = {k_: [] for k_ in ctxs}
for r in range(80):
    for n, c in ctxs.items():
        t0 = time.perf_counter(); l = fwd(c); t1 = time.perf_counter(); l.backward(); t2 = time.perf_counter()
        ts[n].append(t1 - t0); bs[n].append(t2 - t1)
base = statistics.median(ts["none"]); bb = statistics.median(bs["none"])
for n in ctxs: print("%-12s fwd %.2f ms  +%.2f us/save   bwd +%.2f us/save" % (n, statistics.median(ts[n]) * 1e3, (statistics.median(ts[n]) - base) * 1e6 / 600, (statistics.median(bs[n]) - bb) * 1e6 / 600))
