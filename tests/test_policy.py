"""The swap policy (lmsrt/policy/): lms_frac="auto" against scripted model memory on the simulated
device, which runs out of memory at its capacity like the caching allocator does at its limit.

The model is a chain of layers that each save their input (the tensors lmsrt swaps), beside
memory of the model's own that saves nothing: fixed state (parameters, optimizer state), a
transient inside forward (a workspace, an fp32 upcast), and one at the start of backward (a
vocabulary-sized logits gradient). Those are what a fixed mark cannot see (issue: the conv net
ran out in forward, the LM in backward, at lms_frac 0.75)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import assert_same, lmsrt_warnings, says, train_step, transformer

import lmsrt
from lmsrt.device import SimulatedDevice
from lmsrt.plan import OffloadPlan
from lmsrt.policy import AutoPolicy, Profile

MiB = 1 << 16          # scaled down: the sizes relate as MiB would, and run fast on a CPU


class _Layer(torch.autograd.Function):
    """y = x * w; saves x. Allocates ``fwd_extra`` bytes of the model's own memory for the
    length of its forward and ``bwd_extra`` for the length of its backward (or calls it, if it
    is a function)."""

    @staticmethod
    def forward(ctx, x, w, device, fwd_extra, bwd_extra):
        ctx.save_for_backward(x, w)
        ctx.device, ctx.bwd_extra = device, bwd_extra
        if fwd_extra:
            device.empty(fwd_extra)          # allocated and freed inside the interval
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        if callable(ctx.bwd_extra):
            ctx.bwd_extra()
        elif ctx.bwd_extra:
            ctx.device.empty(ctx.bwd_extra)
        return grad * w, (grad * x).sum(0), None, None, None


class Scripted:
    """``layers`` layers saving ``act`` bytes each, ``state`` bytes held for the run, and
    transients: ``fwd`` bytes at forward layer ``fwd_at``, ``bwd`` bytes in the last layer's
    backward (the first to run); ``on_backward`` maps a layer to what its backward calls."""

    def __init__(self, device, layers=16, act=12 * MiB, state=32 * MiB, fwd=0, fwd_at=None,
                 bwd=0, on_backward=None):
        torch.manual_seed(0)
        self.device = device
        self.cols = 256
        self.rows = act // (4 * self.cols)
        self.weights = [torch.randn(self.cols, requires_grad=True) for _ in range(layers)]
        self.state = device.empty(state)
        self.fwd, self.fwd_at, self.bwd = fwd, fwd_at, bwd
        self.on_backward = on_backward or {}

    def step(self, x):
        n = len(self.weights)
        for i, w in enumerate(self.weights):
            x = _Layer.apply(x, w, self.device, self.fwd if i == self.fwd_at else 0,
                             self.on_backward.get(i, self.bwd if i == n - 1 else 0))
        return x.sum()

    def grads(self):
        return [w.grad.clone() for w in self.weights]


def _train(device, lms_frac, steps=8, model_class=None, validate=0, grad=True,
           evaluate=False, **script):
    """Train the scripted model (or ``model_class``'s), after ``validate`` forwards without a
    backward (under no_grad unless ``grad``), with a forward under no_grad inside the block
    after each step if ``evaluate``; return (grads per step, stats) or raise the OOM."""
    model = (model_class or Scripted)(device, **script)
    lms = lmsrt.LMS(device=device, lms=1, lms_frac=lms_frac)
    x0 = torch.randn(model.rows, model.cols, generator=torch.Generator().manual_seed(1))
    for _ in range(validate):
        with lms, torch.set_grad_enabled(grad):
            model.step(x0.clone().requires_grad_(grad))
    grads = []
    for _ in range(steps):
        for w in model.weights:
            w.grad = None
        with lms:
            loss = model.step(x0.clone().requires_grad_())
        loss.backward()
        grads.append(model.grads())
        if evaluate:
            with lms, torch.no_grad():
                model.step(x0.clone())
    return grads, lms.stats()


def _reference(steps=8, **script):
    device = SimulatedDevice(capacity=1 << 40)
    model = Scripted(device, **script)
    x0 = torch.randn(model.rows, model.cols, generator=torch.Generator().manual_seed(1))
    grads = []
    for _ in range(steps):
        for w in model.weights:
            w.grad = None
        model.step(x0.clone().requires_grad_()).backward()
        grads.append(model.grads())
    return grads


def _steps(stats):
    return stats["history"] + [stats["last_step"]]


# 16 layers x 12 MiB saved + 32 MiB state = 224 MiB in use at the end of forward, uncapped.
BACKWARD_TRANSIENT = dict(bwd=96 * MiB)                   # peak ~320 MiB uncapped
FORWARD_TRANSIENT = dict(fwd=120 * MiB, fwd_at=15)        # peak ~330 MiB uncapped
CAP = 256 * MiB


@pytest.mark.parametrize("script", [BACKWARD_TRANSIENT, FORWARD_TRANSIENT],
                         ids=["backward-transient", "forward-transient"])
def test_a_fixed_mark_runs_out_where_auto_fits(script):
    with pytest.raises(torch.OutOfMemoryError):
        _train(SimulatedDevice(capacity=CAP, strict=True), 0.75, **script)

    device = SimulatedDevice(capacity=CAP, strict=True)
    grads, stats = _train(device, "auto", **script)
    for got, want in zip(grads, _reference(**script)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = _steps(stats)
    assert all(s["gpu_peak_bytes"] <= CAP for s in steps)
    # It moves only what must move: far less than the 180 MiB eligible per step once planned
    # (the first layer's input is a leaf that requires grad: not eligible).
    saved = 15 * 12 * MiB
    assert steps[0]["out_bytes"] == saved                 # step 1 learns with everything out
    for s in steps[2:]:
        assert 0 < s["out_bytes"] < saved * 0.75, s["out_bytes"]
        assert s["mode"] == "plan"


@pytest.mark.parametrize("copy_lag", [10, 10**9])
def test_copies_still_running_when_backward_begins_make_way_for_its_transient(copy_lag):
    """Forward can end before its last copies have gone out (on a GPU: 8.6 GiB at 55 GB/s after
    a 40 ms forward); their sources are lmsrt's bytes that no prediction counts, so backward
    lets them go by its level before its first transient (an LM at 18 GiB ran out of memory at
    its logits gradient, in 2 runs of 5). Here copies report done only after ``copy_lag``
    queries, or when a stream waits on them."""
    device = SimulatedDevice(capacity=CAP, strict=True, copy_lag=copy_lag)
    grads, stats = _train(device, "auto", **BACKWARD_TRANSIENT)
    for got, want in zip(grads, _reference(**BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(s["gpu_peak_bytes"] <= CAP for s in _steps(stats))


def test_auto_stops_swapping_a_model_that_fits():
    """Forward passes half the limit (224 MiB at its end of 400): the learning step swaps (its
    deferred copies start, waiting for their pins, once use passes half: NOTE [ Deferred
    copies ]), and the plan then keeps everything."""
    device = SimulatedDevice(capacity=400 * MiB, strict=True)
    grads, stats = _train(device, "auto", **BACKWARD_TRANSIENT)
    for got, want in zip(grads, _reference(**BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = _steps(stats)
    assert steps[0]["out_bytes"] > 0 and steps[0]["deferred_tensors"] > 0
    assert all(s["out_bytes"] == 0 and s["in_bytes"] == 0 for s in steps[1:]), \
        [s["out_bytes"] for s in steps]


@pytest.mark.parametrize("script", [BACKWARD_TRANSIENT, FORWARD_TRANSIENT],
                         ids=["backward-transient", "forward-transient"])
def test_auto_offloads_about_what_the_cap_requires(script):
    """The plan's offload is the smallest whose predicted peak fits: the uncapped peak less the
    bound (the cap less the headroom), give or take a storage, not everything, and not what
    some fraction of the cap would say."""
    _, stats = _train(SimulatedDevice(capacity=1 << 40), 1.0, **script)     # nothing swapped
    uncapped = max(s["gpu_peak_bytes"] for s in _steps(stats)[1:])
    _, stats = _train(SimulatedDevice(capacity=CAP, strict=True), "auto", **script)
    least, most = uncapped - (CAP - (CAP >> 6)), uncapped - (CAP - (CAP >> 5))  # headroom range
    assert least > 0
    for s in _steps(stats)[2:]:
        assert least <= s["out_bytes"] <= most + 12 * MiB, (s["out_bytes"], least, most)


def _profile(fwd_own, fwd_peak, bwd_own, bwd_peak, sizes, last_use):
    prof = Profile()
    prof.sizes, prof.fwd_own, prof.fwd_peak = list(sizes), list(fwd_own), list(fwd_peak)
    prof.bwd_own, prof.bwd_peak, prof.last_use = list(bwd_own), list(bwd_peak), list(last_use)
    return prof


def test_plan_keeps_predicted_peaks_under_the_bound():
    """Four storages of 100 saved in forward and used in reverse in backward; a transient of 350
    right after the first unpack (a logits gradient). Keeping everything peaks there at 350 +
    the three storages not yet used; under a bound of 600 the plan must offload the earliest
    one only."""
    limit = 640
    policy = AutoPolicy(limit=limit, window=1 << 30)
    policy.learning = False
    policy.profile = _profile(fwd_own=[100, 100, 100, 100], fwd_peak=[100, 100, 100, 100],
                              bwd_own=[0, 100, 100, 100], bwd_peak=[100, 350, 100, 100],
                              sizes=[100] * 4, last_use=[3, 2, 1, 0])
    plan = OffloadPlan()
    plan.recorded, plan.planned = [100] * 4, True
    policy.begin_step(plan, base=0, first=100)
    assert policy.bound == limit - (limit >> 4) == 600
    assert plan.chosen == [True, False, False, False] and plan.target == 100
    assert policy.predicted_peak == 550
    # At backward point 0 the transient is still to come: fetching ahead leaves it room. Once
    # it has passed, fetching may fill up to the bound.
    assert policy.fetch_to(plan, 0) < policy.fetch_to(plan, 2) == policy.bound

    followed = dict(followed=True, forward_end_use=0, swapped=0, beyond_plan=0, retries=0)
    # A peak over the bound: plan for that much more than learnt, i.e. offload more.
    policy.finish_step(plan, peak=660, **followed)
    assert policy.correction == 60
    policy.begin_step(plan, base=0, first=100)
    assert plan.chosen == [True, True, False, False]
    # Well under its prediction (corrected: 450 + 60) with something offloaded: plan for half
    # the difference less. Under the bound as predicted (the plan's grain, not its error): no
    # correction.
    assert policy.predicted_peak == 450
    predicted = 450 + 60
    policy.finish_step(plan, peak=predicted - 5, **followed)
    assert policy.correction == 60
    policy.finish_step(plan, peak=predicted - 100, **followed)
    assert policy.correction == 60 - 50
    # Allocator retries far under the bound are the cache filling up; one near it raises the
    # headroom (it costs more than the bytes more headroom frees), unless the next step retries
    # as often (the model's own: undone). Clean steps give it back, down to the floor.
    policy.finish_step(plan, peak=0, **dict(followed, retries=5))
    assert policy.headroom == limit >> 4
    policy.finish_step(plan, peak=policy.bound - 1, **dict(followed, retries=1))
    raised = policy.headroom
    assert raised == (limit >> 4) + (limit >> 6)
    policy.finish_step(plan, peak=policy.bound - 1, **followed)        # and it helped: kept
    assert policy.headroom == raised
    policy.correction = -(limit >> 2)           # nothing left to take from the correction
    for _ in range(40):
        policy.finish_step(plan, peak=0, **followed)
    assert policy.headroom == policy.floor < raised


def _planned():
    """An AutoPolicy past its learning step, a plan, a followed step's arguments, and its limit
    (1 GiB): for the tests of what steps teach it."""
    limit = 1 << 30
    policy = AutoPolicy(limit=limit, window=1 << 30)
    policy.learning = False
    return policy, OffloadPlan(), dict(followed=True, forward_end_use=0, swapped=0,
                                       beyond_plan=0), limit


def test_a_prediction_corrected_under_the_bound_is_not_beyond_it():
    """A profile learnt too high (its prediction corrected down by what steps showed) predicts
    a peak over the bound only uncorrected: allocator retries near the bound still raise the
    headroom (Lightning's GPT at a 14.2 GiB cap on an H200: two a step, none answered)."""
    policy, plan, near, limit = _planned()
    policy.correction = -(limit >> 3)
    policy.predicted_peak = policy.bound + (limit >> 4)             # as learnt: over it
    start = policy.headroom
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)
    assert policy.headroom == start + (limit >> 6), policy.why
    policy = AutoPolicy(limit=limit, window=1 << 30)
    policy.learning = False
    policy.correction = -(limit >> 3)
    policy.predicted_peak = policy.bound + (limit >> 2)             # over it as corrected too
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)
    assert policy.headroom == start, policy.why                     # the model's own: no raise


def test_a_raise_the_plan_did_not_answer_says_nothing_of_the_retries():
    """More headroom that the plan's slack absorbs leaves the plan as it was: retries after it
    are not judged the model's own (Lightning's GPT at a 14.2 GiB cap: one raise of limit/64,
    the plan unchanged, then two retries a step for good). The raise stays and the next one
    comes; once a raise makes the plan hold less and the retries stay, they are the model's,
    and the headroom goes back to where it was before the first raise. A plan that keeps
    everything answers at once: lmsrt holds nothing it could give up."""
    policy, plan, near, limit = _planned()
    start = policy.headroom
    policy._cutoff = 2                                                      # it offloads some
    policy.predicted_peak = policy.bound - (limit >> 3)
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)
    assert policy.headroom == start + (limit >> 6)
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)     # the same plan
    assert policy.headroom == start + 2 * (limit >> 6), policy.why          # raised again
    policy.predicted_peak -= limit >> 6                                     # a plan holding less
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)
    assert policy.headroom == start and "model's own" in policy.why, policy.why
    policy = AutoPolicy(limit=limit, window=1 << 30)
    policy.learning, policy._cutoff = False, 0                              # it keeps everything
    policy.predicted_peak = policy.bound - (limit >> 3)
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)
    policy.finish_step(plan, peak=policy.bound - 1, retries=2, **near)
    assert policy.headroom == start and "model's own" in policy.why, policy.why


def test_one_retry_that_more_headroom_removed_raises_no_floor():
    """Retries that had repeated and went once the headroom was raised leave a floor under it;
    one retry that did not come back (noise at the cap) does not: clean steps give back."""
    limit = 1 << 30
    near = dict(followed=True, forward_end_use=0, swapped=0, beyond_plan=0)
    floors = []
    for first in (1, 3):
        policy = AutoPolicy(limit=limit, window=1 << 30)
        policy.learning = False
        policy.finish_step(OffloadPlan(), peak=policy.bound - 1, retries=first, **near)
        policy.finish_step(OffloadPlan(), peak=policy.bound - 1, retries=0, **near)
        floors.append(policy.floor)
    assert floors == [limit >> 5, (limit >> 4) + (limit >> 7)], floors


def test_a_step_that_retried_near_the_bound_lowers_no_correction():
    """A step that peaked under its prediction lowers the correction (the plan then keeps
    more), unless the allocator retried near the bound in it: that room was the allocator's."""
    policy, plan, near, limit = _planned()
    policy._cutoff = 3                                                      # it offloads some
    policy.predicted_peak = policy.bound
    peak = policy.bound - (limit >> 3)                                      # well under it...
    policy.finish_step(plan, peak=peak, retries=1, **near)                  # ...but not near
    assert policy.correction < 0                                            # lowered
    policy.correction = 0
    policy.predicted_peak = policy.bound                                    # not over it
    peak = policy.bound - (policy.headroom >> 1)                            # near, and retried
    policy.finish_step(plan, peak=peak, retries=1, **near)
    assert policy.correction == 0, policy.why


def test_retries_that_more_headroom_does_not_remove_are_the_models_own():
    """A conv net's allocator retries 4-5 times a step whatever the headroom (cuDNN asking for
    workspaces): a raise for them is undone when the next step retries as often, and from then
    on only retries beyond those count, for raising it and against giving it back."""
    policy, plan, near, limit = _planned()
    start = policy.headroom
    policy.finish_step(plan, peak=policy.bound - 1, retries=5, **near)
    assert policy.headroom > start                       # raised once
    policy.predicted_peak -= 1                           # and the plan holds less for it
    policy.finish_step(plan, peak=policy.bound - 1, retries=5, **near)
    assert policy.headroom == start and "model's own" in policy.why
    for _ in range(8):                                   # as many again: no raise, clean steps
        policy.finish_step(plan, peak=policy.bound - 1, retries=5, **near)
    given_back = policy.headroom
    assert given_back < start
    policy.finish_step(plan, peak=policy.bound - 1, retries=6, **near)
    assert policy.headroom > given_back                  # one beyond them: raised
    policy.finish_step(plan, peak=policy.bound - 1, retries=5, **near)
    assert policy.headroom > given_back                  # and it helped: kept


def test_an_allocation_that_failed_in_a_learning_step_widens_the_headroom():
    """Measured on a conv net under cuDNN's benchmark mode on an H200: learning steps 2 and 3
    failed 1 and 3 allocations at the cap (cuDNN then keeps a slower algorithm), and the
    headroom stayed where it was until a planned step failed too. A failure widens it in any
    step."""
    limit = 1 << 30
    policy = AutoPolicy(limit=limit, window=1 << 30)
    plan = OffloadPlan()
    step = dict(followed=False, forward_end_use=0, swapped=0, beyond_plan=0, peak=0, retries=1)
    start = policy.headroom
    policy.finish_step(plan, failures=0, **step)
    assert policy.learning and policy.headroom == start
    policy.finish_step(plan, failures=2, **step)
    assert policy.learning and policy.headroom == start + (limit >> 6)


def test_the_headroom_is_never_given_back_to_where_a_raise_removed_retries():
    """Measured on a ViT: clean steps gave the headroom back to where it retried, retries
    raised it again, a cycle every ~14 steps (a third of them slower). Once more headroom
    removed retries, clean steps give back no lower than a step over the level they came at."""
    policy, plan, near, limit = _planned()
    for _ in range(40):                                  # clean steps: down to the floor
        policy.finish_step(plan, peak=0, retries=0, **near)
    low = policy.headroom
    assert low == limit >> 5
    policy.finish_step(plan, peak=policy.bound - 1, retries=3, **near)
    raised = policy.headroom
    assert raised > low                                  # raised for the retries
    policy.finish_step(plan, peak=policy.bound - 1, retries=0, **near)   # and it helped
    levels = set()
    for _ in range(60):
        policy.finish_step(plan, peak=policy.bound - 1, retries=0, **near)
        levels.add(policy.headroom)
    assert min(levels) == low + (limit >> 7) > low and policy.headroom == min(levels)


def test_a_storage_the_model_holds_anyway_costs_nothing_to_keep_while_it_does():
    """The last storage saved (an LM's log-softmax output) is still held by the model after
    lmsrt let go of it in the learning step, through the peak at the start of backward: the
    learnt peak counts it already. Keeping it adds nothing there; counting it twice would
    offload it for nothing."""
    def chosen(held):
        policy = AutoPolicy(limit=640, window=1 << 30)
        policy.learning = False
        prof = _profile(fwd_own=[100] * 4, fwd_peak=[100] * 4, bwd_own=[0, 100, 100, 100],
                        bwd_peak=[520, 100, 100, 100], sizes=[100] * 4, last_use=[3, 2, 1, 0])
        prof.owned = held
        policy.profile = prof
        plan = OffloadPlan()
        plan.recorded, plan.planned = [100] * 4, True
        policy.begin_step(plan, base=0, first=100)
        return plan.chosen

    # Points 0-3 are forward's, 4-7 backward's: held by the model from 4 until freed before 5.
    assert chosen({3: (4, 5)}) == [True, True, True, False]
    assert chosen({}) == [True, True, True, True]
    # Held to the end of the step: nothing to add after it was let go.
    assert chosen({3: (4, None)}) == [True, True, True, False]


@pytest.mark.parametrize("lms_frac,cap_mib", [("auto", 16), ("auto", 12), ("auto", 8), (0.5, 16)])
def test_batches_of_changing_size_train_exactly(lms_frac, cap_mib):
    """Batch sizes that change from step to step, then settle, then alternate: the number of
    storages that pass ``lms`` changes with them (LayerNorm's statistics grow past 1 KB), and each
    step's gradients equal the run without LMS. Under auto a batch larger than the learnt one is
    learnt at once, and a step that returns to the learnt batch after another follows the plan.
    (Auto raised IndexError here when a batch grew past the one it had learnt; at 12 MiB it ran
    out of memory where a batch of 16 followed one of 8, planned by the growth that a batch of 4
    had shown; a fixed 0.5 fits at every cap here.)"""
    torch.manual_seed(0)
    model = transformer(d=64, layers=6, heads=4)
    xs = {b: torch.randn(b, 32, 64) for b in (2, 4, 8, 16)}
    refs = {b: train_step(model, x) for b, x in xs.items()}
    order = [4, 4, 2, 8, 16, 16, 8, 16, 8, 4, 4, 8] + [16] * 4 + [2, 2, 16, 2, 16, 2, 2, 16]
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=cap_mib << 20, strict=True), lms=1,
                    lms_frac=lms_frac)
    for b in order:
        assert_same(refs[b], train_step(model, xs[b], lms=lms))
    train_step(model, xs[2], lms=lms)                # closes the last step's figures
    steps = lms.stats()["history"][:len(order)]
    assert sum(s["out_bytes"] for s in steps) > 0
    if lms_frac == "auto":
        learnt = [s["step"] for s in steps if "first saved storage is larger" in s["policy_note"]]
        assert learnt and all(order[n - 1] > order[n - 2] for n in learnt), (learnt, steps)
        back = [s for s, b, before in zip(steps[1:], order[1:], order) if b == 16 != before]
        assert any(s["mode"] == "plan" for s in back), back
    lms.close()


# -- on a GPU ------------------------------------------------------------------------------------

class _LMHead(torch.nn.Module):
    """MLP blocks and a vocabulary-sized head with cross-entropy on fp32 logits: the logits, the
    log-softmax CE saves and the logits' gradient are transients of the model's own that a fixed
    mark does not see (issue: the LM ran out in backward at lms_frac 0.75)."""

    def __init__(self, d=1024, layers=8, vocab=16384):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
            for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.blocks(x)).float(), y)


def _lm_head():
    model = _LMHead().cuda()
    x = torch.randn(8192, 1024, device="cuda")
    y = torch.randint(0, 16384, (8192,), device="cuda")
    return model, lambda: model(x, y)


def _conv_net():
    """The benchmark's conv segmentation net, smaller: 7x7/64 convolutions, BatchNorm, in-place
    ReLU, max-pool and upsampling under bf16 autocast; cuDNN's backward workspaces are large."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from workloads import SegNet
    model = SegNet().cuda()
    x = torch.randn(4, 4, 512, 512, device="cuda")

    def loss():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).float().square().mean()
    return model, loss


def _capped_steps(lms_frac, cap, steps=6, make=_lm_head, recompute=False):
    """Gradients of each step of a model (by default the LM head), under ``cap`` bytes with LMS
    at ``lms_frac`` (or uncapped without LMS when ``lms_frac`` is None), and the stats."""
    torch.manual_seed(0)
    model, forward = make()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if cap:
        torch.cuda.set_per_process_memory_fraction(cap / total)
    lms = (lmsrt.LMS(lms=1000, lms_frac=lms_frac, recompute=recompute) if lms_frac is not None
           else None)
    grads = []
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            if lms is None:
                loss = forward()
            else:
                with lms:
                    loss = forward()
            loss.backward()
            # On the host: gradients kept on the GPU would take more of the cap every step.
            grads.append([p.grad.cpu() for p in model.parameters()])
        return grads, (lms.stats() if lms else None)
    finally:
        if lms is not None:
            lms.close()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _in_a_fresh_process(request) -> bool:
    """Run the test of ``request`` again in a process of its own and assert that it passed;
    False in that process, which runs the test itself. What fits under a cap depends on the
    caching allocator's history: segments that earlier tests in the process left behind, and
    whether expandable segments were on when they were made."""
    test = request.node.nodeid.split("::", 1)[1]
    if os.environ.get("LMSRT_TEST_FRESH") == test:
        return False
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         f"{__file__}::{test}"], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, LMSRT_TEST_FRESH=test))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    return True


@pytest.mark.cuda
@pytest.mark.xfail(strict=False, reason=(
    "open, and it depends on the run: measured on an H200, 2026-11-23, [recompute] ran out of "
    "memory in 6 of 8 runs and [swap] in 2 of 5, in a planned step: the learnt plan predicts "
    "2.53 GiB against a 2.49 GiB bound while steps peak at 2.56-2.63 GiB (cap 2.66 GiB), and "
    "the correction creeps up by 0.01 GiB a step; the failing point asks 512 MiB at 2.38 GiB "
    "allocated. Passed in all 3 runs of the day before (same plan figures), and later that "
    "day in 3 runs of the suite and 10 of the scenario alone (peak 2.50 GiB, cap 2.66 GiB)"))
@pytest.mark.parametrize("recompute", [False, True], ids=["swap", "recompute"])
def test_lm_head_out_of_memory_at_a_fixed_mark_trains_at_auto(request, recompute):
    if _in_a_fresh_process(request):
        return
    want, _ = _capped_steps(None, None)
    torch.cuda.reset_peak_memory_stats()
    _capped_steps(None, None, steps=2)
    uncapped = torch.cuda.max_memory_allocated()
    cap = uncapped - (3 << 29)                      # 1.5 GiB under the uncapped peak
    with pytest.raises(torch.OutOfMemoryError):
        _capped_steps(0.75, cap, recompute=recompute)
    # As a restarted run would: not with the blocks the failed run left in the cache (the
    # reference ran before lmsrt turned on expandable segments; its segments strand 1.5 GiB).
    gc.collect()
    torch.cuda.empty_cache()
    got, stats = _capped_steps("auto", cap, recompute=recompute)
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    steps = stats["history"] + [stats["last_step"]]
    saved = steps[0]["out_bytes"]                   # step 1 learns with everything out
    for s in steps[2:]:
        assert s["mode"] == "plan"
        assert s["out_bytes"] < saved, (s["out_bytes"], saved)


@pytest.mark.cuda
@pytest.mark.xfail(strict=False, reason=(
    "open, and it depends on the run: measured on an H200, 2026-11-23, it passed in one run of "
    "the suite and failed in the next (allocations failed in step 2 or 3, 3 to 8 of them, and "
    "cuDNN's fallback changed the gradients' bits); earlier: 3 in step 2 at 7/8 of the uncapped "
    "peak, and at 3/4 a planned step ran out of memory in forward; passed in the last run of "
    "the suite that day"))
@pytest.mark.parametrize("recompute", [False, True], ids=["swap", "recompute"])
def test_conv_net_keeps_cudnns_algorithms_at_auto(request, recompute):
    """At a cap 7/8 of its uncapped peak, the conv net trains at auto with exact gradients and,
    after the learning step, no allocation fails: one that does makes cuDNN run a slower
    algorithm for the rest of the run (measured at 12 GiB on an H200: backward 1.42 s instead
    of 0.22 s). The reference runs first in the process, so cuDNN's algorithms are chosen
    uncapped; a fallback under lmsrt would also change the gradients' bits."""
    if _in_a_fresh_process(request):
        return
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        want, _ = _capped_steps(None, None, make=_conv_net)
        torch.cuda.reset_peak_memory_stats()
        _capped_steps(None, None, steps=2, make=_conv_net)
        cap = torch.cuda.max_memory_allocated() * 7 // 8
        gc.collect()
        torch.cuda.empty_cache()
        got, stats = _capped_steps("auto", cap, make=_conv_net, recompute=recompute)
    finally:
        torch.backends.cudnn.deterministic = deterministic
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    steps = stats["history"] + [stats["last_step"]]
    assert steps[0]["out_bytes"] > 0
    assert [s["alloc_failures"] for s in steps[1:]] == [0] * (len(steps) - 1)


def test_a_learning_step_waits_for_pins_under_way():
    """Pins that take a while: the learning step still swaps every eligible tensor rather than
    leave any on the GPU (where in the first step it takes memory from cuDNN's choice of
    algorithms): a swap deferred while use was low is copied out, waiting for its pin, once
    use passes half the limit (NOTE [ Deferred copies ])."""
    device = SimulatedDevice(capacity=CAP, strict=True, pin_threads=2, pin_delay=0.05)
    grads, stats = _train(device, "auto", steps=4, **BACKWARD_TRANSIENT)
    for got, want in zip(grads, _reference(steps=4, **BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    first = _steps(stats)[0]
    # Deferred under half the limit without asking for a pin: none lagged behind one.
    assert first["deferred_tensors"] > 0 and first["host_lagged"] == 0, first
    assert first["out_bytes"] == 15 * 12 * MiB and first["kept_bytes"] == 0, first
    assert first["host_pin_wait_s"] > 0


def test_a_fixed_target_stops_at_what_the_step_saves():
    """At a mark under GPU use that is not lmsrt's (another model's tensors), a fixed mark's
    target would grow by that use every step, and the host pool would pin it."""
    plan = OffloadPlan()
    plan.recorded = [10, 20, 30]
    plan.set_target(1000)
    assert plan.target == 60 and plan.cutoff == 3
    plan.set_target(25)
    assert plan.target == 25 and plan.cutoff == 2


def _surprised(shed: bool, monkeypatch, steps=6):
    """From step 2 on, the model holds 60 MiB in the middle of backward (layers 7 to 2) that
    the learning step did not see, and layer 4's backward asks for a 60 MiB workspace and makes
    do with an eighth of it when that fails, as cuDNN does (keeping the slower algorithm for the
    run). Returns (grads, stats, how often the workspace did not fit)."""
    if not shed:                        # the policy never asks for copies to be given back
        monkeypatch.setattr(AutoPolicy, "shed_to", lambda self, plan, level: 0)
    device = SimulatedDevice(capacity=190 * MiB, strict=True)
    state = {"backward": 0, "held": None, "fell_back": 0}

    def hold():
        state["backward"] += 1
        if state["backward"] >= 2:
            state["held"] = device.empty(60 * MiB)

    def let_go():
        state["held"] = None

    def workspace():
        try:
            device.empty(60 * MiB)
        except torch.OutOfMemoryError:
            state["fell_back"] += 1
            device.empty(60 * MiB // 8)

    grads, stats = _train(device, "auto", steps, on_backward={7: hold, 2: let_go, 4: workspace})
    return grads, stats, state["fell_back"]


def test_copies_fetched_ahead_make_way_when_backward_holds_more_than_predicted(monkeypatch):
    """Copies fetched early in backward, while there was room, are given back unused when the
    model then holds more than the plan predicted, so that a later workspace still fits; they
    come back from host memory when needed. Without that, the workspace fails in every step
    until the headroom has grown past the surprise (on a GPU the first failure is for good:
    cuDNN keeps the slower algorithm). The surprise's first step may fail once: nothing
    predicted it, and what the plan keeps cannot be given back (it did not fail before the
    swap levels counted, at each point, the storages the learning step had seen freed there:
    a level short by one storage swapped one the plan keeps, and left room by accident)."""
    said = says("failed at the memory limit")
    with monkeypatch.context() as m, said:
        _, stats, fell_back = _surprised(False, m)
    assert fell_back > 1
    assert sum(s["alloc_failures"] for s in _steps(stats)) == fell_back
    assert any(s["alloc_failures"] for s in _steps(stats)[2:])

    with lmsrt_warnings():                                  # said for the first step's failure
        grads, stats, fell_back = _surprised(True, monkeypatch)
    assert fell_back <= 1
    steps = _steps(stats)
    assert all(s["alloc_failures"] == 0 for s in steps[2:]), [s["alloc_failures"] for s in steps]
    assert sum(s["prefetch_dropped"] for s in steps[1:]) > 0
    # What was given back came in again: more in than out.
    assert any(s["in_bytes"] > s["out_bytes"] for s in steps[1:])
    want = _reference(steps=6)
    for got, ref in zip(grads, want):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_learning_step_fetches_ahead_only_where_a_transient_cannot_meet_it():
    """The learning step cannot know the model's transients yet: a copy it fetched ahead in
    backward made a workspace fail that fits without it (on a GPU cuDNN then keeps a slower
    algorithm for the run: a segmentation net at 8 GiB, every backward 1.5 s instead of 0.33 s).
    Here layer 8's backward asks for a workspace that fits in the learning step only if nothing
    is fetched ahead of it, and makes do with an eighth when that fails."""
    device = SimulatedDevice(capacity=CAP, strict=True)
    fell_back = []

    def workspace():
        try:
            device.empty(CAP - 80 * MiB)
        except torch.OutOfMemoryError:
            fell_back.append(device.memory_allocated())
            device.empty((CAP - 80 * MiB) // 8)

    grads, stats = _train(device, "auto", steps=4, state=64 * MiB, on_backward={8: workspace})
    assert fell_back == []
    steps = _steps(stats)
    assert steps[0]["out_bytes"] == 15 * 12 * MiB
    for got, want in zip(grads, _reference(steps=4, state=64 * MiB)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # Where use stays low (under a quarter of the limit), it still fetches ahead.
    _, stats = _train(SimulatedDevice(capacity=CAP, strict=True), "auto", steps=1, state=8 * MiB)
    assert stats["last_step"]["prefetch_hits"] > 0


class _HeldLate(Scripted):
    """From step 2 on, the model holds ``hold`` bytes from forward layer ``at`` to the end of
    forward: use that the learning step did not see (on a GPU, a tensor the model still held
    that the learning step counted as lmsrt's, depending on when its copies finished)."""

    def __init__(self, device, hold, at, **script):
        super().__init__(device, **script)
        self.hold, self.at, self.steps, self.held = hold, at, 0, None

    def step(self, x):
        self.steps += 1
        n = len(self.weights)
        for i, w in enumerate(self.weights):
            if i == self.at and self.steps >= 2:
                self.held = self.device.empty(self.hold)
            x = _Layer.apply(x, w, self.device, 0, self.bwd if i == n - 1 else 0)
        self.held = None
        return x.sum()


def test_a_step_that_swaps_what_its_plan_keeps_is_planned_again():
    """Forward uses more than the profile learnt from layer 12 on, so planned steps find use
    over the level there and swap storages the plan keeps as they are saved, with no forward
    left to copy them out in, and backward needs them first (measured on an LM: its 3 GiB
    log-probabilities, every step, 0.37 s a step against 0.26-0.31). One such step is enough:
    the policy raises what it learnt from that point and plans again, and the later steps
    offload earlier storages instead."""
    grads, stats = _train(SimulatedDevice(capacity=CAP, strict=True), "auto",
                          model_class=_HeldLate, hold=24 * MiB, at=12, **BACKWARD_TRANSIENT)
    steps = _steps(stats)
    beyond = [s["beyond_plan_bytes"] for s in steps]
    assert beyond[1] > 0, beyond
    assert "over the prediction" in steps[1]["policy_note"]
    assert all(b == 0 for b in beyond[2:]), beyond
    for got, want in zip(grads, _reference(**BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_restored_storage_waiting_between_two_unpacks_counts_in_the_plan():
    """Storage 0 is read twice in backward, at its first point (a skip connection) and at its
    last; in between, a transient of 350 (a convolution's workspace). Offloaded, it is
    restored at backward point 0 and waits there through the transient, which the learning
    step counted as lmsrt's: a plan that offloads it to keep storage 1 predicts 450 where the
    step reaches 550 (on a GPU, cuDNN's workspace fails and the slower algorithm is kept for
    the run). Counting the wait, keeping storage 0 and offloading storage 1 fits."""
    limit = 534                                   # bound 534 - 33 = 501
    policy = AutoPolicy(limit=limit, window=1 << 30)
    policy.learning = False
    prof = _profile(fwd_own=[100, 100, 100, 100], fwd_peak=[100, 100, 100, 100],
                    bwd_own=[0, 100, 100, 100], bwd_peak=[100, 100, 350, 100],
                    sizes=[100] * 4, last_use=[3, 2, 1, 0])
    prof.first_use = [0, 2, 1, 0]
    policy.profile = prof
    plan = OffloadPlan()
    plan.recorded, plan.planned = [100] * 4, True
    policy.begin_step(plan, base=0, first=100)
    assert policy.bound == 501
    assert plan.chosen == [False, True, False, False]
    assert policy.predicted_peak == 450            # 350 beside storage 0, kept
    # Without the second read, storage 0 is the one to offload (the earliest), as before.
    prof.first_use = [3, 2, 1, 0]
    policy._planned_for = None
    policy.begin_step(plan, base=0, first=100)
    assert plan.chosen == [True, False, False, False]


@pytest.mark.parametrize("first", ["graph-dropped", "no-grad"])
def test_auto_learns_from_the_first_step_with_a_backward(first):
    """A validation forward before training (Lightning's sanity check; an eval pass that drops
    its graph, or one under no_grad) is not a training step: auto learns from the first step
    whose saved tensors come back in backward, and training fits where it fits without the
    validation pass."""
    device = SimulatedDevice(capacity=CAP, strict=True)
    grads, stats = _train(device, "auto", validate=3, grad=first != "no-grad",
                          **BACKWARD_TRANSIENT)
    for got, want in zip(grads, _reference(**BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = _steps(stats)
    assert all(s["gpu_peak_bytes"] <= CAP for s in steps)
    assert steps[-1]["mode"] == "plan", [s["mode"] for s in steps]


@pytest.mark.parametrize("lms_frac", ["auto", 0.5])
def test_an_evaluation_inside_the_block_after_every_step_leaves_the_plan_standing(lms_frac):
    """``with lms, torch.no_grad():`` around an evaluation after each training step begins a
    step that saves nothing: it stays in the history, and no plan or policy learns of it. (It
    ended the plan: under a fixed mark the next training step found no sequence to follow, so
    an evaluation after every step left every training step unplanned; under auto the plan
    "left" banned steps that keep everything from the C++ hooks.) Exactly as without LMS."""
    device = SimulatedDevice(capacity=CAP, strict=True)
    grads, stats = _train(device, lms_frac, steps=6, evaluate=True, **BACKWARD_TRANSIENT)
    for got, want in zip(grads, _reference(steps=6, **BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = stats["history"]
    training, evaluations = steps[::2], steps[1::2]
    assert len(training) == 6 and len(evaluations) == 5, steps
    assert [s["mode"] for s in training[1:]] == ["plan"] * 5, [s["mode"] for s in steps]
    assert all(s["policy_note"] == "saved nothing: the plan stands" for s in evaluations)
    assert all(s["gpu_peak_bytes"] <= CAP for s in steps)


class _Tuned(Scripted):
    """cuDNN's benchmark mode as the simulated device sees it: the first call of each shape
    tries algorithms with workspaces as large as memory allows (an allocation that fails is
    caught and the next tried), so the first step's forward peaks near the capacity."""

    def __init__(self, device, **script):
        super().__init__(device, **script)
        device.tuning = True
        self.first = True

    def _try(self):
        free = self.device.capacity - self.device.memory_allocated() - MiB
        self.device.empty(free)              # the largest workspace that fits, freed at once

    def step(self, x):
        tuned, self.on_backward = self.on_backward, {}
        if self.first:                       # each layer's first backward tries algorithms
            self.first = False
            self.on_backward = {i: self._try for i in range(len(self.weights) - 1)}
        try:
            return super().step(x)
        finally:
            self.on_backward = tuned


def test_auto_learns_after_cudnn_benchmark_trials():
    """The trials' workspaces are not what later steps need: learnt from, every storage would
    move for good; learnt from the step after, only about what the cap requires."""
    device = SimulatedDevice(capacity=CAP, strict=True)
    grads, stats = _train(device, "auto", model_class=_Tuned, **BACKWARD_TRANSIENT)
    for got, want in zip(grads, _reference(**BACKWARD_TRANSIENT)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = _steps(stats)
    assert all(s["gpu_peak_bytes"] <= CAP for s in steps)
    saved = 15 * 12 * MiB
    for s in steps[3:]:
        assert s["mode"] == "plan" and 0 < s["out_bytes"] < saved * 0.75, s["out_bytes"]
        # Planned from the trials, the prediction stands over the cap (every workspace tried
        # counted as the model's own) and the step moves more than the cap requires.
        assert s["predicted_peak_bytes"] <= CAP, s["predicted_peak_bytes"]
    assert steps[0]["out_bytes"] == steps[1]["out_bytes"] == saved      # two learning steps


def _counting_pins(device):
    """Count the bytes ``device`` ever pins (its ``pinned_total`` falls again as pins are given
    back)."""
    pinned = device.pinned
    device.pins = []

    def counted(nbytes):
        device.pins.append(nbytes)
        return pinned(nbytes)

    device.pinned = counted
    return device


# Half the limit and more: 32 layers of 6 MiB, no state (186 MiB saved and at the peak).
SAVED_ONLY = dict(layers=32, act=6 * MiB, state=0)


@pytest.mark.parametrize("limit, script", [(4 * 512 * MiB, BACKWARD_TRANSIENT),
                                           (800 * MiB, BACKWARD_TRANSIENT),
                                           (390 * MiB, SAVED_ONLY)],
                         ids=["16pct", "40pct", "48pct-saved-only"])
def test_a_model_under_half_the_limit_neither_pins_nor_moves(limit, script):
    """A model that fits with room to spare: its first step keeps every saved tensor (deferred,
    never copied) and pins nothing, and no later step does either (NOTE [ Deferred copies ]).
    At 800 MiB its use passes a quarter of the limit in forward (224 MiB at forward's end, 308
    at the peak). At 390 MiB its saved tensors alone are nearly half the limit: a plan that
    counted them twice (as the model's own in the learning step, and again as kept) would
    predict a peak over the bound and move some."""
    device = _counting_pins(SimulatedDevice(capacity=limit, strict=True))
    grads, stats = _train(device, "auto", steps=4, **script)
    for got, want in zip(grads, _reference(steps=4, **script)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    steps = _steps(stats)
    saved = (script.get("layers", 16) - 1) * script.get("act", 12 * MiB)
    peak = max(s["gpu_peak_bytes"] for s in steps)
    assert peak < limit // 2
    for s in steps:
        assert s["out_bytes"] == 0 and s["host_pinned_bytes"] == 0, s
        assert s["kept_bytes"] == saved, s
    assert steps[0]["deferred_tensors"] == steps[0]["kept_tensors"]
    assert [s["mode"] for s in steps[1:]] == ["plan"] * 3
    assert steps[-1]["predicted_peak_bytes"] == peak          # nothing counted twice
    assert device.pins == [] and device.pinned_total == 0


def test_learning_again_keeps_the_allocators_lessons_and_tuned_shapes():
    """recompute/regions.py has the engine learn again when it recomputes other regions: what the
    model saves changed, not the shapes cuDNN tuned (one learning step, not two) nor the headroom
    that allocation failures raised (NOTE [ Auto ], 7)."""
    device = SimulatedDevice(capacity=CAP, strict=True)
    model = _Tuned(device, **BACKWARD_TRANSIENT)
    lms = lmsrt.LMS(device=device, lms=1, lms_frac="auto")
    x0 = torch.randn(model.rows, model.cols, generator=torch.Generator().manual_seed(1))

    def step():
        for w in model.weights:
            w.grad = None
        with lms:
            loss = model.step(x0.clone().requires_grad_())
        loss.backward()

    for _ in range(4):
        step()
    engine = lms._engine
    policy = engine.policy
    policy.headroom = raised = policy.headroom + (CAP >> 6)
    policy._tried = None       # what the recomputed regions save differs from the tuned step's
    engine.relearn()
    for _ in range(3):
        step()
    steps = _steps(lms.stats())
    assert engine.policy is policy and policy.headroom == raised
    assert "the regions recomputed changed" in steps[4]["policy_note"], steps[4]["policy_note"]
    assert [s["mode"] for s in steps[5:]] == ["plan", "plan"]
    assert steps[5]["out_bytes"] < steps[4]["out_bytes"]



@pytest.mark.cuda
def test_a_model_under_half_the_limit_neither_pins_nor_moves_on_a_gpu():
    """The same on a GPU, capped so that the step's plain peak is 40% of the limit."""
    torch.manual_seed(0)
    model = transformer(d=512, layers=8, heads=8).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    train_step(model, x)                             # grads exist, as in every later step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ref = train_step(model, x)
    peak = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(peak / 0.4 / total)
    try:
        lms = lmsrt.LMS(device="cuda", lms=1, lms_frac="auto", pin_ahead=False)
        for _ in range(3):
            assert_same(ref, train_step(model, x, lms))
        steps = _steps(lms.stats())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    for s in steps:
        assert s["out_bytes"] == 0 and s["host_pinned_bytes"] == 0 and s["host_pin_s"] == 0, s
        assert s["kept_bytes"] > 0, s
    assert steps[0]["deferred_tensors"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("loop", ["cudnn-benchmark", "eval-first"])
def test_auto_fits_real_loops_on_a_gpu(loop, monkeypatch):
    """Auto on a conv net capped at 85% of its plain peak: with cuDNN's benchmark mode on (the
    step that tried algorithms is not learnt from), or after a validation forward under no_grad
    (not learnt from either; NOTE [ Auto ], 6). It fits, plans, and trains exactly, with no
    allocation failing at the cap."""
    from models import convnet
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", loop == "cudnn-benchmark")
    torch.manual_seed(0)
    before = torch.cuda.memory_allocated()     # (anything another test left: not this model's)
    model = convnet(c=32).cuda()
    x = torch.randn(8, 3, 512, 512, device="cuda")
    train_step(model, x)                 # grads exist, and cuDNN has tried its algorithms
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ref = train_step(model, x)
    peak = torch.cuda.max_memory_allocated() - before
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()             # blocks cached before the cap would not count against it
    torch.cuda.set_per_process_memory_fraction((before + peak * 0.85) / total)
    try:
        lms = lmsrt.LMS(device="cuda", lms=1, lms_frac="auto", pin_ahead=False)
        if loop == "eval-first":
            with lms, torch.no_grad():
                model.eval()
                model(x)
                model.train()
        for _ in range(5):
            assert_same(ref, train_step(model, x, lms))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        steps = _steps(lms.stats())
        notes = [(s["mode"], s["out_bytes"], s["gpu_peak_bytes"], s["predicted_peak_bytes"],
                  s["alloc_failures"], s["policy_note"]) for s in steps]
        print("\n".join(map(str, notes)))       # shown where the test fails
        print([{k: s[k] for k in ("bound_bytes", "headroom_bytes", "alloc_retries",
                                   "backward_retries", "prefetch_dropped", "recomputed_bytes",
                                   "recipe_bytes", "rebuild_checks")} for s in steps])
        regions = lms.stats()["regions"]
        print({k: regions[k] for k in ("note", "each", "unfit")})
    assert any(s["mode"] == "plan" for s in steps[1:]), notes
    assert sum(s["alloc_failures"] for s in steps) == 0, notes
    said = " ".join(s["policy_note"] for s in steps)
    assert ("benchmark mode tried" in said if loop == "cudnn-benchmark"
            else steps[0]["policy_note"] == "saved nothing: the plan stands"), notes
