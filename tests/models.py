"""Small models shared by the tests, and the helpers that train them with and without LMS."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import warnings

import pytest
import torch
from torch import nn

import lmsrt
from lmsrt.device import SimulatedDevice
from lmsrt.say import PREFIX

# Every check runs on the simulated device, and on CUDA under the `cuda` marker.
DEVICES = [pytest.param("sim", id="sim"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


# torch.compile's backends per device: aot_eager everywhere, inductor where it can build.
COMPILE_BACKENDS = [
    pytest.param("sim", "aot_eager", id="sim-aot_eager"),
    pytest.param("sim", "inductor", id="sim-inductor", marks=pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")),
    pytest.param("cuda", "inductor", id="cuda-inductor", marks=pytest.mark.cuda)]


def torch_device(kind: str) -> torch.device:
    return torch.device("cuda" if kind == "cuda" else "cpu")


def make_lms(kind: str, capacity: int = 1 << 30, copy_lag: int = 0, pin_limit=None,
             pins_ready: bool = True, **kw) -> lmsrt.LMS:
    device = (SimulatedDevice(capacity=capacity, copy_lag=copy_lag, pin_limit=pin_limit)
              if kind == "sim" else "cuda")
    kw.setdefault("lms", 1)
    kw.setdefault("lms_frac", 0.0)
    lms = lmsrt.LMS(device=device, **kw)
    if pins_ready and kind == "cuda":
        pins_at_hand(lms)
    return lms


def pins_at_hand(lms: lmsrt.LMS, nbytes: int = 256 << 20) -> None:
    """Pin ``nbytes`` of host memory now, as a run has after its first steps. On a real GPU the
    tests' small models use so little of it that a first step defers its swaps while pins run
    (engine/deferred.py, NOTE [ Deferred copies ]) and may move nothing; tests of what swapping does
    need their copies made."""
    pool = lms._engine.host
    pool.reserve(nbytes)
    slot = pool.settle(nbytes)           # waits for the pins just started
    if slot is not None:
        pool.free(slot)


def rebuild_small_tensors(kind: str, monkeypatch=None) -> None:
    """On CUDA, let the rebuilds of the tests' small models pass the cost rule
    (recompute/rebuilds.py, ``_COPY_FIXED_S``): a rebuild of a few KB, timed on an idle GPU, is its
    launch (tens of us), and the rule rightly prefers the copy then. What these tests check is
    exactness; the rule has a test of its own, and the benchmark shows rebuilds kept at real
    sizes."""
    if kind == "cuda":
        import lmsrt.recompute.rebuilds
        if monkeypatch is not None:
            monkeypatch.setattr(lmsrt.recompute.rebuilds, "_COPY_FIXED_S", 1.0)
        else:                           # a script of its own: for the process
            lmsrt.recompute.rebuilds._COPY_FIXED_S = 1.0


class Block(nn.Module):
    """A pre-norm transformer block with hand-written attention (deterministic on CUDA)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)      # three views of one storage
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def transformer(d=64, layers=4, heads=4):
    return nn.Sequential(*[Block(d, heads) for _ in range(layers)])


def mlp(d=128, layers=6):
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(layers)])


def convnet(c=8):
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
        nn.Upsample(scale_factor=2), nn.Conv2d(c, 2, 1))


class ViewsModel(nn.Module):
    """Saves views, transposes and chunks of shared storages, and an expanded tensor."""

    def __init__(self, d=64):
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)
        self.w = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        h = self.lin(x)
        a, b = h.chunk(2, dim=-1)                # two views of one storage
        y = a.sigmoid() * b.t().t()              # b saved through a double transpose
        z = y.t() @ a                            # a transpose view saved by matmul
        w = y[:, ::2].exp()                      # strided view
        return z.sum() + (w * self.w[0, : w.shape[1]]).sum() + (y @ self.w.t()).square().sum()


def train_step(model, inputs, lms=None, create_graph=False, retain=False):
    """One forward/backward; returns (loss, grads)."""
    model.zero_grad(set_to_none=True)
    if lms is not None:
        with lms:
            out = model(inputs)
    else:
        out = model(inputs)
    loss = out.float().square().mean()
    if create_graph:
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        second = sum(g.square().sum() for g in grads)
        second.backward()
    else:
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def same_hooks():
    """Identity saved-tensor hooks: a compiled region whose saves go through hooks may be
    compiled differently (other fused kernels, last-bit differences), so a reference for a
    compiled model under lmsrt runs under these, and what is compared is what lmsrt does to the
    saved bytes, not what the compiler did."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def compiled_reference(model, inputs, backend: str):
    """``train_step`` of a compiled ``model`` under ``same_hooks``; skips the test where
    ``backend`` cannot compile here (no C++ compiler, or no Triton for this GPU)."""
    try:
        return train_step(model, inputs, lms=same_hooks())
    except Exception as e:  # noqa: BLE001 - whatever the compiler raises
        pytest.skip(f"torch.compile(backend={backend!r}) is not available here: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def assert_same(ref, got):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert torch.equal(ref_loss, loss), (ref_loss, loss)
    for i, (a, b) in enumerate(zip(ref_grads, grads)):
        assert torch.equal(a, b), f"gradient {i} differs: max |d| = {(a - b).abs().max().item()}"


def assert_same_steps(ref, got) -> None:
    """Steps of (loss, gradients, buffers), each ``torch.equal`` to the reference's."""
    assert len(ref) == len(got)
    for (la, ga, ba), (lb, gb, bb) in zip(ref, got):
        assert torch.equal(la, lb)
        assert len(ga) == len(gb) and all(torch.equal(x, y) for x, y in zip(ga, gb))
        assert len(ba) == len(bb) and all(torch.equal(x, y) for x, y in zip(ba, bb))


def run_threads(work, args, timeout: float = 120.0) -> None:
    """Run ``work(*a)`` for each ``a`` in ``args`` on its own thread, switching between threads
    often so that they interleave inside the engine, and wait for all of them."""
    import sys
    import threading
    threads = [threading.Thread(target=work, args=a) for a in args]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        sys.setswitchinterval(switch)


@contextlib.contextmanager
def lmsrt_warnings():
    """Collects the message of every lmsrt note (a record of the ``lmsrt`` logger, given its
    ``lmsrt: `` back) and warning given inside, however often one repeats."""
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(PREFIX + record.getMessage())
    logger = logging.getLogger("lmsrt")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        logger.removeHandler(handler)
    said.extend(str(w.message) for w in caught if str(w.message).startswith("lmsrt:"))


@contextlib.contextmanager
def says(pattern: str):
    """Fails unless lmsrt says something that ``pattern`` matches inside (``lmsrt_warnings``)."""
    with lmsrt_warnings() as said:
        yield said
    assert any(re.search(pattern, text) for text in said), said
