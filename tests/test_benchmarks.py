"""The benchmarks stay importable and runnable without a GPU: the ``lm`` workload at a tiny size on
the CPU, offload.py's command line, and its table with an ``auto`` row. The GPU numbers themselves
come from running benchmarks/offload.py on a GPU, not from tests."""
import contextlib
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
TINY_LM = dict(batch=2, seq=16, d=32, layers=2, heads=2, vocab=64, device="cpu")


def _load(name: str):
    """benchmarks/<name>.py as a module, leaving sys.path as it was (offload.py extends it)."""
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def test_lm_workload_steps_on_cpu():
    work = _load("workloads").build("lm", **TINY_LM)
    model = work.model
    assert model.head.weight is model.wte.weight          # tied, as GPT-2 does
    before = [p.detach().clone() for p in model.parameters()]
    loss = work.step(contextlib.nullcontext())
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.2)
    # The optimizer stepped every parameter, and the gradients were dropped after it.
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.isfinite(work.step(contextlib.nullcontext()))


def test_offload_help_mentions_auto():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "offload.py"), "--help"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "auto" in out.stdout


def test_fracs_and_settled_steps():
    offload = _load("offload")
    assert offload.parse_fracs("auto,0.7,0.9, 0.5") == ([0.9, 0.7, 0.5], True)
    assert offload.parse_fracs("0.5") == ([0.5], False)
    assert offload.settled_after([3.0, 1.0, 1.02, 0.98], 1.0) == 1
    assert offload.settled_after([1.0, 1.0], 1.0) == 0
    assert offload.settled_after([1.0, 2.0], 1.0) is None      # still moving at the last step


def _reference(**row) -> dict:
    """offload.py's row of an uncapped reference run, at 55 GB/s each way."""
    return {"method": "reference", "cap_gib": 0, "lms_frac": 0.0, "outcome": "ok",
            "moved_gib": 0.0, "settled_after": 1, "bandwidth": {"d2h": 55e9, "h2d": 55e9},
            **row}


def test_table_with_auto_rows():
    offload = _load("offload")
    ref = _reference(workload="lm", step_s=0.1, peak_gib=27.5, t_fwd=0.03, t_bwd=0.06,
                     t_opt=0.01)
    grid = dict(ref, method="lmsrt", cap_gib=14.0, lms_frac=0.5, step_s=0.8, peak_gib=13.9,
                moved_gib=18.9, settled_after=2)
    auto = dict(grid, lms_frac="auto", step_s=0.6, settled_after=None)
    refused = {"workload": "lm", "method": "lmsrt", "cap_gib": 18.0, "lms_frac": "auto",
               "outcome": "unsupported"}
    rows = [ref, grid, auto, refused]
    # The optimizer step cannot overlap the copies: it adds to the floor.
    x = (27.5 - 14) * 2**30 / 55e9
    assert offload.floor_s(ref, 14.0) == pytest.approx(2 * x + 0.01)
    text = offload.table(rows, {"lm": ref})
    assert "unsupported" in text and " auto " in text
    assert text.splitlines()[3].split()[-1] == "2"          # the grid row settled after 2 steps
    assert text.splitlines()[4].split()[-1] == "no"         # auto never settled
    lines = offload.auto_against_grid(rows).splitlines()
    assert lines[0].startswith("lm at 14 GiB: auto 0.600 s = 0.75x")
    assert lines[1] == "lm at 18 GiB: auto unsupported, grid not run"


def test_table_with_recompute_rows_and_the_floor_of_what_still_moves():
    offload = _load("offload")
    ref = _reference(workload="gpt", step_s=0.2, peak_gib=18.2, t_fwd=0.06, t_bwd=0.13,
                     t_opt=0.0)
    off = dict(ref, method="lmsrt", cap_gib=8.0, lms_frac=0.7, step_s=0.43, moved_gib=10.2)
    on = dict(off, recompute=True, step_s=0.34, moved_gib=6.2, rebuilt_gib=4.0)
    text = offload.table([ref, off, on], {"gpt": ref})
    last = text.splitlines()[-1].split()
    assert last[2] == "lmsrt+rb" and last[-2] == "4.00"
    # What still crosses: 18.2 - 8 - 4 GiB each way, under the compute it overlaps.
    x = (18.2 - 8 - 4) * 2**30 / 55e9
    assert float(last[-1]) == pytest.approx(max(0.06, x) + max(0.13, x), abs=1e-3)
    assert offload.floor_s(ref, 8.0, 4.0) < offload.floor_s(ref, 8.0)
    line = offload.rebuilt_against_moved([ref, off, on])
    assert line.startswith("gpt at 8 GiB, lms_frac 0.7: 1.26x faster with recompute")


@pytest.mark.parametrize("name, size", [("lm", TINY_LM), ("seg", None)])
def test_checkpointed_workloads_step_on_cpu(name, size):
    """offload.py's ckpt method: the same loss and gradients as the plain step."""
    offload, workloads = _load("offload"), _load("workloads")
    if size is None:      # the conv net, small, on the CPU
        def build():
            torch.manual_seed(0)
            work = workloads.Workload.__new__(workloads.Workload)
            work.name, work.model = name, workloads.SegNet().eval()
            work.inputs, work.autocast, work.device = (torch.randn(2, 4, 32, 32),), False, "cpu"
            work.loss, work.optimizer = workloads._square_mean, None
            return work
    else:
        def build():
            torch.manual_seed(0)
            return workloads.build(name, **size)
    plain, ckpt = build(), build()
    offload.checkpointed(ckpt, 4)
    grads = []
    for work in (plain, ckpt):
        loss = work.forward()
        loss.backward()
        grads.append([p.grad for p in work.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_optimizer_step_benchmark_runs_tiny_and_is_exact(tmp_path):
    """benchmarks/optimizer_step.py on the simulated device: the step in host memory, in parts,
    brought its state in and left the parameters equal to torch's own step."""
    import json
    out = subprocess.run([sys.executable, str(BENCHMARKS / "optimizer_step.py"), "--tiny",
                          "--steps", "3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "optimizer_step.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["gpu", "host"]
    assert rows[1]["exact"] is True and rows[1]["in_bytes"] == rows[1]["state_bytes"] > 0
    assert "| host |" in out.stdout


@pytest.mark.parametrize("model", ["llama", "resnet"])
def test_overhead_benchmark_runs_tiny(tmp_path, model):
    """benchmarks/overhead.py at two blocks a stack (a Llama's layers, each of a ResNet's four
    stages of Bottlenecks): its settled steps recompute them all, move nothing, and their
    losses are the plain run's; cProfile's split names the hooks it was entered by."""
    import json
    if model == "llama":
        pytest.importorskip("transformers")
        shape, regions = ["--layers", "2"], 2
    else:
        shape, regions = ["--blocks", "2,2,2,2", "--width", "4", "--size", "32"], 8
    out = subprocess.run([sys.executable, str(BENCHMARKS / "overhead.py"), "--model", model,
                          *shape, "--steps", "8", "--profile", "1", "--top", "3",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "overhead.json").read_text())
    settled = result["settled"]
    assert settled["recomputed"] == regions and settled["moved_bytes"] == 0, settled
    assert result["model"]["name"] == model
    assert set(result["step"]) == {"wall median", "wall min", "cpu median", "cpu min"}
    assert result["profile"]["entries"]["module pre-hook"]["calls_per_step"] > 0
    assert "lmsrt's overhead" in out.stdout


def test_cap_emulation_table_compares_each_way_with_the_first_measured(tmp_path, monkeypatch):
    """benchmarks/cap_emulation.py: each way's row (from its own process, faked here) in the
    table with its figures against the first way measured, an error row as it came, and the
    JSON written; every way failing (no GPU) exits non-zero after saying so."""
    bench = _load("cap_emulation")
    rows = {
        "none": dict(way="none", held_gib=0.0, cap_s=0.0, matmul_tflops=600.0, copy_gbs=3000.0,
                     retries_per_round=0.0, request_ms=1.0, reserved_gib=12.0),
        "fraction": dict(way="fraction", held_gib=0.0, cap_s=0.0, matmul_tflops=600.0,
                         copy_gbs=3000.0, retries_per_round=1.0, request_ms=9.0,
                         reserved_gib=10.5, laid_out=False),
        "hold": dict(way="hold", held_gib=125.3, cap_s=0.2, matmul_tflops=564.0,
                     copy_gbs=2820.0, retries_per_round=0.0, request_ms=1.2, reserved_gib=13.0),
        "hold-chunks": dict(way="hold-chunks", error="RuntimeError: cuMemAlloc failed"),
    }
    monkeypatch.setattr(bench, "run_way", lambda way, args: rows[way])
    bench.main(["--cap", "14", "--out", str(tmp_path)])
    import json
    saved = json.loads((tmp_path / "cap_emulation.json").read_text())
    assert [r["way"] for r in saved["rows"]] == list(rows) and saved["cap_gib"] == 14.0
    text = bench.table(list(rows.values()))
    hold = next(line for line in text.splitlines() if line.startswith("| hold |"))
    assert "564.0 (0.940x)" in hold and "2820.0 (0.940x)" in hold and "| 0.00 |" in hold
    assert "| fraction | 0.0 | 0.00 | 600.0 (1.000x) |" in text
    assert "1.00 (blocks not laid out as meant)" in text
    assert "| hold-chunks | RuntimeError: cuMemAlloc failed |" in text
    monkeypatch.setattr(bench, "run_way", lambda way, args: dict(way=way, error="no CUDA"))
    with pytest.raises(SystemExit, match="no way could be measured"):
        bench.main(["--ways", "none,hold", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--ways", "none,sideways"])
    with pytest.raises(SystemExit):
        bench.main(["--ways", ","])


def test_cap_emulation_child_says_there_is_no_gpu():
    """Without CUDA a way's own process answers with its error, not a traceback."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "cap_emulation.py"), "--child",
                          "hold", "--cap", "14"], capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the child would measure")
    assert out.returncode == 0, out.stderr
    assert '"error": "no CUDA device"' in out.stdout
