"""Recipes for saved tensors (recompute/recipes.py, NOTE [ Recipes ]): which saved tensors a cheap
op made from inputs that stay available, and that running the op again gives the same bits; and the
engine rebuilding them in backward instead of moving them (engine/recipes.py, NOTE [ Rebuilt
storages ]), with gradients compared by torch.equal against the run without LMS."""
from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import (
    DEVICES,
    Block,
    assert_same,
    lmsrt_warnings,
    make_lms,
    says,
    torch_device,
    train_step,
)
from torch.utils._python_dispatch import _get_current_dispatch_mode

import lmsrt
from lmsrt.device import SimulatedDevice
from lmsrt.engine import SwapEngine
from lmsrt.plan import OffloadPlan
from lmsrt.recompute.recipes import Recipe, Recorder, census, view_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from workloads import GPTBlock

pytestmark = pytest.mark.usefixtures("small_rebuilds_pay")


def _blocks(d=64, n=2):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[GPTBlock(d, 4) for _ in range(n)])


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_recipes_of_a_transformer_block_rebuild_bit_for_bit(autocast):
    blocks = _blocks()
    x = torch.randn(2, 32, 64, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return blocks(x).float().sum()

    found = census(forward)
    rebuilt = [(t, r) for t, r in found["saved"] if r is not None]
    # Each block: GELU's output (the input of fc2), and in fp32 both LayerNorm outputs; under
    # autocast the bf16 casts of those outputs and of the four weights.
    ops = set(found["by_op"])
    assert "gelu" in ops
    assert ("native_layer_norm" in ops) != autocast
    assert ("_to_copy" in ops) == autocast
    d, tokens = 64, 2 * 32
    itemsize = 2 if autocast else 4
    assert found["by_op"]["gelu"] == 2 * tokens * 4 * d * itemsize
    assert 0 < found["rebuildable_bytes"] < found["saved_bytes"]
    for t, recipe in rebuilt:
        again = view_of(recipe.rebuild(), t)
        assert again.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(again, t), recipe.name
    found["output"].backward()       # the graph is intact: the census only looked


def test_an_input_changed_in_place_since_the_op_ran_is_not_rebuilt():
    a = torch.randn(64, 64)
    with Recorder() as rec:
        h = F.gelu(a)
    recipe = rec.recipe_for(h)
    assert recipe is not None and recipe.inputs_saved(lambda storage: True)
    a.mul_(2)
    assert not recipe.inputs_saved(lambda storage: True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        recipe.rebuild()


def test_an_output_changed_in_place_has_no_recipe():
    a = torch.randn(64, 64)
    with Recorder() as rec:
        h = torch.tanh(a)
        h.add_(1)
    assert rec.recipe_for(h) is None


def test_random_and_in_place_ops_are_not_recorded():
    a = torch.randn(64, 64)
    with Recorder() as rec:
        d = F.dropout(a, 0.5, training=True)
        r = torch.relu_(a.clone())
    assert rec.recipe_for(d) is None and rec.recipe_for(r) is None
    assert len(rec) == 0


def test_an_input_nobody_saved_makes_no_recipe():
    """GELU's input saved by GELU: rebuildable. tanh saves its output, not its input: the
    input is gone by backward, so tanh's output is moved, not rebuilt."""
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)

    def forward():
        return (torch.tanh(x @ w) @ w).sum() + (F.gelu(x @ w) @ w).sum()

    found = census(forward)
    assert set(found["by_op"]) == {"gelu"}


def test_a_recorder_keeps_nothing_alive():
    with Recorder() as rec:
        a = torch.randn(256, 256)
        h = F.gelu(a)
        gone = weakref.ref(h.untyped_storage())
        del h
    gc.collect()
    assert gone() is None and len(rec) == 0
    assert a is not None


def test_a_block_left_from_another_thread_forgets_its_asleep_recorder():
    """A block left inside backward on autograd's device thread (CUDA's): the entering thread's
    recorder, asleep since backward began, is forgotten there, so that thread's next forward
    wakes nothing (it stayed on its mode stack for good, and ran every later op through it)."""
    lms = make_lms("sim")
    engine = lms._engine
    recorder = engine.rebuilds.recorder().__enter__()
    engine.rebuilds.sleep()                         # as backward begins
    assert _get_current_dispatch_mode() is None
    entering = threading.get_ident()
    other = threading.Thread(target=engine.exit, args=(recorder, None, entering))
    other.start()
    other.join()
    engine.rebuilds.follow_noting()                 # the entering thread's next forward
    assert _get_current_dispatch_mode() is None
    lms.close()


# -- the engine rebuilds ---------------------------------------------------------------------

def _train(model, x, lms=None, autocast=False, create_graph=False, backward=None):
    """One step: (loss, gradients). ``backward(out)`` replaces the usual loss and backward."""
    model.zero_grad(set_to_none=True)
    with lms if lms is not None else contextlib.nullcontext():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
    if backward is not None:
        loss = backward(out)
    else:
        loss = out.float().square().mean()
        if create_graph:
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            sum(g.square().sum() for g in grads).backward()
        else:
            loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _setup(build, shape, kind="sim", **train):
    """A seeded model, its input, its (loss, gradients) without LMS, and an LMS with recompute."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = build().to(dev)
    x = torch.randn(*shape, device=dev)
    return model, x, _train(model, x, **train), make_lms(kind, recompute=True)


def _gelu_mlp(d=64):
    return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, d))


def _steps(lms):
    stats = lms.stats()
    return stats["history"] + [stats["last_step"]]


def _check_rebuilt(kind, build, shape, steps=3, **train):
    """Train ``build()`` with recompute on at lms_frac 0: every step's gradients equal the run
    without LMS, step 1 checks rebuilds bit for bit (in forward, or beside the copies in
    backward), and the last step rebuilds instead of moving. Returns the LMS."""
    model, x, ref, lms = _setup(build, shape, kind, **train)
    for _ in range(steps):
        assert_same(ref, _train(model, x, lms=lms, **train))
    lms.close()
    first, last = _steps(lms)[0], _steps(lms)[-1]
    assert first["rebuild_checks"] > 0, first
    assert last["recipe_bytes"] > 0 and last["rebuilt_bytes"] >= last["recipe_bytes"], last
    # What is rebuilt is what is no longer moved: lms_frac 0 offloads every eligible storage
    # (but those alive anyway, such as the input batch, which step 1 finds out).
    moved = last["out_bytes"] + last["recipe_bytes"] + last["live_bytes"]
    assert moved == first["out_bytes"] + first["recipe_bytes"], (first, last)
    return lms


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("check", ["forward", "backward"])
def test_a_transformer_trains_exactly_with_rebuilt_tensors(kind, autocast, check, monkeypatch):
    """Step 1 checks each recipe in forward, while the tensor and its inputs are still on the
    GPU, and rebuilds from there on; where there is no room for that (here: made so), it
    copies the tensor out and checks the rebuild beside the copy in backward."""
    if check == "backward":
        monkeypatch.setattr(SwapEngine, "_check_now", lambda *args: None)
    lms = _check_rebuilt(kind, lambda: torch.nn.Sequential(*[Block(64, 4) for _ in range(4)]),
                         (4, 32, 64), autocast=autocast)
    first, last = _steps(lms)[0], _steps(lms)[-1]
    if check == "forward":
        assert first["recipe_bytes"] == last["recipe_bytes"], (first, last)
    else:
        assert first["recipe_bytes"] == 0, first
    if kind == "sim":
        # Inputs of rebuilds are brought back once, as they would be for their own use.
        assert last["in_bytes"] == last["out_bytes"], last
    assert "rebuilt, not moved" in lms.summary()


def test_the_first_forward_holds_recipe_inputs_only_until_their_outputs_are_saved():
    """A GELU's input is copied out and let go before the GELU's output is saved: the first
    forward holds it for the check made then, and lets it go once that output is saved; nothing
    is held once forward ends, and later forwards hold nothing."""
    model, x, ref, lms = _setup(_gelu_mlp, (64, 64))
    engine = lms._engine
    held = []
    check_now = engine.rebuilds.check_now

    def watching(recipe, original, resolve):
        held.append(recipe.retained)
        return check_now(recipe, original, resolve)
    engine.rebuilds.check_now = watching
    for step in range(2):
        with lms:
            out = model(x)
            assert all(r.retained is None for _, r in engine.rebuilds.recipes.values()
                       if r.func is torch.ops.aten.gelu.default)
        assert all(r.retained is None for _, r in engine.rebuilds.recipes.values())
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    assert len(held) == 1 and held[0] is not None and len(held[0]) == 1
    first, second = _steps(lms)
    assert first["rebuild_checks"] == 1 and first["recipe_bytes"] == second["recipe_bytes"] > 0
    lms.close()


def _conv_net():
    """BatchNorm with an in-place ReLU (nothing rebuildable there), then SiLU and GELU, whose
    outputs are the next convolution's saved input."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.SiLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.GELU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 2, 1))


@pytest.mark.parametrize("kind", DEVICES)
def test_a_conv_net_with_batchnorm_and_in_place_relu_trains_exactly(kind):
    _check_rebuilt(kind, _conv_net, (4, 3, 32, 32))


@pytest.mark.parametrize("kind", DEVICES)
def test_batchnorm_and_its_in_place_relu_are_rebuilt_and_statistics_updated_once(kind):
    """BatchNorm's output, made again from its saved input, then ReLU'd in place again: rebuilt
    with its running statistics updated once a step, as without LMS."""
    dev = torch_device(kind)

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(inplace=True), torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True), torch.nn.Conv2d(8, 2, 1)).to(dev)
    plain, swapped = net(), net()
    x = torch.randn(4, 3, 32, 32, device=dev)
    lms = make_lms(kind, recompute=True)
    for _ in range(3):
        assert_same(_train(plain, x), _train(swapped, x, lms=lms))
    for a, b in zip(plain.buffers(), swapped.buffers()):
        assert torch.equal(a, b)
    last = _steps(lms)[-1]
    # Both ReLU outputs (each the next convolution's saved input) are rebuilt.
    assert last["recipe_bytes"] == 2 * 4 * 8 * 32 * 32 * 4, last


class _TiedLM(torch.nn.Module):
    """Embedding and head share one weight; under autocast its bf16 copy is rebuilt from it."""

    def __init__(self, vocab=96, d=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.block = Block(d, 4)

    def forward(self, idx):
        return torch.nn.functional.linear(self.block(self.emb(idx)), self.emb.weight)


@pytest.mark.parametrize("kind", DEVICES)
def test_tied_weights_train_exactly(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = _TiedLM().to(dev)
    idx = torch.randint(0, 96, (4, 32), device=dev)

    def loss(out):
        value = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), idx.flatten())
        value.backward()
        return value

    ref = _train(model, idx, autocast=True, backward=loss)
    lms = make_lms(kind, recompute=True)
    for _ in range(3):
        assert_same(ref, _train(model, idx, lms=lms, autocast=True, backward=loss))
    assert _steps(lms)[-1]["recipe_bytes"] > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_double_backward_trains_exactly(kind):
    def gelu_mlp():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), _gelu_mlp())

    model, x, ref, lms = _setup(gelu_mlp, (32, 64), kind, create_graph=True)
    for _ in range(3):
        assert_same(ref, _train(model, x, lms=lms, create_graph=True))
    assert _steps(lms)[-1]["rebuilt_bytes"] > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_backward_twice_over_a_retained_graph_rebuilds_again(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64, 4) for _ in range(2)]).to(dev)
    x = torch.randn(4, 32, 64, device=dev)
    ref = train_step(model, x, retain=True)
    lms = make_lms(kind, recompute=True)
    for _ in range(3):
        assert_same(ref, train_step(model, x, lms=lms, retain=True))
    last = _steps(lms)[-1]
    assert last["rebuilt_bytes"] == 2 * last["recipe_bytes"] > 0, last


class _Checkpointed(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, 4) for _ in range(3))

    def forward(self, x):
        x = self.blocks[0](x)
        x = torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=False)
        return self.blocks[2](x)


@pytest.mark.parametrize("kind", DEVICES)
def test_a_checkpointed_block_inside_trains_exactly(kind):
    _check_rebuilt(kind, _Checkpointed, (4, 32, 64))


class _GeluPair(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.fc1(x)
        self.h = h
        return self.fc2(torch.nn.functional.gelu(h))


@pytest.mark.parametrize("kind", DEVICES)
def test_an_input_modified_in_place_before_backward_raises_as_autograd_does(kind):
    dev = torch_device(kind)
    model = _GeluPair().to(dev)
    x = torch.randn(32, 64, device=dev)

    def modify_then_backward(out):
        with torch.no_grad():
            model.h.add_(1)           # GELU saved h: its output can no longer be made again
        out.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _train(model, x, backward=modify_then_backward)
    lms = make_lms(kind, recompute=True)
    _train(model, x, lms=lms)           # step 1 checks GELU's rebuild; step 2 rebuilds it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _train(model, x, lms=lms, backward=modify_then_backward)
    assert lms.stats()["last_step"]["recipe_bytes"] > 0


class _LateInput(torch.nn.Module):
    """The input of a cast is saved only by a multiply that backward runs, and frees, before
    the cast's output is needed (two backward calls): the recipe alone keeps it."""

    def __init__(self, d=64):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.scale = torch.nn.Parameter(torch.randn(d))
        self.w = torch.nn.Parameter(torch.randn(d, d, dtype=torch.float64))

    def forward(self, x):
        h = self.lin(x)
        m = h * self.scale                      # saves h
        z = h.to(torch.float64) @ self.w        # saves the cast of h
        return m, z


@pytest.mark.parametrize("kind", DEVICES)
def test_a_recipe_keeps_its_input_after_every_other_user_is_gone(kind):
    def in_two(out):
        m, z = out
        model.scale.grad, = torch.autograd.grad(m.sum(), [model.scale])   # frees its saved h
        gc.collect()
        z.sum().backward()              # needs the cast of h: rebuilt from the pinned h
        return z.detach().sum()

    dev = torch_device(kind)
    torch.manual_seed(0)
    model = _LateInput().to(dev)
    x = torch.randn(32, 64, device=dev)
    ref = _train(model, x, backward=in_two)
    lms = make_lms(kind, recompute=True)
    for _ in range(3):
        assert_same(ref, _train(model, x, lms=lms, backward=in_two))
    assert lms.stats()["last_step"]["rebuilt_bytes"] > 0
    engine = lms._engine
    with lms:
        pass
    left = engine.outstanding(reap=False)
    assert engine.host.used_bytes == 0 and left["released"] == left["storages"]


def _three_exact_steps_of_a_gelu_pair(steps=3):
    """Three steps of a GELU pair on the simulated device with recompute on, each with the
    gradients of the run without LMS; returns the LMS."""
    lms = make_lms("sim", recompute=True)
    torch.manual_seed(0)
    model = _GeluPair()
    x = torch.randn(32, 64)
    ref = _train(model, x)
    for _ in range(steps):
        assert_same(ref, _train(model, x, lms=lms))
    return lms


def test_a_rebuild_that_differs_is_caught_and_never_used(monkeypatch):
    original = Recipe.run

    def off_by_one(self, args):
        return original(self, args).add(1)

    monkeypatch.setattr(Recipe, "run", off_by_one)
    with lmsrt_warnings() as said:
        lms = _three_exact_steps_of_a_gelu_pair()
    steps = _steps(lms)
    assert steps[0]["rebuild_checks"] > 0
    assert all(s["recipe_bytes"] == 0 and s["rebuilt_bytes"] == 0 for s in steps), steps
    assert any("did not give back the original bit for bit" in m for m in said), said
    assert lms.stats()["rebuild_refused"] == {"gelu": "did not rebuild bit for bit"}
    assert "not rebuilt: gelu (did not rebuild bit for bit)" in lms.summary()


def _timed_at(monkeypatch, timings_ms):
    """Every rebuild timed at the next of ``timings_ms`` (the last one repeats)."""
    left = list(timings_ms)
    monkeypatch.setattr(type(SimulatedDevice().new_event(timing=True)), "elapsed_time",
                        lambda self, other: left.pop(0) if len(left) > 1 else left[0])


def test_a_rebuild_slower_than_its_copies_is_refused_and_said(monkeypatch):
    _timed_at(monkeypatch, [5.0])                       # ms: every rebuild
    lms = _three_exact_steps_of_a_gelu_pair(steps=6)
    steps = _steps(lms)
    assert steps[-1]["recipe_bytes"] == 0 and steps[-2]["recipe_bytes"] == 0, steps
    why = lms.stats()["rebuild_refused"]["gelu"]
    assert why.startswith("rebuilt in 5.000 ms at best of 3, slower than its copies (0.0"), why
    assert "not rebuilt: gelu (rebuilt in 5.000 ms" in lms.summary()


def test_one_slow_timing_of_a_rebuild_does_not_refuse_it(monkeypatch):
    """A rebuild's events time whatever ran beside it (backward's kernels, the first step's
    copies): one slow reading among fast ones is not the rebuild's cost (on an H200 a 128 MiB
    gelu once read 18.9 ms, and its refusal made an LM 30% slower for the rest of the run)."""
    _timed_at(monkeypatch, [5.0, 0.001])
    lms = _three_exact_steps_of_a_gelu_pair(steps=6)
    assert "gelu" not in lms.stats()["rebuild_refused"], lms.stats()["rebuild_refused"]
    assert _steps(lms)[-1]["recipe_bytes"] > 0, _steps(lms)


def test_recompute_off_rebuilds_nothing_and_records_nothing():
    lms = make_lms("sim", recompute=False)
    assert lms._engine.rebuilds is None
    model = _GeluPair()
    x = torch.randn(32, 64)
    for _ in range(2):
        _train(model, x, lms=lms)
    assert all(s["recipe_bytes"] == 0 and s["rebuild_checks"] == 0 for s in _steps(lms))
    assert "rebuilt, not moved" not in lms.summary()


def test_a_target_in_bytes_takes_rebuildable_storages_first():
    plan = OffloadPlan()
    for n in (10, 10, 10, 10):
        plan.offload(len(plan.current), n)
    plan.finish_step(rebuildable={2, 3})
    plan.set_target(15)
    assert plan.chosen == [False, False, True, True]
    plan.set_target(25)
    assert plan.chosen == [True, False, True, True]
    for n in (10, 10, 10, 10):
        plan.offload(len(plan.current), n)
    plan.finish_step()                      # nothing rebuildable: the earliest, as before
    plan.set_target(15)
    assert plan.cutoff == 2 and not plan.chosen


def test_a_rebuild_counts_its_inputs_read_early_and_is_moved_where_they_would_not_fit():
    """A rebuild runs at the storage's first unpack and reads its inputs there, before their
    own first unpack (a convolution's output is read in backward before its input): storage 1,
    rebuilt from storage 0 at backward point 0, holds storage 0 from there to point 2, where
    moving brought it back. Where those bytes fit, the prediction counts them; where they do
    not, storage 1 is moved instead (measured on an H200: the first step that rebuilt a 256 MiB
    convolution output of a conv net at 85% of its peak ran out of memory)."""
    from lmsrt.policy.planner import choose_offloads
    from lmsrt.policy.profile import Profile
    prof = Profile()
    for own, peak in ((0, 0), (0, 100)):
        prof.record(False, used=own, peak=peak, lmsrt_before=0, lmsrt_now=0, nbytes=100)
    for peak in (70, 50, 50, 50):
        prof.record(True, used=0, peak=peak, lmsrt_before=0, lmsrt_now=0)
    prof.used_at(1, 0)
    prof.used_at(0, 2)
    # Storage 0 fits nowhere (200 at forward's point 1), storage 1 not at point 0 (170): both
    # offloaded; the rebuild holds storage 0 over points 1 and 2 (peaks 3 and 4).
    offload, peaks, _, swapped = choose_offloads(prof, set(), {1: (0,)}, 160)
    assert offload == [True, True] and not swapped
    assert peaks[2:] == [70, 150, 150, 50]
    offload, peaks, _, swapped = choose_offloads(prof, set(), {1: (0,)}, 140)
    assert offload == [True, True] and swapped == {1}
    assert peaks[2:] == [70, 50, 50, 50]
    # A recipe that reads nothing saved, or an input alive anyway, holds nothing more.
    for rebuildable, live in (({1: ()}, set()), ({1}, set()), ({1: (0,)}, {0})):
        offload, peaks, _, swapped = choose_offloads(prof, live, rebuildable, 140)
        assert offload[1] and not swapped and peaks[2:] == [70, 50, 50, 50]
    # The plan moves what it swaps: the host holds it.
    plan = OffloadPlan()
    for n in (100, 100):
        plan.offload(len(plan.current), n)
    plan.finish_step(rebuildable={1: (0,)})
    plan.set_offloaded([True, True], swapped={1})
    assert plan.copied == 200 and plan.rebuildable == {1: (0,)}
    plan.set_offloaded([True, True])
    assert plan.copied == 100


def test_the_plan_counts_for_the_host_only_what_it_copies():
    plan = OffloadPlan()
    for n in (10, 20, 30, 40):
        plan.offload(len(plan.current), n)
    plan.finish_step(rebuildable={1, 3})
    plan.set_target(70)                     # rebuildable first: 20 + 40, then 10
    assert plan.target == 70 and plan.copied == 10
    plan.set_cutoff(3)
    assert plan.target == 60 and plan.copied == 40


def test_a_planned_step_pins_ahead_only_what_it_will_copy():
    """Rebuilt storages take no host memory: a step's reserve asks for the bytes that will
    cross the link (measured on an H200: 5.2 GiB rebuilt a step were pinned for nothing)."""
    model, x, ref, lms = _setup(lambda: torch.nn.Sequential(*[Block(64, 4) for _ in range(4)]),
                                (4, 32, 64))
    host, asked = lms._engine.host, []
    reserve = host.reserve
    host.reserve = lambda nbytes: (asked.append(nbytes), reserve(nbytes))
    for _ in range(3):
        assert_same(ref, _train(model, x, lms=lms))
    last = _steps(lms)[-1]
    lms.close()
    assert last["recipe_bytes"] > 0 and last["out_bytes"] > 0, last
    # (The plan also counts storages that outlive a step, such as the input batch: kept.)
    assert asked[-1] == last["out_bytes"] + last["live_bytes"], (asked, last)


@pytest.mark.parametrize("lms_frac", [0.5, "auto"])
def test_where_part_must_move_rebuilt_bytes_come_off_what_moves(lms_frac):
    """Under a cap that a fraction of the saved tensors must leave, recompute offloads the
    rebuildable ones first: fewer bytes cross the link, the same gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64, 4) for _ in range(8)])
    x = torch.randn(8, 64, 64)
    ref = _train(model, x)
    moved = {}
    for recompute in (False, True):
        device = SimulatedDevice(capacity=20 << 20, strict=True)    # uncapped peak: 20 MiB
        lms = lmsrt.LMS(device=device, lms=1, lms_frac=lms_frac, recompute=recompute)
        for _ in range(4):
            assert_same(ref, _train(model, x, lms=lms))
        last = _steps(lms)[-1]
        assert last["mode"] == "plan" and last["kept_bytes"] > 0, last
        moved[recompute] = last["out_bytes"], last["recipe_bytes"]
    (off, _), (on, rebuilt) = moved[False], moved[True]
    assert rebuilt > 0 and on < off, moved


class _HeldLogits(torch.nn.Module):
    """Tanh layers, then a GELU "logits" (rebuildable from its input, which GELU saves) that
    the caller holds past forward's end and lets go as backward starts, as a training loop
    lets go of the step's output once its loss is taken (Lightning's closure)."""

    def __init__(self, d=256, vocab=2048, layers=8):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.gelu(self.head(x))


def _held_logits_step(model, x, lms=None):
    for p in model.parameters():
        p.grad = None
    with lms if lms is not None else contextlib.nullcontext():
        held = [model(x)]
        loss = held[0].square().mean()
    loss.register_hook(lambda grad: held.clear())
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _swaps_at_once(monkeypatch) -> None:
    """A forward whose use passes half the limit, as at a real cap, swaps at once rather than
    deferring (NOTE [ Deferred copies ]): made so for these small models."""
    import lmsrt.policy.auto as auto
    monkeypatch.setattr(auto.AutoPolicy, "may_defer", lambda self, use: False)
    monkeypatch.setattr(auto.AutoPolicy, "may_keep_deferred", lambda self, use: False)


def _held_logits_steps(model, x, device, recompute: bool, steps: int) -> list:
    """``steps`` steps under auto, each exactly as without LMS; their figures. The learning step
    rebuilds (with ``recompute``) or copies its storages."""
    ref = _held_logits_step(model, x)
    lms = lmsrt.LMS(device=device, lms=1, lms_frac="auto", recompute=recompute)
    for _ in range(steps):
        assert_same(ref, _held_logits_step(model, x, lms=lms))
    lms.close()
    figures = _steps(lms)
    assert (figures[0]["recipe_bytes"] > 0) == recompute, figures[0]
    return figures


def test_a_storage_rebuilt_in_the_learning_step_while_the_model_holds_it_is_counted_once(
        monkeypatch):
    """The learning step rebuilds the logits (32 MiB) by recipe while the caller still holds
    them: no source of lmsrt's holds them, so the reading at backward's start counts them as
    the model's own, and the plan that keeps them must not add them again (it did: the
    prediction was 32 MiB over the same step's with recompute off, where the logits are
    swapped; on an H200, Lightning's 1.95 GiB logits put every planned step's prediction
    1.95 GiB over)."""
    _swaps_at_once(monkeypatch)
    torch.manual_seed(0)
    model = _HeldLogits()
    x = torch.randn(4096, 256)
    predicted = {}
    for recompute in (False, True):
        device = SimulatedDevice(capacity=220 << 20, strict=True)   # the check in forward fits
        steps = _held_logits_steps(model, x, device, recompute, 4)
        assert steps[-1]["mode"] == "plan", steps[-1]
        predicted[recompute] = steps[-1]["predicted_peak_bytes"]
        assert 0 <= predicted[recompute] - steps[-1]["gpu_peak_bytes"] < 32 << 20, steps[-1]
    assert predicted[True] <= predicted[False], predicted


class _FreedAtOnce(_HeldLogits):
    """A GELU output (rebuildable, 32 MiB) that only the op after it reads, freed as that op
    returns; then a 256 MiB workspace, freed, before the next save."""

    def forward(self, x):
        for layer in self.layers[:4]:
            x = torch.tanh(layer(x))
        q = F.gelu(self.head(x)).square()
        self.workspace(256 << 20)
        return torch.tanh(q)


@pytest.mark.parametrize("recompute", [False, True], ids=["swap", "recompute"])
def test_a_storage_freed_before_its_intervals_peak_counts_there_when_kept(monkeypatch, recompute):
    """A storage the model lets go within the interval in which lmsrt let go of it (a swapped
    source dropped, a rebuilt storage) may be gone when that interval peaks: there, keeping it
    adds its bytes. Left out, the plan kept the GELU output and its first planned step ran out
    of memory in the workspace (at 330 MiB: 84 MiB allocated, 256 asked); counted, steps peak
    at 304 MiB against 308 predicted."""
    _swaps_at_once(monkeypatch)
    torch.manual_seed(0)
    model = _FreedAtOnce(layers=4)
    x = torch.randn(4096, 256)
    device = SimulatedDevice(capacity=330 << 20, strict=True)
    model.workspace = device.empty      # (the reference's too: counted only under LMS)
    steps = _held_logits_steps(model, x, device, recompute, 5)
    for s in steps[1:]:
        assert s["mode"] == "plan" and s["predicted_peak_bytes"] >= s["gpu_peak_bytes"], s


def test_a_rebuilds_inputs_read_early_must_fit_together():
    """Storage 2, rebuilt at backward point 0 from storages 0 and 1 (unpacked at points 3 and
    2), holds both from there: 50 + 50 over the 50 there, which fits under 160 and not under
    140, though either input alone would."""
    from lmsrt.policy.planner import choose_offloads
    from lmsrt.policy.profile import Profile
    prof = Profile()
    for size, peak in ((50, 0), (50, 200), (100, 200)):
        prof.record(False, used=0, peak=peak, lmsrt_before=0, lmsrt_now=0, nbytes=size)
    for peak in (100, 50, 50, 50):
        prof.record(True, used=0, peak=peak, lmsrt_before=0, lmsrt_now=0)
    for i, j in ((2, 0), (1, 2), (0, 3)):
        prof.used_at(i, j)
    offload, peaks, _, swapped = choose_offloads(prof, set(), {2: (0, 1)}, 160)
    assert offload == [True, True, True] and not swapped
    assert peaks[3:] == [100, 150, 150, 100]
    offload, peaks, _, swapped = choose_offloads(prof, set(), {2: (0, 1)}, 140)
    assert offload == [True, True, True] and swapped == {2}
    assert peaks[3:] == [100, 50, 50, 50]


def test_a_rebuildable_storage_the_plan_moves_is_copied_not_rebuilt(monkeypatch):
    """Where a rebuild's inputs would not fit before their own use, the planner moves the
    storage instead (``choose_offloads``' swapped): the planned steps then copy every
    rebuildable storage they offload, rebuild none, and stay exact; the recipes are still noted,
    so the plan's rebuildable set, and with it the plan, stays as it was."""
    import lmsrt.policy.auto as auto
    choose = auto.choose_offloads

    def moving(prof, live, rebuildable, budget):
        offload, peaks, between, _ = choose(prof, live, rebuildable, budget)
        return offload, peaks, between, {k for k in rebuildable if offload[k]}

    monkeypatch.setattr(auto, "choose_offloads", moving)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64, 4) for _ in range(8)])
    x = torch.randn(8, 64, 64)
    ref = _train(model, x)
    device = SimulatedDevice(capacity=20 << 20, strict=True)    # uncapped peak: 20 MiB
    lms = lmsrt.LMS(device=device, lms=1, lms_frac="auto", recompute=True)
    for _ in range(5):
        assert_same(ref, _train(model, x, lms=lms))
    plan = lms._engine.plan
    steps = [s for s in _steps(lms) if s["mode"] == "plan"]
    assert len(steps) >= 2 and plan.rebuildable and plan.swapped, steps
    assert plan.swapped <= set(plan.rebuildable)
    for s in steps:
        assert s["recipe_bytes"] == 0 and s["out_bytes"] > 0, s
    assert plan.copied == plan.target


def test_a_plan_that_offloads_nothing_notes_no_recipes_until_it_offloads_again():
    """A model that fits: from the first planned step that keeps everything, forward runs
    without the recorder (its per-op cost made an LM that fits 1.7x slower). When the batch
    grows past the cap (more storages than the profile knew: this raised IndexError in the
    plan), that step copies what it must move, exactly; the new sequence is learnt again once
    it repeats, and later steps note recipes and rebuild again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64, 4) for _ in range(8)])
    small, big = torch.randn(2, 64, 64), torch.randn(8, 64, 64)
    ref_small, ref_big = _train(model, small), _train(model, big)
    device = SimulatedDevice(capacity=20 << 20, strict=True)    # big's uncapped peak: 20 MiB
    lms = lmsrt.LMS(device=device, lms=1, lms_frac="auto")
    recording = []
    enter = type(lms).__enter__

    def entered(self):
        out = enter(self)
        recording.append(isinstance(_get_current_dispatch_mode(), Recorder))
        return out

    type(lms).__enter__ = entered
    try:
        for _ in range(4):
            assert_same(ref_small, _train(model, small, lms=lms))
        assert recording[0] and not any(recording[2:]), recording
        assert all(s["out_bytes"] == 0 for s in _steps(lms)[1:]), _steps(lms)
        for _ in range(6):
            assert_same(ref_big, _train(model, big, lms=lms))
    finally:
        type(lms).__enter__ = enter
    bigger = _steps(lms)[4:]
    assert bigger[0]["recipe_bytes"] == 0 and bigger[0]["out_bytes"] > 0, bigger[0]
    # The larger batch is learnt at once (its profile, not the small one's, plans).
    assert "first saved storage is larger" in bigger[0]["policy_note"], bigger[0]
    assert recording[-1] and bigger[-1]["recipe_bytes"] > 0, (recording, bigger[-1])
    lms.close()


def test_under_one_block_around_the_loop_the_recorder_sleeps_while_nothing_is_noted():
    """As ``lmsrt run`` enters LMS once around the whole script: in backward, and in planned
    steps that keep everything, the recorder is off the thread's mode stack (on it, every
    kernel of forward, backward and the optimizer ran through Python: a Trainer step 1.4-1.8x
    slower), and back on it, noting recipes, once a larger batch must move; the block's exit
    leaves the stack as it found it. Gradients equal the run without LMS throughout."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64, 4) for _ in range(8)])
    small, big = torch.randn(2, 64, 64), torch.randn(8, 64, 64)
    ref_small, ref_big = _train(model, small), _train(model, big)
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=20 << 20, strict=True), lms=1,
                    lms_frac="auto")
    on_stack, in_backward = [], []

    def step(x):
        model.zero_grad(set_to_none=True)
        out = model(x)
        on_stack.append(isinstance(_get_current_dispatch_mode(), Recorder))
        out.register_hook(lambda g: in_backward.append(_get_current_dispatch_mode()))
        out.float().square().mean().backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    with lms:
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(ref_small[1], step(small)))
        for _ in range(6):
            assert all(torch.equal(a, b) for a, b in zip(ref_big[1], step(big)))
    assert on_stack[0] and not any(on_stack[2:4]), on_stack
    assert on_stack[-1] and _steps(lms)[-1]["recipe_bytes"] > 0, (on_stack, _steps(lms)[-1])
    # Backward (and what follows it until the next forward) runs without it.
    assert in_backward == [None] * 10, in_backward
    assert _get_current_dispatch_mode() is None
    lms.close()


def test_rebuilding_stops_for_the_run_where_the_recorder_costs_more_than_it_saves():
    """Each op of forward passes through the recorder while it notes recipes: where that costs
    more than the copies its rebuilds save (made so here by the cost an op is taken to have),
    the next steps note nothing, rebuild nothing and move those storages instead, exactly; it
    is said once."""
    def run(dispatch_s: float) -> list:
        model, x, ref, lms = _setup(
            lambda: torch.nn.Sequential(*[Block(64, 4) for _ in range(4)]), (4, 32, 64))
        lms._engine.rebuilds.dispatch_s = dispatch_s
        for _ in range(5):
            assert_same(ref, _train(model, x, lms=lms))
        steps = _steps(lms)
        lms.close()
        return steps

    kept_on = run(0.0)[-1]                  # the recorder costs nothing: it notes throughout
    assert kept_on["recipe_bytes"] > 0, kept_on
    # Judged after the step without a plan already (its rebuilt bytes' copies at most: NOTE in
    # judge_recorder): from step 2 on nothing is noted or rebuilt, and those bytes move.
    with says("could add at most"):
        steps = run(1.0)
    assert steps[0]["rebuilt_bytes"] > 0, steps[0]
    assert all(s["recipe_bytes"] == s["rebuilt_bytes"] == 0 for s in steps[1:]), steps[1:]
    assert steps[-1]["out_bytes"] >= kept_on["out_bytes"] + kept_on["recipe_bytes"] // 2


def test_the_recorder_is_judged_by_the_copies_the_link_could_not_hide(monkeypatch):
    """The recorder's Python is weighed against the step time that copying its rebuilt bytes
    instead would add, not against the copies' whole time: under a forward long enough to hide
    them it goes (resnet152 at 12 GiB on an H200: 1.2 GiB rebuilt, ~20 ms of recorder a step,
    0.25 s a step against 0.19 without it); where the passes are short, or the link is full
    already, it stays."""
    from lmsrt.recompute import plan as spans
    from lmsrt.recompute.rebuilds import Rebuilds, exposed
    from lmsrt.stats import StepStats

    gib = 1 << 30
    assert exposed(0, gib, 50e9, 0.08) == 0.0                       # 21 ms under 80 ms
    assert exposed(0, gib, 50e9, 0.01) == pytest.approx(gib / 50e9 - 0.01)
    assert exposed(4 * gib, gib, 50e9, 0.08) == pytest.approx(gib / 50e9)   # link full already
    monkeypatch.setattr(spans, "link_bandwidth", lambda device: 50e9)
    monkeypatch.setattr(lmsrt.say, "_said", set())              # said once: again here
    step = StepStats(rebuilt_bytes=gib, rebuilt_tensors=10)

    def judged(forward_s, step_s, ops=400, out=0):
        rebuilds = Rebuilds(SimulatedDevice(capacity=gib), lambda t: None)
        rebuilds.dispatch_s = 50e-6                                 # a GPU host's cost an op
        rebuilds.dispatched[0] = ops
        step.out_bytes = step.in_bytes = out
        return rebuilds.judge_recorder(step, forward_s, step_s)

    with says("rebuilding saved tensors costs more"):
        assert not judged(0.08, 0.2)             # 20 ms of Python, the copies hidden: off
    assert judged(0.005, 0.01)                   # short passes: the copies would show
    assert judged(0.08, 0.2, out=4 * gib)        # the link is busy already
    assert judged(0.08, 0.2, ops=100)            # 5 ms of Python is not material


def test_a_learning_step_judges_the_recorder_by_the_most_its_copies_could_add(monkeypatch):
    """A step that learnt is judged only against every copy of its rebuilt bytes shown, at half
    the nominal link, with no probe of the link: off at once where even that is less than the
    recorder's Python (the Trainer with its own checkpointing: ~107 ms for 0.06 GiB), never on
    its times (first calls' costs are in them)."""
    from lmsrt.recompute import plan as spans
    from lmsrt.recompute.rebuilds import Rebuilds
    from lmsrt.stats import StepStats

    def no_probe(device):
        raise AssertionError("a learning step probes no link")

    monkeypatch.setattr(spans, "link_bandwidth", no_probe)
    monkeypatch.setattr(lmsrt.say, "_said", set())
    mib = 1 << 20

    def judged(rebuilt, ops):
        rebuilds = Rebuilds(SimulatedDevice(capacity=1 << 30), lambda t: None)
        rebuilds.dispatch_s = 50e-6
        rebuilds.dispatched[0] = ops
        step = StepStats(rebuilt_bytes=rebuilt, rebuilt_tensors=8)
        return rebuilds.judge_recorder(step, 10.0, 20.0, planned=False)

    with says("could add at most"):
        assert not judged(64 * mib, ops=2143)      # ~107 ms against ~11 ms of copies at most
    assert judged(1024 * mib, ops=2143)            # ~172 ms of copies: left to a planned step
    assert judged(64 * mib, ops=150)               # 7.5 ms of Python is not material


def test_the_recorders_ops_are_counted_from_the_steps_first_save():
    """What the recorder costs a step is its forward's ops: those before the step's first saved
    tensor (a script's set-up under ``lmsrt run``, the optimizer's step) are not counted."""
    def counts(ops_before: int) -> list:
        model, x, ref, lms = _setup(
            lambda: torch.nn.Sequential(*[Block(64, 4) for _ in range(2)]), (4, 32, 64))
        seen = []
        rebuilds = lms._engine.rebuilds
        judge = rebuilds.judge_recorder

        def spy(step, forward_s=0.0, step_s=0.0, planned=True):
            seen.append(rebuilds.dispatched[0])
            return judge(step, forward_s, step_s, planned)

        rebuilds.judge_recorder = spy
        for _ in range(3):
            with lms:
                for _ in range(ops_before):
                    torch.ones(3).add_(1)          # before the first save: not the forward's
                loss = model(x).float().square().mean()
            loss.backward()
        lms.close()
        return seen

    plain = counts(0)
    assert len(plain) == 2 and all(plain), plain
    assert counts(50) == plain


def test_the_recorder_is_judged_by_each_planned_steps_wall_times(monkeypatch):
    """The engine hands the judge each planned step's forward and whole-step wall times, read
    as the step ran (the forward, then the rest, at least as long)."""
    from lmsrt.recompute.rebuilds import Rebuilds

    seen, judge = [], Rebuilds.judge_recorder

    def spy(self, step, forward_s=0.0, step_s=0.0, planned=True):
        if planned and step is not None and step.rebuilt_bytes:
            seen.append((forward_s, step_s))
        return judge(self, step, forward_s, step_s, planned)

    monkeypatch.setattr(Rebuilds, "judge_recorder", spy)
    model, x, ref, lms = _setup(lambda: torch.nn.Sequential(*[Block(64, 4) for _ in range(4)]),
                                (4, 32, 64))
    for _ in range(5):
        assert_same(ref, _train(model, x, lms=lms))
    assert seen and all(0 < f <= s for f, s in seen), seen
    lms.close()


# -- what the engine must not rebuild, and what must not break -------------------------------

class _ScaledInPlace(torch.nn.Module):
    """LayerNorm, then an unlisted in-place scale (LayerScale), then a cast that is saved: the
    LayerNorm's recipe no longer makes the cast's input, whose gain the optimizer moves."""

    def __init__(self, d=64):
        super().__init__()
        self.inp, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.gamma = torch.nn.Parameter(torch.ones(d))
        self.out = torch.nn.Linear(d, d, dtype=torch.float64)

    def forward(self, x):
        h = self.ln(self.inp(x))
        h.mul_(self.gamma)
        return self.out(h.double())


def test_an_input_written_in_place_after_its_recipe_is_not_rebuilt_by_it():
    def run(lms=None):
        torch.manual_seed(0)
        model = _ScaledInPlace()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(4, 32, 64)
        grads = []
        for _ in range(3):
            grads.append(_train(model, x, lms=lms))
            opt.step()
        return grads

    lms = make_lms("sim", recompute=True)
    for ref, got in zip(run(), run(lms)):
        assert_same(ref, got)


def test_a_parameter_changed_before_backward_fails_clearly_where_it_feeds_a_rebuild():
    model, x, _, lms = _setup(_gelu_mlp, (32, 64))
    _train(model, x, lms=lms, autocast=True)      # checks the bf16 weight casts: trusted

    def step_then_backward(out):
        with torch.no_grad():
            model[2].weight.add_(1)
        out.float().sum().backward()

    with pytest.raises(RuntimeError, match="a parameter .* was modified in place between forward "
                                           "and backward.*recompute=False"):
        _train(model, x, lms=lms, autocast=True, backward=step_then_backward)


def test_nested_tensors_and_subclasses_pass_the_recorder_untouched():
    from torch.testing._internal.two_tensor import TwoTensor
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    lms = make_lms("sim", recompute=True)
    with lmsrt_warnings():
        with lms:
            out = model(torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)]))
        sum(t.sum() for t in out.unbind()).backward()
        a = TwoTensor(torch.randn(4, 4), torch.randn(4, 4)).requires_grad_()
        with lms:
            z = F.gelu(a).to(torch.float64)
        z.sum().backward()
    assert len(lms._engine.rebuilds.recipes) == 0


def test_torch_compile_compiles_inside_the_recorder():
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    model, x, ref, lms = _setup(_gelu_mlp, (32, 64))
    compiled = torch.compile(model, backend=counter)
    for _ in range(2):
        assert_same(ref, _train(compiled, x, lms=lms))
    assert counter.frame_count == 1
    torch._dynamo.reset()


class _LoggedStatistic(torch.nn.Module):
    """A statistic logged with grad on saves a tensor and drops its graph at once: the input's
    entry is gone by the time the cast of that tensor is saved; its own recipe makes it."""

    def __init__(self, d=64):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.w = torch.nn.Parameter(torch.randn(d, d, dtype=torch.float64) / 8)

    def forward(self, x):
        a = F.gelu(self.lin(x))
        self.stat = a.norm().item()
        return a.to(torch.float64) @ self.w


def test_an_input_whose_entry_died_in_forward_is_made_by_its_own_recipe():
    model, x, ref, lms = _setup(_LoggedStatistic, (32, 64))
    engine = lms._engine
    for _ in range(4):
        assert_same(ref, _train(model, x, lms=lms))
        with lms:                              # a step boundary: everything given back
            pass
        left = engine.outstanding(reap=False)
        assert left["restored_bytes"] == left["storages"] == 0 and engine.host.used_bytes == 0
    assert _steps(lms)[-2]["rebuilt_bytes"] > 0


def test_leaving_the_block_inside_backward_leaves_no_recorder_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    model, x, ref, lms = _setup(_GeluPair, (32, 64))
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        lms.__enter__()
        loss = model(x).square().mean()
        loss.register_hook(lambda g: lms.__exit__(None, None, None))
        loss.backward()
    x.requires_grad_()
    (x * x.exp()).sum()                        # a save outside LMS pops what was left
    assert _get_current_dispatch_mode_stack() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert_same(ref, _train(model, x.detach(), lms=lms))


def _lines_of(fn):
    import inspect
    lines, first = inspect.getsourcelines(fn)
    body = [first + i for i, line in enumerate(lines) if line.strip()
            and not line.strip().startswith(("def ", '"""', "#")) and i > 0]
    return body


@pytest.mark.parametrize("line", _lines_of(SwapEngine._rebuild))
def test_an_interrupt_anywhere_in_a_rebuild_leaves_the_lms_usable(line):
    """A KeyboardInterrupt raised at each line of the engine's rebuild (as Ctrl-C could): the
    step fails, the next steps are exact, and a step boundary gives everything back."""
    model, x, ref, lms = _setup(lambda: torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)]), (32, 64))
    _train(model, x, lms=lms)                  # checks GELU's rebuilds: trusted from here
    code = SwapEngine._rebuild.__code__

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == line:
                sys.settrace(None)
                raise KeyboardInterrupt
            return local
        return local

    def interrupted(out):
        sys.settrace(tracer)
        try:
            out.square().mean().backward()
        finally:
            sys.settrace(None)
        return out.detach().sum()

    try:
        _train(model, x, lms=lms, backward=interrupted)
        pytest.skip("that line does not run on this device (another stream's branch)")
    except KeyboardInterrupt:
        pass
    gc.collect()
    for _ in range(2):
        assert_same(ref, _train(model, x, lms=lms))
    engine = lms._engine
    with lms:
        left = engine.outstanding(reap=False)
        assert engine.host.used_bytes == 0 and left["restored_bytes"] == 0
    lms.close()


def test_the_recorder_loads_no_compiler_until_one_is_loaded():
    """A dispatch mode's first op would import torch._dynamo (seconds, inside the first step):
    the recorder runs without it while it is not loaded, and through torch's compile-disabling
    wrapper once it is."""
    import subprocess
    script = (
        "import sys, torch, lmsrt\n"
        "from lmsrt.recompute.recipes import Recorder\n"
        "x = torch.randn(4, 4, requires_grad=True)\n"
        "with Recorder() as r:\n"
        "    y = torch.nn.functional.gelu(x)\n"
        "assert len(r) == 1 and 'torch._dynamo' not in sys.modules\n"
        "raw = Recorder.__dict__['__torch_dispatch__'].__wrapped__\n"
        "before = getattr(raw, '__dynamo_disable')\n"
        "import torch._dynamo\n"
        "with Recorder() as r:\n"
        "    y = torch.nn.functional.gelu(x)\n"
        "after = getattr(raw, '__dynamo_disable')\n"
        "assert len(r) == 1 and after is not before and after is not raw\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]
