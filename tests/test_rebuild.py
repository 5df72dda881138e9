"""Recipes for saved tensors (rebuild.py, NOTE [ Recipes ]): which saved tensors a cheap op made
from inputs that stay available, and that running the op again gives the same bits."""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmsrt.rebuild import Recorder, census, view_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from workloads import GPTBlock  # noqa: E402


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
