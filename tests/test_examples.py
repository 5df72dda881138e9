"""The examples run as their docstrings say: tiny on the CPU (LMS on the simulated device), and on a
GPU under a memory cap, where they OOM without LMS and train with it."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from processes import ROOT, clean_env

GPT = str(ROOT / "examples" / "train_gpt.py")
SEGNET = str(ROOT / "examples" / "train_segnet.py")
TINY_GPT = ["--layers", "2", "--d-model", "64", "--seq-len", "64", "--batch-size", "2",
            "--vocab", "256", "--steps", "3", "--device", "cpu"]
TINY_SEGNET = ["--size", "65x97", "--width", "4", "--stages", "2", "--batch-size", "2",
               "--steps", "3", "--device", "cpu"]


def run(*argv: str, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                            env=env or clean_env(), timeout=600)
    print(result.stdout, result.stderr)   # shown when a test fails
    return result


def losses(stdout: str) -> list:
    return re.findall(r"step +\d+ \| loss (\S+)", stdout)


def test_gpt_example_on_cpu_direct_and_under_lmsrt_run(tmp_path):
    plain = run(GPT, *TINY_GPT)
    assert plain.returncode == 0 and "LMS: off" in plain.stdout
    direct = run(GPT, *TINY_GPT, "--lms", "1", "--lms-frac", "0")
    assert direct.returncode == 0, direct.stderr
    assert "LMS: enabled by the script" in direct.stdout and "swapped out" in direct.stdout
    stats = tmp_path / "stats.json"
    launched = run("-m", "lmsrt", "run", "--lms", "1", "--lms-frac", "0", "--stats", str(stats),
                   GPT, *TINY_GPT, "--lms", "5")
    assert launched.returncode == 0, launched.stderr
    assert "LMS: enabled by lmsrt run (this script's --lms is ignored)" in launched.stdout
    assert "swapped out" not in launched.stdout          # no second LMS inside the script
    assert json.loads(stats.read_text())["total"]["out_bytes"] > 0
    assert len(losses(plain.stdout)) == 3
    assert losses(plain.stdout) == losses(direct.stdout) == losses(launched.stdout)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_gpt_example_compiled_under_lmsrt_run_on_cpu():
    """``--compile`` (torch.compile(model), inductor) under lmsrt run: the blocks run eagerly in
    step 1 and compiled after (compiling one block with inductor on the CPU: ~20 s cold)."""
    plain = run(GPT, *TINY_GPT)
    launched = run("-m", "lmsrt", "run", "--lms", "1", "--lms-frac", "0", GPT, *TINY_GPT,
                   "--compile")
    assert launched.returncode == 0, launched.stderr
    assert launched.stderr.count("compiles its 2 Block blocks one by one") == 1, launched.stderr
    assert "swapped out" not in launched.stdout and "between compiled regions" not in (
        launched.stderr)
    # Step 1 runs the model eagerly; later steps' inductor kernels may differ in the last bits.
    got, want = losses(launched.stdout), losses(plain.stdout)
    assert len(got) == 3 and got[0] == want[0]
    assert all(abs(float(a) - float(b)) < 1e-3 for a, b in zip(got, want)), (got, want)


def test_segnet_example_on_cpu():
    plain = run(SEGNET, *TINY_SEGNET)
    swapped = run(SEGNET, *TINY_SEGNET, "--lms", "1", "--lms-frac", "0")
    assert plain.returncode == 0 and swapped.returncode == 0, swapped.stderr
    assert "swapped out" in swapped.stdout
    assert len(losses(plain.stdout)) == 3 and losses(plain.stdout) == losses(swapped.stdout)


@pytest.mark.cuda
def test_gpt_example_ooms_under_a_cap_without_lms_and_trains_with_it(tmp_path):
    """The cap is half the uncapped peak: activations dominate this configuration (8 layers of
    d512 at 16x2048 tokens save ~4.8 GiB; weights and AdamW state take ~0.4 GiB)."""
    config = ["--layers", "8", "--d-model", "512", "--seq-len", "2048", "--batch-size", "16",
              "--vocab", "1024", "--steps", "4"]
    env = clean_env(LMSRT_DEVICE="")
    plain = run(GPT, *config, env=env)
    assert plain.returncode == 0, plain.stderr
    peak = float(re.search(r"peak GPU memory ([\d.]+) GiB", plain.stdout).group(1))
    cap = f"{peak / 2:.2f}"
    capped = run(GPT, *config, "--gpu-limit", cap, env=env)
    assert capped.returncode == 1 and "out of GPU memory" in capped.stdout
    with_lms = run(GPT, *config, "--gpu-limit", cap, "--lms", "100", "--lms-frac", "0.6", env=env)
    assert with_lms.returncode == 0, with_lms.stderr
    assert len(losses(with_lms.stdout)) == 4
    stats = tmp_path / "stats.json"
    launched = run("-m", "lmsrt", "run", "--gpu-limit", cap, "--lms", "100", "--lms-frac", "0.6",
                   "--stats", str(stats), GPT, *config, env=env)
    assert launched.returncode == 0, launched.stderr
    data = json.loads(stats.read_text())
    assert data["total"]["out_bytes"] > 0 and data["limit_bytes"] <= float(cap) * 2**30 + 2**20
    assert data["step_time_median_s"] > 0


@pytest.mark.cuda
def test_gpt_example_compiled_trains_under_lmsrt_run_at_half_its_peak():
    """``--compile`` under lmsrt run (lms_frac auto) at half the compiled model's uncapped peak:
    the blocks compiled one by one, under the recompute budget lmsrt chooses."""
    config = ["--layers", "8", "--d-model", "512", "--seq-len", "2048", "--batch-size", "16",
              "--vocab", "1024", "--steps", "5", "--compile"]
    env = clean_env(LMSRT_DEVICE="")
    plain = run(GPT, *config, env=env)
    assert plain.returncode == 0, plain.stderr
    peak = float(re.search(r"peak GPU memory ([\d.]+) GiB", plain.stdout).group(1))
    launched = run("-m", "lmsrt", "run", "--gpu-limit", f"{peak / 2:.2f}", "--lms", "100", GPT,
                   *config, env=env)
    assert launched.returncode == 0, launched.stderr
    assert len(losses(launched.stdout)) == 5
    assert "blocks one by one" in launched.stderr and "activation_memory_budget=" in (
        launched.stderr)
