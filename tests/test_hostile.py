"""Hostile cases (issue 36): threads racing over shared queues, backward after close, inputs of a
rebuild changed where autograd cannot see it (``.data``), optimizer steps between forward and
backward. Gradients are compared with ``torch.equal`` against the run without LMS; each check
runs on the simulated device, and on CUDA under the marker:

    PYTHONPATH=. python -m pytest -q tests/test_hostile.py             # CUDA twins skipped
    PYTHONPATH=. python -m pytest -q -m cuda tests/test_hostile.py     # on a GPU machine
"""
import collections
import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from models import (
    DEVICES,
    assert_same,
    make_lms,
    mlp,
    run_threads,
    torch_device,
    train_step,
)

from lmsrt.recompute.recipes import RecipeTable

pytestmark = pytest.mark.usefixtures("small_rebuilds_pay")


# -- threads ------------------------------------------------------------------------------------

class _Racing(collections.deque):
    """A queue whose first pop on each thread waits until ``n`` threads are about to pop: each
    has seen the queue non-empty before any of them takes from it."""

    def __init__(self, n: int):
        super().__init__()
        self.barrier = threading.Barrier(n, timeout=10)
        self.seen, self.armed = threading.local(), False

    def popleft(self):
        if self.armed and not getattr(self.seen, "once", False):
            self.seen.once = True
            self.barrier.wait()
        return super().popleft()


def test_threads_sweeping_one_recipe_table_at_once_never_pop_an_empty_queue():
    table = RecipeTable()
    table._dead = racing = _Racing(4)
    storage = torch.empty(8).untyped_storage()
    table.note(storage, object())
    del storage                                 # its reference queues itself: one entry, 4 pops
    assert len(racing) == 1
    racing.armed = True
    errors = []

    def sweep():
        try:
            table.sweep()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    run_threads(sweep, [()] * 4)
    assert not errors, errors
    assert not racing and not table


def test_threads_noting_and_freeing_recipes_soak():
    """Eight threads note recipes of storages that die at once, sweeping as they go, with the
    interpreter switching threads every few bytecodes."""
    table = RecipeTable()
    errors = []

    def work():
        try:
            for _ in range(3000):
                table.note(torch.empty(1).untyped_storage(), None)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    run_threads(work, [()] * 8, timeout=300)
    assert not errors, errors
    table.sweep()
    assert not table


# -- close --------------------------------------------------------------------------------------

def _check_backward_after_close(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = mlp(d=64, layers=6).to(dev)
    x = torch.randn(32, 64, device=dev)
    w = torch.randn(64, device=dev, requires_grad=True)
    lms = make_lms(kind)
    with lms:
        # Backward first unpacks a small tensor that stays on the GPU, and moves prefetch along.
        loss = (model(x).sum(0).tanh() * w).sum()
    lms.close()
    with pytest.raises(RuntimeError, match="backward needs a saved tensor .* closed"):
        loss.backward()


@pytest.mark.parametrize("kind", DEVICES)
def test_backward_after_close_fails_with_the_clear_error(kind):
    _check_backward_after_close(kind)


# -- inputs of a rebuild that change between forward and backward -------------------------------

def _train_with(kind, between, lms=None, steps=3, norm=False):
    """``steps`` steps of a small MLP under bf16 autocast, calling ``between(model, opt)``
    between each forward and its backward; returns each step's gradients and parameters."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256)] + [torch.nn.LayerNorm(256)] * norm
    model = torch.nn.Sequential(*layers, torch.nn.GELU(), torch.nn.Linear(256, 64)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64, device=dev)
    seen = []
    for _ in range(steps):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            if lms is None:
                y = model(x)
            else:
                with lms:
                    y = model(x)
        loss = y.float().square().mean()
        between(model, opt)
        loss.backward()
        seen.append([p.grad.clone() for p in model.parameters()]
                    + [p.detach().clone() for p in model.parameters()])
    return seen


def _scale_through_data(model, opt):
    for p in model.parameters():
        p.data.mul_(0.9)                       # decoupled weight decay, EMA: no version bump


def _optimizer_step(model, opt):
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.full_like(p, 0.01)
    opt.step()                                 # one network's step before another's backward


def _check_parameters_changed_before_backward(kind, between, norm):
    lms = make_lms(kind)
    ref = _train_with(kind, between, norm=norm)
    got = _train_with(kind, between, lms=lms, norm=norm)
    for r, g in zip(ref, got):
        assert_same((torch.zeros(()), r), (torch.zeros(()), g))
    # The weights' bf16 casts were rebuilt, not moved (made before the parameters changed).
    assert lms.stats()["total"]["rebuilt_bytes"] > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_parameters_scaled_through_data_before_backward_train_exactly(kind):
    _check_parameters_changed_before_backward(kind, _scale_through_data, norm=True)


@pytest.mark.parametrize("kind", DEVICES)
def test_an_optimizer_step_before_backward_trains_exactly(kind):
    # (No LayerNorm: it saves its weight itself, and PyTorch then raises at this step.)
    _check_parameters_changed_before_backward(kind, _optimizer_step, norm=False)


def _train_in_closures(kind, lms=None, steps=4):
    """``steps`` steps whose forward and backward run inside the optimizer's step, as a closure
    (Lightning's loop, LBFGS): the step's pre-hook comes before forward, and the step before it
    changed the parameters that the last step's rebuilds read. Each step's parameters."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    # A pre-norm block: its LayerNorm's output (rebuilt, from the norm's parameters) is used in
    # backward after the last swapped tensor (the norm's own input is the script's, kept).
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device=dev)

    def closure():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16), (lms or contextlib.nullcontext()):
            loss = model(x).float().square().mean()
        loss.backward()
        return loss

    seen = []
    for _ in range(steps):
        opt.step(closure)
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


def _check_closures(kind):
    lms = make_lms(kind)
    for r, g in zip(_train_in_closures(kind), _train_in_closures(kind, lms=lms)):
        assert_same((torch.zeros(()), r), (torch.zeros(()), g))
    steps = lms.stats()["history"]
    # The LayerNorm's output and the weights' casts, which read parameters, were rebuilt in
    # each backward, and only there: nothing of a finished step was made again at the next
    # step's pre-hook (it raised, its parameters changed since; elsewhere it was work thrown away).
    assert all(s["rebuilt_tensors"] == s["recipe_tensors"] > 0 for s in steps[1:]), steps


@pytest.mark.parametrize("kind", DEVICES)
def test_forward_and_backward_inside_the_optimizers_step_train_exactly(kind):
    _check_closures(kind)


def _check_activation_changed_through_data(kind):
    dev = torch_device(kind)
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 256).to(dev), torch.nn.Linear(256, 64).to(dev)
    opt = torch.optim.SGD([*lin1.parameters(), *lin2.parameters()], lr=0.1)
    x = torch.randn(32, 64, device=dev)
    lms = make_lms(kind)
    with lms:                                  # the first step checks GELU's rebuild: trusted
        F.gelu(lin1(x)).matmul(lin2.weight.t()).square().mean().backward()
    with lms:
        h = lin1(x)
        loss = F.gelu(h).matmul(lin2.weight.t()).square().mean()
    h.data.mul_(2)                             # GELU's input, changed where no version counts
    loss.backward()
    with pytest.raises(RuntimeError, match="rebuilt for backward \\(gelu\\) differs .* "
                                           "recompute=False"):
        opt.step()
    assert lms.stats()["last_step"]["rebuilt_bytes"] > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_an_activation_changed_through_data_fails_before_the_step_not_silently(kind):
    _check_activation_changed_through_data(kind)


# -- PyTorch's own saved-tensor-hook tests, as they apply to an LMS -----------------------------

class _AddInBackward(torch.autograd.Function):
    """Saves its input and adds 1 to the saved tensor in place in backward (torch's
    test_saved_tensors_hook_version_counter_not_shared)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.add_(1)
        return grad * x.cos()


def _check_in_place_on_an_unpacked_saved_tensor(kind):
    """Without hooks the tensor backward unpacks is the original, sharing its version counter:
    an in-place op on it changes the original and bumps its version. An LMS does the same for
    what it keeps, and for what it swapped while the original is still there."""
    dev = torch_device(kind)

    def run(lms, n, leaf):
        torch.manual_seed(0)
        w = torch.randn(n, device=dev, requires_grad=True)
        a = w if leaf else w * 1
        with lms if lms is not None else contextlib.nullcontext():
            out = _AddInBackward.apply(a)
        out.sum().backward()
        return a.detach().clone(), a._version, w.grad

    for n, leaf in [(64, True), (64, False), (4096, False)]:    # kept, kept, swapped (alive)
        lms = make_lms(kind)
        ref, got = run(None, n, leaf), run(lms, n, leaf)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[2], got[2])
        assert ref[1] == got[1], (n, leaf, ref[1], got[1])
        if n == 4096:
            assert lms.stats()["last_step"]["out_tensors"] == 1


@pytest.mark.parametrize("kind", DEVICES)
def test_an_in_place_op_on_an_unpacked_saved_tensor_acts_as_without_hooks(kind):
    _check_in_place_on_an_unpacked_saved_tensor(kind)


def _top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _check_exit_during_backward(kind):
    """torch's test_saved_tensor_hooks_extra_exit_during_bw_no_crash, with an LMS: its block
    left inside backward (on autograd's device thread, on CUDA) ten times over; one more exit
    afterwards takes its hooks off at once, and a save after it has no hooks at all."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    dev = torch_device(kind)
    lms = make_lms(kind)
    for _ in range(10):
        lms.__enter__()
        x = torch.randn(64, 64, device=dev, requires_grad=True)
        y = (x * x.exp()).sum()
        y.register_hook(lambda g: lms.__exit__(None, None, None))
        y.backward()
    lms.__exit__(None, None, None)
    assert _top_hooks() is None
    assert _get_current_dispatch_mode_stack() == []
    a = torch.tensor(1.0, device=dev, requires_grad=True)
    y = a.exp()               # held: its node owns the saved tensor that register_hooks writes
    y.grad_fn._raw_saved_result.register_hooks(lambda t: t, lambda t: t)
    # Hooks pushed inside the block and left there stay; the LMS's own go at its exit.
    inner = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    lms.__enter__()
    inner.__enter__()
    lms.__exit__(None, None, None)
    assert _top_hooks() is not None and _top_hooks()[0] is not lms._engine.pack
    inner.__exit__()
    assert _top_hooks() is None


@pytest.mark.parametrize("kind", DEVICES)
def test_an_exit_inside_backward_leaves_no_hooks_after_the_next_exit(kind):
    _check_exit_during_backward(kind)


def test_lms_frac_0_moves_every_eligible_tensor_but_uses_held_sources_in_place():
    """README's `lms_frac` row: at 0 every eligible tensor goes out, and a source whose copy is
    still running when backward needs it (held within 1/8 of the limit) is used in place."""
    model, x = mlp(d=64, layers=6), torch.randn(32, 64)
    ref = train_step(model, x)
    lms = make_lms("sim", copy_lag=10 ** 6, recompute=False)     # copies never seen done
    assert_same(ref, train_step(model, x, lms=lms))
    step = lms.stats()["last_step"]
    assert step["out_tensors"] > 0 and step["kept_tensors"] == 0
    assert step["in_bytes"] == 0
