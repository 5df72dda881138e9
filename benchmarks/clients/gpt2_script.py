"""A GPT-2-medium training script of the common kind, as nanoGPT's train.py writes it.

    python benchmarks/clients/gpt2_script.py --steps 40 --json gpt2.json              # uncapped
    python benchmarks/clients/gpt2_script.py --checkpoint --gpu-limit 14               # the peer
    python -m lmsrt run --gpu-limit 14 --stats stats.json benchmarks/clients/gpt2_script.py
    python -m lmsrt run --gpu-limit 14 benchmarks/clients/gpt2_script.py --compile
    python benchmarks/clients/gpt2_script.py --tiny --steps 3                           # CPU

GPT-2 medium (24 layers, 1024 wide, 16 heads; nanogpt.py), batch 16 x 1024 random tokens, the
loss computed inside the model's forward, bf16 autocast, fused AdamW, gradient clipping at 1.0,
--grad-accum micro-steps, an evaluation of the train and val splits under torch.no_grad() with
model.eval() before the first step (nanoGPT's iteration 0) and every --eval-interval steps,
optionally torch.compile(model). The peer: --checkpoint, torch.utils.checkpoint per block. Step
times leave the evaluations out.
"""
import argparse

import torch
from common import add_flags, device, maybe, run_script, seed_all
from nanogpt import GPT, GPTConfig


def build(args):
    """The model (on the device), its optimizer, the grad scaler and get_batch(split)."""
    dev = device()
    seed_all(1337 + args.seed)
    if args.tiny:
        config = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    else:
        config = GPTConfig(block_size=args.block_size)
    g = torch.Generator().manual_seed(args.seed)
    tokens = {split: torch.randint(config.vocab_size, (n,), generator=g)
              for split, n in (("train", 1 << 21), ("val", 1 << 18))}

    def get_batch(split):
        data = tokens[split]
        ix = torch.randint(len(data) - config.block_size, (args.batch,))
        x = torch.stack([data[i:i + config.block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + config.block_size] for i in ix])
        if dev.type == "cuda":
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev,
                                                                                non_blocking=True)
        return x, y

    model = GPT(config, gradient_checkpointing=args.checkpoint).to(dev)
    scaler = torch.amp.GradScaler(dev.type, enabled=args.dtype == "float16")
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), dev.type)
    return model, optimizer, scaler, get_batch


def train(args, lms=None, timer=None):
    """Train ``args.steps`` steps (under ``lms``, an ``lmsrt.LMS``, if given); the model."""
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model, optimizer, scaler, get_batch = build(args)
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    ctx = torch.autocast(dev.type, dtype=getattr(torch, args.dtype),
                         enabled=args.dtype != "float32")

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    with maybe(lms):
        X, Y = get_batch("train")
        for it in range(args.steps):
            if args.eval_interval and it % args.eval_interval == 0:
                losses = estimate_loss()
                print(f"step {it}: train loss {losses['train']:.4f}, val loss "
                      f"{losses['val']:.4f}")
            if timer:
                timer.begin()
            for _ in range(args.grad_accum):
                with ctx:
                    _, loss = model(X, Y)
                    loss = loss / args.grad_accum
                X, Y = get_batch("train")
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if timer:
                timer.end(loss * args.grad_accum)
    return raw_model


def parse(argv=None):
    ap = add_flags(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--checkpoint", action="store_true",
                    help="torch.utils.checkpoint per block (the peer)")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--eval-interval", type=int, default=250, help="0: no evaluation "
                    "(nanoGPT evaluates every 250 or 2000 iterations, and at iteration 0)")
    ap.add_argument("--eval-iters", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 16)
    return args


if __name__ == "__main__":
    run_script(parse, train, "gpt2_script")
