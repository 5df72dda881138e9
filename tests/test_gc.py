"""What lmsrt leaves to Python's cyclic collector: nothing. Every object a step makes (handles,
storage records, region frames, the flattened arguments of a region call) is freed by reference
counting, so a step adds no cyclic garbage and no full collection is needed to free it. The
collector is the user's: these tests turn it off only around their own steps."""
import contextlib
import gc
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

import lmsrt
from lmsrt.device import SimulatedDevice
from lmsrt.engine.records import KeptHandle, SwapHandle
from lmsrt.recompute.frames import Frame, flatten


class Rotary(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor


class Layer(nn.Module):
    """A block called as transformers calls its decoder layers: keyword arguments, a tuple of
    tensors among them, a flag and None."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask=None, position=None, cache=None, use_cache=False):
        h = self.ln(x) * position[0] + position[1]
        return x + self.fc2(F.gelu(self.fc1(h))) * mask


class Model(nn.Module):
    def __init__(self, d: int = 32, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(self, x):
        mask = torch.ones_like(x)
        position = (torch.ones_like(x), torch.zeros_like(x))
        for layer in self.layers:
            x = layer(x, mask=mask, position=position, cache=None, use_cache=False)
        return x


def _recomputing() -> lmsrt.LMS:
    """Its plan recomputes every region (a link of 1 byte/s, any excess worth it)."""
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device=SimulatedDevice(capacity=1 << 30))
    lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    return lms


def _swapping() -> lmsrt.LMS:
    """It swaps every saved storage out and back."""
    return lmsrt.LMS(lms=1, lms_frac=0.0, recompute=False,
                     device=SimulatedDevice(capacity=1 << 30))


# What autograd holds for a saved tensor, and a region call's frame. (A storage's record,
# ``Offloaded``, lives on to the next step's boundary, where the engine lets it go.)
_HELD = (SwapHandle, KeptHandle, Frame)


def _settle() -> None:
    """Collect until nothing is left: a collection may free objects whose weak references'
    callbacks let go of more (torch's fake tensors, after a compilation earlier in the process,
    fell as 194 objects of garbage in the next collection)."""
    while gc.collect():
        pass


def _garbage_per_step(lms, steps: int = 5) -> list:
    """Per step, with the collector off: what a collection then finds unreachable, and the
    handles and region frames of the finished step still alive."""
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    found = []
    was = gc.isenabled()
    _settle()
    gc.disable()
    try:
        for _ in range(steps):
            with lms if lms is not None else contextlib.nullcontext():
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            handles = sum(type(o) in _HELD for o in gc.get_objects())
            found.append((gc.collect(), handles))
    finally:
        if was:
            gc.enable()
    return found


@pytest.mark.parametrize("make", [_recomputing, _swapping], ids=["recompute", "swap"])
def test_a_step_leaves_nothing_for_the_cyclic_collector(make):
    assert _garbage_per_step(None) == [(0, 0)] * 5     # the loop itself makes none
    lms = make()
    found = _garbage_per_step(lms)
    step = lms.stats()["last_step"]
    # (what the check is about: regions recomputed, or storages swapped)
    assert step["recomputed_regions"] if make is _recomputing else step["out_tensors"]
    assert found == [(0, 0)] * 5


def test_flatten_is_tree_flatten():
    t = torch.ones(2)
    tree = ((t, 1), {"mask": t, "position": (t, t), "rotary": Rotary(t, t), "cache": None,
                     "use_cache": False, "list": [t, [t, "a"]]})
    leaves, spec = flatten(tree)
    want_leaves, want_spec = tree_flatten(tree)
    assert spec == want_spec
    assert len(leaves) == len(want_leaves)
    assert all(a is b for a, b in zip(leaves, want_leaves))
    _settle()
    was = gc.isenabled()
    gc.disable()
    try:
        flatten(tree)
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()
