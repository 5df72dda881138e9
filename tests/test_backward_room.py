"""An allocation of backward's that fails at the limit (a fetch on demand, a rebuild, a region's
rerun) gives back the copies fetched ahead and not yet used, and is tried once more
(``SwapEngine.room_in_backward``): measured on an H200, a conv net's planned step ran out of
memory in a region's rerun with copies fetched ahead on the GPU."""
from __future__ import annotations

import pytest
import torch
from models import assert_same_steps
from test_region_exact import Stack, _lms, _train

import lmsrt.recompute.regions


def _failing(real, when):
    """``real``, raising the allocator's error instead where ``when(engine)`` says so."""
    calls = {"failed": 0}

    def run(*args, **kwargs):
        if when():
            calls["failed"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)
    return run, calls


def _plain(x, steps=4):
    torch.manual_seed(0)
    model = Stack()
    return model, _train(model, x, steps)


def test_a_rerun_that_fails_gives_back_the_copies_fetched_ahead_and_runs_again(monkeypatch):
    x = torch.randn(64, 32)
    plain_model, plain = _plain(x)
    model = Stack()
    model.load_state_dict(plain_model.state_dict())
    lms = _lms("sim")
    engine = lms._engine
    once = {"left": 1}

    def when():        # the first rerun of a planned step that finds copies fetched ahead
        if engine.step.step >= 3 and engine.prefetch.ahead and once["left"]:
            once["left"] -= 1
            return True
        return False

    rerun, calls = _failing(lmsrt.recompute.regions.rerun, when)
    monkeypatch.setattr(lmsrt.recompute.regions, "rerun", rerun)
    under = _train(model, x, 4, lms)
    assert_same_steps(plain, under)
    total = lms.stats()["total"]
    assert calls["failed"] == 1
    assert total["backward_retries"] == 1 and total["prefetch_dropped"] >= 1, total
    assert total["recomputed_regions"] > 0


def test_a_fetch_that_fails_gives_back_the_copies_fetched_ahead_and_fetches_again():
    x = torch.randn(64, 32)
    plain_model, plain = _plain(x)
    model = Stack()
    model.load_state_dict(plain_model.state_dict())
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim", recompute=False)
    engine = lms._engine
    once = {"left": 1}

    def when():
        if engine.step.step >= 3 and engine.prefetch.ahead and once["left"]:
            once["left"] -= 1
            return True
        return False

    engine._resident, calls = _failing(engine._resident, when)
    under = _train(model, x, 4, lms)
    assert_same_steps(plain, under)
    total = lms.stats()["total"]
    assert calls["failed"] == 1
    assert total["backward_retries"] == 1 and total["prefetch_dropped"] >= 1, total


def test_a_failure_with_nothing_fetched_ahead_is_raised_with_lmsrts_context():
    x = torch.randn(64, 32)
    torch.manual_seed(0)
    model = Stack()
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim", recompute=False)
    engine = lms._engine
    engine._resident, calls = _failing(engine._resident, lambda: not engine.prefetch.ahead)
    with pytest.raises(torch.OutOfMemoryError, match="bringing a saved tensor back"):
        _train(model, x, 1, lms)
    assert calls["failed"] == 1 and lms.stats()["last_step"]["backward_retries"] == 0


class _CheckedFrame:
    """A checked call after its rerun (recompute/reruns.py): the rerun's tensors in ``again``,
    handles of what it kept in ``outer``; ``outer_unpack`` brings one back (here: made afresh,
    the first one other bits than the rerun's) and counts how many are alive at once."""

    def __init__(self, n: int):
        import types
        import weakref
        self.checking, self.kind, self.leaves = True, "kind", []
        self.region = types.SimpleNamespace(modules=[], name="block")
        self.rerun = {i: torch.full((8,), float(i)) for i in range(n)}
        self.again, self.outer = dict(self.rerun), {i: i for i in range(n)}
        self.alive, self.most = weakref.WeakSet(), 0

    def outer_unpack(self, i: int) -> torch.Tensor:
        kept = torch.full((8,), float(i) + (0.5 if i == 0 else 0.0))
        self.alive.add(kept)
        self.most = max(self.most, len(self.alive))
        return kept


def test_a_check_brings_back_what_it_kept_one_tensor_at_a_time():
    """A check compares its rerun with what it kept one tensor at a time (measured on an H200:
    all of it brought back at once beside the rerun's ran a conv net out of memory at 85% of
    its peak); backward gets the rerun's tensor where the bits are the same, the kept one where
    not, and the kind is refused."""
    from lmsrt.recompute.reruns import RerunCheck

    check, frame, refused = RerunCheck(device=None), _CheckedFrame(6), []

    class Backward(torch.autograd.Function):      # compare runs on autograd's thread
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            check.compare(frame, lambda region, why: refused.append(region.name))
            return grad

    Backward.apply(torch.zeros(1, requires_grad=True)).sum().backward()
    assert frame.most == 2, frame.most          # the one that differs, and one at a time
    assert frame.again[0] is not frame.rerun[0]
    assert torch.equal(frame.again[0], torch.full((8,), 0.5))
    assert all(frame.again[i] is frame.rerun[i] for i in range(1, 6))
    assert check.verdicts == {"kind": False} and refused == ["block"]
