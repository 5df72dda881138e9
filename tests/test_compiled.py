"""A model compiled whole under LMS is compiled block by block, and CUDA graph capture runs with
lmsrt's hooks aside (lmsrt/recompute/compiled.py). Compiling on the CPU is slow: tiny models,
few tests."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from models import (
    COMPILE_BACKENDS,
    DEVICES,
    assert_same,
    compiled_reference,
    lmsrt_warnings,
    make_lms,
    same_hooks,
    torch_device,
    train_step,
    transformer,
)
from processes import clean_env, write
from torch import nn

import lmsrt.lms
import lmsrt.recompute.compiled
import lmsrt.say
from lmsrt.recompute.compiled import repeated_blocks

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
    monkeypatch.setattr(lmsrt.lms, "_advice", weakref.WeakSet())
    monkeypatch.setattr(lmsrt.recompute.compiled, "_regional_models", 0)
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
    whole = compiled_reference(compiled, x, backend)
    assert not compiled.forward.regional
    lms = make_lms(kind)
    with lmsrt_warnings() as said:
        got = [train_step(compiled, x, lms=lms) for _ in range(3)]
        assert compiled.forward.regional
        # The same compiled blocks without lmsrt: an LMS is live, but not entered. (Two
        # compilations of one graph by inductor on CUDA may differ in the last bits.) Step 1
        # ran the blocks eagerly (NOTE [ Regions under LMS ], Rule 6).
        ref = train_step(compiled, x, lms=same_hooks())
        for step in got[1:]:
            assert_same(ref, step)
    assert [m for m in said if "blocks one by one" in m] == [
        "lmsrt: torch.compile(Sequential) under LMS compiles its 4 Block blocks one by one, once "
        "lmsrt has learnt a step (they run eagerly until then), and runs the rest eagerly, so "
        "that saved tensors can be swapped between blocks (a compiled region hands them over "
        "only after its forward; said once)."], said
    assert not [m for m in said if "between compiled regions" in m], said
    step = lms.stats()["last_step"]
    assert step["out_bytes"] > 0
    if kind == "sim":
        # Everything swaps at lms_frac 0: held on the "GPU" at once is about one block's saves,
        # not the model's (a region per model held them all at its end). (A real GPU's peak
        # also counts the parameters, which at this size outweigh the saves.)
        assert step["gpu_peak_bytes"] < step["out_bytes"] / 2, step
    return whole, ref, got[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch's own, from inductor
@pytest.mark.parametrize("kind, backend", COMPILE_BACKENDS)
def test_model_compiled_whole_swaps_between_blocks(kind, backend, monkeypatch):
    import torch._inductor.config
    # Inductor's deterministic mode: reduction configs by rule, not by timing (test_reliability's
    # test of compile says why).
    with torch._inductor.config.patch(deterministic=True):
        whole, ref, eager = _check_regional(kind, backend, monkeypatch)
    if backend == "aot_eager":
        # Run-to-run exact, also against the whole-model graph and the eager step.
        assert_same(ref, whole)
        assert_same(ref, eager)


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
    assert counter.frame_count == whole              # step 1 runs the blocks eagerly
    train_step(model, x, lms=lms)
    assert counter.frame_count == whole + 1          # one graph shared by the three blocks
    torch._dynamo.reset()


def test_a_torch_that_compiles_blocks_apart_keeps_the_model_whole(monkeypatch):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    _fresh_live_engines(monkeypatch)
    # (torch's own patch: pytest's monkeypatch deletes an option that it found only through
    # the config's __getattr__, and a deleted option reads as missing afterwards.)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = GPT2LM(vocab=64, seq=8, d=16, layers=3, heads=2)
    compiled = torch.compile(model, backend=counter)
    lms = make_lms("sim")
    with lmsrt_warnings() as said, torch._dynamo.config.patch(inline_inbuilt_nn_modules=False):
        train_step(compiled, torch.randint(64, (2, 8)), lms=lms)
    assert not compiled.forward.regional and counter.frame_count == 1
    assert len(said) == 1 and "inline_inbuilt_nn_modules" in said[0] and "torch 2.5" in said[0]
    torch._dynamo.reset()


def test_cuda_graph_modes_are_left_out_of_blocks():
    from lmsrt.recompute.compiled import _block_arguments
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


def test_memory_budget_from_a_steps_figures():
    # NOTE [ Regions under LMS ], Rule 7: the share of the blocks' saves they may keep.
    from lmsrt.policy import make_policy
    from lmsrt.recompute.plan import LEAST_BUDGET, StepFigures, memory_budget
    gib = 1 << 30
    step = StepFigures(excess=6 * gib, saved=16 * gib, rebuilt=0, t_fwd=0.0, t_bwd=0.0,
                       bandwidth=55e9)
    assert memory_budget(step, 12 * gib) == 0.5              # half of what the blocks save goes
    assert memory_budget(step, 7 * gib) == 0.1               # 1/7 kept: rounded down, 0.14 -> 0.1
    assert memory_budget(step, 5 * gib) == LEAST_BUDGET      # more than the blocks save
    assert memory_budget(step, 0) == 1.0                     # no blocks saved anything
    # Copies that hide under the shorter pass need no recompute: 55 GB/s x 0.05 s = 2.56 GiB.
    hidden = dict(t_fwd=0.05, t_bwd=0.1)
    assert memory_budget(StepFigures(2 * gib, 16 * gib, 0, bandwidth=55e9, **hidden),
                         12 * gib) == 1.0
    assert memory_budget(StepFigures(8 * gib, 16 * gib, 0, bandwidth=55e9, **hidden),
                         12 * gib) == 0.5                    # 5.44 of 12 GiB freed: 0.547 kept
    # Rebuilt storages (the same share of what remains) cross no link.
    assert memory_budget(StepFigures(10 * gib, 16 * gib, 8 * gib, 0.0, 0.0, 55e9),
                         12 * gib) == 0.65                   # 0 = 10 - F - (16 - F) / 2: F = 4
    assert memory_budget(StepFigures(8 * gib, 16 * gib, 8 * gib, 0.0, 0.0, 55e9),
                         12 * gib) == 1.0                    # the rebuilt half is the excess
    # A free link (the simulated device), or nothing over the bound: torch's default.
    assert memory_budget(dataclasses.replace(step, bandwidth=float("inf")), 12 * gib) == 1.0
    assert memory_budget(dataclasses.replace(step, excess=0), 12 * gib) == 1.0
    # Every policy answers it alike, from the same function.
    for frac in (0.5, "auto"):
        assert make_policy(frac, 16 * gib, gib).compiled_budget(step, 12 * gib) == 0.5


def _counting_aot_eager(budgets: list, calls: list):
    """aot_eager (the min-cut partitioner, no code generation) that notes the budget each graph
    is partitioned under and counts the compiled forwards run."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        budgets.append(functorch_config.activation_memory_budget)
        forward = aot_eager(gm, example_inputs)

        def run(*args):
            calls.append(1)
            return forward(*args)
        return run
    return backend


def _saved_bytes(model, x) -> tuple:
    """(loss and gradients, bytes saved for backward) of a step without lmsrt, its saves counted
    through identity saved-tensor hooks (as the references above: a region whose saves go
    through hooks may be compiled otherwise)."""
    nbytes = [0]

    def pack(t):
        nbytes[0] += t.untyped_storage().nbytes()
        return t
    result = train_step(model, x, lms=torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    return result, nbytes[0]


def _counted_transformer(kind):
    """A small transformer, an input, and the transformer compiled whole by the counting backend
    (with the budgets it was compiled under and the compiled calls)."""
    import torch._dynamo
    torch._dynamo.reset()           # the budget is not guarded: a graph of another run would do
    torch.manual_seed(0)
    dev = torch_device(kind)
    model = transformer(d=32, layers=4, heads=2).to(dev)
    x = torch.randn(2, 16, 32, device=dev)
    budgets, calls = [], []
    compiled = torch.compile(model, backend=_counting_aot_eager(budgets, calls))
    return model, x, compiled, budgets, calls


def _compiled_run(kind, costly_link: bool, steps: int = 3, **lms_kw):
    """A transformer compiled whole, trained ``steps`` steps under LMS; with ``costly_link`` the
    link's copies cost step time (on the simulated device they cost none)."""
    model, x, compiled, budgets, calls = _counted_transformer(kind)
    lms = make_lms(kind, **lms_kw)
    advice = lms._compile_advice
    if kind == "sim" and costly_link:
        advice.bandwidth = 1e9
    elif not costly_link:
        advice.bandwidth = float("inf")     # copies that cost no step time
    got = []
    for step in range(steps):
        got.append(train_step(compiled, x, lms=lms))
        if step == 0:
            # Step 1 ran the blocks eagerly, their saves counted: dynamo compiled nothing
            # (NOTE [ Regions under LMS ], Rule 6).
            assert compiled.forward.regional and not advice.ready
            assert budgets == [] and calls == [] and advice.blocks > 0
    # From step 2 the four blocks ran compiled, each step.
    assert advice.ready and len(calls) == 4 * (steps - 1), calls
    return compiled, x, lms, budgets, got


def _check_budget(kind, monkeypatch):
    from lmsrt.recompute.plan import memory_budget
    _fresh_live_engines(monkeypatch)
    # The cap forces recompute on the simulated device (an auto policy at a small capacity);
    # on a GPU, swapping everything (lms_frac 0) does.
    short = dict(capacity=150_000, lms_frac="auto") if kind == "sim" else dict(lms_frac=0.0)
    with lmsrt_warnings() as said:
        compiled, x, lms, budgets, got = _compiled_run(kind, True, **short)
    advice = lms._compile_advice
    budget = advice.budget
    assert budget < 1.0 and budget == memory_budget(advice.figures, advice.blocks)
    assert budgets and set(budgets) == {budget}, budgets      # patched as they were compiled
    assert compiled.forward.budget == budget
    assert lms.stats()["compiled"]["budget"] == budget
    lines = [m for m in said if "activation_memory_budget" in m]
    assert len(lines) == 1 and f"activation_memory_budget={budget:g}," in lines[0], said
    # The same compiled graphs without lmsrt: the same bytes, and fewer saved.
    ref, saved = _saved_bytes(compiled, x)
    for step in got[1:]:
        assert_same(ref, step)
    assert lms.stats()["last_step"]["out_bytes"] > 0
    # At torch's default (nothing over the bound that copies cost time for): nothing patched.
    _fresh_live_engines(monkeypatch)
    with lmsrt_warnings() as said:
        compiled, x, lms, budgets, got = _compiled_run(kind, False, steps=2, **(
            dict(capacity=150_000, lms_frac="auto") if kind == "sim" else dict(lms_frac=0.0)))
    assert lms._compile_advice.budget == 1.0 and set(budgets) == {1.0}, budgets
    assert not [m for m in said if "activation_memory_budget" in m], said
    default, saved_default = _saved_bytes(compiled, x)
    assert saved < saved_default * 0.8, (saved, saved_default)
    # Recomputed in backward rather than saved: the same ops, the same values (aot_eager runs
    # aten's own kernels, which repeat bit for bit).
    assert_same(default, ref)
    return budget


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch's own, from inductor
@pytest.mark.parametrize("kind", DEVICES)
def test_blocks_compile_after_the_learnt_step_under_its_budget(kind, monkeypatch):
    budget = _check_budget(kind, monkeypatch)
    if kind == "sim":
        assert budget == 0.45       # 143 of the blocks' 272 KiB over the bound, at the capacity


@pytest.mark.parametrize("around_the_loop", [False, True],
                         ids=["with-each-step", "with-around-loop"])
def test_the_step_that_compiles_the_blocks_is_learnt(around_the_loop, monkeypatch):
    # A step begins as `with lms:` is entered, or, with one `with` around the loop (as under
    # lmsrt run), at its first save: here inside the first block. Either way the whole of step 2
    # runs the blocks compiled, and is learnt afresh (NOTE [ Regions under LMS ], Rule 6).
    import torch._dynamo
    _fresh_live_engines(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformer(d=32, layers=4, heads=2)
    x = torch.randn(2, 16, 32)
    budgets, calls = [], []
    compiled = torch.compile(model, backend=_counting_aot_eager(budgets, calls))
    lms = make_lms("sim", lms_frac="auto", capacity=150_000)     # over the bound: regional
    ref = train_step(model, x)
    with lms if around_the_loop else contextlib.nullcontext():
        for step in range(4):
            assert_same(ref, train_step(compiled, x, lms=None if around_the_loop else lms))
            assert len(calls) == 4 * step, (step, calls)
    notes = [s["policy_note"] for s in lms.stats()["history"]]
    assert notes[0].startswith("learnt") and notes[1].startswith("learnt"), notes
    assert not notes[2].startswith("learnt"), notes


@pytest.mark.parametrize("kind", DEVICES)
def test_a_model_that_fits_goes_back_to_its_whole_graph(kind, monkeypatch):
    """Step 1 learns with the blocks eager; with nothing over the bound, everything kept, the
    model runs its whole-model graph from then on (NOTE [ Regions under LMS ], Rule 8)."""
    _fresh_live_engines(monkeypatch)
    model, x, compiled, budgets, calls = _counted_transformer(kind)
    whole = train_step(compiled, x, lms=same_hooks())
    graphs = len(calls)
    lms = make_lms(kind, lms_frac="auto", capacity=1 << 30)
    with lmsrt_warnings() as said:
        got = [train_step(compiled, x, lms=lms) for _ in range(3)]
    advice = lms._compile_advice
    assert advice.whole and lms.stats()["compiled"]["whole"]
    assert not compiled.forward.regional
    assert all(b._compiled_call_impl is None for b in model)
    # Steps 2 and 3 ran the whole-model graph (as many compiled calls as the plain step), and
    # nothing was compiled again.
    assert len(calls) == 3 * graphs and set(budgets) == {1.0}, (calls, budgets)
    for step in got:
        assert_same(whole, step)
    assert [m for m in said if "runs as compiled" in m], said


def _block_class(name: str, scale: float) -> type:
    """A block class of its own, named ``name``: a residual Linear and tanh, scaled."""

    def __init__(self, d: int = 32, k: int = 1):
        nn.Module.__init__(self)
        self.lin, self.k = nn.Linear(d, d), k

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * (scale * self.k)

    return type(name, (nn.Module,), dict(__init__=__init__, forward=forward))


def _compiled_blocks(model, x, lms, backend, steps=3):
    """``model`` compiled whole, trained ``steps`` steps under ``lms``: the steps, and the
    compiled model."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()                           # (which reset() leaves)
    compiled = torch.compile(model, backend=backend)
    got = []
    for step in range(steps):
        got.append(train_step(compiled, x, lms=lms))
        assert compiled.forward.regional
    return got, compiled


def _check_block_classes(kind, backend, monkeypatch):
    # Each block class compiles through a function of its own, so each has dynamo's recompile
    # limit (NOTE [ Regions under LMS ], Rule 5): ten classes, past the limit of 8, all compile.
    import torch._dynamo
    from torch._dynamo.utils import counters
    _fresh_live_engines(monkeypatch)
    dev = torch_device(kind)
    torch.manual_seed(0)
    classes = [_block_class(f"Kind{i}", i + 1.0) for i in range(10)]
    model = nn.Sequential(*[cls() for cls in classes for _ in range(2)]).to(dev)
    x = torch.randn(16, 32, device=dev)
    eager = train_step(model, x)
    lms = make_lms(kind)
    with lmsrt_warnings() as said:
        got, compiled = _compiled_blocks(model, x, lms, backend)
    assert torch._dynamo.config.recompile_limit < len(classes)
    # Step 1 ran eagerly; from step 2 a graph per class (and one more for the first block,
    # whose input does not require grad), and no frame dynamo gave up on.
    frames = counters["frames"]
    assert frames["ok"] == frames["total"] == len(classes) + 1, frames
    assert not [m for m in said if "recompile limit" in m], said
    # The same compiled blocks without lmsrt (an LMS live, not entered).
    ref = train_step(compiled, x, lms=same_hooks())
    for step in got[1:]:
        assert_same(ref, step)
    if backend == "aot_eager":                 # aten's own kernels: also the eager model's bytes
        assert_same(eager, ref)
        assert_same(eager, got[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("kind, backend", [p for p in COMPILE_BACKENDS if p.id != "sim-inductor"])
def test_more_block_classes_than_dynamos_recompile_limit_all_compile(kind, backend, monkeypatch):
    _check_block_classes(kind, backend, monkeypatch)


def test_blocks_past_the_recompile_limit_of_their_class_are_named(monkeypatch):
    # Blocks of one class that dynamo must compile apart (a Python number it guards on) pass the
    # limit: the rest run eagerly, exactly, and lmsrt says so once, naming the class.
    import torch._dynamo
    _fresh_live_engines(monkeypatch)
    torch.manual_seed(0)
    scaled = _block_class("ScaledBlock", 0.5)
    model = nn.Sequential(*[scaled(k=k) for k in range(1, 5)])
    x = torch.randn(16, 32)
    eager = train_step(model, x)
    lms = make_lms("sim")
    budgets, calls = [], []
    with lmsrt_warnings() as said, torch._dynamo.config.patch(recompile_limit=2):
        got, compiled = _compiled_blocks(model, x, lms, _counting_aot_eager(budgets, calls))
    # Two of the four blocks compiled, two eager, in steps 2 and 3.
    assert len(budgets) == 2 and len(calls) == 2 * 2, (budgets, calls)
    lines = [m for m in said if "recompile limit" in m]
    assert len(lines) == 1 and "2 graphs for the ScaledBlock blocks" in lines[0], said
    assert "recompile_limit=2" in lines[0]
    for step in got:
        assert_same(eager, step)
    torch._dynamo.reset()
