"""A small DDP training run that records each rank's per-step losses (tests/test_multigpu.py).

    torchrun --standalone --nproc-per-node 2 tests/scripts/ddp_losses.py --out /tmp/ddp
    lmsrt run --standalone --nproc-per-node 2 --lms 1 --lms-frac 0 \
        tests/scripts/ddp_losses.py --out /tmp/ddp-lms

Rank r writes OUT.rank{r}.json: the losses as float.hex strings, so they compare bit for bit.
"""
import argparse
import json
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

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
ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
gen = torch.Generator(device=device).manual_seed(1000 + rank)

losses = []
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.seq_len, d, device=device, generator=gen)
    loss = ddp(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item().hex())
    print(f"rank {rank} step {step} loss {float.fromhex(losses[-1]):.8f}", flush=True)

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
