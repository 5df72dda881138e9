"""Per block, what a step did with the tensors saved inside it (lmsrt/recompute/account.py,
NOTE [ Block account ]): kept, moved, rebuilt and rerun bytes a block and outside them, each
column adding up to the step's own counts, in the stats, the summary and ``lmsrt profile``."""
import textwrap

import pytest
import torch
from click.testing import CliRunner
from models import assert_same_steps
from test_regions import Stack, _check_exact, _segnet, _train

import lmsrt
from lmsrt._cli import main
from lmsrt.recompute.account import OUTSIDE
from lmsrt.units import format_bytes


def _adds_up(stats) -> dict:
    """The blocks' rows by name, after checking that each column sums to the step's count."""
    rows, last = stats["blocks"], stats["last_step"]
    assert rows[-1]["block"] == OUTSIDE
    assert sum(r["kept_bytes"] for r in rows) == last["kept_bytes"] + last["live_bytes"]
    assert sum(r["moved_bytes"] for r in rows) == last["out_bytes"]
    assert sum(r["rebuilt_bytes"] for r in rows) == last["recipe_bytes"]
    assert sum(r["rerun_bytes"] for r in rows) == last["recomputed_bytes"]
    assert all(min(r["kept_bytes"], r["moved_bytes"], r["rebuilt_bytes"]) >= 0 for r in rows)
    return {r["block"]: r for r in rows}


def test_every_block_rerun_and_the_loss_outside():
    x = torch.randn(4, 16, 32)
    lms = _check_exact("sim", lambda: Stack(32, 4), x)        # gradients torch.equal
    stats = lms.stats()
    rows = _adds_up(stats)
    assert list(rows) == [f"blocks[{i}]" for i in range(4)] + [OUTSIDE]
    assert stats["last_step"]["recomputed_regions"] == 4
    for i in range(4):
        row = rows[f"blocks[{i}]"]
        # What its ops saved is dropped; its input alone goes to the engine.
        assert row["rerun_bytes"] > 0 and row["rerun_ms"] is not None
        assert row["kept_bytes"] + row["moved_bytes"] == x.nbytes
    # The loss saved the stack's output, outside every block: moved (lms_frac=0).
    outside = rows[OUTSIDE]
    assert outside["moved_bytes"] == x.nbytes and outside["rerun_bytes"] == 0
    assert outside["rerun_ms"] is None


def test_stages_of_a_conv_net_add_up():
    lms = _check_exact("sim", _segnet, torch.randn(2, 3, 16, 16))
    rows = _adds_up(lms.stats())
    stages = [name for name in rows if name != OUTSIDE]
    assert stages[0] == "Sequential[0:4]" and len(stages) >= 4
    assert sum(rows[s]["rerun_bytes"] > 0 for s in stages) >= 3


def test_recompute_off_blocks_moved_none_rerun():
    torch.manual_seed(0)
    model, plain_model = Stack(32, 4), Stack(32, 4)
    plain_model.load_state_dict(model.state_dict())
    x = torch.randn(4, 16, 32)
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim", recompute=False)
    assert_same_steps(_train(plain_model, x, 3), _train(model, x, 3, lms))
    stats = lms.stats()
    assert stats["regions"] is None
    rows = _adds_up(stats)
    assert list(rows) == [f"blocks[{i}]" for i in range(4)] + [OUTSIDE]
    for name, row in rows.items():
        assert row["moved_bytes"] > 0 and row["rerun_bytes"] == 0 and row["rebuilt_bytes"] == 0
        if name != "blocks[0]":         # (the first block's input is the caller's: kept)
            assert row["kept_bytes"] == 0


def test_rebuilt_inside_blocks_where_none_is_rerun():
    torch.manual_seed(0)
    model, plain_model = Stack(32, 4), Stack(32, 4)
    plain_model.load_state_dict(model.state_dict())
    x = torch.randn(4, 16, 32)
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim")    # the link is free: nothing rerun
    assert_same_steps(_train(plain_model, x, 3), _train(model, x, 3, lms))
    rows = _adds_up(lms.stats())
    for i in range(4):
        row = rows[f"blocks[{i}]"]
        assert row["rebuilt_bytes"] > 0 and row["moved_bytes"] > 0 and row["rerun_bytes"] == 0


def test_kept_where_it_fits():
    lms = lmsrt.LMS(lms=1, lms_frac=1.0, device="sim")
    _train(Stack(32, 4), torch.randn(4, 16, 32), 3, lms)
    rows = _adds_up(lms.stats())
    assert all(rows[f"blocks[{i}]"]["kept_bytes"] > 0 for i in range(4))
    assert not any(r["moved_bytes"] or r["rebuilt_bytes"] or r["rerun_bytes"]
                   for r in rows.values())


def test_no_blocks_no_table():
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim")
    _train(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh()),
           torch.randn(8, 32), 2, lms)
    rows = lms.stats()["blocks"]
    assert [r["block"] for r in rows] == [OUTSIDE]
    assert "per block" not in lms.summary()


def test_summary_shows_the_table():
    lms = _check_exact("sim", lambda: Stack(32, 4), torch.randn(4, 16, 32))
    stats, text = lms.stats(), lms.summary()
    assert "swapped out" in text and "regions recomputed" in text     # the lines kept
    table = text[text.index("per block: last step"):].splitlines()
    assert table[0].split() == ["per", "block:", "last", "step", "kept", "moved", "rebuilt",
                                "rerun", "rerun", "ms"]
    for line, row in zip(table[1:], stats["blocks"]):
        words = line.split()
        assert " ".join(words).startswith(row["block"])
        assert format_bytes(row["rerun_bytes"]) in line
        assert format_bytes(row["moved_bytes"]) in line
    assert len(table) == 1 + len(stats["blocks"])
    assert "per block" not in lms.summary(full=False)


_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    import lmsrt

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.tanh(self.fc1(x)))

    class Stack(nn.Module):
        def __init__(self, d=32, n=3):
            super().__init__()
            self.emb = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))

        def forward(self, x):
            x = self.emb(x)
            for b in self.blocks:
                x = b(x)
            return x

    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim")
    x = torch.randn(8, 32)
    for step in range(int(sys.argv[1])):
        with lms:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def test_profile_shows_the_scripts_blocks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    result = CliRunner().invoke(main, ["profile", "--steps", "2", str(script), "4"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "under the script's lmsrt.LMS, step 2:" in out
    table = out[out.index("per block: last step"):].splitlines()
    assert [line.split()[0] for line in table[1:5]] == ["blocks[0]", "blocks[1]", "blocks[2]",
                                                         "outside"]
    assert all("KiB" in line for line in table[1:4])
    for lms in lmsrt.lms.open_lms():
        lms.close()


@pytest.mark.parametrize("recompute", [True, False])
def test_closed_lms_is_not_shown(recompute):
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim", recompute=recompute)
    assert lms in lmsrt.lms.open_lms()
    lms.close()
    assert lms not in lmsrt.lms.open_lms()
