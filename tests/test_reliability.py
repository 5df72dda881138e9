"""Reliability: faults and limits, shutdown, a long run, sharing, threads, the rest of PyTorch,
and bad input. lmsrt sits inside other people's training runs: it must never be the reason one
dies or learns from corrupt data, so every check compares gradients with ``torch.equal`` against
the same run without LMS. Each runs on the simulated device, and on CUDA under the marker:

    PYTHONPATH=. python -m pytest -q tests/test_reliability.py             # CUDA twins skipped
    PYTHONPATH=. python -m pytest -q -m cuda tests/test_reliability.py     # on a GPU machine
"""
import contextlib
import fractions
import itertools
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from models import (
    COMPILE_BACKENDS,
    DEVICES,
    assert_same,
    compiled_reference,
    lmsrt_warnings,
    make_lms,
    mlp,
    run_threads,
    torch_device,
    train_step,
    transformer,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

import lmsrt
import lmsrt.say
from lmsrt import host_memory as host_module  # the budget: psutil, cgroups
from lmsrt.device import SimulatedDevice
from lmsrt.host_memory import cgroup_available, host_budget
from lmsrt.stats import HISTORY_STEPS
from lmsrt.summary import format_headline
from lmsrt.units import GiB

ROOT = Path(__file__).resolve().parent.parent



def _setup(kind, d=64, layers=6, batch=32):
    """An MLP, its input, and its (loss, grads) without LMS."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = mlp(d=d, layers=layers).to(dev)
    x = torch.randn(batch, d, device=dev)
    return model, x, train_step(model, x)


def _boundary_is_clean(lms):
    """A step boundary gives back everything the last step held: host slots and bookkeeping."""
    engine = lms._engine
    with lms:
        assert engine.host.used_bytes == 0, engine.host.used_bytes
        left = engine.outstanding(reap=False)
        assert left["storages"] == left["dead_handles"] == left["held"] == 0


def _failing(copy, when=lambda: True):
    """``copy`` (the copy path's copy_out or copy_in, Python or C++) raising as a failed DMA or a
    driver error would, whenever ``when()`` says so."""
    def flaky(*args):
        if when():
            raise RuntimeError("injected: the copy failed")
        return copy(*args)
    return flaky


def _oom(kind):
    """Run out of GPU memory: for real on CUDA, by raising torch's error on the simulated GPU."""
    if kind == "cuda":
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 1.00 PiB.")


# -- host memory budget ------------------------------------------------------------------------

def _files(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_limit_leaves_out_reclaimable_cache(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    _files(root, {"memory.max": f"{8 * GiB}\n", "memory.current": f"{5 * GiB}\n",
                  "memory.stat": f"anon {3 * GiB}\nfile {2 * GiB}\ninactive_file {GiB}\n"})
    assert cgroup_available(str(root), str(proc)) == 4 * GiB      # 8 - (5 - 1 inactive cache)
    _files(root, {"memory.max": "max\n"})
    assert cgroup_available(str(root), str(proc)) is None


def test_cgroup_v2_every_limit_up_the_tree_binds(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "proc_cgroup"
    proc.write_text("0::/job.slice/step.scope\n")
    _files(root, {"job.slice/memory.max": f"{6 * GiB}\n",
                  "job.slice/memory.current": f"{2 * GiB}\n",
                  "job.slice/step.scope/memory.max": "max\n",
                  "job.slice/step.scope/memory.current": f"{GiB}\n"})
    assert cgroup_available(str(root), str(proc)) == 4 * GiB      # the parent's limit
    _files(root, {"job.slice/step.scope/memory.max": f"{2 * GiB}\n"})
    assert cgroup_available(str(root), str(proc)) == GiB          # the tighter child's


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "proc_cgroup"
    proc.write_text("12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n")
    # Without a cgroup namespace the container's own cgroup is mounted at the root: the path in
    # /proc/self/cgroup does not exist under it, and the root's files are the container's.
    _files(root, {"memory/memory.limit_in_bytes": f"{4 * GiB}\n",
                  "memory/memory.usage_in_bytes": f"{3 * GiB}\n",
                  "memory/memory.stat": f"cache {GiB}\ntotal_inactive_file {GiB // 2}\n"})
    assert cgroup_available(str(root), str(proc)) == GiB + GiB // 2
    _files(root, {"memory/memory.limit_in_bytes": "9223372036854771712\n"})   # v1's "no limit"
    assert cgroup_available(str(root), str(proc)) is None
    assert cgroup_available(str(tmp_path / "none"), str(tmp_path / "missing")) is None


def test_host_budget_is_shared_among_local_ranks(monkeypatch):
    monkeypatch.setattr(host_module.psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=100 * GiB))
    monkeypatch.setattr(host_module, "cgroup_available", lambda: None)
    for ranks, share in ((None, 1), ("1", 1), ("4", 4), ("bogus", 1), ("0", 1)):
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert host_budget() == int(100 * GiB * 0.8 / share), ranks
    monkeypatch.setattr(host_module, "cgroup_available", lambda: 40 * GiB)   # a tighter container
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_budget(already_pinned=GiB) == GiB + int(40 * GiB * 0.8 / 4)


# -- faults: pinning, budget, copies -----------------------------------------------------------

def _check_pin_failure(kind, monkeypatch):
    model, x, ref = _setup(kind)
    lms = make_lms(kind, pin_limit=0, pins_ready=False)   # the simulated host cannot pin a byte
    device = lms._engine.host.device
    pinned, attempts = device.pinned, []

    def pin(nbytes):
        attempts.append(nbytes)
        if kind == "cuda":
            raise RuntimeError("injected: cannot pin host memory")
        return pinned(nbytes)

    monkeypatch.setattr(device, "pinned", pin)
    with lmsrt_warnings() as said:
        for _ in range(5):
            assert_same(ref, train_step(model, x, lms=lms))
    assert len(said) == 1 and "pinning" in said[0] and "stay on the GPU" in said[0], said
    total = lms.stats()["total"]
    assert total["out_bytes"] == 0 and total["kept_tensors"] > 0 and total["host_refused"] > 0
    assert 1 <= len(attempts) <= 5, "a failed pin is tried again once a step, not per tensor"


@pytest.mark.parametrize("kind", DEVICES)
def test_pin_failure_keeps_tensors_on_gpu_with_one_warning(kind, monkeypatch):
    _check_pin_failure(kind, monkeypatch)


def _check_tiny_budget(kind):
    model, x, ref = _setup(kind)
    budget = 24 << 10                               # three 8 KiB activations of a dozen
    lms = make_lms(kind, host_budget_gb=budget / GiB, pins_ready=False)
    with lmsrt_warnings() as said:
        for _ in range(5):
            assert_same(ref, train_step(model, x, lms=lms))
    assert len(said) == 1 and "host memory budget" in said[0], said
    total = lms.stats()["total"]
    assert total["out_tensors"] > 0 and total["kept_tensors"] > 0 and total["host_refused"] > 0
    assert 0 < lms._engine.host.pinned_bytes <= budget
    # If the GPU then runs out, the error says why tensors stayed and which setting helps.
    handle = model[4].register_forward_hook(lambda module, args, out: _oom(kind))
    with pytest.raises(torch.OutOfMemoryError, match="host memory budget was reached") as info:
        train_step(model, x, lms=lms)
    handle.remove()
    assert "--host-budget-gb" in str(info.value)


@pytest.mark.parametrize("kind", DEVICES)
def test_tiny_host_budget_swaps_what_fits_and_keeps_the_rest(kind):
    _check_tiny_budget(kind)


def _check_d2h_failure(kind):
    model, x, ref = _setup(kind)
    lms = make_lms(kind)
    copies, calls = lms._engine.copies, itertools.count()
    copies.copy_out = _failing(copies.copy_out, lambda: next(calls) % 3 == 1)  # every third
    with lmsrt_warnings() as said:
        for _ in range(4):
            assert_same(ref, train_step(model, x, lms=lms))
            _boundary_is_clean(lms)                 # failed slots were given back
    assert len(said) == 1 and "copying a saved tensor" in said[0] and "injected" in said[0], said
    total = lms.stats()["total"]
    assert total["out_tensors"] > 0 and total["kept_tensors"] > 0, total


@pytest.mark.parametrize("kind", DEVICES)
def test_failed_copy_out_keeps_the_tensor_on_gpu(kind):
    _check_d2h_failure(kind)


def _check_h2d_failure(kind, monkeypatch):
    model, x, ref = _setup(kind)
    lms = make_lms(kind)
    copies = lms._engine.copies
    copy_in = copies.copy_in
    monkeypatch.setattr(copies, "copy_in", _failing(copy_in))
    model.zero_grad(set_to_none=True)
    with lms:
        loss = model(x).square().mean()
    with pytest.raises(RuntimeError, match="lmsrt: copying a swapped-out saved tensor") as info:
        loss.backward()
    assert "injected" in str(info.value.__cause__)
    del loss, info
    monkeypatch.setattr(copies, "copy_in", copy_in)
    for _ in range(2):                              # the engine goes on as if nothing happened
        assert_same(ref, train_step(model, x, lms=lms))
    _boundary_is_clean(lms)


@pytest.mark.parametrize("kind", DEVICES)
def test_failed_copy_back_fails_backward_clearly_then_recovers(kind, monkeypatch):
    _check_h2d_failure(kind, monkeypatch)


# -- out of GPU memory -------------------------------------------------------------------------

def _check_oom_in_forward(kind):
    model, x, ref = _setup(kind)
    lms = make_lms(kind, lms_frac=0.5)
    handle = model[4].register_forward_hook(lambda module, args, out: _oom(kind))
    with pytest.raises(torch.OutOfMemoryError) as info:
        train_step(model, x, lms=lms)
    handle.remove()
    text = str(info.value)
    assert "out of memory" in text.splitlines()[0].lower()          # torch's own message first
    for part in ("lmsrt: out of GPU memory with LMS on, in forward", "swapping starts at",
                 "lms_frac=0.5", "largest saved storage 8.00 KiB", "--lms-frac", "--lms,",
                 "expandable_segments:True", "lmsrt profile"):
        assert part in text, (part, text)
    assert text.count("lmsrt: out of GPU memory") == 1
    del info
    for _ in range(2):          # a job that catches it (e.g. to retry smaller) trains on exactly
        assert_same(ref, train_step(model, x, lms=lms))
    _boundary_is_clean(lms)


@pytest.mark.parametrize("kind", DEVICES)
def test_oom_in_forward_says_what_lmsrt_saw_and_what_to_change(kind):
    _check_oom_in_forward(kind)


def _check_oom_bringing_back(kind, monkeypatch):
    model, x, ref = _setup(kind)
    lms = make_lms(kind)                            # lms_frac=0: swapping is at its most
    device = lms._engine.device
    empty = device.empty
    monkeypatch.setattr(device, "empty", lambda nbytes: _oom(kind))
    model.zero_grad(set_to_none=True)
    with lms:
        loss = model(x).square().mean()
    with pytest.raises(torch.OutOfMemoryError) as info:
        loss.backward()
    text = str(info.value)
    for part in ("bringing a saved tensor back for backward", "shape (32, 64)", "8.00 KiB",
                 "already at its most", "torch.utils.checkpoint"):
        assert part in text, (part, text)
    del loss, info
    monkeypatch.setattr(device, "empty", empty)
    for _ in range(2):
        assert_same(ref, train_step(model, x, lms=lms))
    _boundary_is_clean(lms)


@pytest.mark.parametrize("kind", DEVICES)
def test_oom_bringing_a_tensor_back_names_it(kind, monkeypatch):
    _check_oom_bringing_back(kind, monkeypatch)


def _check_prefetch_oom(kind, monkeypatch):
    model, x, ref = _setup(kind)
    lms = make_lms(kind)
    device = lms._engine.device
    empty, calls = device.empty, itertools.count()

    def empty_or_oom(nbytes):                       # the first prefetch finds no room
        if next(calls) == 1:
            _oom(kind)
        return empty(nbytes)

    monkeypatch.setattr(device, "empty", empty_or_oom)
    assert_same(ref, train_step(model, x, lms=lms))
    step = lms.stats()["last_step"]
    assert next(calls) > 3 and step["in_tensors"] == step["out_tensors"] - step["live_tensors"]
    assert step["prefetch_misses"] >= step["in_tensors"] - 1, "then fetched on demand"


@pytest.mark.parametrize("kind", DEVICES)
def test_prefetch_out_of_memory_falls_back_to_fetch_on_demand(kind, monkeypatch):
    _check_prefetch_oom(kind, monkeypatch)


# -- shutdown and Ctrl-C (each in its own process; stderr must stay empty) --------------------

SHUTDOWN_MODES = ["forward", "signal", "backward", "exit-active", "exit-closed"]


@pytest.mark.parametrize("mode", SHUTDOWN_MODES)
@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
def test_interrupts_and_exits_leave_a_clean_process(kind, mode, recompute):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    script = ROOT / "tests" / "scripts" / "interrupted_steps.py"
    result = subprocess.run([sys.executable, str(script), kind, mode] + ["recompute"] * recompute,
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1:] == ["ok"], result.stdout
    assert result.stderr == "", result.stderr


def _check_closed_engine(kind):
    model, x, ref = _setup(kind)
    lms = make_lms(kind)
    with lms:
        loss = model(x).square().mean()
    lms.close()
    with pytest.raises(RuntimeError, match="backward needs a saved tensor .* closed"):
        loss.backward()
    del loss                                        # its handles die after close: harmless
    with pytest.raises(RuntimeError, match="was closed"):
        with lms:
            pass
    lms.close()                                     # twice is fine
    # Hooks still on when the LMS closes (interpreter exit under `lmsrt run`): nothing is pinned
    # any more, tensors stay on the GPU, gradients stay exact.
    lms = make_lms(kind)
    lms.__enter__()
    lms.close()
    model.zero_grad(set_to_none=True)
    loss = model(x).float().square().mean()
    loss.backward()
    lms.__exit__(None, None, None)
    assert_same(ref, (loss.detach(), [p.grad for p in model.parameters()]))
    assert lms._engine.host.pinned_bytes == 0


@pytest.mark.parametrize("kind", DEVICES)
def test_closed_lms_fails_clearly_and_frees_its_memory(kind):
    _check_closed_engine(kind)


# -- a long run with changing shapes -----------------------------------------------------------

def _check_soak(kind, steps):
    """Shapes (batch, sequence length) change every few steps: each change is a reactive step,
    then the plan takes over; host slots, pinned slabs and bookkeeping stay flat."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = transformer(d=16, layers=2, heads=2).to(dev)
    shapes = [(2, 8), (3, 8), (2, 12), (3, 12)]
    inputs = {shape: torch.randn(*shape, 16, device=dev) for shape in shapes}
    refs = {shape: train_step(model, inputs[shape]) for shape in shapes}
    # Sim: the mark sits inside a step's saved bytes, so the plan has a target to find.
    lms = make_lms(kind, capacity=96 << 10, lms_frac=0.5 if kind == "sim" else 0.0)
    engine, repeat = lms._engine, 3
    first_cycle = len(shapes) * repeat
    ceiling = pinned = None
    for step in range(steps):
        shape = shapes[(step // repeat) % len(shapes)]
        model.zero_grad(set_to_none=True)
        with lms:
            left = engine.outstanding(reap=False)
            assert engine.host.used_bytes == 0 and left["storages"] == left["dead_handles"] == 0
            use = engine.device.memory_allocated()
            out = model(inputs[shape])
        assert not engine.state.by_ptr
        loss = out.float().square().mean()
        loss.backward()
        assert_same(refs[shape], (loss.detach(), [p.grad for p in model.parameters()]))
        if step < first_cycle:
            ceiling = max(ceiling or 0, use)
        else:
            # Pinned memory never grows after the first cycle (a slab idle for the pool's
            # idle_steps may go back: host.py, NOTE [ Pinning ], Give-back).
            now = engine.host.pinned_bytes
            assert use <= ceiling and (pinned is None or now <= pinned), (step, use, ceiling)
            pinned = now
    history = list(engine.run_stats.history)
    assert len(history) == min(steps - 1, HISTORY_STEPS)
    for s in history:
        want = "reactive" if (s.step - 1) % repeat == 0 else "plan"
        assert s.mode == want, (s.step, s.mode)
    total = lms.stats()["total"]
    assert total["steps"] == steps and total["out_tensors"] > 0
    if kind == "sim":
        assert total["kept_tensors"] > 0, "the mark never mattered: the soak proves less"


def test_soak_1000_steps_with_changing_shapes():
    _check_soak("sim", 1000)


@pytest.mark.cuda
def test_soak_200_steps_with_changing_shapes_cuda():
    _check_soak("cuda", 200)


# -- one LMS for several models, several LMS at once -------------------------------------------

def _check_train_and_eval(kind):
    model, x, ref = _setup(kind)
    dev = torch_device(kind)
    evalnet = transformer(d=32, layers=2).to(dev).eval()
    xe = torch.randn(2, 16, 32, device=dev)
    with torch.no_grad():
        ref_eval = evalnet(xe)
    lms = make_lms(kind)
    for _ in range(3):
        assert_same(ref, train_step(model, x, lms=lms))
        with lms:                   # a validation forward with grad on, never run backward
            out = evalnet(xe)
        assert torch.equal(out, ref_eval)
        del out
        with lms, torch.no_grad():
            assert torch.equal(evalnet(xe), ref_eval)
    _boundary_is_clean(lms)


@pytest.mark.parametrize("kind", DEVICES)
def test_one_lms_for_a_train_net_and_an_eval_net(kind):
    _check_train_and_eval(kind)


def _gan_step(G, D, z, real, lms=None):
    """One GAN step: G forward; D on the fake (detached) and on real data; D backward; G forward
    again through D; G backward. Returns the losses and both nets' gradients."""
    ctx = lms if lms is not None else contextlib.nullcontext()
    G.zero_grad(set_to_none=True)
    D.zero_grad(set_to_none=True)
    with ctx:
        fake = G(z)                 # this graph stays alive, never run backward
    with ctx:
        d_loss = (nn.functional.softplus(D(fake.detach())).mean()
                  + nn.functional.softplus(-D(real)).mean())
    d_loss.backward()
    d_grads = [p.grad.clone() for p in D.parameters()]
    D.zero_grad(set_to_none=True)
    with ctx:
        g_loss = nn.functional.softplus(-D(G(z))).mean()
    g_loss.backward()
    return d_loss.detach(), g_loss.detach(), d_grads, [p.grad.clone() for p in G.parameters()]


def _check_gan(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh()).to(dev)
    D = nn.Sequential(nn.Linear(128, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1)).to(dev)
    z, real = torch.randn(64, 32, device=dev), torch.randn(64, 128, device=dev)
    ref = _gan_step(G, D, z, real)
    lms = make_lms(kind)
    for _ in range(3):
        got = _gan_step(G, D, z, real, lms)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        for a, b in zip(ref[2] + ref[3], got[2] + got[3]):
            assert torch.equal(a, b)
    assert lms.stats()["total"]["out_tensors"] > 0
    _boundary_is_clean(lms)


@pytest.mark.parametrize("kind", DEVICES)
def test_one_lms_for_a_gan_generator_and_discriminator(kind):
    _check_gan(kind)


def _check_two_engines(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    m1, m2 = mlp(d=64, layers=4).to(dev), mlp(d=64, layers=4).to(dev)
    x1, x2 = torch.randn(32, 64, device=dev), torch.randn(32, 64, device=dev)
    params = list(m1.parameters()) + list(m2.parameters())

    def step(lms1=None, lms2=None):
        one, two = lms1 or contextlib.nullcontext(), lms2 or contextlib.nullcontext()
        with one:
            a = m1(x1)
        with two:
            b = m2(x2)
        with one:                   # nested: the inner LMS takes what is saved inside it
            h = m1(x2)
            with two:
                c = m2(h)
        loss = a.square().mean() + b.square().mean() + c.square().mean()
        return [loss.detach()] + list(torch.autograd.grad(loss, params))

    ref = step()
    lms1, lms2 = make_lms(kind), make_lms(kind)
    for _ in range(3):
        assert all(torch.equal(r, g) for r, g in zip(ref, step(lms1, lms2)))
    for lms in (lms1, lms2):
        assert lms.stats()["total"]["out_tensors"] > 0
        _boundary_is_clean(lms)


@pytest.mark.parametrize("kind", DEVICES)
def test_two_lms_alive_at_once_and_nested(kind):
    _check_two_engines(kind)


# -- threads -----------------------------------------------------------------------------------

def _check_threads(kind, n=3, steps=8, **lms_kw):
    """Threads share one LMS, each `with lms:` installing the hooks on its own thread, forward
    and backward running concurrently (the engine's lock orders its bookkeeping)."""
    dev = torch_device(kind)
    models, inputs, refs = [], [], []
    for i in range(n):
        torch.manual_seed(i)
        models.append(transformer(d=32, layers=2).to(dev))
        inputs.append(torch.randn(2, 16, 32, device=dev))
        refs.append(train_step(models[-1], inputs[-1]))
    lms = make_lms(kind, copy_lag=2, **lms_kw)
    barrier, errors = threading.Barrier(n), []

    def work(i):
        try:
            barrier.wait()
            for _ in range(steps):
                assert_same(refs[i], train_step(models[i], inputs[i], lms=lms))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    run_threads(work, [(i,) for i in range(n)])
    assert not errors, errors
    assert lms.stats()["total"]["out_tensors"] > 0
    _boundary_is_clean(lms)
    return lms


@pytest.mark.parametrize("kind", DEVICES)
def test_threads_share_one_lms_with_exact_gradients(kind):
    _check_threads(kind)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.usefixtures("small_rebuilds_pay")
def test_threads_share_one_lms_rebuilding_with_exact_gradients(kind):
    # Each thread records on its own recorder into the one table; rebuilds read pinned inputs.
    lms = _check_threads(kind, recompute=True)
    assert lms.stats()["total"]["rebuilt_bytes"] > 0


def _check_other_stream_refused(kind, monkeypatch):
    model, x, ref = _setup(kind)
    lms = make_lms(kind)
    # A first step pins the host memory the forwards below swap into: on a GPU a later step
    # whose pins are still being made keeps its tensors there instead, with nothing to order.
    assert_same(ref, train_step(model, x, lms=lms))
    device = lms._engine.device
    if kind == "cuda":
        side = torch.cuda.Stream()
        on_side = lambda: torch.cuda.stream(side)                   # noqa: E731
    else:
        default, side, here = device.current_stream(), device.new_stream(), threading.local()
        monkeypatch.setattr(device, "current_stream",
                            lambda: side if getattr(here, "side", False) else default)

        @contextlib.contextmanager
        def on_side():
            here.side = True
            yield
            here.side = False

    inside, leave = threading.Event(), threading.Event()

    def hold():                         # another thread's forward is open on the default stream
        with lms:
            inside.set()
            leave.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(60)
    with on_side(), pytest.raises(RuntimeError, match="one compute stream"):
        with lms:
            pass
    leave.set()
    holder.join(60)
    with lms:                           # a graph saved on the default stream is alive
        loss = model(x).float().square().mean()
    assert lms.stats()["last_step"]["out_bytes"] > 0
    with on_side(), pytest.raises(RuntimeError, match="one compute stream"):
        with lms:
            pass
    model.zero_grad(set_to_none=True)
    loss.backward()
    del loss
    with on_side():                     # nothing of the default stream is left: fine
        model.zero_grad(set_to_none=True)
        assert_same(ref, train_step(model, x, lms=lms))


@pytest.mark.parametrize("kind", DEVICES)
def test_forward_on_another_stream_is_refused_while_the_first_is_in_use(kind, monkeypatch):
    _check_other_stream_refused(kind, monkeypatch)


# -- the rest of PyTorch -----------------------------------------------------------------------

def _check_checkpoint(kind, reentrant):
    model, x, _ = _setup(kind, layers=8)
    lms = make_lms(kind)

    def run(lms=None):
        model.zero_grad(set_to_none=True)
        with lms or contextlib.nullcontext():
            h = model[:2](x)
            h = checkpoint(model[2:5], h, use_reentrant=reentrant)
            out = model[5:](h)
        loss = out.square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref = run()
    for _ in range(3):
        assert_same(ref, run(lms))
    assert lms.stats()["total"]["out_tensors"] > 0


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("kind", DEVICES)
def test_activation_checkpointing(kind, reentrant):
    _check_checkpoint(kind, reentrant)


def _check_autocast(kind, dtype):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = transformer(d=64, layers=2).to(dev)
    x = torch.randn(4, 32, 64, device=dev)
    scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None
    lms = make_lms(kind)

    def run(lms=None):
        model.zero_grad(set_to_none=True)
        with lms or contextlib.nullcontext(), torch.autocast(dev.type, dtype=dtype):
            out = model(x)
        loss = out.float().square().mean()
        (scaler.scale(loss) if scaler else loss).backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref = run()
    for _ in range(3):
        assert_same(ref, run(lms))
    assert lms.stats()["total"]["out_tensors"] > 0


@pytest.mark.parametrize("kind, dtype", [
    pytest.param("sim", torch.bfloat16, id="sim-bf16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.cuda),
    pytest.param("cuda", torch.float16, id="cuda-fp16-gradscaler", marks=pytest.mark.cuda)])
def test_autocast(kind, dtype):
    _check_autocast(kind, dtype)


def _check_no_grad(kind):
    model, x, ref = _setup(kind)
    with torch.no_grad():
        ref_out = model(x)
    lms = make_lms(kind)
    for mode in (torch.no_grad, torch.inference_mode):
        with lms, mode():
            out = model(x)
        assert torch.equal(out, ref_out)
        step = lms.stats()["last_step"]
        assert (step["out_tensors"], step["kept_tensors"], step["skipped_tensors"]) == (0, 0, 0)
    assert_same(ref, train_step(model, x, lms=lms))


@pytest.mark.parametrize("kind", DEVICES)
def test_no_grad_and_inference_mode_save_nothing(kind):
    _check_no_grad(kind)


class _ScaledSilu(torch.autograd.Function):
    """y = x * sigmoid(x) * w. Saves its input, its output, a transposed view of a temporary,
    and a parameter."""

    @staticmethod
    def forward(ctx, x, w):
        s = torch.sigmoid(x)
        y = x * s * w
        ctx.save_for_backward(x, y, s.t(), w)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y, s_t, w = ctx.saved_tensors
        s = s_t.t()
        return grad * w * (s + x * s * (1 - s)), (grad * y).sum(0) / w


class _CustomNet(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, d), nn.Linear(d, d)
        self.w = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.lin2(_ScaledSilu.apply(self.lin1(x), self.w))


def _check_custom_function(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = _CustomNet().to(dev)
    x = torch.randn(32, 64, device=dev)
    ref = train_step(model, x)
    lms = make_lms(kind)
    with lmsrt_warnings() as said:
        for _ in range(3):
            assert_same(ref, train_step(model, x, lms=lms))
    assert not said, said                       # a custom Function is no compiled region
    assert lms.stats()["last_step"]["out_tensors"] >= 3    # input, output, temporary (+ x)


@pytest.mark.parametrize("kind", DEVICES)
def test_custom_autograd_function_saving_input_output_and_view(kind):
    _check_custom_function(kind)


def _check_compile(kind, backend):
    import torch._dynamo
    import torch._inductor.config

    # Inductor picks reduction configs by timing them on the device, so two compilations of one
    # graph can differ in the last bits; its deterministic mode picks them by rule instead.
    with torch._inductor.config.patch(deterministic=True):
        _check_compile_exact(kind, backend)


def _check_compile_exact(kind, backend):
    dev = torch_device(kind)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformer(d=32, layers=3).to(dev)
    for block in model:                 # one compiled region per block: swapping between them
        block.compile(backend=backend)
    x = torch.randn(2, 16, 32, device=dev)
    ref = compiled_reference(model, x, backend)          # (models.same_hooks says why)
    lms = make_lms(kind)
    with lmsrt_warnings() as said:
        for _ in range(3):
            got = train_step(model, x, lms=lms)
            s = lms.stats()["last_step"]
            print(s["step"], s["mode"], {k: s[k] for k in (     # shown where the test fails
                "out_bytes", "recipe_bytes", "rebuilt_bytes", "rebuild_checks",
                "recomputed_bytes", "kept_bytes", "skipped_tensors")}, s["policy_note"])
            assert_same(ref, got)
    compiled = [m for m in said if "torch.compile" in m]
    assert len(compiled) == 1 and "between compiled regions" in compiled[0], said
    # Offloaded between the compiled regions: moved, or (on a GPU, where timing decides)
    # rebuilt instead of moved.
    total = lms.stats()["total"]
    assert total["out_bytes"] + total["recipe_bytes"] > 0, total
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch's own, from inductor
@pytest.mark.parametrize("kind, backend", COMPILE_BACKENDS)
def test_torch_compile_is_detected_and_stays_exact(kind, backend):
    _check_compile(kind, backend)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch's own, from dynamo
def test_an_lms_collected_while_torch_compiles_leaves_its_guards_whole(monkeypatch):
    """An LMS dropped in a reference cycle goes when the collector next runs, which may be in the
    middle of a compilation, between dynamo's tracing the global module hooks and its guarding
    their keys: removing its hooks there broke the compilation (KeyError from a guard). Here it
    is let go and collected exactly there."""
    import gc

    import torch._dynamo
    import torch._dynamo.convert_frame as convert_frame

    hooks = nn.modules.module._global_forward_hooks
    before = set(hooks)
    held = [make_lms("sim")]
    added = set(hooks) - before
    assert added                        # its region hooks
    manager = convert_frame.CheckFunctionManager

    class CollectFirst(manager):        # guards are built after the trace
        def __init__(self, *args, **kwargs):
            held.clear()
            gc.collect()
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(convert_frame, "CheckFunctionManager", CollectFirst)
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        block = nn.Linear(4, 4)
        run = torch.compile(lambda x: block(x).relu(), backend="eager")
        x = torch.randn(2, 4)
        assert torch.equal(run(x), block(x).relu())
        assert not held and added <= set(hooks)      # collected; its hooks inert, in place
        make_lms("sim").close()         # code the user called: they go now
        assert not added & set(hooks)
        assert torch.equal(run(x), block(x).relu())  # compiled again, over the hooks left
    finally:
        torch._dynamo.reset()


# -- bad input at the API ----------------------------------------------------------------------

BAD_ARGUMENTS = [
    (dict(lms="1000"), TypeError, r"lms must be a number \(KiB"),
    (dict(lms=True), TypeError, "lms must be a number"),
    (dict(lms=float("nan")), ValueError, "lms must be finite"),
    (dict(lms_frac=1.5), ValueError, r"lms_frac must be in \[0, 1\]"),
    (dict(lms_frac=-0.1), ValueError, r"lms_frac must be in \[0, 1\]"),
    (dict(lms_frac="0.5"), TypeError, r"lms_frac must be a number \(in \[0, 1\]\)"),
    (dict(lms_frac=None), TypeError, "lms_frac must be a number"),
    (dict(prefetch_mb=-1), ValueError, "prefetch_mb must be >= 0 MiB"),
    (dict(prefetch_mb=float("inf")), ValueError, "prefetch_mb must be finite"),
    (dict(prefetch_mb=[64]), TypeError, r"prefetch_mb must be a number \(MiB"),
    (dict(host_budget_gb=-1), ValueError, "host_budget_gb must be >= 0 GiB or None"),
    (dict(host_budget_gb="8"), TypeError, "host_budget_gb must be a number"),
    (dict(device="cpu"), ValueError, r"device must be 'cuda', 'cuda:N' \(N = 0, 1, ...\), 'sim'"),
    (dict(device="cuda:x"), ValueError, "device must be 'cuda', 'cuda:N'"),
    (dict(device="cuda:-1"), ValueError, "device must be 'cuda', 'cuda:N'"),
    (dict(device="gpu"), ValueError, "device must be 'cuda', 'cuda:N'"),
    (dict(device=torch.device("cpu")), ValueError, "device must be 'cuda', 'cuda:N'"),
    (dict(device=0), TypeError, "device must be None, 'cuda', 'cuda:N', 'sim' or a torch.device"),
    (dict(device=1.5), TypeError, "device must be None"),
    (dict(config={"lms": 1}), TypeError, "config must be an lmsrt.LMSConfig"),
    (dict(config=lmsrt.LMSConfig(), lms_frac=0.2), TypeError, "pass either config or lms_frac"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_ARGUMENTS,
                         ids=[f"{next(iter(k))}={v!r}"[:40] for k, _, _ in BAD_ARGUMENTS
                              for v in [next(iter(k.values()))]])
def test_bad_arguments_say_what_is_allowed(kwargs, error, match):
    with pytest.raises(error, match=match):
        lmsrt.LMS(**kwargs)
    if "config" not in kwargs and not isinstance(kwargs.get("device", ""), (int, float)):
        spec = kwargs.get("device")
        config_kwargs = dict(kwargs, device=str(spec)) if spec is not None else kwargs
        with pytest.raises(error, match=match.split(r" \(")[0]):
            lmsrt.LMSConfig(**config_kwargs)


def test_config_device_type_and_env_are_checked():
    with pytest.raises(TypeError, match="device must be None or a string"):
        lmsrt.LMSConfig(device=0)
    with pytest.raises(ValueError, match="LMSRT_LMS_FRAC='half' is not a number"):
        lmsrt.LMSConfig.from_env({"LMSRT_LMS_FRAC": "half"})
    with pytest.raises(ValueError, match="device must be 'cuda', 'cuda:N'"):
        lmsrt.LMSConfig.from_env({"LMSRT_DEVICE": "gpu0"})


def test_numbers_of_any_real_type_are_accepted():
    lms = lmsrt.LMS(lms=np.int64(64), lms_frac=fractions.Fraction(1, 2),
                    prefetch_mb=np.float32(16), host_budget_gb=1, device="sim")
    assert (lms.config.lms, lms.config.lms_frac, lms.config.prefetch_mb) == (64.0, 0.5, 16.0)
    assert lms.enabled


@pytest.mark.cuda
def test_cuda_device_that_does_not_exist():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"this machine has {count} CUDA"):
        lmsrt.LMS(device=f"cuda:{count}")
    assert lmsrt.LMS(device=torch.device("cuda", 0)).enabled


def test_no_gpu_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(lmsrt.say, "_said", set())         # as in a new process
    with lmsrt_warnings() as said:
        for _ in range(3):
            lms = lmsrt.LMS()
            with lms:
                y = (torch.randn(10, requires_grad=True) * 2).exp()
            y.sum().backward()
            assert not lms.enabled and lms.stats()["total"]["out_bytes"] == 0
        lmsrt.LMS(lms=0)
    assert len(said) == 1 and "no CUDA device" in said[0], said


class _RetryingDevice(SimulatedDevice):
    """A simulated GPU whose caching allocator retries ``per_step`` times each step."""

    def __init__(self, per_step, **kw):
        super().__init__(**kw)
        self.per_step, self.retries = per_step, 0

    def alloc_retries(self):
        return self.retries


def test_allocator_retries_are_counted_per_step_and_said_once():
    torch.manual_seed(0)
    model = transformer(d=32, layers=2, heads=2)
    x = torch.randn(2, 16, 32)
    device = _RetryingDevice(per_step=2)
    lms = lmsrt.LMS(device=device, lms=1, lms_frac=0.5)
    with lmsrt_warnings() as caught:
        for _ in range(4):
            train_step(model, x, lms=lms)
            device.retries += device.per_step      # as if backward had run out twice
    history = lms.stats()["history"]
    assert [h["alloc_retries"] for h in history] == [2, 2, 2]
    assert lms.stats()["total"]["alloc_retries"] == 6 + lms.stats()["last_step"]["alloc_retries"]
    said = [w for w in caught if "ran out of room" in w]
    assert len(said) == 1 and "lms_frac" in said[0], caught
    assert "allocator retries" in lms.summary()
    headline = format_headline(lms.stats())
    assert "the allocator freeing its cache 2 times a step to go on" in headline, headline
