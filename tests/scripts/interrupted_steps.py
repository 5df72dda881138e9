"""Ctrl-C and process exit in the middle of an LMS step (tests/test_reliability.py).

    PYTHONPATH=. python tests/scripts/interrupted_steps.py sim forward
    PYTHONPATH=. python tests/scripts/interrupted_steps.py cuda exit-active
    PYTHONPATH=. python tests/scripts/interrupted_steps.py sim backward recompute

KIND is sim or cuda. A third argument, recompute, trains a GELU MLP with recompute on, one step
before the interrupt, so that rebuilt tensors (and the inputs they pin) are in flight. MODE:
  forward      KeyboardInterrupt raised by a forward hook inside `with lms:`; 2 more exact steps
  signal       a real SIGINT sent from a forward hook; 2 more exact steps
  backward     KeyboardInterrupt raised by a tensor hook in the middle of backward; 2 more steps
  exit-active  exit with LMS still active (no __exit__), a graph alive and copies in flight
  exit-closed  close the LMS with a graph alive; its backward fails clearly; then exit
Prints "ok" and exits 0. Anything on stderr (a traceback, a warning) is a failure.
"""
import atexit
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # models.py
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS

import torch


@atexit.register
def _after_lmsrt():
    # Registered before lmsrt is imported, like torch's own handlers, so it runs after lmsrt's:
    # by then every engine must be closed and its pinned memory given back.
    if engine is not None and not (engine.closed and engine.host.pinned_bytes == 0):
        print("lmsrt's engine was still open when earlier atexit handlers ran", file=sys.stderr)


engine = None
from models import assert_same, make_lms, mlp, rebuild_small_tensors, torch_device, train_step  # noqa: E402 (lmsrt)

# Not what this script checks, and not there when lmsrt was built with a compiler.
warnings.filterwarnings("ignore", message="lmsrt: the native allocator")

kind, mode = sys.argv[1:3]
recompute = sys.argv[3:] == ["recompute"]
dev = torch_device(kind)
torch.manual_seed(0)
if recompute:
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(6)]).to(dev)
else:
    model = mlp(d=64, layers=6).to(dev)
x = torch.randn(32, 64, device=dev)
ref = train_step(model, x)
rebuild_small_tensors(kind)
lms = make_lms(kind, copy_lag=3, recompute=recompute)   # sim copies "in flight" for 3 queries
engine = lms._engine
if recompute:
    assert_same(ref, train_step(model, x, lms=lms))       # checks the rebuilds: trusted from here


def interrupt():
    raise KeyboardInterrupt


def stall_copies():
    if kind == "cuda":                    # copies queued behind this stay in flight at exit
        with torch.cuda.stream(engine.d2h):
            torch.cuda._sleep(200_000_000)


if mode in ("forward", "signal"):
    how = interrupt if mode == "forward" else (lambda: os.kill(os.getpid(), signal.SIGINT))
    handle = model[3].register_forward_hook(lambda module, args, out: how())
    try:
        train_step(model, x, lms=lms)
        sys.exit("the interrupt never came")
    except KeyboardInterrupt:
        pass
    handle.remove()
elif mode == "backward":
    model.zero_grad(set_to_none=True)
    with lms:
        h = model[:3](x)
        h.register_hook(lambda grad: interrupt())
        out = model[3:](h)
    try:
        out.square().mean().backward()
        sys.exit("the interrupt never came")
    except KeyboardInterrupt:
        pass
    del h, out
elif mode == "exit-active":
    lms.__enter__()
    stall_copies()
    out = model(x)                        # its graph is alive when the interpreter exits
    assert lms.stats()["last_step"]["out_tensors"] > 0
    print("ok")
    sys.exit(0)
elif mode == "exit-closed":
    stall_copies()
    with lms:
        out = model(x).square().mean()
    lms.close()                           # waits for the copies, gives the host memory back
    try:
        out.backward()
        sys.exit("backward after close should fail")
    except RuntimeError as e:
        assert "lmsrt" in str(e) and "closed" in str(e), e
    print("ok")
    sys.exit(0)
else:
    sys.exit(f"unknown mode {mode!r}")

for _ in range(2):
    assert_same(ref, train_step(model, x, lms=lms))
with lms:                                 # a step boundary gives back what the last step held
    assert engine.host.used_bytes == 0, engine.host.used_bytes
assert lms.stats()["total"]["out_tensors"] > 0
assert not recompute or lms.stats()["total"]["rebuilt_bytes"] > 0
print("ok")
