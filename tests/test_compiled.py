"""A model compiled whole under LMS is compiled block by block, and CUDA graph capture runs with
lmsrt's hooks aside (lmsrt/compiled.py). Compiling on the CPU is slow: tiny models, few tests."""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from models import (
    assert_same,
    lmsrt_warnings,
    make_lms,
    torch_device,
    train_step,
    transformer,
)
from processes import clean_env, write
from torch import nn

import lmsrt.compiled
import lmsrt.lms
import lmsrt.say
from lmsrt.compiled import repeated_blocks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from workloads import GPT2LM, GPTBlock


class _Nested(nn.Module):
    """Repeated blocks that hold repeated blocks of their own: only the outer ones count."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.stages = nn.ModuleList([nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                                                   nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
                                     for _ in range(3)])


def test_repeated_blocks():
    lm = GPT2LM(vocab=64, seq=8, d=16, layers=3, heads=2)
    assert repeated_blocks(lm) == list(lm.blocks) and all(isinstance(b, GPTBlock)
                                                          for b in repeated_blocks(lm))
    nested = _Nested()
    assert repeated_blocks(nested) == list(nested.stages)
    # Repeated leaves are no blocks, and one block alone is no repetition.
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))) == []
    assert repeated_blocks(transformer(d=16, layers=1, heads=2)) == []


def _fresh_live_engines(monkeypatch):
    # LMS objects that other tests left for the collector must not make this model regional early;
    # and the regions made here must not silence other tests' warning about compiled regions.
    gc.collect()
    monkeypatch.setattr(lmsrt.lms, "_live_engines", weakref.WeakSet())
    monkeypatch.setattr(lmsrt.compiled, "_regional_models", 0)
    monkeypatch.setattr(lmsrt.say, "_said", set())          # each test sees its said-once lines


def _check_regional(kind, backend, monkeypatch):
    import torch._dynamo
    _fresh_live_engines(monkeypatch)
    dev = torch_device(kind)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformer(d=32, layers=4, heads=2).to(dev)
    x = torch.randn(2, 16, 32, device=dev)
    compiled = torch.compile(model, backend=backend)       # before any LMS, as scripts do
    # The references run under identity saved-tensor hooks: a region whose saves go through
    # hooks may be compiled otherwise (test_reliability's test of compile says why).
    same_hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        whole = train_step(compiled, x, lms=same_hooks)
    except Exception as e:  # noqa: BLE001 - no C++ compiler, or no Triton for this GPU
        pytest.skip(f"torch.compile(backend={backend!r}) is not available here: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    assert not compiled.forward.regional
    lms = make_lms(kind)
    with lmsrt_warnings() as said:
        # The same compiled blocks without lmsrt: an LMS is live, but not entered. (Two
        # compilations of one graph by inductor on CUDA may differ in the last bits.)
        ref = train_step(compiled, x, lms=same_hooks)
        assert compiled.forward.regional
        for _ in range(3):
            assert_same(ref, train_step(compiled, x, lms=lms))
    assert [m for m in said if "blocks one by one" in m] == [
        "lmsrt: torch.compile(Sequential) under LMS compiles its 4 Block blocks one by one and "
        "runs the rest eagerly, so that saved tensors can be swapped between blocks (a compiled "
        "region hands them over only after its forward; said once)."], said
    assert not [m for m in said if "between compiled regions" in m], said
    step = lms.stats()["last_step"]
    assert step["out_bytes"] > 0
    if kind == "sim":
        # Everything swaps at lms_frac 0: held on the "GPU" at once is about one block's saves,
        # not the model's (a region per model held them all at its end). (A real GPU's peak
        # also counts the parameters, which at this size outweigh the saves.)
        assert step["gpu_peak_bytes"] < step["out_bytes"] / 2, step
    return whole, ref


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch's own, from inductor
@pytest.mark.parametrize("kind, backend", [
    pytest.param("sim", "aot_eager", id="sim-aot_eager"),
    pytest.param("sim", "inductor", id="sim-inductor", marks=pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")),
    pytest.param("cuda", "inductor", id="cuda-inductor", marks=pytest.mark.cuda)])
def test_model_compiled_whole_swaps_between_blocks(kind, backend, monkeypatch):
    import torch._inductor.config
    # Inductor's deterministic mode: reduction configs by rule, not by timing (test_reliability's
    # test of compile says why).
    with torch._inductor.config.patch(deterministic=True):
        whole, ref = _check_regional(kind, backend, monkeypatch)
    if backend == "aot_eager":
        # Run-to-run exact, also against the whole-model graph.
        assert_same(ref, whole)


@pytest.mark.cuda
def test_reduce_overhead_model_under_lms(monkeypatch):
    # CUDA graphs are left out of the blocks (NOTE [ Regions under LMS ], Rule 3).
    _fresh_live_engines(monkeypatch)
    torch.manual_seed(0)
    model = transformer(d=64, layers=3).cuda()
    x = torch.randn(2, 16, 64, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead")
    lms = make_lms("cuda")
    with lmsrt_warnings() as said:
        for _ in range(3):
            train_step(compiled, x, lms=lms)
    assert compiled.forward.regional
    assert lms.stats()["total"]["out_tensors"] > 0
    assert sum("CUDA graphs" in m for m in said) == 1, said


def test_no_lms_compiles_whole(monkeypatch):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    _fresh_live_engines(monkeypatch)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = GPT2LM(vocab=64, seq=8, d=16, layers=3, heads=2)
    x = torch.randint(64, (2, 8))
    model.compile(backend=counter)                   # nn.Module.compile, in place
    train_step(model, x)
    whole = counter.frame_count
    assert whole == 1 and not model._compiled_call_impl.regional
    lms = make_lms("sim", lms=0)                     # an LMS that does not swap changes nothing
    train_step(model, x, lms=lms)
    assert counter.frame_count == whole and not model._compiled_call_impl.regional
    lms = make_lms("sim")
    train_step(model, x, lms=lms)
    assert model._compiled_call_impl.regional
    assert counter.frame_count == whole + 1          # one graph shared by the three blocks
    torch._dynamo.reset()


def test_a_torch_that_compiles_blocks_apart_keeps_the_model_whole(monkeypatch):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    _fresh_live_engines(monkeypatch)
    monkeypatch.setattr(torch._dynamo.config, "inline_inbuilt_nn_modules", False)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = GPT2LM(vocab=64, seq=8, d=16, layers=3, heads=2)
    compiled = torch.compile(model, backend=counter)
    lms = make_lms("sim")
    with lmsrt_warnings() as said:
        train_step(compiled, torch.randint(64, (2, 8)), lms=lms)
    assert not compiled.forward.regional and counter.frame_count == 1
    assert len(said) == 1 and "inline_inbuilt_nn_modules" in said[0] and "torch 2.5" in said[0]
    torch._dynamo.reset()


def test_cuda_graph_modes_are_left_out_of_blocks():
    from lmsrt.compiled import _block_arguments
    said = []
    say = lambda key, message: said.append(key)     # noqa: E731
    assert _block_arguments(dict(mode="reduce-overhead", fullgraph=True), say) == dict(
        mode="default", fullgraph=True)
    assert _block_arguments(dict(mode="max-autotune"), say) == dict(
        mode="max-autotune-no-cudagraphs")
    assert _block_arguments(dict(options={"triton.cudagraphs": True}), say) == dict(
        options={"triton.cudagraphs": False})
    assert _block_arguments(dict(backend="aot_eager"), say) == dict(backend="aot_eager")
    assert said == ["cudagraphs"] * 3


@pytest.mark.cuda
def test_cuda_graph_capture_under_lms_steps_aside(monkeypatch):
    _fresh_live_engines(monkeypatch)
    torch.manual_seed(0)
    model = transformer(d=64, layers=2).cuda()
    x = torch.randn(2, 16, 64, device="cuda")
    ref = train_step(model, x)
    lms = make_lms("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                    # warm-up off the default stream, as torch asks
        for _ in range(2):
            train_step(model, x, lms=lms)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    model.zero_grad(set_to_none=True)
    with lmsrt_warnings() as said:
        with lms:
            with torch.cuda.graph(graph):            # capture inside an active LMS
                static_loss = model(static_x).float().square().mean()
                static_loss.backward()
        # and an LMS entered inside a capture
        graph2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph2):
            with lms:
                model(static_x).float().square().mean()
    assert any("CUDA graph" in m for m in said), said
    model.zero_grad(set_to_none=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_loss, ref[0])
    for g, p in zip(ref[1], model.parameters()):
        assert torch.equal(g, p.grad)
    # and swapping still works after
    assert_same(ref, train_step(model, x, lms=lms))


# An unmodified script that compiles its model whole, as nanoGPT's train.py does.
COMPILED_SCRIPT = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                  for _ in range(4)])
    model = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    for step in range(4):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item()!r}")
""")


def test_lmsrt_run_compiles_a_whole_model_block_by_block(tmp_path):
    script = write(tmp_path / "train.py", COMPILED_SCRIPT)
    plain = subprocess.run([sys.executable, script], capture_output=True, text=True,
                           env=clean_env(), timeout=300)
    stats = tmp_path / "stats.json"
    run = subprocess.run([sys.executable, "-m", "lmsrt", "run", "--lms", "1", "--lms-frac", "0",
                          "--stats", str(stats), script], capture_output=True, text=True,
                         env=clean_env(), timeout=300)
    assert plain.returncode == 0 and run.returncode == 0, (plain.stderr, run.stderr)
    losses = [line for line in run.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 4 and losses == [line for line in plain.stdout.splitlines()
                                           if line.startswith("step")]
    assert run.stderr.count("blocks one by one") == 1, run.stderr
    assert "between compiled regions" not in run.stderr, run.stderr
    assert json.loads(stats.read_text())["total"]["out_tensors"] > 0
