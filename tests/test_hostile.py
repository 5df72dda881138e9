"""Hostile cases (issue 36): threads racing over shared queues, backward after close, inputs of a
rebuild changed where autograd cannot see it (``.data``), optimizer steps between forward and
backward. Gradients are compared with ``torch.equal`` against the run without LMS; each check
runs on the simulated device, and on CUDA under the marker:

    PYTHONPATH=. python -m pytest -q tests/test_hostile.py             # CUDA twins skipped
    PYTHONPATH=. python -m pytest -q -m cuda tests/test_hostile.py     # on a GPU machine
"""
import collections
import threading

import pytest
import torch
from models import (
    DEVICES,
    make_lms,
    mlp,
    rebuild_small_tensors,
    run_threads,
    torch_device,
)

from lmsrt.rebuild import RecipeTable


@pytest.fixture(autouse=True)
def _small_rebuilds_pay(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    rebuild_small_tensors(callspec.params.get("kind", "sim") if callspec else "sim", monkeypatch)


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
