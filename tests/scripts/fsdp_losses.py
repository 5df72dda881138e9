"""A small FSDP2 (fully_shard) training run that records each rank's per-step losses
(tests/test_multigpu.py).

    torchrun --standalone --nproc-per-node 2 tests/scripts/fsdp_losses.py --out /tmp/fsdp
    lmsrt run --standalone --nproc-per-node 2 --lms 1 --lms-frac 0 \
        tests/scripts/fsdp_losses.py --out /tmp/fsdp-lms

Rank r writes OUT.rank{r}.json: the losses as float.hex strings, so they compare bit for bit.
"""
import argparse
import json
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:   # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=128)
args = parser.parse_args()

torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
# On a machine without GPUs the same run goes on the CPU over gloo (LMSRT_DEVICE=sim for LMS).
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

torch.manual_seed(0)
d = 256
model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                      nn.Linear(4 * d, d)) for _ in range(4)]).to(device)
for block in model:
    fully_shard(block)          # parameters all-gathered per block, resharded after forward
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator(device=device).manual_seed(1000 + rank)

losses = []
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.seq_len, d, device=device, generator=gen)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item().hex())
    print(f"rank {rank} step {step} loss {float.fromhex(losses[-1]):.8f}", flush=True)

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
