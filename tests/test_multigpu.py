"""`lmsrt run --nproc-per-node 2` on DDP and FSDP2 (fully_shard) scripts: every rank's losses are
bit-identical to the same run under plain torchrun. On 2 GPUs (`multigpu`); FSDP2 also on the CPU
over gloo with LMS on the simulated device (DDP there would add 15 s and little coverage: the
torchrun path itself is tested in test_cli.py)."""
import json
import subprocess
import sys

import pytest
from processes import ROOT, clean_env

SCRIPTS = ROOT / "tests" / "scripts"
KINDS = [pytest.param("sim", id="sim"),
         pytest.param("cuda", id="cuda", marks=pytest.mark.multigpu)]


def _launch(prefix: list, script: str, out, extra: list, env: dict) -> None:
    result = subprocess.run([sys.executable, "-m", *prefix, "--standalone", "--nproc-per-node", "2",
                             str(SCRIPTS / script), "--out", str(out), *extra],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def _check(kind: str, script: str, tmp_path) -> None:
    # The environment (NCCL_NVLS_ENABLE=0 included) passes through to the workers.
    env = clean_env(LMSRT_DEVICE="sim" if kind == "sim" else "")
    if kind == "sim":
        env["CUDA_VISIBLE_DEVICES"] = ""         # the scripts then train on the CPU, over gloo
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    extra = ["--batch-size", "2", "--seq-len", "16", "--steps", "3"] if kind == "sim" else []
    stats = tmp_path / "stats.json"
    _launch(["torch.distributed.run"], script, tmp_path / "plain", extra, env)
    _launch(["lmsrt", "run", "--lms", "1", "--lms-frac", "0", "--stats", str(stats)], script,
            tmp_path / "lms", extra, env)
    for rank in (0, 1):
        plain = json.loads((tmp_path / f"plain.rank{rank}.json").read_text())
        swapped = json.loads((tmp_path / f"lms.rank{rank}.json").read_text())
        assert plain == swapped, (rank, plain, swapped)
        data = json.loads((stats if rank == 0 else tmp_path / "stats.json.rank1").read_text())
        assert data["rank"] == rank and data["total"]["out_bytes"] > 0    # LMS was on, per rank


@pytest.mark.parametrize("kind", KINDS[1:])
def test_ddp_losses_identical_with_lms(kind, tmp_path):
    _check(kind, "ddp_losses.py", tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_losses_identical_with_lms(kind, tmp_path):
    _check(kind, "fsdp_losses.py", tmp_path)
