"""Recomputed regions (lmsrt/recompute/regions.py): repeated blocks found without model changes,
dropped in forward and run again in backward, exactly: gradients, dropout, autocast and batch norm's
running statistics equal to the run without lmsrt, bit for bit."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from models import assert_same_steps, says
from torch import nn
from torch.utils.checkpoint import checkpoint

import lmsrt
from lmsrt.device import SimulatedDevice
from lmsrt.recompute.regions import StepFigures, choose_regions
from lmsrt.summary import format_headline, moved
from lmsrt.units import format_bytes


class Block(nn.Module):
    """A pre-norm MLP block with dropout."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Stack(nn.Module):
    """Blocks in a ModuleList, called by a loop; ``ckpt`` checkpoints each as a user would."""

    def __init__(self, d: int = 32, n: int = 4, ckpt: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


def _segnet():
    """A small conv net in one Sequential of mixed classes, as the benchmark's SegNet."""
    down, up = [], []
    for i in range(2):
        down += [nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.BatchNorm2d(8),
                 nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        up += [nn.Upsample(scale_factor=2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
               nn.ReLU(inplace=True)]
    return nn.Sequential(*down, *up, nn.Conv2d(8, 2, 1))


def _lms(device: str) -> lmsrt.LMS:
    """An LMS whose plan recomputes every region: a link of 1 byte/s hides no copy, and any
    excess is worth it (by default 1/16 of the limit)."""
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device=device)
    lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    return lms


def _torch_device(device: str) -> str:
    return "cpu" if device == "sim" else device


@contextlib.contextmanager
def _deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _train(model, x, steps: int, ctx=None, autocast: bool = False, evaluate: bool = False):
    """Per step: the loss, the gradients, and every buffer after the step; with ``evaluate``, a
    forward under no_grad (inside ``ctx``) after each."""
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        with ctx or contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x).float().square().mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()
                                    if p.grad is not None],
                    [b.clone() for b in model.buffers()]))
        model.zero_grad(set_to_none=True)
        if evaluate:
            with ctx or contextlib.nullcontext(), torch.no_grad():
                model(x)
    return out


def _check_exact(device: str, make, x, autocast: bool = False, steps: int = 4):
    torch.manual_seed(0)
    model = make().to(_torch_device(device))
    plain_model = make().to(_torch_device(device))
    plain_model.load_state_dict(model.state_dict())
    lms = _lms(device)
    with _deterministic():
        plain = _train(plain_model, x, steps, autocast=autocast)
        under = _train(model, x, steps, lms, autocast=autocast)
    assert_same_steps(plain, under)
    return lms


def _check_dropout_and_autocast(device: str, autocast: bool):
    x = torch.randn(4, 16, 32, device=_torch_device(device))
    lms = _check_exact(device, lambda: Stack(32, 4), x, autocast)
    regions = lms.stats()["regions"]
    # Step 1 surveys, step 2 times every region, then the plan recomputes all four.
    assert regions["phase"] == "planned" and regions["planned"] == 4
    assert regions["recomputed"] == 4 and regions["dropped_bytes"] > 0
    assert "regions: 4 of 4 recomputed" in lms.summary()


@pytest.mark.parametrize("autocast", [False, True])
def test_dropout_and_autocast_recomputed_exactly(autocast):
    _check_dropout_and_autocast("sim", autocast)


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_dropout_and_autocast_recomputed_exactly_cuda(autocast):
    _check_dropout_and_autocast("cuda", autocast)


def _check_figures(device: str):
    """What was recomputed, per step and summed: how many region calls, the bytes they freed
    in forward, their GPU time in backward; in the summary, its one line and ``moved``."""
    x = torch.randn(4, 16, 32, device=_torch_device(device))
    lms = _check_exact(device, lambda: Stack(32, 4), x, steps=5)
    if device != "sim":
        torch.cuda.synchronize()        # the last recomputes' times are read once they are done
    stats = lms.stats()
    steps, total = stats["history"] + [stats["last_step"]], stats["total"]
    assert [s["recomputed_regions"] for s in steps] == [0, 4, 4, 4, 4]
    assert steps[0]["recomputed_bytes"] == 0 and steps[0]["recompute_ms"] == 0
    assert all(s["recomputed_bytes"] > 0 and s["recompute_ms"] > 0 for s in steps[1:]), steps
    for name in ("recomputed_regions", "recomputed_bytes"):
        assert total[name] == sum(s[name] for s in steps)
    assert total["recompute_ms"] == pytest.approx(sum(s["recompute_ms"] for s in steps))
    regions = stats["regions"]
    assert (regions["recomputed"], regions["dropped_bytes"], regions["recompute_ms"]) == (
        4, steps[-1]["recomputed_bytes"], steps[-1]["recompute_ms"])
    summary = lms.summary()
    assert "regions: 4 of 4 recomputed last step" in summary and regions["note"] in summary
    for row in ("regions recomputed", "  freed in forward", "  recompute GPU (ms)"):
        assert row in summary
    headline = format_headline(stats)
    assert f"recomputed {format_bytes(steps[-1]['recomputed_bytes'])}; " in headline
    assert "recomputed 4 of 4 blocks a step" in headline
    only_recomputed = dict(stats, total=dict(total, out_bytes=0, recipe_bytes=0))
    assert moved(only_recomputed)        # lmsrt run prints the table for such a run


def test_what_was_recomputed_is_in_the_stats_and_the_summary():
    _check_figures("sim")


@pytest.mark.cuda
def test_what_was_recomputed_is_in_the_stats_and_the_summary_cuda():
    _check_figures("cuda")


def _check_batch_norm(device: str):
    x = torch.randn(4, 3, 16, 16, device=_torch_device(device))
    lms = _check_exact(device, _segnet, x)
    regions = lms._regions
    # Stages cut where the tensor passed on is smallest: after pooling, before upsampling.
    assert [r.name for r in regions.order] == ["Sequential[0:4]", "Sequential[4:8]",
                                               "Sequential[8:12]", "Sequential[12:16]",
                                               "Sequential[16:17]"]
    stats = lms.stats()["regions"]
    assert stats["recomputed"] >= 4 and stats["recompute_ms"] > 0


def test_batch_norm_statistics_updated_once():
    _check_batch_norm("sim")


@pytest.mark.cuda
def test_batch_norm_statistics_updated_once_cuda():
    _check_batch_norm("cuda")


def test_a_rerun_updates_stand_ins_made_once_for_the_running_statistics():
    """A rerun in training mode updates stand-ins for a norm's running statistics, made once
    (not a copy of each buffer at every rerun), and made again once the buffers are others (a
    model moved or cast); the statistics stay the plain run's (_check_exact)."""
    from lmsrt.recompute import frames

    x = torch.randn(4, 3, 16, 16)
    bn = nn.BatchNorm2d(3)
    made = frames._stand_ins(bn)
    assert made is frames._stand_ins(bn) and made["running_var"] is not bn.running_var
    assert torch.equal(made["running_var"], bn.running_var)
    bn.double()
    again = frames._stand_ins(bn)
    assert again is not made and again["running_mean"].dtype == torch.float64
    torch.manual_seed(0)
    model, lms = _segnet(), _lms("sim")
    _train(model, x, 4, lms)
    norms = [m for r in lms._regions.order for m in frames.running_norms(r)]
    assert norms and all(m in frames._STAND_INS for m in norms)
    kept = {m: frames._STAND_INS[m][1]["running_mean"] for m in norms}
    _train(model, x, 2, lms)
    assert lms.stats()["regions"]["recomputed"] >= 4
    assert all(frames._STAND_INS[m][1]["running_mean"] is t for m, t in kept.items())


def test_a_users_checkpoint_is_left_alone():
    """Blocks run under the script's own checkpointing are found, never recomputed, and said to
    be so; no step times them (the Trainer with its checkpointing on at 14 GiB learnt a second
    time, 0.53 s, for a plan of 0 regions)."""
    x = torch.randn(4, 16, 32)
    with says(r"none refused; left to the script's own checkpointing: blocks\[0\.\.3\]"):
        lms = _check_exact("sim", lambda: Stack(32, 4, ckpt=True), x)
    stats = lms.stats()["regions"]
    assert stats["regions"] == 4 and stats["recomputed"] == 0 and stats["kept_calls"] == 0
    assert stats["figures"] is None and "their calls ran inside" in stats["note"], stats
    assert all("own checkpointing" in why for why in stats["unfit"].values()), stats["unfit"]
    assert len(stats["unfit"]) == 4


class _Frozen(Stack):
    """Its first two blocks run without grad (frozen, as a fine-tuning script's early layers)."""

    def forward(self, x):
        with torch.no_grad():
            for b in self.blocks[:2]:
                x = b(x)
        for b in self.blocks[2:]:
            x = b(x)
        return x


def test_blocks_run_without_grad_are_not_taken_for_a_users_checkpoint():
    """Only blocks that ran with grad under another's saved-tensor hooks are left to the
    script's checkpointing: frozen blocks (no grad) are not said to be, and the others are
    recomputed."""
    lms = _check_exact("sim", lambda: _Frozen(32, 4), torch.randn(4, 16, 32))
    stats = lms.stats()["regions"]
    assert not any("own checkpointing" in why for why in stats["unfit"].values()), stats
    assert stats["recomputed"] >= 2 and "own checkpointing" not in stats["note"], stats


class Seen(Block):
    """A Block that notes, at each call, the state a rerun must restore: a backend flag and
    autocast's."""

    def __init__(self, d: int, seen: list):
        super().__init__(d)
        self.seen = seen

    def forward(self, x):
        self.seen.append((torch._C._get_mkldnn_enabled(), torch.is_autocast_enabled("cpu"),
                          torch.get_autocast_dtype("cpu")))
        return super().forward(x)


def _changed(on: bool) -> contextlib.ExitStack:
    """mkldnn off and autocast on (bfloat16), or nothing changed."""
    stack = contextlib.ExitStack()
    if on:
        stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


@pytest.mark.parametrize("changed", ["forward", "backward", "neither"])
def test_a_rerun_runs_under_forwards_flags_and_autocast(changed):
    """Rule 6, where forward and backward differ both ways (the rerun sets forward's state and
    puts backward's back) and where they agree (it has nothing to set)."""
    seen: list = []
    model = nn.Sequential(*[Seen(32, seen) for _ in range(3)])
    lms, x = _lms("sim"), torch.randn(4, 8, 32)
    reruns = 0
    for step in range(3):
        with lms, _changed(changed == "forward"):
            loss = model(x).float().square().mean()
        calls = len(seen)
        # (Not in step 1, which rebuilds saved tensors, under backward's autocast.)
        on = changed == "backward" and step > 0
        with _changed(on):
            loss.backward()
            assert torch.is_autocast_enabled("cpu") == on           # put back after the rerun
            assert torch._C._get_mkldnn_enabled() != on
        reruns += len(seen) - calls
        assert len(set(seen)) == 1, seen            # every rerun as forward ran
        seen.clear()
    assert reruns == 6                              # steps 2 and 3 recompute all three


def test_a_reruns_norms_are_its_training_norms_in_module_order_each_once():
    """``running_norms``, read at every rerun: ``module.modules()``'s order, a module listed
    twice once, a child set to None skipped, norms in eval mode left out."""
    from lmsrt.recompute.finder import Region
    from lmsrt.recompute.frames import running_norms
    shared = nn.BatchNorm1d(4)
    inner = nn.Sequential(shared, nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4), shared))
    block = nn.Sequential(nn.BatchNorm1d(4).eval(), inner, nn.BatchNorm1d(4), inner)
    block.add_module("gone", None)
    region = Region("block", (block, inner), True)
    assert running_norms(region) == [m for module in (block, inner) for m in module.modules()
                                     if isinstance(m, nn.BatchNorm1d) and m.training]
    assert len(running_norms(region)) == 5       # (three in the block, two in inner)


class InPlaceInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x.relu_())


def test_a_region_that_changes_its_input_in_place_is_kept():
    def model_of():
        return nn.Sequential(nn.Linear(32, 32), nn.Sequential(*[InPlaceInput() for _ in range(3)]))

    lms = _check_exact("sim", model_of, torch.randn(256, 32))
    stats = lms.stats()["regions"]
    assert stats["recomputed"] == 0
    assert set(stats["refused"].values()) == {"it changed an input in place"}


def test_an_input_changed_after_its_region_raises_as_autograd_does():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(32, 32)
            self.blocks = nn.ModuleList(Block(32) for _ in range(2))
            self.change = False

        def forward(self, x):
            h = self.first(x)
            y = self.blocks[1](self.blocks[0](h))
            if self.change:
                h.mul_(2)          # the first block's LayerNorm saved h
            return y

    torch.manual_seed(0)
    model, x = Model(), torch.randn(256, 32)
    model.change = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _train(model, x, 1)
    model.change = False
    lms = _lms("sim")
    _train(model, x, 3, lms)           # the plan recomputes both blocks from step 3
    model.change = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _train(model, x, 1, lms)
    assert lms.stats()["regions"]["recomputed"] == 2


def test_recompute_off_recomputes_no_regions():
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim", recompute=False)
    _train(Stack(32, 4), torch.randn(4, 16, 32), 3, lms)
    assert lms.stats()["regions"] is None and lms.stats()["total"]["recomputed_regions"] == 0


def _figures(excess_gib: float, **changes) -> StepFigures:
    """A transformer stack's step: 15 GiB saved, forward 50 ms, backward 100 ms, 55 GB/s."""
    return StepFigures(**dict(dict(excess=int(excess_gib * 2**30), saved=15 << 30, rebuilt=0,
                                   t_fwd=0.05, t_bwd=0.1, bandwidth=55e9), **changes))


def test_plan_recomputes_nothing_where_swaps_hide():
    blocks = [(1 << 30, 0.003)] * 16
    # 2.5 GiB out at 55 GB/s hide under forward, and come back under backward.
    assert choose_regions(blocks, _figures(2.5)) == []
    assert choose_regions(blocks, _figures(0)) == []
    # So do 5 GiB, of which the engine rebuilds half.
    assert choose_regions(blocks, _figures(5, rebuilt=7.5 * 2**30)) == []
    assert choose_regions(blocks, _figures(5)) != []


def test_plan_recomputes_the_last_regions_where_swaps_do_not_hide():
    blocks = [(1 << 30, 0.003)] * 16
    chosen = choose_regions(blocks, _figures(14))
    # The last ones, and only as many as pay: what is left to move hides.
    assert chosen == list(range(16 - len(chosen), 16)) and 8 <= len(chosen) < 14
    assert _figures(14).swap_seconds(len(chosen) << 30) < 0.003
    # A region slower to run than its bytes to move is never recomputed.
    slow = blocks[:15] + [(1 << 20, 0.01)]
    assert 15 not in choose_regions(slow, _figures(14))


def _choose_last_two(monkeypatch) -> None:
    """The plan's choice taken as given: the last two regions of four."""
    import lmsrt.recompute.plan
    import lmsrt.recompute.regions
    monkeypatch.setattr(lmsrt.recompute.regions, "choose_regions", lambda regions, figures: [2, 3])


def test_a_plan_that_recomputes_some_regions_shows_them(monkeypatch):
    _choose_last_two(monkeypatch)
    lms = _check_exact("sim", lambda: Stack(32, 4), torch.randn(4, 16, 32), steps=5)
    stats = lms.stats()["regions"]
    # Step 2 recomputed every region, step 3 learnt afresh what the choice saves, and step 5
    # follows its plan, swaps and recomputes mixed.
    assert stats["phase"] == "planned" and stats["planned"] == 2 and stats["recomputed"] == 2
    assert [r.name for r in lms._regions.order if r.chosen] == ["blocks[2]", "blocks[3]"]
    assert "regions: 2 of 4 recomputed" in lms.summary()
    assert lms.stats()["last_step"]["mode"] == "plan"


@pytest.mark.parametrize("choice", ["some", "all"])
def test_the_plan_settles_by_step_three_with_no_trial_steps(monkeypatch, choice):
    """No step is spent trying choices (NOTE [ Region plan ], 4): the engine learns in steps 1
    and 2 and, where the plan does not recompute every region, in step 3; every later step is
    planned and recomputes the same regions."""
    if choice == "some":
        _choose_last_two(monkeypatch)
    lms = _check_exact("sim", lambda: Stack(32, 4), torch.randn(4, 16, 32), steps=9)
    history = lms.stats()["history"]
    learnt = [s["step"] for s in history if s["mode"] != "plan"]
    assert learnt == ([1, 2, 3] if choice == "some" else [1, 2]), learnt
    settled = history[3:]
    want = 2 if choice == "some" else 4
    assert all(s["mode"] == "plan" and s["recomputed_regions"] == want for s in settled), settled


def _retrying(monkeypatch, retry_s: float, every: int = 1):
    """Two of four regions recomputed, a retry costing ``retry_s``, and an LMS whose planned
    steps from step 4 each retry the allocator once (every ``every``-th step; counted in
    backward). Returns (model, its plain twin, input, LMS)."""
    import lmsrt.recompute.plan
    _choose_last_two(monkeypatch)
    monkeypatch.setattr(lmsrt.recompute.plan, "RETRY_S", retry_s)
    torch.manual_seed(0)
    model, plain_model, x = Stack(32, 4), Stack(32, 4), torch.randn(4, 16, 32)
    plain_model.load_state_dict(model.state_dict())
    lms = _lms("sim")
    engine, retries = lms._engine, [0]

    def retry(*_):
        if engine.step.step >= 4 and engine.step.step % every == 0:
            retries[0] += 1
    model.register_full_backward_hook(retry)
    engine.device.alloc_retries = lambda: retries[0]
    return model, plain_model, x, lms


@pytest.mark.parametrize("every, dear", [(1, False), (2, False), (1, True)],
                         ids=["every-step", "every-other-step", "dearer-than-the-retries"])
def test_allocator_retries_that_stay_recompute_one_region_more_at_a_time(monkeypatch, every,
                                                                          dear):
    """NOTE [ Region plan ], 6: planned steps that each retry the allocator (one retry a step
    here, counted in backward) four in a row recompute the last region kept in forward too, and
    the engine learns it; four more, the one before; all the while exactly as the plain run.
    (The first planned step, step 4, is read for its own check: NOTE [ Region plan ], 5.)
    Retries every other step never make four in a row: the plan stays; nor does it where the
    regions' forwards, added up, would cost more than a step's retries."""
    # A retry costs more than the regions' forwards (timed in wall seconds here: a loaded
    # machine's), or less than the first one's.
    model, plain_model, x, lms = _retrying(monkeypatch, 1e-9 if dear else 60.0, every)
    with _deterministic():
        assert_same_steps(_train(plain_model, x, 16), _train(model, x, 16, lms))
    history = lms.stats()["history"]
    assert all(s["alloc_retries"] == (s["step"] >= 4 and s["step"] % every == 0)
               for s in history), history
    learnt = [s["step"] for s in history if s["mode"] != "plan"]
    recomputed = [s["recomputed_regions"] for s in history[3:]]
    if every == 1 and not dear:
        assert learnt == [1, 2, 3, 9, 14], learnt
        assert recomputed == [2] * 5 + [3] * 5 + [4] * 2, recomputed
        assert [r.chosen for r in lms._regions.order] == [True] * 4
        assert "allocator retries a step in 4 planned steps" in lms.stats()["regions"]["note"]
    else:
        assert learnt == [1, 2, 3] and recomputed == [2] * 12, (learnt, recomputed)


def test_evaluations_between_retrying_steps_neither_count_nor_break_the_run(monkeypatch):
    """An evaluation under no_grad inside the block after every training step saves nothing: it
    neither ends the plan nor breaks the run of retrying planned steps (NOTE [ Region plan ],
    6), so regions are still added one at a time, exactly as without LMS."""
    model, plain_model, x, lms = _retrying(monkeypatch, 60.0)
    with _deterministic():
        assert_same_steps(_train(plain_model, x, 16, evaluate=True),
                          _train(model, x, 16, lms, evaluate=True))
    history = lms.stats()["history"]
    evaluations = [s for s in history if s["policy_note"] == "saved nothing: the plan stands"]
    assert len(evaluations) == 15 and len(history) == 31, history
    assert [r.chosen for r in lms._regions.order] == [True] * 4
    assert history[-1]["mode"] == "plan" and history[-1]["recomputed_regions"] == 4


def _replanned(monkeypatch, at_step_four, stalled_model=None) -> tuple:
    """Eight steps whose plan recomputes the last two regions of four, then (the check of the
    first planned step, NOTE [ Region plan ], 5) the last three, exactly as the plain run;
    ``at_step_four(regions)`` changes the plan's figures as step 4 begins, and
    ``stalled_model(lms, model)`` the model. Returns the LMS and the figures the plan was made
    from each time."""
    import lmsrt.recompute.plan
    import lmsrt.recompute.regions
    seen, choices = [], iter([[2, 3], [1, 2, 3]])

    def choose(regions, figures):
        seen.append(figures)
        return next(choices)

    monkeypatch.setattr(lmsrt.recompute.regions, "choose_regions", choose)
    torch.manual_seed(0)
    model, plain_model, x = Stack(32, 4), Stack(32, 4), torch.randn(4, 16, 32)
    plain_model.load_state_dict(model.state_dict())
    lms = _lms("sim")
    lms.add_step_listener(lambda step: at_step_four(lms._regions) if step == 4 else None)
    if stalled_model is not None:
        stalled_model(lms, model)
    with _deterministic():
        assert_same_steps(_train(plain_model, x, 8), _train(model, x, 8, lms))
    history = lms.stats()["history"]
    assert [s["step"] for s in history if s["mode"] != "plan"] == [1, 2, 3, 5], history
    assert [s["recomputed_regions"] for s in history[3:]] == [2, 3, 3, 3], history
    return lms, seen


def test_a_plan_whose_step_took_more_off_the_gpu_than_its_excess_recomputes_more(monkeypatch):
    """NOTE [ Region plan ], 5: the first planned step is read once; where it took more off the
    GPU than the excess planned for (made so here: the plan's figures say 1 byte), the plan is
    made again and the engine learns the added regions in one step; later steps follow it,
    exactly."""
    import dataclasses

    def shrink(regions) -> None:
        regions.figures = dataclasses.replace(regions.figures, excess=1)

    lms, _ = _replanned(monkeypatch, shrink)
    assert "took" in lms.stats()["regions"]["note"]


def test_a_plan_whose_copies_stalled_compute_longer_than_predicted_recomputes_more(monkeypatch):
    """NOTE [ Region plan ], 5: where the first planned step's compute stream waited longer for
    its copies than the plan predicted (made so here: 0.5 s of waits where the figures say the
    copies hide), the plan is made again from figures that predict those waits, and the engine
    learns the added regions in one step; later steps follow it, exactly."""
    import dataclasses

    def hiding(regions) -> None:       # a fast link: the plan counts on the copies hiding
        regions.figures = dataclasses.replace(regions.figures, bandwidth=1e12, t_fwd=0.01,
                                              t_bwd=0.02)

    def stalls(lms, model) -> None:
        def stall(module, args):
            if lms._regions.step == 4:
                lms._engine.step.swapout_wait_ms = 500.0
        model.register_forward_pre_hook(stall)

    lms, seen = _replanned(monkeypatch, hiding, stalls)
    assert len(seen) == 2 and seen[0].hide == 1.0
    again = seen[1]
    assert again.hide < 1.0 or again.bandwidth < 1e12
    step4 = lms.stats()["history"][3]
    assert again.swap_seconds(step4["recomputed_bytes"]) == pytest.approx(0.5, rel=1e-3)
    assert "stalled compute 500.0 ms" in lms.stats()["regions"]["note"]


def test_forward_waits_for_copies_out_are_taken_off_a_regions_time(monkeypatch):
    """NOTE [ Region plan ], 3: the timing step learns, and what its forward waited for copies
    out inside a region (``swapout_wait_ms``' events) is not the region's own time. Here every
    span lasts 1 s of a fake clock and block 0 waited 0.6 s of it: it counts 0.4 s, and so,
    the fastest of the class, does every block."""
    import itertools
    import types

    import lmsrt.recompute.plan
    import lmsrt.recompute.regions
    ticks = itertools.count()
    monkeypatch.setattr(lmsrt.recompute.plan, "time", types.SimpleNamespace(
        perf_counter=lambda: float(next(ticks))))

    class Waited:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

        def query(self):
            return True

    class Waiting(Block):
        waits = False

        def forward(self, x):
            if self.waits and lms._regions.phase == "timing":
                lms._engine._timed_waits.append(("swapout_wait_ms", Waited(0.0), Waited(600.0)))
                lms._engine._timed_waits.append(("swapin_wait_ms", Waited(0.0), Waited(300.0)))
            return super().forward(x)

    model, x = Stack(32, 4), torch.randn(4, 16, 32)
    model.blocks = nn.ModuleList(Waiting(32) for _ in range(4))
    model.blocks[0].waits = True
    lms = _lms("sim")
    _train(model, x, 3, lms)
    seconds = [each[2] for each in lms.stats()["regions"]["each"]]
    assert seconds == [pytest.approx(400.0)] * 4, seconds     # ms


def test_a_region_counts_at_the_faster_of_its_forward_and_its_rerun(monkeypatch):
    """NOTE [ Region plan ], 3: the timing step's forward is slowed by what it learns; the
    same step's rerun of each region in backward swaps nothing. With forward spans of 1 s on a
    fake clock and reruns of 0.25 s, every region counts 0.25 s."""
    import types

    import lmsrt.recompute.plan
    import lmsrt.recompute.regions
    clock = types.SimpleNamespace(now=0.0, step=1.0)

    def perf_counter():
        clock.now += clock.step
        clock.step = 1.0
        return clock.now

    monkeypatch.setattr(lmsrt.recompute.plan, "time",
                        types.SimpleNamespace(perf_counter=perf_counter))
    real = lmsrt.recompute.regions.rerun

    def quick(frame):
        clock.step = 0.25           # the rerun's end comes a quarter of a tick after its start
        return real(frame)

    monkeypatch.setattr(lmsrt.recompute.regions, "rerun", quick)
    model, x = Stack(32, 4), torch.randn(4, 16, 32)
    lms = _lms("sim")
    _train(model, x, 3, lms)
    seconds = [each[2] for each in lms.stats()["regions"]["each"]]
    assert seconds == [pytest.approx(250.0)] * 4, seconds     # ms


def test_calibrated_figures_predict_the_measured_waits():
    from lmsrt.recompute.plan import calibrated
    step = _figures(8)
    # Measured waits under the prediction change nothing: the figures only grow more careful.
    assert calibrated(step, 0, step.swap_seconds(0) / 2) == step
    for exposed in (step.swap_seconds(0) * 1.5, 0.3, 2.0):
        got = calibrated(step, 0, exposed)
        assert got.swap_seconds(0) == pytest.approx(exposed, rel=1e-3)
        assert got.hide < step.hide and got.bandwidth <= step.bandwidth
    # So calibrated, the plan recomputes more of the same blocks.
    blocks = [(1 << 30, 0.003)] * 16
    assert len(choose_regions(blocks, calibrated(step, 0, 0.3))) > len(choose_regions(blocks,
                                                                                      step))


def test_double_backward_through_a_recomputed_region_says_what_to_do():
    torch.manual_seed(0)
    model, x = Stack(32, 4), torch.randn(4, 16, 32)
    lms = _lms("sim")
    _train(model, x, 3, lms)            # regions recomputed from step 2
    with lms:
        loss = model(x).square().mean()
    with pytest.raises(RuntimeError, match="create_graph=True.*recompute=False"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


class _Tail(nn.Module):
    """Saves nothing for backward; counts its calls."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return x * 2.0


class _TailBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2, self.tail = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), _Tail()

    def forward(self, x):
        return self.tail(self.fc2(F.gelu(self.fc1(x))))


def test_a_rerun_stops_at_the_last_tensor_it_dropped(monkeypatch):
    """What a region runs after its last save (here a scaling that saves nothing) is not run
    again in backward (NOTE [ Recomputed regions ], Rule 4), and the gradients stay exact."""
    monkeypatch.setattr(_Tail, "calls", 0)

    def make():
        stack = Stack(32, 4)
        stack.blocks = nn.ModuleList(_TailBlock(32) for _ in range(4))
        return stack

    lms = _check_exact("sim", make, torch.randn(4, 16, 32), steps=4)
    recomputed = lms.stats()["total"]["recomputed_regions"]
    assert recomputed > 0
    # Each step's forward calls every tail once, in both runs; no rerun calls one.
    assert _Tail.calls == 2 * 4 * 4, (_Tail.calls, recomputed)


def test_what_step_one_leaves_on_the_gpu_counts_in_the_excess():
    """NOTE [ Region plan ], 1: what step 1 leaves on the GPU for the steps after it (an
    optimizer's state, made by its first step: here 1 MiB of the simulated device's memory,
    made after backward) raises the peak of every later step's passes, and so the excess, by
    as much; counted once, although step 1's own peak came after its passes with it."""
    excess = []
    for left in (0, 1 << 20):
        torch.manual_seed(0)
        model, x = Stack(32, 4), torch.randn(4, 16, 32)
        # auto, so step 1 is recorded; a GPU of 256 KiB, which the blocks' saves fill
        lms, state = lmsrt.LMS(lms=1, device=SimulatedDevice(capacity=256 << 10)), []
        lms._regions.bandwidth, lms._regions.worth = 1.0, 0
        for step in range(2):
            with lms:
                loss = model(x).square().mean()
            loss.backward()
            if step == 0 and left:
                state.append(lms._engine.device.empty(left))
        excess.append(lms._regions._excess)
        lms.close()
    assert excess[0] > 0 and excess[1] - excess[0] == 1 << 20, excess


def test_what_lmsrt_held_at_step_ones_peak_counts_once():
    """NOTE [ Region plan ], 1: a learning step's peak came with lmsrt holding 200 (a source in
    flight, a restored copy), which what it saved counts already: the passes' peak counts the
    model's own 100, not 300: the excess is 100 + 400 saved - 450 = 50."""
    from lmsrt.policy.profile import Profile
    from lmsrt.recompute.plan import over_bound
    from lmsrt.stats import StepStats
    prof = Profile()
    prof.record(False, used=100, peak=300, lmsrt_before=200, lmsrt_now=0, nbytes=100)
    prof.record(True, used=50, peak=80, lmsrt_before=0, lmsrt_now=0)
    step = StepStats(step=1, gpu_peak_bytes=20, out_bytes=400)
    assert over_bound(step, 450, (prof.own_peak(), 0)) == (400, 50)
    assert over_bound(step, 450, (prof.own_peak(), 30)) == (400, 80)


def test_a_rerun_holds_what_its_call_saved_from_its_first_unpack_to_each_ones_last():
    """NOTE [ Region plan ], 2: a call that saved storages 1 and 2 (of 0-3), unpacked first at
    backward point 1 and last at points 2 and 3: recomputed, from the interval after point 1
    both are held, storage 1 until the interval after point 2; the use there is the step's
    own (its ``bwd_peak``) plus them, and plus the storages saved before the call that it was
    called with, from the rerun on. Storages never unpacked, and storages alive anyway, hold
    nothing."""
    from lmsrt.policy.profile import Profile
    from lmsrt.recompute.plan import rerun_peak
    prof = Profile()
    for size in (10, 100, 1000, 5):
        prof.record(False, used=0, peak=0, lmsrt_before=0, lmsrt_now=0, nbytes=size)
    for own in (7, 3, 50, 2, 1, 0):
        prof.record(True, used=own, peak=own, lmsrt_before=0, lmsrt_now=0)
    for i, j in ((3, 0), (1, 1), (2, 1), (1, 2), (2, 3), (0, 4)):
        prof.used_at(i, j)
    # points 2..4: 50 + 1100 at 2, 2 + 1100 at 3 (storage 1 read last at 2), 1 + 1000 at 4
    assert rerun_peak(prof, 1, 3) == 1150
    assert rerun_peak(prof, 2, 3) == 1050               # 50 + 1000 at point 2
    # Called with storage 0 (saved before it, unpacked first at point 4): the rerun starts
    # from it, so it is held from the rerun on; a storage of its own called with counts once.
    assert rerun_peak(prof, 1, 3, inputs=[0]) == 1160
    assert rerun_peak(prof, 1, 3, inputs=[1, 1]) == 1150
    assert rerun_peak(prof, 2, 3, inputs=[0, 1]) == 1160    # 50 + 1000 + 100 + 10 at point 2
    prof.live = {2}
    assert rerun_peak(prof, 1, 3) == 150
    prof.first_use[1] = prof.last_use[1] = 1 << 62      # never unpacked
    assert rerun_peak(prof, 1, 3) == 0


def test_a_region_whose_rerun_would_not_fit_is_not_recomputed():
    """NOTE [ Region plan ], 2: a rerun holds all its call saved at once, where swapping brings
    each storage back alone; a region whose rerun, in the survey step, would have passed the
    bound is not recomputed (on an H200, a conv net at 85% of its peak ran out of memory in
    backward in the first step that reran its 768 MiB stages). At a 4 MiB simulated GPU the
    conv net's stages that save 4-5 MiB are left to the swaps, and said; the one that fits is
    recomputed; at 16 MiB they all fit. Each trains exactly."""
    import copy

    from models import convnet, lmsrt_warnings
    torch.manual_seed(0)
    model, x = convnet(c=8), torch.randn(4, 3, 128, 128)
    plain = _train(copy.deepcopy(model), x, 4)
    unfit = {}
    for cap in (4 << 20, 16 << 20):
        lms = lmsrt.LMS(lms=1, lms_frac="auto", device=SimulatedDevice(capacity=cap))
        lms._regions.bandwidth, lms._regions.worth = 1.0, 0
        with lmsrt_warnings() as said:
            assert_same_steps(plain, _train(copy.deepcopy(model), x, 4, lms))
        regions = lms.stats()["regions"]
        unfit[cap] = regions["unfit"]
        rerun = {name for name, _, _, chosen in regions["each"] if chosen}
        assert rerun and not rerun & set(unfit[cap]), regions
        if unfit[cap]:
            assert any("too large to rerun" in line for line in said), said
        lms.close()
    assert unfit[4 << 20] and not unfit[16 << 20], unfit
    assert all("over the bound" in why for why in unfit[4 << 20].values())


def test_the_rebuild_recorder_sleeps_inside_a_recomputed_region(monkeypatch):
    """NOTE [ Recomputed regions ], Rule 3: ops inside a region that is recomputed do not pass
    through the engine's rebuild recorder (what they save is dropped and run again, never
    rebuilt; each op through the recorder costs its dispatch through Python), while ops outside
    the regions still do, and the steps stay exact."""
    import collections

    import lmsrt.recompute.recipes as recipes
    step, ops = [0], collections.defaultdict(collections.Counter)
    dispatch = recipes.Recorder.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        ops[step[0]][func.overloadpacket.__name__] += 1
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(recipes.Recorder, "__torch_dispatch__", counted)
    torch.manual_seed(0)
    model, plain_model, x = Stack(32, 4), Stack(32, 4), torch.randn(4, 16, 32)
    plain_model.load_state_dict(model.state_dict())
    lms = _lms("sim")
    lms.add_step_listener(lambda n: step.__setitem__(0, n))
    with _deterministic():
        assert_same_steps(_train(plain_model, x, 5), _train(model, x, 5, lms))
    assert lms.stats()["regions"]["recomputed"] == 4
    # Step 1 recomputes nothing, and every block's ops are noted; from step 2 every block is
    # recomputed, and only ops outside them (the loss's square) pass through the recorder.
    assert ops[1]["gelu"] == 4 and ops[1]["native_layer_norm"] == 4, ops[1]
    for n in (2, 3, 4, 5):
        assert not ops[n]["gelu"] and not ops[n]["native_layer_norm"], ops[n]
        assert not ops[n]["addmm"] and ops[n]["pow"] == 1, ops[n]


@pytest.mark.parametrize("make", [lambda: Stack(), _segnet], ids=["blocks", "stages"])
def test_a_model_dropped_under_an_open_lms_is_freed(make):
    """An LMS open across models (a sweep, a script that builds its model again) holds none of
    them: a model trained under it, its regions recomputed, is freed once the user drops it
    (measured on a GPU: a dropped 192 MiB model and its gradients held until the LMS closed)."""
    import gc
    import weakref
    lms = _lms("sim")
    model = make()
    x = torch.randn(4, 32) if isinstance(model, Stack) else torch.randn(2, 3, 16, 16)
    _train(model, x, 3, lms)
    assert lms.stats()["total"]["recomputed_bytes"] > 0
    gone = [weakref.ref(m) for m in model.modules()]
    del model
    gc.collect()
    held = [type(m()).__name__ for m in gone if m() is not None]
    assert not held, held
    lms.close()
