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
