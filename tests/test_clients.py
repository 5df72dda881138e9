"""The client matrix's scripts (benchmarks/clients/), built tiny on the simulated device: each
library's own loop trains under lmsrt without running out of memory, its parameters and buffers
equal bit for bit to the same seeded run without lmsrt, at lmsrt's defaults and where lmsrt is
made to move, rebuild and recompute everything it can. And the matrix runner's plan, its table
and one small run of it. The GPU numbers come from running benchmarks/clients/matrix.py on a GPU.

Each client is skipped where its library is missing (``pip install -e ".[clients]"``; timm and
torchvision are not in that extra)."""
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import lmsrt

CLIENTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "clients"
# Each client, the libraries it needs, and its tiny flags.
NEEDS = {"hf_trainer": ("transformers", "accelerate"), "gpt2_script": (),
         "tv_reference": ("torchvision",), "lightning_trainer": ("lightning",),
         "timm_train": ("timm",), "llama_offload": ("transformers",)}
TINY = ["--tiny", "--steps", "3"]


@pytest.fixture(autouse=True)
def _simulated_device(monkeypatch):
    """The clients train on the CPU, as lmsrt's simulated device wants, also on a GPU machine
    (benchmarks/clients/common.py: ``device()``)."""
    monkeypatch.setenv("LMSRT_DEVICE", "sim")


def _client(name: str):
    """benchmarks/clients/<name>.py as a module (its imports of common and nanogpt found beside
    it), after skipping where a library it needs is missing."""
    for lib in NEEDS.get(name, ()):
        pytest.importorskip(lib)
    path = list(sys.path)
    sys.path.insert(0, str(CLIENTS))
    try:
        spec = importlib.util.spec_from_file_location(f"_client_{name}", CLIENTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module          # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def _forced() -> lmsrt.LMS:
    """An LMS that takes every eligible tensor off the device and recomputes every region it
    may: a link of 1 byte/s hides no copy, and any excess is worth it (tests/test_regions.py);
    and keeps the optimizer's state on the host, its step in parts of 128 KiB (a sixteenth of a
    simulated device of 2 MiB)."""
    from lmsrt.device import SimulatedDevice
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device=SimulatedDevice(capacity=2 << 20),
                    optimizer_state="host")
    lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    return lms


def _check(name: str, argv, forced: bool, tuning: bool = False) -> lmsrt.LMS:
    """Train ``name`` tiny without lmsrt and under it; the state after the last step is the same
    bit for bit, and every step ran. Returns the LMS for more checks. ``tuning``: the simulated
    device stands in for cuDNN's benchmark mode."""
    client = _client(name)
    common = sys.modules["common"]
    args = client.parse(argv)
    plain = client.train(args)
    lms = _forced() if forced else lmsrt.LMS(device="sim")
    lms._device.tuning = tuning
    timer = common.StepTimer()
    try:
        under = client.train(args, lms=lms, timer=timer)
    finally:
        lms.close()
    assert timer.steps == args.steps
    assert len(timer.times) == len(timer.cpu) == len(timer.retries) == args.steps
    assert all(loss is not None and math.isfinite(loss) for loss in timer.losses), timer.losses
    want, got = plain.state_dict(), under.state_dict()
    assert list(want) == list(got)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"{name}: not equal to the run without lmsrt: {differ[:5]}"
    total = lms.stats()["total"]
    assert total["alloc_failures"] == 0
    if forced:
        assert total["out_bytes"] + total["recipe_bytes"] > 0, "lmsrt moved nothing"
        assert total["optimizer_out_bytes"] > 0 or "--fsdp2-offload" in argv, "state stayed"
    return lms


CASES = [pytest.param("hf_trainer", [], id="hf"),
         pytest.param("hf_trainer", ["--gradient-checkpointing"], id="hf-peer"),
         pytest.param("gpt2_script", ["--eval-interval", "2"], id="gpt2"),
         pytest.param("gpt2_script", ["--checkpoint", "--grad-accum", "2"], id="gpt2-peer"),
         pytest.param("tv_reference", ["--channels-last"], id="tv"),
         pytest.param("tv_reference", ["--checkpoint"], id="tv-peer"),
         pytest.param("lightning_trainer", ["--precision", "bf16-mixed"], id="lightning"),
         pytest.param("lightning_trainer", ["--checkpoint"], id="lightning-peer"),
         pytest.param("timm_train", [], id="timm"),
         pytest.param("timm_train", ["--checkpoint"], id="timm-peer"),
         pytest.param("llama_offload", [], id="llama"),
         pytest.param("llama_offload", ["--fsdp2-offload"], id="llama-peer")]


@pytest.mark.parametrize("name, extra", CASES)
def test_each_client_is_exact_at_the_defaults(name, extra):
    _check(name, TINY + extra, forced=False)


@pytest.mark.parametrize("name, extra", CASES)
def test_each_client_is_exact_when_everything_moves(name, extra):
    _check(name, TINY + extra, forced=True)


# Blocks lmsrt recomputes when made to: decoder layers called with keyword arguments (hf,
# lightning), nanoGPT's blocks in a ModuleList inside a ModuleDict that is never called (gpt2).
REGIONS = [
    pytest.param("hf_trainer", [], id="hf"),
    pytest.param("lightning_trainer", [], id="lightning"),
    pytest.param("gpt2_script", ["--eval-interval", "0"], id="gpt2"),
    pytest.param("tv_reference", [], id="tv"),
    pytest.param("timm_train", [], id="timm"),
]


@pytest.mark.parametrize("name, extra", REGIONS)
def test_blocks_are_recomputed_exactly_when_made_to(name, extra):
    lms = _check(name, ["--tiny", "--steps", "4", *extra], forced=True)
    regions = lms.stats()["regions"]
    assert regions and regions["regions"] > 0, regions
    assert not regions["refused"], regions["refused"]
    assert lms.stats()["total"]["recomputed_bytes"] > 0, regions["note"]


@pytest.mark.parametrize("name, extra", REGIONS)
def test_blocks_are_checked_and_recomputed_under_benchmark_mode(name, extra):
    """NOTE [ Reruns under cuDNN's benchmark mode ]: each client's blocks (decoder layers called
    with keyword arguments; resnet's bottlenecks with batch norms and a downsampling first block
    per stage) pass the check of each kind of call and are recomputed, exactly."""
    lms = _check(name, ["--tiny", "--steps", "4", *extra], forced=True, tuning=True)
    regions = lms.stats()["regions"]
    assert not regions["refused"], regions["refused"]
    assert lms.stats()["total"]["recomputed_bytes"] > 0, regions["note"]


# -- the shared helpers -------------------------------------------------------------------------

def test_an_out_of_memory_error_is_written_and_exits_3(tmp_path):
    common = _client("common")
    args = common.add_flags(__import__("argparse").ArgumentParser()).parse_args(
        ["--json", str(tmp_path / "r.json")])

    def run(timer):
        for _ in range(2):
            timer.begin()
            timer.end(torch.tensor(1.5))
        raise RuntimeError("wrapped") from torch.OutOfMemoryError("CUDA out of memory. Tried")

    with pytest.raises(SystemExit) as exit:
        common.finish(args, run, "fake")
    assert exit.value.code == common.OOM_EXIT == 3
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["outcome"] == "oom" and result["oom_step"] == 3
    assert result["losses"] == [1.5, 1.5] and len(result["step_times_s"]) == 2
    # Any other error is the script's own: it leaves as it is, and nothing is written.
    args.json = str(tmp_path / "other.json")
    with pytest.raises(ValueError):
        common.finish(args, lambda timer: int("x"), "fake")
    assert not (tmp_path / "other.json").exists()


def test_the_cap_is_lmsrts_under_lmsrt_run(monkeypatch):
    common = _client("common")
    from lmsrt import gpu_cap
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gpu_cap, "apply", lambda nbytes, index: calls.append((nbytes, index)))
    monkeypatch.delenv("LMSRT_ACTIVE", raising=False)
    common.cap_gpu(20)
    monkeypatch.setenv("LMSRT_ACTIVE", "1")
    common.cap_gpu(20)
    assert calls == [(20 * common.GiB, 0)]


# -- the matrix -------------------------------------------------------------------------------

def _matrix(*argv, env=None):
    return subprocess.run([sys.executable, str(CLIENTS / "matrix.py"), *argv],
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_dry_run_lists_every_run():
    out = _matrix("--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    n = len(lines)
    assert n > 20 and lines[0].startswith(f"run 1 of {n}: hf-plain-none: ")
    assert any("-m lmsrt run --gpu-limit 20 --stats" in line and "hf_trainer.py" in line
               and "--gradient-checkpointing" not in line for line in lines)
    assert any("hf_trainer.py" in line and "--gradient-checkpointing --gpu-limit 10" in line
               for line in lines)
    assert "min on an H100" in out.stderr
    quick = _matrix("--dry-run", "--quick").stdout.splitlines()
    assert 3 <= len(quick) < n
    bad = _matrix("--dry-run", "--clients", "nope")
    assert bad.returncode == 2 and "nope" in bad.stderr
    # A cap that is a share of plain's peak needs plain's run: said before anything runs.
    share = _matrix("--dry-run", "--clients", "lightning", "--caps", "0.6", "--methods", "lmsrt")
    assert share.returncode == 2 and "lightning has no plain run" in share.stderr, share.stderr
    assert _matrix("--dry-run", "--clients", "lightning", "--caps", "14.2",
                   "--methods", "lmsrt").returncode == 0


def test_a_peer_that_fits_is_taken_from_its_uncapped_run():
    matrix = _client("matrix")
    runs = [matrix.Run("hf", m, cap) for cap in (20, 14, 10) for m in ("peer", "lmsrt+peer")]
    taken = [(r.method, r.cap) for r in runs if matrix.taken_elsewhere(r, runs, r.cap, 11.8)]
    # The peer peaked at 11.8 GiB: it is the uncapped run at 20 and 14 GiB (under 85%), and
    # lmsrt beside it runs at 14 (the lowest cap it fits) and 10 (where it does not), not 20.
    assert taken == [("peer", 20), ("lmsrt+peer", 20), ("peer", 14)]
    assert matrix.first_cost([2.0] + [1.0] * 39) == pytest.approx(31 / 30)
    assert matrix.first_cost([2.0] + [1.0] * 39, skip=1) == pytest.approx(1.0)
    assert matrix.first_cost([9.0, 2.0] + [1.0] * 38, skip=1) == pytest.approx(31 / 30)
    assert matrix.settled([9.0] * 30 + [1.0] * 10) == 1.0
    # The first 30 steps' seconds against the peer's: its slow first step counts there too.
    assert matrix.first_against([2.0] + [1.0] * 39, [5.0] + [1.0] * 39) == pytest.approx(31 / 34)
    assert matrix.first_against([1.0] * 20, [1.0] * 40) is None


def test_the_matrix_runs_the_hf_client_under_lmsrt_run_unchanged(tmp_path):
    """The one test that starts processes: the matrix runs `lmsrt run` on the tiny HF client."""
    _client("hf_trainer")
    env = dict(os.environ)
    env.pop("LMSRT_ACTIVE", None)
    out = _matrix("--clients", "hf", "--methods", "lmsrt", "--caps", "14", "--steps", "3",
                  "--script-args=--tiny", "--out", str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "run 1 of 1: hf lmsrt at 14 GiB" in out.stderr
    data = json.loads((tmp_path / "clients.json").read_text())
    [row] = data["rows"]
    assert row["outcome"] == "ok" and row["lmsrt_active"], row
    assert row["cap_gib"] == 14 and len(row["step_times_s"]) == 3 and row["settled_s"] > 0
    assert row["cpu_s"] > 0                        # the host's share of the step, beside it
    assert row["retries"] == 0                     # the allocator's, a settled step (no CUDA)
    assert row["moved_gib"] is not None and row["regions_note"]      # from lmsrt's --stats
    stats = json.loads((tmp_path / "runs" / "hf-lmsrt-14.stats.json").read_text())
    assert stats["total"]["steps"] == 3
    table = (tmp_path / "clients.md").read_text().splitlines()
    assert any("| CPU s | retries |" in line for line in table), table
    assert any(line.startswith("| hf | 14 | lmsrt | ok |") for line in table), table
