"""What `lmsrt run` says at the end, on the simulated device sized by --gpu-limit: the headline,
the table behind --summary full, steps against optimizer steps, LMS off, and --stats -."""
import json
import re

import pytest
import torch
from processes import clean_env, write
from test_cli import invoke, lmsrt_process

import lmsrt
from lmsrt.device import SimulatedDevice, resolve_device, sim_capacity
from lmsrt.summary import LABELS, format_summary
from lmsrt.units import GiB, MiB

# 6 optimizer steps of 2 micro-batches each: 12 LMS steps. Its saved tensors (2 MiB each) do
# not fit a simulated GPU of 0.01 GiB.
ACCUMULATING = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU())
                              for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    for micro in range(2):
        model(torch.randn(1024, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def _headline(stderr: str) -> str:
    [line] = [ln for ln in stderr.splitlines() if re.match(r"lmsrt: \d+ steps? ", ln)]
    return line


def test_the_simulated_gpu_takes_its_size_from_gpu_limit_and_the_headline_says_what_moved(
        tmp_path):
    script = write(tmp_path / "accumulate.py", ACCUMULATING)
    result = lmsrt_process("run", "--gpu-limit", "0.01", "--summary", "full", "--stats", "-",
                           script)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["limit_bytes"] == int(0.01 * GiB) and stats["total"]["out_bytes"] > 0
    assert stats["total"]["steps"] == 12 and stats["optimizer_steps"] == 6
    headline = _headline(result.stderr)
    assert headline.startswith("lmsrt: 12 steps (6 optimizer steps), ")
    assert " s a step settled; GPU peak " in headline and " of 10.2 MiB (" in headline
    assert "; a step swapped " in headline and " saved tensors a step to host memory" in headline
    lines = result.stderr.splitlines()
    table = lines[lines.index(headline) + 1:]
    assert table[0].startswith("settings: lms=1000 KiB") and "mark" not in result.stderr
    labels = [ln[:22].rstrip() for ln in table if ln.startswith(" ") or ln[:1].isalpha()]
    # Prefetch rows sit under "swapped in", not under "rebuilt".
    assert labels.index("  fetched ahead") == labels.index("swapped in") + 1


def test_the_headline_says_what_optimizer_state_lived_in_host_memory(tmp_path):
    """An AdamW script under --optimizer-state host: the headline says how much of its state
    lived in host memory between optimizer steps, and the full table has its rows."""
    script = write(tmp_path / "adamw.py", ACCUMULATING.replace(
        "torch.optim.SGD(model.parameters(), lr=0.01)",
        "torch.optim.AdamW(model.parameters(), lr=0.01)"))
    result = lmsrt_process("run", "--optimizer-state", "host", "--lms", "64", "--summary",
                           "full", "--stats", "-", script)
    assert result.returncode == 0, result.stderr
    state = 2 * 4 * 512 * 512 * 4                    # AdamW's moments of the 4 weights
    assert json.loads(result.stdout)["last_step"]["optimizer_out_bytes"] == state
    assert "lmsrt kept 8.00 MiB of optimizer state in host memory between optimizer steps" in (
        _headline(result.stderr))
    assert "optimizer state on host" in result.stderr and "  written back" in result.stderr


def test_without_gpu_limit_the_simulated_gpu_holds_lmsrt_sim_gb(tmp_path, monkeypatch):
    assert sim_capacity({}) == GiB and sim_capacity({"LMSRT_SIM_GB": "0.25"}) == GiB // 4
    monkeypatch.setenv("LMSRT_SIM_GB", "0.5")
    assert resolve_device("sim").capacity == GiB // 2
    with pytest.raises(ValueError, match="LMSRT_SIM_GB='big' is not a number of GiB"):
        sim_capacity({"LMSRT_SIM_GB": "big"})
    result = invoke("run", write(tmp_path / "s.py", "print('ran')\n"))
    assert result.exit_code == 0
    bad = lmsrt_process("run", write(tmp_path / "s.py", "print('ran')\n"),
                        env=clean_env(LMSRT_SIM_GB="-1"))
    assert bad.returncode == 2 and "LMSRT_SIM_GB" in bad.stderr and "ran" not in bad.stdout


def test_the_headline_comes_first_and_each_row_has_its_label():
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=4 * MiB), lms=1, lms_frac=0.5)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256))
    for _ in range(3):
        with lms:
            loss = model(torch.randn(512, 256)).square().mean()
        loss.backward()
    text = lms.summary()
    first, *rest = text.splitlines()
    assert first.startswith("lmsrt: 3 steps; GPU peak ") and " of 4.00 MiB (" in first
    assert lms.summary(full=False) == first
    blocks = next(i for i, line in enumerate(rest) if line.startswith("per block:"))
    for line in rest[:blocks + 1]:                  # (below it, a line a block, by its name)
        label = line.split(":")[0] if ":" in line[:12] else line[:22].strip()
        assert not label or label in LABELS, line
    for term in ("mark", "alive anyway", "beyond the plan", "not eligible"):
        assert term not in text
    lms.close()


def test_lms_off_is_one_line_not_a_table_of_zeros(tmp_path):
    off = lmsrt.LMS(device="sim", lms=0)
    assert off.summary() == ("lmsrt: LMS was off (lms <= 0), so nothing was swapped and there is "
                             "no summary")
    result = lmsrt_process("run", "--lms", "0", "--summary", "full",
                           write(tmp_path / "s.py", ACCUMULATING))
    assert result.returncode == 0
    said = [ln for ln in result.stderr.splitlines() if ln.startswith("lmsrt:")]
    assert said == ["lmsrt: LMS was off (lms <= 0), so nothing was swapped and there is no "
                    "summary"], result.stderr


def test_a_run_that_moved_nothing_says_lmsrt_changed_nothing():
    stats = lmsrt.LMS(device="sim").stats()
    assert format_summary(stats, full=False).endswith("; lmsrt changed nothing: the saved "
                                                      "tensors fit")


def test_the_headline_says_how_long_the_gpu_waited_for_copies_where_it_did():
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=4 * MiB), lms=1, lms_frac=0.0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256))
    with lms:
        loss = model(torch.randn(512, 256)).square().mean()
    loss.backward()
    stats = lms.stats()
    assert stats["last_step"]["out_bytes"] > 0
    assert "waited" not in format_summary(stats, full=False)     # the simulated GPU never waits
    stats["last_step"].update(swapout_wait_ms=30.2, swapin_wait_ms=11.9)
    assert " out (the GPU waited 42 ms for copies), rebuilt " in format_summary(stats, full=False)
    lms.close()


@pytest.mark.parametrize("target", ["-", "/dev/stdout"])
def test_stats_to_standard_output(tmp_path, target):
    result = lmsrt_process("run", "-q", "--stats", target,
                           write(tmp_path / "s.py", "print('from the script')\n"))
    assert result.returncode == 0, result.stderr
    printed, _, stats = result.stdout.partition("\n")
    assert printed == "from the script" and json.loads(stats)["schema"] >= 1
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("capacity_mib", [64, 256])
def test_autos_note_never_says_a_peak_is_under_a_smaller_level(capacity_mib):
    # "the predicted peak, 0.98 GiB, is under 0.94 GiB" was said: the level is the one the plan
    # kept the peak under, not the bound before the correction learnt from the steps.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh())
                                  for _ in range(6)])
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=capacity_mib * MiB), recompute=False)
    for _ in range(5):
        with lms:
            loss = model(torch.randn(1024, 512)).square().mean()
        loss.backward()
    stats = lms.stats()
    notes = [s["policy_note"] for s in [*stats["history"], stats["last_step"]]]
    claims = [re.search(r"predicted peak, ([0-9.]+) GiB, (?:is|stays) under ([0-9.]+) GiB", n)
              for n in notes]
    assert any(claims), notes
    for claim in filter(None, claims):
        assert float(claim.group(1)) <= float(claim.group(2)), claim.group(0)
    lms.close()
