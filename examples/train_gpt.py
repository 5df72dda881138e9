"""
Train a GPT-like model on random tokens, with or without lmsrt.

Embedding, N pre-norm transformer blocks (causal SDPA attention, GELU MLP), LM head; bf16 autocast
and AdamW. The tokens are random, so the loss shows that training runs, not that it learns.
Each step prints its time and peak GPU memory; the LMS summary comes at the end.

    python examples/train_gpt.py                                    # plain PyTorch
    python examples/train_gpt.py --lms 1000                         # LMS enabled by the script
    lmsrt run --lms 1000 examples/train_gpt.py                      # LMS enabled by the launcher
    python examples/train_gpt.py --gpu-limit 10                     # as on a 10 GiB GPU: OOM
    python examples/train_gpt.py --gpu-limit 10 --lms 1000       # trains (lms_frac auto)
    lmsrt run --gpu-limit 10 --lms 1000 examples/train_gpt.py
    lmsrt run --gpu-limit 10 --lms 1000 examples/train_gpt.py --compile     # compiled, as below

With --compile the model is compiled whole (``model = torch.compile(model)``, as nanoGPT's
train.py does). Under LMS lmsrt compiles its blocks one by one instead, from the second step
(the first runs them eagerly while lmsrt learns it), and where memory is short lets the compiler
recompute more of what they save (docs/compiled.md). The first compiled step takes a while.

The defaults (d_model 1024, 16 layers, batch 8, seq 2048) save about 10 GiB for backward per
step, and the weights, gradients and AdamW state take 3.5 GiB more. Pick a --gpu-limit below the
peak the first command prints.

On a machine without a GPU it runs on the CPU, LMS on a simulated GPU (for tests):

    python examples/train_gpt.py --layers 2 --d-model 64 --seq-len 64 --batch-size 2 --vocab 256 \
        --steps 3 --lms 1 --lms-frac 0

Under `lmsrt run` LMS is already on (the launcher sets LMSRT_ACTIVE=1), so the script does not
enable it a second time and ignores its own --lms and --lms-frac: give them to lmsrt run.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import lmsrt

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
parser.add_argument("--lms", type=float, default=None, help="LMS threshold in KiB (default: off)")
parser.add_argument("--lms-frac", type=lambda v: v if v == "auto" else float(v), default="auto",
                    help="GPU use before swapping starts, or auto (lmsrt finds it)")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=2048)
parser.add_argument("--layers", type=int, default=16)
parser.add_argument("--d-model", type=int, default=1024)
parser.add_argument("--vocab", type=int, default=8192)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--gpu-limit", type=float, default=None, help="cap GPU memory at this many GiB")
parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
parser.add_argument("--compile", action="store_true", help="torch.compile the model")
args = parser.parse_args()

device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
cuda = device == "cuda"
if args.gpu_limit and cuda:
    # As a GPU of that size would be, before LMS is created: it reads how much memory the
    # process may use when it starts (the memory above the cap is held: lmsrt/gpu_cap.py).
    from lmsrt import gpu_cap
    gpu_cap.apply(int(args.gpu_limit * 2**30), torch.cuda.current_device())

# lmsrt run enables LMS for the whole script and says so in LMSRT_ACTIVE; a second LMS would
# only stack another set of hooks on top of it.
lms = None
if os.environ.get("LMSRT_ACTIVE") == "1":
    print("LMS: enabled by lmsrt run" + (" (this script's --lms is ignored)" if args.lms else ""))
elif args.lms is not None:
    lms = lmsrt.LMS(lms=args.lms, lms_frac=args.lms_frac, device=None if cuda else "sim")
    print(f"LMS: enabled by the script (lms={args.lms:g} KiB, lms_frac={args.lms_frac})")
else:
    print("LMS: off")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.heads = max(1, d // 128)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, seq_len):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


torch.manual_seed(0)
model = GPT(args.vocab, args.d_model, args.layers, args.seq_len).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
if args.compile:
    model = torch.compile(model)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}")
idx = torch.randint(args.vocab, (args.batch_size, args.seq_len + 1), device=device)
x, y = idx[:, :-1], idx[:, 1:]
autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)  # bf16 on the GPU only

times = []
for step in range(args.steps):
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        with autocast:
            if lms is not None:
                with lms:        # around the forward (and the loss): backward swaps back by itself
                    loss = model(x, y)
            else:
                loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.item()       # waits for the GPU, so the step time is the GPU's
    except torch.cuda.OutOfMemoryError as e:
        if lms is not None or os.environ.get("LMSRT_ACTIVE"):
            print(f"step {step}: out of GPU memory with LMS on. Give a low --lms-frac (swap "
                  "from lower GPU use), or see README's \"Out of memory?\".\n"
                  f"{e}")
        else:
            print(f"step {step}: out of GPU memory. Enable LMS: --lms 1000, or "
                  "lmsrt run --lms 1000 examples/train_gpt.py ...")
        sys.exit(1)
    times.append(time.perf_counter() - t0)
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else "n/a (CPU)"
    print(f"step {step:3d} | loss {loss:.4f} | {times[-1] * 1000:8.1f} ms | peak {peak}",
          flush=True)

steady = times[2:] or times                    # the first steps autotune, allocate and pin
print(f"median step {statistics.median(steady) * 1000:.1f} ms over steps "
      f"{len(times) - len(steady)}..{len(times) - 1}")
if cuda:
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (last step)")
if lms is not None:
    print(lms.summary())
