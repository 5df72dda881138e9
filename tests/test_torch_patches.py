"""What lmsrt changes in torch goes with the last LMS that needed it (torch_patches.py, NOTE [ What
lmsrt changes in torch ], 7 and 8): ``Parameter.data`` is torch's own descriptor again and no
optimizer step pre-hook of lmsrt's is left, after ``close()`` or after the LMS is collected; while
another LMS lives, the patches stay and its rebuilds stay exact. Each check runs on the simulated
device, and on CUDA under the marker:

    PYTHONPATH=. python -m pytest -q tests/test_torch_patches.py
    PYTHONPATH=. python -m pytest -q -m cuda tests/test_torch_patches.py     # on a GPU machine
"""
import gc
import inspect
import subprocess
import sys

import pytest
import torch
from models import DEVICES, make_lms, torch_device
from processes import ROOT, clean_env
from torch.optim.optimizer import _global_optimizer_pre_hooks

from lmsrt.torch_patches import CountedPatch

pytestmark = pytest.mark.usefixtures("small_rebuilds_pay")

TORCH_DATA = torch._C.TensorBase.data          # what Parameter.data is without lmsrt


def _data_patched() -> bool:
    return inspect.getattr_static(torch.nn.Parameter, "data") is not TORCH_DATA


def _lmsrt_step_hooks() -> list:
    """The step pre-hooks of rebuilds (params.py); the optimizer mover's have their own test
    (test_optimizer_state.py)."""
    return [h for h in _global_optimizer_pre_hooks.values()
            if getattr(h, "__module__", "") == "lmsrt.params"]


def _train(kind, lms=None, steps=3):
    """Steps of a small MLP under bf16 autocast whose weights are scaled through ``p.data``
    between forward and backward (a rebuild of their casts must be made before that); each
    step's gradients and parameters."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to(dev)
    x = torch.randn(32, 64, device=dev)
    seen = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            if lms is None:
                y = model(x)
            else:
                with lms:
                    y = model(x)
        loss = y.float().square().mean()
        for p in model.parameters():
            p.data.mul_(0.9)                   # decoupled weight decay: no version bump
        loss.backward()
        seen += [p.grad.clone() for p in model.parameters()]
        seen += [p.detach().clone() for p in model.parameters()]
    return seen


def _check_exact(kind, ref, lms):
    got = _train(kind, lms)
    assert all(torch.equal(r, g) for r, g in zip(ref, got))
    assert lms.stats()["total"]["rebuilt_bytes"] > 0      # casts of parameters were rebuilt


def _check_patches_go_with_the_last_lms(kind):
    gc.collect()                               # LMS objects other tests left to the collector
    assert not _data_patched() and not _lmsrt_step_hooks()
    ref = _train(kind)
    first, second = make_lms(kind), make_lms(kind)
    assert _lmsrt_step_hooks() and not _data_patched()     # p.data: at the first rebuild
    _check_exact(kind, ref, first)
    _check_exact(kind, ref, second)
    assert _data_patched() and len(_lmsrt_step_hooks()) == 1
    first.close()
    assert _data_patched() and len(_lmsrt_step_hooks()) == 1    # the second one lives
    _check_exact(kind, ref, second)
    second.close()
    assert torch.nn.Parameter.data is TORCH_DATA and "data" not in vars(torch.nn.Parameter)
    assert not _lmsrt_step_hooks()
    # An LMS made afterwards makes them again, and is exact; collected, it takes them too.
    third = make_lms(kind)
    _check_exact(kind, ref, third)
    assert _data_patched() and _lmsrt_step_hooks()
    del third
    gc.collect()
    assert torch.nn.Parameter.data is TORCH_DATA and not _lmsrt_step_hooks()


_FRESH = """
import sys
sys.path.insert(0, {tests!r})
import pytest
from models import rebuild_small_tensors
import test_torch_patches
with pytest.MonkeyPatch.context() as monkeypatch:
    rebuild_small_tensors({kind!r}, monkeypatch)
    test_torch_patches._check_patches_go_with_the_last_lms({kind!r})
print("ok")
"""


@pytest.mark.parametrize("kind", DEVICES)
def test_torch_patches_go_with_the_last_lms(kind):
    """In a process of its own: an LMS another test left alive in this one keeps the patches,
    as it should, and the check needs the last LMS of the process to be its own."""
    code = _FRESH.format(tests=str(ROOT / "tests"), kind=kind)
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.splitlines()[-1:] == ["ok"], result.stderr


class _User:
    pass


def test_a_counted_patch_is_made_once_and_undone_by_its_last_user():
    made, undone = [], []
    patch = CountedPatch("test", lambda: (made.append(1), lambda: undone.append(1))[1])
    a, b = _User(), _User()
    patch.add_user(a)
    patch.add_user(a)                          # counted once
    patch.add_user(b)
    assert patch.installed and made == [1]
    patch.remove_user(a)
    patch.remove_user(a)                       # removed once
    assert patch.installed and undone == []
    del b                                      # collected: its count goes with it
    gc.collect()
    assert not patch.installed and undone == [1]
    patch.add_user(a)                          # made again for a new user
    assert patch.installed and made == [1, 1]
    patch.remove_user(a)
    assert undone == [1, 1]
