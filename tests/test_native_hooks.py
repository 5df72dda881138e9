"""The C++ saved-tensor hooks (csrc/copy_path.cpp, ``Keeper``) that decide the packs of a step
whose plan keeps everything (engine/native.py, NOTE [ Steps that keep everything ]). Built here
against CPU torch and run on the simulated device, side by side with the Python hooks: the same
decisions, counts and gradients; the Python hooks take over wherever the plan stops holding in the
middle of a forward (a storage of another size, GPU use over the policy's level); autograd's
in-place error; and no cycle that would keep a dropped LMS alive."""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import lmsrt
import lmsrt.copy_path as copy_path
from lmsrt.device import SimulatedDevice

pytestmark = pytest.mark.skipif(bool(copy_path._missing_tool()),
                                reason="needs a C++ compiler and ninja: "
                                f"{copy_path._missing_tool()}")

KiB = 1 << 10


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """lmsrt.copy_path's module, compiled once for this module (about a minute)."""
    saved_env, saved_loaded = os.environ.get("LMSRT_CACHE"), copy_path._loaded
    os.environ["LMSRT_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        copy_path._loaded = None
        copy_path.build()
        module = copy_path.load()
        assert module is not None, copy_path.status()
        yield module
    finally:
        copy_path._loaded = saved_loaded
        if saved_env is None:
            os.environ.pop("LMSRT_CACHE", None)
        else:
            os.environ["LMSRT_CACHE"] = saved_env


class Net(torch.nn.Module):
    """Linear+Tanh layers (each saves its input, a weight and its output); from layer ``grow_at``
    on, while ``wide`` is set, the activations are twice as wide (a storage of another size in
    the middle of a forward); with ``resave``, layer ``grow_at``'s input is multiplied by the
    net's (which saves the step's first storage again); ``transient`` allocates model memory of
    that many bytes on the simulated device at layer ``transient_at``, held to the end of the
    step."""

    def __init__(self, device, d=64, layers=12):
        super().__init__()
        torch.manual_seed(0)
        self.device = device
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.wide, self.grow_at = False, layers // 2
        self.transient, self.transient_at = 0, layers // 2
        self.held = None
        self.resave = False          # multiply by the input (the step's first storage) there

    def forward(self, x):
        x0 = x
        for i, layer in enumerate(self.layers):
            if self.wide and i == self.grow_at:
                x = torch.cat([x, x])
            if self.resave and i == self.grow_at:
                x = x * x0
            if self.transient and i == self.transient_at:
                self.held = self.device.empty(self.transient)
            x = torch.tanh(layer(x))
        return x.square().mean()


def _lms(native_module, capacity=1 << 30):
    device = SimulatedDevice(capacity=capacity)
    device.native_hooks = native_module
    return lmsrt.LMS(device=device, lms=1, lms_frac="auto"), device


def _run(net, lms, x, steps, before_step=None):
    """Train ``steps`` steps; return (losses, grads, step stats) per step."""
    out = []
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        net.zero_grad(set_to_none=True)
        net.held = None
        with lms if lms is not None else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t):
            loss = net(x)
        loss.backward()
        stats = lms.stats()["last_step"] if lms is not None else None
        out.append((loss.detach(), [p.grad.clone() for p in net.parameters()], stats))
    return out


_COUNTS = ("mode", "kept_tensors", "kept_bytes", "skipped_tensors", "live_tensors", "out_bytes",
           "out_tensors")


def _side_by_side(native_module, steps, before_step=None, capacity=1 << 30):
    """The same net trained without lmsrt, under the Python hooks and under the C++ hooks:
    every loss and gradient equal, and the C++ run's step counts equal the Python run's."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in ("plain", "python", "native"):
        device = SimulatedDevice(capacity=capacity)
        if name == "native":
            device.native_hooks = native_module
        lms = None if name == "plain" else lmsrt.LMS(device=device, lms=1, lms_frac="auto")
        if lms is not None:
            # GPU use read at every decision, as on a GPU with the copy path built (the
            # simulated device's reading would otherwise be estimated between readings).
            lms._engine.gauge.every = 0
        net = Net(device)
        hook = None if before_step is None else (lambda i, net=net: before_step(i, net))
        runs[name] = (_run(net, lms, x, steps, hook), lms)
    for (ref_loss, ref_grads, _), (loss, grads, _) in zip(runs["plain"][0], runs["native"][0]):
        assert torch.equal(ref_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    for i, ((_, _, want), (_, _, got)) in enumerate(zip(runs["python"][0], runs["native"][0])):
        assert {k: got[k] for k in _COUNTS} == {k: want[k] for k in _COUNTS}, f"step {i + 1}"
    return runs


def _python_decisions(lms):
    """Counts the storages the Python hooks decide (engine._decide calls)."""
    engine, calls = lms._engine, []
    decide = engine._decide

    def counted(*args):
        calls.append(args[-1])
        return decide(*args)

    engine._decide = counted
    return calls


def test_a_step_that_keeps_everything_is_decided_in_cpp_with_the_same_counts(native):
    runs = _side_by_side(native, steps=6)
    stats = [s for _, _, s in runs["native"][0]]
    assert stats[-1]["mode"] == "plan" and stats[-1]["out_bytes"] == 0
    assert stats[-1]["kept_tensors"] >= 12 and stats[-1]["skipped_tensors"] >= 11   # weights

    lms, device = _lms(native)
    net = Net(device)
    x = torch.randn(32, 64)
    _run(net, lms, x, 5)
    calls = _python_decisions(lms)
    _run(net, lms, x, 1)
    # The first storage of the step arms the C++ hooks; they decide the rest.
    assert len(calls) == 1, calls
    assert lms.stats()["last_step"]["kept_tensors"] >= 12


def test_the_first_storage_saved_again_after_the_hooks_armed_is_kept_once(native):
    """NOTE [ Steps that keep everything ]: the step's first storage is decided in Python, and
    arms the C++ hooks; saved again after that (a Llama's hidden state, which its norm saves
    twice), the C++ hooks know it as the storage kept, not as the next point: the step follows
    its plan, with the Python hooks' counts, and stays in C++ (on an H200 every lean step of
    transformers' Trainer left its plan at that storage)."""
    def resave(i, net):
        net.resave = True

    runs = _side_by_side(native, steps=6, before_step=resave)
    stats = [s for _, _, s in runs["native"][0]]
    assert stats[-1]["mode"] == "plan" and stats[-1]["out_bytes"] == 0

    lms, device = _lms(native)
    net = Net(device)
    net.resave = True
    x = torch.randn(32, 64)
    _run(net, lms, x, 5)
    calls = _python_decisions(lms)
    _run(net, lms, x, 1)
    assert len(calls) == 1, calls
    assert lms.stats()["last_step"]["mode"] == "plan"


def test_a_storage_of_another_size_hands_the_step_to_python(native):
    def widen(i, net):
        net.wide = i == 6            # step 7 saves larger storages from the middle layer on

    runs = _side_by_side(native, steps=9, before_step=widen)
    stats = [s for _, _, s in runs["native"][0]]
    assert stats[6]["mode"] == "reactive"          # the step left the plan (and still trained)


def test_use_over_the_policys_level_hands_the_step_to_python_which_swaps(native):
    # The net saves 104 KiB a step; step 7 holds a 960 KiB transient from its middle layer on,
    # which leaves a 1 MiB device too little for the storages saved after it: some must go out.
    def transient(i, net):
        net.transient = 960 * KiB if i == 6 else 0

    runs = _side_by_side(native, steps=8, before_step=transient, capacity=1024 * KiB)
    stats = [s for _, _, s in runs["native"][0]]
    assert stats[5]["out_bytes"] == 0 and stats[6]["out_bytes"] > 0


def test_an_in_place_change_raises_autograds_error_as_the_python_hooks_do(native):
    messages = []
    for hooks in (None, native):
        device = SimulatedDevice(capacity=1 << 30)
        device.native_hooks = hooks
        lms = lmsrt.LMS(device=device, lms=1, lms_frac="auto")
        net = Net(device)
        x = torch.randn(32, 64)
        _run(net, lms, x, 5)
        with lms:
            h = torch.tanh(net.layers[0](x))
            loss = net.layers[1](h).sum()       # saves h, which tanh saved as its output too
        h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            loss.backward()
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_a_dropped_lms_is_freed_at_once(native):
    lms, device = _lms(native)
    net = Net(device)
    _run(net, lms, torch.randn(32, 64), 4)
    engine = weakref.ref(lms._engine)
    assert lms._hooks is not None
    gc.disable()
    try:
        del lms
        assert engine() is None
    finally:
        gc.enable()


@pytest.mark.cuda
def test_cuda_a_model_that_fits_trains_exactly_through_the_cpp_hooks():
    """On a GPU with the copy path built (it builds itself on first use there), a step whose
    plan keeps everything is decided in C++, and the gradients are those of the run without
    lmsrt, bit for bit; then a step that needs the Python hooks (a batch of another size) too."""
    if copy_path.load() is None:
        pytest.skip(f"copy path not built: {copy_path.status()}")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU())
                                for _ in range(8)]).cuda()
    lms = lmsrt.LMS(lms=64, lms_frac="auto")
    assert lms._hooks is not None
    calls = None
    for step in range(8):
        x = torch.randn(256 if step != 6 else 384, 512, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(step))
        net.zero_grad(set_to_none=True)
        want = [g.clone() for g in torch.autograd.grad(net(x).square().mean(), net.parameters())]
        if step == 5:
            calls = _python_decisions(lms)
        with lms:
            loss = net(x).square().mean()
        loss.backward()
        assert all(torch.equal(p.grad, w) for p, w in zip(net.parameters(), want)), step
        if step == 5:
            assert lms.stats()["last_step"]["mode"] == "plan"
            assert len(calls) == 1 and lms.stats()["last_step"]["kept_tensors"] >= 16
    assert lms.stats()["last_step"]["kept_tensors"] >= 16


def test_blocks_accounted_while_the_cpp_hooks_decide(native):
    """A block's span is read from the C++ hooks' forward point while they decide the packs
    (recompute/account.py, NOTE [ Block account ]): the same rows as under the Python hooks."""
    runs = _side_by_side(native, 4)
    want, got = (runs[name][1].stats()["blocks"] for name in ("python", "native"))
    assert got == want
    # The first layer saved the batch; each tanh, outside the layers, saved its output first.
    last = runs["native"][1].stats()["last_step"]
    assert got[0]["kept_bytes"] > 0 and got[-1]["kept_bytes"] > 0
    assert sum(row["kept_bytes"] for row in got) == last["kept_bytes"] + last["live_bytes"]
