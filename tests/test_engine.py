"""Exact gradients, swap counts, plan, prefetch and release, on the simulated device and CUDA."""
import pytest
import torch
from models import (
    DEVICES,
    ViewsModel,
    assert_same,
    convnet,
    make_lms,
    mlp,
    says,
    torch_device,
    train_step,
    transformer,
)

import lmsrt
import lmsrt.say
from lmsrt.device import SimulatedDevice


def _check_exact(kind, build, shape, steps=3, **step_kw):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = build().to(dev)
    x = torch.randn(*shape, device=dev)
    ref = train_step(model, x, **step_kw)
    lms = make_lms(kind)
    for _ in range(steps):
        assert_same(ref, train_step(model, x, lms=lms, **step_kw))
    stats = lms.stats()
    assert stats["total"]["out_tensors"] > 0, "nothing was swapped: the check proves nothing"
    # Each backward pass brings a storage back at most once (sources still on the GPU need none).
    passes = 2 if step_kw.get("retain") or step_kw.get("create_graph") else 1
    last = stats["last_step"]
    assert 0 < last["in_bytes"] <= passes * last["out_bytes"], last
    if kind == "sim" and passes == 1:
        assert last["in_bytes"] == last["out_bytes"], last
    return lms


@pytest.mark.parametrize("kind", DEVICES)
def test_mlp_exact(kind):
    _check_exact(kind, mlp, (64, 128))


@pytest.mark.parametrize("kind", DEVICES)
def test_transformer_exact(kind):
    _check_exact(kind, transformer, (4, 32, 64))


@pytest.mark.parametrize("kind", DEVICES)
def test_convnet_batchnorm_inplace_relu_exact(kind):
    _check_exact(kind, convnet, (4, 3, 32, 32))


@pytest.mark.parametrize("kind", DEVICES)
def test_views_and_shared_storage_exact(kind):
    lms = _check_exact(kind, ViewsModel, (48, 64))
    step = lms.stats()["last_step"]
    # lin's output holds a, b and their views: swapped once, however many views were saved.
    assert step["out_tensors"] < step["out_tensors"] + step["skipped_tensors"]


@pytest.mark.parametrize("kind", DEVICES)
def test_retain_graph_backward_twice_exact(kind):
    _check_exact(kind, transformer, (2, 16, 64), retain=True)


@pytest.mark.parametrize("kind", DEVICES)
def test_double_backward_exact(kind):
    _check_exact(kind, mlp, (32, 128), create_graph=True)


def test_chunk_views_are_copied_once():
    lms = make_lms("sim")
    h = None

    def fwd(x, w):
        nonlocal h
        h = x @ w                         # one storage
        q, k, v = h.chunk(3, dim=-1)
        return (q.sigmoid() * k.exp() * v.tanh()).sum()   # each of q, k, v saved

    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 96, requires_grad=True)
    ref = torch.autograd.grad(fwd(x, w), (x, w))
    with lms:
        loss = fwd(x, w)
    del h
    got = torch.autograd.grad(loss, (x, w))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    step = lms.stats()["last_step"]
    h_bytes = 64 * 96 * 4
    # h's storage went out once even though three views of it were saved.
    assert step["in_bytes"] >= h_bytes
    assert step["out_bytes"] < 2 * h_bytes + 3 * 64 * 32 * 4 * 3


def test_small_tensors_and_params_are_not_swapped_but_indices_are():
    lms = make_lms("sim", lms=64)                  # 64 KB threshold
    lin = torch.nn.Linear(256, 256)
    weight = torch.nn.Parameter(torch.randn(128, 256))
    x = torch.randn(8, 256)        # 8 KB input: under the threshold
    img = torch.randn(4, 16, 64, 64, requires_grad=True)
    with lms:
        h = lin(x.repeat(16, 1)).tanh()   # h: 128 KB, swapped
        y = (weight * h).sum()            # saves weight (a parameter) and h again (same storage)
        pooled = torch.nn.functional.max_pool2d(img * 2, 2)   # saves its input and int64 indices
    (y + pooled.sum()).backward()
    step = lms.stats()["last_step"]
    # h, the repeated input lin saved (a temporary, no grad_fn), the pooling input (1 MB) and its
    # int64 indices (512 KB, no grad_fn) go out; the weights do not.
    assert step["out_tensors"] == 4
    assert step["out_bytes"] == 2 * 128 * 256 * 4 + 4 * 16 * 64 * 64 * 4 + 4 * 16 * 32 * 32 * 8
    assert step["skipped_tensors"] == 1            # the parameter `weight`


def test_lms_zero_or_negative_disables():
    for value in (0, -1):
        lms = lmsrt.LMS(lms=value, device=SimulatedDevice())
        assert not lms.enabled
        with lms:
            y = (torch.randn(100, 100, requires_grad=True) * 2).exp()
        y.sum().backward()
        assert lms.stats()["total"]["out_bytes"] == 0


def _saved_sequence_model():
    torch.manual_seed(0)
    return mlp(d=128, layers=8)


@pytest.mark.parametrize("copy_lag", [0, 3])
def test_first_step_swaps_all_then_plan_offloads_earliest(copy_lag):
    """Step 1 swaps every eligible storage (algorithms picked in it see the most free memory);
    later steps swap a prefix, the earliest storages, and give back room until GPU use at the
    end of forward sits under the mark. With copies lagging forward (copy_lag), sources still in
    flight must not count as demand."""
    model = _saved_sequence_model()
    x = torch.randn(256, 128)
    act = 256 * 128 * 4                       # bytes of one activation
    # The mark sits at half of what the saved activations need.
    lms = make_lms("sim", capacity=8 * act, lms_frac=0.5, copy_lag=copy_lag)   # mark: 4 of 8
    order = []
    engine = lms._engine
    swap_out = engine._swap_out

    def spy(*args):
        s = swap_out(*args)
        order.append(engine.state.index - 1)            # index of the storage in this forward
        return s

    engine._swap_out = spy
    ref = train_step(model, x)
    history = []
    for _ in range(8):
        order.clear()
        assert_same(ref, train_step(model, x, lms=lms))
        history.append((lms.stats()["last_step"]["mode"], list(order)))
    mode1, first = history[0]
    assert mode1 == "reactive" and first == list(range(engine.state.index)), history
    # Storage 0 is the input batch and the last one the output train_step holds, both alive
    # through backward anyway: swapping them frees nothing, so from step 2 they stay
    # (live_tensors); the plan swaps a prefix of the rest.
    for mode, swapped in history[1:]:
        assert mode == "plan", history
        assert swapped == list(range(1, len(swapped) + 1)), f"plan must swap a prefix: {history}"
    assert lms.stats()["last_step"]["live_tensors"] >= 1      # the input (the output, if seen)
    counts = [len(swapped) for _, swapped in history]
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0], history
    steps = lms.stats()["history"]
    assert steps[-1]["forward_end_bytes"] <= engine.mark, steps[-1]
    assert max(s["gpu_peak_bytes"] for s in steps[1:]) <= engine.mark + act


def test_a_model_under_the_mark_stops_swapping_after_the_first_steps():
    model = _saved_sequence_model()
    x = torch.randn(256, 128)
    lms = make_lms("sim", capacity=64 * 256 * 128 * 4, lms_frac=0.5)   # needs 9 of 32
    for _ in range(5):
        assert_same(train_step(model, x), train_step(model, x, lms=lms))
    out = [s["out_tensors"] for s in lms.stats()["history"]] + [
        lms.stats()["last_step"]["out_tensors"]]
    assert out[0] > 0 and out[-2:] == [0, 0], out


def test_changed_sequence_falls_back_to_reactive():
    model = _saved_sequence_model()
    lms = make_lms("sim", capacity=8 * 256 * 128 * 4, lms_frac=0.5)
    for batch in (256, 256, 192, 192):
        x = torch.randn(batch, 128)
        assert_same(train_step(model, x), train_step(model, x, lms=lms))
    modes = [s["mode"] for s in lms.stats()["history"]] + [lms.stats()["last_step"]["mode"]]
    assert modes == ["reactive", "plan", "reactive", "plan"], modes


def test_prefetch_runs_in_reverse_save_order():
    model = _saved_sequence_model()
    x = torch.randn(64, 128)
    lms = make_lms("sim", prefetch_mb=1)
    engine = lms._engine
    fetched = []
    copy_in = engine.copies.copy_in

    def spy(block, slot, stream):               # each fetch copies its storage's slot in
        fetched.append(next(s.index for s in engine.prefetch.order if s.host is slot))
        return copy_in(block, slot, stream)

    engine.copies.copy_in = spy
    assert_same(train_step(model, x), train_step(model, x, lms=lms))
    step = lms.stats()["last_step"]
    # The input and the output train_step holds are alive anyway: used in place, not fetched.
    assert len(fetched) == step["out_tensors"] - step["live_tensors"] > 1
    assert step["live_tensors"] == 2
    assert fetched == sorted(fetched, reverse=True)
    assert step["prefetch_hits"] > step["prefetch_misses"]


def test_dead_graph_returns_host_and_gpu_memory():
    lms = make_lms("sim")
    engine = lms._engine
    model = _saved_sequence_model()
    x = torch.randn(64, 128)
    with lms:
        loss = model(x).sum()
    assert engine.host.used_bytes > 0
    del loss                                   # the graph dies without a backward
    with lms:
        pass
    assert engine.host.used_bytes == 0
    left = engine.outstanding(reap=False)
    assert left["released"] == left["storages"]


def test_retain_graph_keeps_host_copies_until_graph_dies():
    lms = make_lms("sim")
    engine = lms._engine
    model = _saved_sequence_model()
    x = torch.randn(64, 128)
    with lms:
        loss = model(x).sum()
    held = engine.host.used_bytes
    loss.backward(retain_graph=True)
    assert engine.host.used_bytes == held      # still needed by a second backward
    loss.backward()
    del loss
    with lms:
        pass
    assert engine.host.used_bytes == 0


def test_host_budget_refusal_keeps_tensors_on_gpu_exact():
    model = _saved_sequence_model()
    x = torch.randn(64, 128)
    lms = make_lms("sim", host_budget_gb=0)
    with says("host memory budget"):
        got = train_step(model, x, lms=lms)
    assert_same(train_step(model, x), got)
    step = lms.stats()["last_step"]
    assert step["out_bytes"] == 0 and step["kept_tensors"] > 0 and step["host_refused"] > 0


def test_summary_and_stats_shape():
    lms = make_lms("sim")
    train_step(_saved_sequence_model(), torch.randn(64, 128), lms=lms)
    s = lms.stats()
    for key in ("out_bytes", "in_bytes", "kept_bytes", "prefetch_hits", "prefetch_misses",
                "swapin_wait_ms", "gpu_peak_bytes", "host_peak_bytes"):
        assert key in s["last_step"] and key in s["total"]
    text = lms.summary()
    counters = text.split("\nper block:")[0]            # (then a line a block)
    assert "swapped out" in text and "  fetched ahead" in text and len(counters.splitlines()) < 40
    assert text.splitlines()[0].startswith("lmsrt: 1 step; GPU peak ")      # the headline first


def test_nested_with_is_refused():
    lms = make_lms("sim")
    with lms:
        with pytest.raises(RuntimeError, match="nested"):
            with lms:
                pass


def test_no_gpu_is_a_noop_with_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(lmsrt.say, "_said", set())     # said once per process: as in a new one
    with pytest.warns(RuntimeWarning, match="no CUDA device"):
        lms = lmsrt.LMS()
    assert not lms.enabled
    with lms:
        y = (torch.randn(10, requires_grad=True) * 2).exp()
    y.sum().backward()


def test_one_with_block_around_a_loop_finds_the_steps():
    """`with lms:` around the whole loop (as `lmsrt run` does): each forward after a backward is a
    new step, so the plan engages and nothing piles up."""
    model = _saved_sequence_model()
    x = torch.randn(256, 128)
    act = 256 * 128 * 4
    lms = make_lms("sim", capacity=8 * act, lms_frac=0.5)
    ref = train_step(model, x)
    with lms:
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            out = model(x)
            out.float().square().mean().backward()
            assert all(torch.equal(a, p.grad) for a, p in zip(ref[1], model.parameters()))
    history = lms.stats()["history"]
    assert [s["mode"] for s in history] == ["reactive", "plan", "plan"]
    assert lms._engine.outstanding(reap=False)["storages"] <= 8


def test_checkpoint_recompute_is_not_a_step_boundary():
    from torch.utils.checkpoint import checkpoint
    model = _saved_sequence_model()
    x = torch.randn(64, 128)
    lms = make_lms("sim")

    def run(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            out = checkpoint(model[:4], x, use_reentrant=False)
            out = model[4:](out)
        out.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    import contextlib
    ref = run(contextlib.nullcontext())
    assert all(torch.equal(a, b) for a, b in zip(ref, run(lms)))
    assert all(torch.equal(a, b) for a, b in zip(ref, run(lms)))
    assert len(lms.stats()["history"]) == 1        # two steps: one finished, one in flight


def test_one_with_block_with_changing_depth_prefetches_each_step():
    """Inside one `with lms:` (as under `lmsrt run`) the number of swapped storages changes from
    step to step: prefetch must follow each step's own storages."""
    model = _saved_sequence_model()
    x = torch.randn(64, 128)
    lms = make_lms("sim")
    with lms:
        for depth in (4, 8, 6, 3, 8):
            model.zero_grad(set_to_none=True)
            ref = model[:depth](x).square().mean()
            ref_grads = torch.autograd.grad(ref, list(model[:depth].parameters()))
            out = model[:depth](x).square().mean()
            out.backward()
            params = model[:depth].parameters()
            assert all(torch.equal(a, p.grad) for a, p in zip(ref_grads, params))
    for step in lms.stats()["history"][1:] + [lms.stats()["last_step"]]:
        assert step["prefetch_misses"] <= 1, step


def test_plan_target_does_not_ratchet_on_a_transient_it_cannot_remove():
    """A planned step in which the mark rule swaps a little beyond the plan while forward still
    ends under the mark (a transient inside forward): the target must settle, not grow by those
    bytes every step until everything is offloaded."""
    from lmsrt.plan import OffloadPlan
    from lmsrt.policy import FixedPolicy

    plan, policy = OffloadPlan(), FixedPolicy(lms_frac=0.3, limit=10000, window=1 << 30)
    sizes = [100] * 50

    def finish(**step):
        policy.finish_step(plan, followed=plan.finish_step(), peak=0, retries=0, **step)

    for step in range(12):
        for i, n in enumerate(sizes):
            plan.offload(i, n)
        if step == 0:
            finish(forward_end_use=2500, swapped=1500, beyond_plan=0)
        else:
            finish(forward_end_use=2700, swapped=plan.target + 200, beyond_plan=200)
    assert plan.target == 1500, plan.target

    # Over the mark at the end of forward, beyond-plan swaps included: grow by the excess only.
    for i, n in enumerate(sizes):
        plan.offload(i, n)
    finish(forward_end_use=2950, swapped=1700, beyond_plan=200)
    assert plan.target == 1650, plan.target


def test_decisions_about_large_storages_read_gpu_use_exactly():
    """Between exact readings the engine estimates GPU use, blind to the model's own allocations;
    for a storage of 64 MiB or more (whose copy dwarfs a reading) it always reads."""
    device = SimulatedDevice(capacity=1 << 36)
    lms = lmsrt.LMS(device=device, lms=1, lms_frac=0.9)
    engine, reads = lms._engine, []
    real = device.memory_allocated
    device.memory_allocated = lambda: reads.append(1) or real()
    engine.begin_forward()
    small = [torch.randn(256) for _ in range(32)]
    for t in small:
        engine.pack(t)
    assert 0 < len(reads) <= 32 // 8 + 1            # estimates in between
    big = [torch.empty(16 << 20) for _ in range(3)]   # 64 MiB each
    before = len(reads)
    for t in big:
        engine.pack(t)
    assert len(reads) - before >= len(big)
    engine.end_forward()
    lms.close()


class _KernelChosenWithoutAMode(torch.nn.Module):
    """Saves one more tensor when no dispatch mode is on the stack, as a library may choose
    another kernel there (NOTE [ Lean steps that leave the plan ])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)

    def forward(self, x):
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        h = torch.tanh(self.a(x))
        if _get_current_dispatch_mode() is None:
            h = h * torch.ones_like(h)          # the same values, one more tensor saved
        return torch.tanh(self.b(h))


def test_a_lean_step_that_saves_another_sequence_of_its_batch_ends_lean_steps():
    """Measured on the Trainer at 20 GiB: every second step, planned to keep everything and
    noting no recipes, saved another sequence and swapped 9.5 GiB. A lean step that leaves the
    plan ends lean steps for 8 steps, then 16: of 24 steps whose every lean one leaves it, two
    leave the plan (not 11), and every one is exact."""
    model = _KernelChosenWithoutAMode()
    x = torch.randn(256, 128)
    lms = make_lms("sim", capacity=1 << 30, lms_frac="auto")
    for _ in range(24):
        assert_same(train_step(model, x), train_step(model, x, lms=lms))
    history = lms.stats()["history"]
    left = [s["step"] for s in history if "another sequence" in s["policy_note"]]
    reactive = [s["step"] for s in history if s["mode"] != "plan"]
    assert left == [3, 12] and reactive == [1, 3, 12], (left, reactive)
    # The note says where: the fourth storage, one the plan did not have.
    note, again = history[2]["policy_note"], history[11]["policy_note"]
    assert "storage 4 saved, 128 KiB (float32 [256, 128])" in note and "none for 8 steps" in note
    assert "none for 16 steps" in again, again
    # and the sizes around it: the plan's three, the step's four (the fourth bracketed)
    assert ("planned 128 KiB / 128 KiB, saved 128 KiB / 128 KiB / [128 KiB] / 128 KiB"
            in note), note


def test_a_lean_step_of_another_batch_ends_lean_steps_for_a_while():
    """An epoch's last, shorter batch leaves the plan at its first storage, once: lean steps
    end for 8 steps only (a model that fits keeps its lean steps for the rest of its run)."""
    model = _KernelChosenWithoutAMode()
    model.forward = lambda x: torch.tanh(model.b(torch.tanh(model.a(x))))
    lms = make_lms("sim", capacity=1 << 30, lms_frac="auto")
    for batch in [256] * 6 + [64] + [256] * 6:
        x = torch.randn(batch, 128)
        assert_same(train_step(model, x), train_step(model, x, lms=lms))
    history = lms.stats()["history"]
    left = [s for s in history if "another sequence" in s["policy_note"]]
    assert [s["step"] for s in left] == [7], [s["policy_note"] for s in history]
    assert "storage 1 was 32.0 KiB" in left[0]["policy_note"]
    assert "none for 8 steps" in left[0]["policy_note"]


def test_a_planned_step_that_leaves_its_plan_says_where():
    """A planned step (not a lean one) whose model saved another sequence says so in its note,
    with the storage where it left (measured: a conv net's fourth step under cuDNN's benchmark
    mode left its plan, its note empty, and the next step ran out of memory)."""
    model = _KernelChosenWithoutAMode()
    model.forward = lambda x: torch.tanh(model.b(
        torch.tanh(model.a(x)) * (torch.ones_like(x) if extra[0] else 1)))
    extra = [False]
    x = torch.randn(256, 128)
    lms = make_lms("sim", capacity=1 << 30, lms=1, lms_frac=0.0)
    for step in range(6):
        extra[0] = step == 3
        assert_same(train_step(model, x), train_step(model, x, lms=lms))
    stats = lms.stats()
    history = stats["history"] + [stats["last_step"]]
    notes = [s["policy_note"] for s in history]
    assert [s["mode"] for s in history] == ["reactive", "plan", "plan", "reactive", "reactive",
                                           "plan"], notes
    assert notes[3].startswith("this step left its plan (storage "), notes
    assert "planned" in notes[3] and "saved" in notes[3], notes
    # The step after it left the plan made from it: it saved one storage fewer.
    assert notes[4] == "this step left its plan (4 storages saved where 5 were planned for)"
    assert not any("left its plan" in n for n in notes[:3] + notes[5:]), notes
