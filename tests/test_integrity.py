"""What must never give a wrong gradient or lose anything: in-place changes to saved tensors,
storages saved many times, interrupts inside engine code, hooks left pushed, shared threads,
side streams, regions that forbid saved-tensor hooks, tensor kinds the engine cannot swap, and
tensors that stay alive anyway. Gradients are compared with ``torch.equal``; each check runs on
the simulated device, and on CUDA under the marker:

    PYTHONPATH=. python -m pytest -q tests/test_integrity.py             # CUDA twins skipped
    PYTHONPATH=. python -m pytest -q -m cuda tests/test_integrity.py     # on a GPU machine
"""
import contextlib
import gc
import os
import subprocess
import sys
import threading
import tracemalloc
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from models import (
    DEVICES,
    assert_same,
    lmsrt_warnings,
    make_lms,
    mlp,
    pins_at_hand,
    run_threads,
    torch_device,
    train_step,
    transformer,
)
from torch import nn

import lmsrt
from lmsrt.engine import forward as engine_module  # the room that makes handles
from lmsrt.policy import FixedPolicy

ROOT = Path(__file__).resolve().parent.parent
INPLACE = "modified by an inplace operation"


def _params_grads(model):
    return [p.grad.clone() for p in model.parameters()]


# -- in-place changes to saved tensors ---------------------------------------------------------

def _check_inplace_raises(kind, lms_frac, lms_kb, drop):
    """Autograd's own example: z saved by exp, then modified in place. Without LMS backward
    raises; with LMS it must raise the same error, whether z was kept or swapped, and also when
    z itself is gone by backward time (its storage still held by the graph)."""
    dev = torch_device(kind)
    x = torch.randn(256, 64, device=dev, requires_grad=True)
    with pytest.raises(RuntimeError, match=INPLACE):
        z = (x * 2).exp()
        loss = z.sum()
        z.add_(1)
        loss.backward()
    lms = make_lms(kind, lms=lms_kb, lms_frac=lms_frac)
    with lms:
        z = (x * 2).exp()
        loss = z.sum()
    z.add_(1)
    if drop:
        del z
    with pytest.raises(RuntimeError, match=INPLACE) as info:
        loss.backward()
    assert "expected version 0" in str(info.value) and "lmsrt" in str(info.value)
    how = "swapped to host memory" if lms_kb == 1 else "kept on the GPU"
    assert how in str(info.value), str(info.value)


@pytest.mark.parametrize("lms_frac, lms_kb", [(0.0, 1), (0.0, 1 << 20)],
                         ids=["swapped", "kept"])
@pytest.mark.parametrize("drop", [False, True], ids=["alive", "dropped"])
@pytest.mark.parametrize("kind", DEVICES)
def test_inplace_change_of_a_saved_tensor_raises_like_autograd(kind, lms_frac, lms_kb, drop):
    _check_inplace_raises(kind, lms_frac, lms_kb, drop)


@pytest.mark.parametrize("use_lms", [False, True], ids=["plain", "lms"])
def test_inplace_change_of_a_trainable_leaf_raises_like_autograd(use_lms):
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with make_lms("sim") if use_lms else contextlib.nullcontext():
        loss = (x @ w.sin()).sum()         # sin saves w for w's gradient
    with torch.no_grad():
        w.mul_(2)                          # an optimizer step before backward: a user's bug
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


@pytest.mark.cuda
def test_inplace_change_while_the_copy_is_in_flight_raises_cuda():
    """The D2H copy waits on the compute stream only up to the save; an in-place kernel queued
    after it races the copy. Stalling the D2H stream makes the kernel win every time: the
    copied bytes are the modified ones, and the version check must catch it."""
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    for lms_frac in (0.0, 0.5, 0.9):
        lms = lmsrt.LMS(lms=1, lms_frac=lms_frac, device="cuda")
        pins_at_hand(lms)                   # the copy goes out in step 1, not deferred
        for _ in range(3):
            with lms:
                z = (x * 2).exp()
                loss = z.sum()
            with torch.cuda.stream(lms._engine.d2h):
                torch.cuda._sleep(100_000_000)
            z.add_(1)
            with pytest.raises(RuntimeError, match=INPLACE):
                loss.backward()
            del z, loss
        lms.close()


# -- a storage saved by many ops comes back once -----------------------------------------------

class _Fan(nn.Module):
    """One activation saved by ``n`` ops (each multiply saves it for its weight's gradient)."""

    def __init__(self, d, n):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(d)) for _ in range(n)])

    def forward(self, x):
        h = self.lin(x).tanh()
        return sum((h * w).sin().sum() for w in self.ws)


def _check_fetched_once(kind, n):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = _Fan(256, n).to(dev)
    x = torch.randn(512, 256, device=dev)

    def step(lms=None):
        model.zero_grad(set_to_none=True)
        if lms is None:
            model(x).backward()
        else:
            with lms:
                loss = model(x)
            loss.backward()
        return _params_grads(model)

    ref = step()
    lms = make_lms(kind, prefetch_mb=1)
    for _ in range(3):
        for a, b in zip(ref, step(lms)):
            assert torch.equal(a, b)
        s = lms.stats()["last_step"]
        # Every swapped storage crosses back at most once (step 1 uses the input, alive in the
        # caller, in place; from step 2 it is not swapped at all).
        assert s["in_tensors"] <= s["out_tensors"] and s["in_bytes"] <= s["out_bytes"], s
    assert s["in_tensors"] == s["out_tensors"] > 0 and s["in_bytes"] == s["out_bytes"], s


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("kind", DEVICES)
def test_a_storage_saved_by_many_ops_is_brought_back_once(kind, n):
    _check_fetched_once(kind, n)


# -- no reference cycles -----------------------------------------------------------------------

def test_a_dropped_lms_frees_its_engine_and_pinned_memory_without_gc():
    model = mlp(d=64, layers=4)
    x = torch.randn(32, 64)
    gc.collect()
    gc.disable()
    try:
        lms = make_lms("sim")
        train_step(model, x, lms=lms)
        with lms:
            loss = model(x).sum()
        loss.backward()                        # a graph died inside the with-block, too
        assert lms._engine.host.pinned_bytes > 0
        engine = weakref.ref(lms._engine)
        slab = weakref.ref(lms._engine.host.slabs[0])
        del lms, loss
        assert engine() is None and slab() is None
    finally:
        gc.enable()


# -- interrupts inside engine code -------------------------------------------------------------

class _Interrupt:
    """Raises KeyboardInterrupt from ``obj.name`` on its ``at``-th call, once."""

    def __init__(self, monkeypatch, obj, name, at):
        self.real, self.calls, self.at = getattr(obj, name), 0, at
        monkeypatch.setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


BACKWARD_POINTS = [("copies", "copy_in", 1), ("copies", "copy_in", 2), ("device", "empty", 2)]
FORWARD_POINTS = [("copies", "copy_out", 2), ("module", "producer_of", 3),
                  ("device", "stream_key", 4), ("host", "alloc", 3), ("host", "free", 1),
                  ("host", "free", 4)]


def _target(lms, where):
    engine = lms._engine
    return {"copies": engine.copies, "device": engine.device, "host": engine.host,
            "module": engine_module}[where]


def _check_interrupted_backward(kind, monkeypatch, where, name, at):
    model, x = _mlp_and_input(kind)
    ref = train_step(model, x)
    lms = make_lms(kind, copy_lag=2)
    train_step(model, x, lms=lms)
    model.zero_grad(set_to_none=True)
    with lms:
        loss = model(x).square().mean()
    hit = _Interrupt(monkeypatch, _target(lms, where), name, at)
    try:
        loss.backward(retain_graph=True)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert hit.calls >= at
    model.zero_grad(set_to_none=True)
    loss.backward()                          # the retained graph, bit for bit
    assert_same(ref, (loss, _params_grads(model)))
    del loss
    for _ in range(2):
        assert_same(ref, train_step(model, x, lms=lms))
    with lms:
        assert lms._engine.host.used_bytes == 0


def _check_interrupted_forward(kind, monkeypatch, where, name, at):
    model, x = _mlp_and_input(kind)
    ref = train_step(model, x)
    lms = make_lms(kind, copy_lag=2)
    train_step(model, x, lms=lms)
    hit = _Interrupt(monkeypatch, _target(lms, where), name, at)
    with pytest.raises(KeyboardInterrupt):
        train_step(model, x, lms=lms)
    monkeypatch.undo()
    assert hit.calls == at
    for _ in range(2):
        assert_same(ref, train_step(model, x, lms=lms))
    with lms:
        assert lms._engine.host.used_bytes == 0


def _mlp_and_input(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    return mlp(d=64, layers=6).to(dev), torch.randn(32, 64, device=dev)


@pytest.mark.parametrize("where, name, at", BACKWARD_POINTS,
                         ids=[f"{n}#{a}" for _, n, a in BACKWARD_POINTS])
@pytest.mark.parametrize("kind", DEVICES)
def test_interrupt_in_backward_then_the_retained_graph_is_exact(kind, monkeypatch, where, name, at):
    _check_interrupted_backward(kind, monkeypatch, where, name, at)


@pytest.mark.parametrize("where, name, at", FORWARD_POINTS,
                         ids=[f"{n}#{a}" for _, n, a in FORWARD_POINTS])
@pytest.mark.parametrize("kind", DEVICES)
def test_interrupt_in_forward_loses_nothing(kind, monkeypatch, where, name, at):
    _check_interrupted_forward(kind, monkeypatch, where, name, at)


@pytest.mark.parametrize("lms_frac", [0.0, "auto"])
def test_no_python_runs_when_autograd_drops_a_handle(lms_frac):
    """A handle's death must not run Python (where an interrupt would be swallowed as
    "Exception ignored in __del__", and training go on after a Ctrl-C): handles have no
    __del__, and their watches, the recipe table's references (tanh's output has a recipe) and
    those of the learning step's profile (auto's first step) call a C function."""
    assert not hasattr(engine_module.SwapHandle, "__del__")
    lms = make_lms("sim", lms_frac=lms_frac)
    w = torch.randn(64, 64, requires_grad=True)
    with lms:
        h = (torch.randn(64, 64) @ w).tanh()       # held by the caller too: its storage lives on
        y = h.exp().sum()
    assert len(lms._engine.rebuilds.recipes) >= 1
    if lms_frac == "auto":
        assert lms._engine.policy.learning
    calls = []

    def tracer(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)
    sys.setprofile(tracer)
    try:
        del y, h
    finally:
        sys.setprofile(None)
    assert not calls, calls
    assert lms._engine.outstanding(reap=False)["dead_handles"] >= 1


def test_lmsrt_run_exits_130_on_every_ctrl_c(tmp_path):
    """Ctrl-C lands anywhere in a step, engine code and autograd freeing a graph included: the
    run must end at once with status 130, every time."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch\n"
        "torch.set_num_threads(1)\n"
        "w = torch.randn(128, 128, requires_grad=True)\n"
        "for step in range(10**9):\n"
        "    y = torch.randn(32, 128)\n"
        "    for _ in range(8):\n"
        "        y = (y @ w).tanh()\n"
        "    y.sum().backward()\n"
        "    if step == 0:\n"
        "        os.write(3, b'ready')\n")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               LMSRT_DEVICE="sim", LMSRT_LMS="1", LMSRT_LMS_FRAC="0")
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "sigint_runs.py"),
                             str(script), "20"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["130"] * 20, (result.stdout, result.stderr[-2000:])


# -- hooks left pushed, steps counted ----------------------------------------------------------

def test_exit_inside_backward_leaves_no_hooks_behind():
    """One of PyTorch's own hook tests leaves the block from inside backward; autograd then puts
    the thread's hooks back as they were when backward started, lmsrt's pair included."""
    model, x = _mlp_and_input("sim")
    ref = train_step(model, x)
    lms = make_lms("sim")
    for _ in range(10):
        model.zero_grad(set_to_none=True)
        lms.__enter__()
        out = model(x)
        loss = out.float().square().mean()
        loss.register_hook(lambda g: lms.__exit__(None, None, None))
        loss.backward()
        assert_same(ref, (loss, _params_grads(model)))
    x.requires_grad_()
    (x * x.exp()).sum()                       # a save outside LMS pops what was left
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert_same(ref, train_step(model, x, lms=lms))


def _steps(lms):
    return lms.stats()["total"]["steps"]


def test_threads_sharing_one_lms_count_one_step_per_forward():
    lms = make_lms("sim")
    models = [mlp(d=32, layers=2) for _ in range(2)]
    x = torch.randn(8, 32)
    barrier = threading.Barrier(2)

    def work(model):
        barrier.wait()
        for _ in range(100):
            train_step(model, x, lms=lms)

    run_threads(work, [(m,) for m in models])
    assert _steps(lms) == 200


def test_steps_are_counted_when_no_tensor_is_eligible():
    model, x = _mlp_and_input("sim")
    lms = make_lms("sim", lms=1 << 20)       # every saved tensor is below lms
    with lms:                                # one block around the loop, as `lmsrt run` does
        for _ in range(7):
            model(x).square().mean().backward()
    assert _steps(lms) == 7
    assert lms.stats()["total"]["out_tensors"] == 0


def test_soak_threads_keep_counts_host_and_python_memory_flat():
    """1000 steps, two threads sharing one LMS, copies lagging: step counts exact, no host bytes
    left over, and Python's own memory flat after warm-up."""
    lms = make_lms("sim", copy_lag=2)
    torch.manual_seed(0)
    models = [mlp(d=32, layers=3) for _ in range(2)]
    x = torch.randn(16, 32)
    refs = [train_step(m, x) for m in models]
    errors = []

    def work(i, steps):
        try:
            for _ in range(steps):
                assert_same(refs[i], train_step(models[i], x, lms=lms))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def run(steps):
        run_threads(work, [(i, steps) for i in range(2)], timeout=300)

    tracemalloc.start()
    try:
        run(150)                              # the step history (200 steps) fills up
        gc.collect()
        before = tracemalloc.take_snapshot()
        run(350)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert not errors, errors
    assert _steps(lms) == 1000
    grown = sum(s.size_diff for s in after.compare_to(before, "filename")
                if "lmsrt" in str(s.traceback))
    assert grown < 64 << 10, grown
    with lms:
        engine = lms._engine
        left = engine.outstanding(reap=False)
        assert engine.host.used_bytes == 0 and left["storages"] == left["dead_handles"] == 0


# -- regions without hooks, kinds that cannot be swapped ---------------------------------------

def test_torch_func_inside_lms_steps_aside_with_one_warning():
    torch.manual_seed(0)
    model = mlp(d=32, layers=3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(16, 32), torch.randn(16, 32)

    def loss_of(p, xi, yi):
        out = torch.func.functional_call(model, p, (xi.unsqueeze(0),))
        return (out.squeeze(0) - yi).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss_of), in_dims=(None, 0, 0))
    ref = per_sample(params, x, y)
    lms = make_lms("sim")
    with lmsrt_warnings() as caught:
        for _ in range(2):
            with lms:
                got = per_sample(params, x, y)
                with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
                    (x.requires_grad_() * 2).exp().sum().backward()
            x.requires_grad_(False)
    said = [text for text in caught if "steps aside" in text]
    assert len(said) <= 1                     # said once per process
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    with lms:                                 # the hooks are back after the region
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        owner = top[0].__self__ if top is not None else None
        assert getattr(owner, "engine", owner) is lms._engine     # C++ hooks name theirs
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_torch_func_script_under_lmsrt_run(tmp_path):
    script = tmp_path / "per_sample.py"
    script.write_text(
        "import torch\n"
        "w = torch.randn(8, 8)\n"
        "f = lambda w, x: (x @ w).tanh().sum()\n"
        "g = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(w, torch.randn(4, 8))\n"
        "h = torch.func.hessian(lambda x: (x.sin() * w[0]).sum())(torch.randn(8))\n"
        "print('ok', tuple(g.shape), tuple(h.shape))\n")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               LMSRT_DEVICE="sim")
    result = subprocess.run([sys.executable, "-m", "lmsrt", "run", "--lms", "1", "--lms-frac", "0",
                             str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ok (4, 8, 8) (8, 8)" in result.stdout


def _check_nested(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).to(dev)

    def step(lms=None):
        lin.zero_grad(set_to_none=True)
        parts = [torch.randn(n, 16, device=dev, generator=None) for n in (3, 5)]
        nt = torch.nested.nested_tensor([p.sin() for p in parts])
        ctx = lms if lms is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            out = lin(nt.to_padded_tensor(0.0)).tanh()
            loss = out.square().sum() + (nt * 2).to_padded_tensor(0.0).sum()
        loss.backward()
        return lin.weight.grad.clone()

    torch.manual_seed(1)
    ref = step()
    lms = make_lms(kind)
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = step(lms)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("kind", DEVICES)
def test_nested_tensors_stay_on_the_gpu_and_train_exactly(kind):
    _check_nested(kind)


def test_nested_tensor_saved_directly_is_kept_with_one_warning():
    lms = make_lms("sim")
    nt = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], requires_grad=True)
    with lmsrt_warnings() as caught:
        with lms:
            out = nt.sin()                      # sin saves its nested input
        out.backward(torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)]))
    said = [text for text in caught if "kind nested" in text]
    assert len(said) == 1, caught
    assert nt.grad is not None


# -- tensors alive anyway, overlap at lms_frac 0 -----------------------------------------------

class _FrozenHead(nn.Module):
    """A frozen projection held as a plain tensor (a buffer): saved by the matmul every step,
    alive for the whole run, so swapping it frees nothing."""

    def __init__(self, d):
        super().__init__()
        self.body = mlp(d=d, layers=3)
        self.register_buffer("proj", torch.randn(d, d))

    def forward(self, x):
        return self.body(x) @ self.proj


def test_tensors_alive_anyway_are_kept_not_copied():
    torch.manual_seed(0)
    model = _FrozenHead(64)
    x = torch.randn(64, 64)
    ref = train_step(model, x)
    lms = make_lms("sim")
    out_bytes = []
    for _ in range(4):
        assert_same(ref, train_step(model, x, lms=lms))
        out_bytes.append(lms.stats()["last_step"]["out_bytes"])
    last = lms.stats()["last_step"]
    nbytes = 64 * 64 * 4
    assert last["live_tensors"] >= 2 and last["live_bytes"] >= 2 * nbytes, last  # proj, input
    assert out_bytes[-1] <= out_bytes[0] - 2 * nbytes, out_bytes
    assert last["in_bytes"] == last["out_bytes"], last


def test_lms_frac_0_overlaps_copies_with_forward():
    """At a mark of 0 every byte is over it: forward must still let copies run behind it
    instead of waiting for each one."""
    model, x = _mlp_and_input("sim")
    lms = make_lms("sim", copy_lag=3)
    train_step(model, x, lms=lms)
    step = lms.stats()["last_step"]
    assert step["out_tensors"] > 4 and step["swapout_waits"] == 0, step


def test_oom_in_backward_outside_lmsrt_carries_its_context_and_lms_goes_on():
    """An out-of-memory error raised in backward by the model's own kernels (not while lmsrt
    brings a tensor back) keeps torch's message and type, with lmsrt's context added."""
    model, x = _mlp_and_input("sim")
    ref = train_step(model, x)
    lms = make_lms("sim")
    with lms:
        out = model(x)
    out.register_hook(lambda g: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory (injected)")))
    with pytest.raises(torch.OutOfMemoryError) as info:
        out.square().mean().backward()
    text = str(info.value)
    assert text.startswith("CUDA out of memory (injected)") and "in backward" in text, text
    assert "lmsrt: out of GPU memory with LMS on" in text
    del out, info
    assert_same(ref, train_step(model, x, lms=lms))


# -- side streams (CUDA) -----------------------------------------------------------------------

class _Branches(nn.Module):
    """Two branches on two side streams, joined on the current one."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = mlp(d=d, layers=3), mlp(d=d, layers=3)
        self.streams = None

    def forward(self, x):
        if self.streams is None:
            self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        main = torch.cuda.current_stream()
        outs = []
        for branch, s in zip((self.a, self.b), self.streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                outs.append(branch(x * 1.0))
        for s in self.streams:
            main.wait_stream(s)
        for o in outs:
            o.record_stream(main)
        return outs[0] * outs[1]


def _side_stream_step(W, lms=None):
    """The issue's example: part of forward on a side stream, joined back."""
    W.grad = None
    s = torch.cuda.Stream()
    current = torch.cuda.current_stream()
    ctx = lms if lms is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                               lambda t: t)
    with ctx:
        seeded = torch.Generator("cuda").manual_seed(0)
        z0 = torch.randn(2048, 2048, device="cuda", generator=seeded)
        s.wait_stream(current)
        with torch.cuda.stream(s):
            z = z0.exp()
            y = (z @ W).sin().sum()
        current.wait_stream(s)
    y.backward()
    torch.cuda.synchronize()
    return W.grad.clone()


@pytest.mark.cuda
@pytest.mark.parametrize("copy_path", ["python", "C++"])
@pytest.mark.parametrize("lms_frac", [0.0, 0.5, 0.9])
def test_side_stream_forward_gives_exact_gradients_cuda(lms_frac, copy_path, monkeypatch):
    from lmsrt import copy_path as native
    if copy_path == "C++" and native.load() is None:
        pytest.skip("the C++ copy path is not built here")
    if copy_path == "python":
        monkeypatch.setattr("lmsrt.device.copy_path.load", lambda: None)
    torch.manual_seed(0)
    W = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    ref = _side_stream_step(W)
    cap = torch.cuda.memory_allocated() + (256 << 20)
    lms = lmsrt.LMS(lms=1, lms_frac=lms_frac, device="cuda")
    lms._engine.policy = FixedPolicy(lms_frac, cap, 1 << 30)   # a mark this workload can cross
    for _ in range(5):
        assert torch.equal(ref, _side_stream_step(W, lms))
    assert lms.stats()["total"]["out_tensors"] > 0 or lms_frac > 0
    torch.manual_seed(0)
    model = _Branches(512).cuda()
    x = torch.randn(256, 512, device="cuda")
    ref = train_step(model, x)
    for _ in range(3):
        assert_same(ref, train_step(model, x, lms=lms))
    lms.close()


@pytest.mark.multigpu
def test_copies_leave_the_threads_current_device_alone():
    torch.cuda.set_device(0)
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="cuda:1")
    torch.manual_seed(0)
    model = transformer(d=64, layers=2).to("cuda:1")
    x = torch.randn(2, 32, 64, device="cuda:1")
    ref = train_step(model, x)
    for _ in range(2):
        assert_same(ref, train_step(model, x, lms=lms))
        assert torch.cuda.current_device() == 0
    assert lms.stats()["total"]["out_tensors"] > 0


# -- found in review ---------------------------------------------------------------------------

def test_a_storage_saved_again_after_its_handles_died_comes_back():
    """An activation used first by an op whose result is dropped (a logged norm, say), then
    saved again: the released entry must not be reused."""
    a = torch.randn(256, 64, requires_grad=True)

    def step(lms):
        a.grad = None
        with lms if lms is not None else contextlib.nullcontext():
            x = a * 2
            t1 = x.sin()
            del t1                             # x's only handle dies
            y = x.cos()
            del x                              # x saved again, then gone
            loss = y.sum()
        loss.backward()
        return a.grad.clone()

    ref = step(None)
    lms = make_lms("sim")
    for _ in range(2):
        assert torch.equal(ref, step(lms))


def test_an_interrupt_before_a_handle_is_counted_leaves_the_engine_usable(monkeypatch):
    """An interrupt right after a handle's watch is armed but before it knows its storage: the
    watch is queued without one, and every later reap must skip it."""
    model, x = _mlp_and_input("sim")
    ref = train_step(model, x)
    lms = make_lms("sim")
    train_step(model, x, lms=lms)
    real, calls = engine_module.Watch, []

    class _Unfinished(real):
        __slots__ = ()

        def __setattr__(self, name, value):
            calls.append(name)
            if len(calls) == 3:
                raise KeyboardInterrupt
            super().__setattr__(name, value)

    monkeypatch.setattr(engine_module, "Watch", _Unfinished)
    with pytest.raises(KeyboardInterrupt):
        train_step(model, x, lms=lms)
    monkeypatch.undo()
    for _ in range(2):
        assert_same(ref, train_step(model, x, lms=lms))
    with lms:
        assert lms._engine.host.used_bytes == 0


def test_a_tensor_alive_once_is_not_kept_for_good():
    model, x = _mlp_and_input("sim")
    lms = make_lms("sim")
    held = {}
    train_step(model, x, lms=lms)
    hook = model[2].register_forward_hook(lambda m, i, o: held.__setitem__("o", o))
    train_step(model, x, lms=lms)             # the hooked output outlives backward once
    hook.remove()
    held.clear()
    live = []
    for _ in range(20):
        train_step(model, x, lms=lms)
        live.append(lms.stats()["last_step"]["live_bytes"])
    assert live[-1] < max(live), live         # relearnt: no longer kept
