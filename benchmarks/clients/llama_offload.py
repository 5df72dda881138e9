"""A Llama-style model of 1.5B parameters trained in fp32 weights with AdamW, as a plain PyTorch
loop writes it: its parameters, gradients and optimizer state (~22 GiB) pass a 16 GiB cap
whatever is done with its activations (issue 49's second target).

    python benchmarks/clients/llama_offload.py --steps 20 --json llama.json            # uncapped
    python benchmarks/clients/llama_offload.py --fsdp2-offload --gpu-limit 16          # the peer
    python -m lmsrt run --gpu-limit 16 --stats stats.json benchmarks/clients/llama_offload.py
    python benchmarks/clients/llama_offload.py --tiny --steps 3                        # CPU

transformers' LlamaForCausalLM from a config (hidden 2048, 26 layers, 16 heads, MLP 5632, vocab
32000: 1.47B parameters), batch 2 x 1024 random tokens, the loss inside the model's forward,
bf16 autocast, AdamW (fused on the GPU), gradient clipping at 1.0. The peer, what a user reaches
for today: FSDP2 (``fully_shard`` on each decoder layer and on the model) with
``CPUOffloadPolicy``, one process on one GPU: parameters, gradients and AdamW's state live in
pinned host memory, each layer's parameters are brought to the GPU as it runs, and the
optimizer steps on the CPU. (Its arithmetic is not the plain run's: its optimizer runs on the
CPU.)
"""
import argparse

import torch
from common import add_flags, device, llama, maybe, run_script


def _one_process_group(dev: torch.device) -> None:
    """A process group of this process alone, which FSDP2 needs: made once, kept for the
    process (the model's sharded parameters are read through it, also after training)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    # An in-process store: no port to take, so runs beside each other (tests under xdist)
    # cannot collide.
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)


def shard_offloaded(model, dev: torch.device):
    """The peer: FSDP2 on each decoder layer and on the model, with parameters, gradients and
    optimizer state in (pinned, on a GPU) host memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    mesh = init_device_mesh(dev.type, (1,))
    policy = CPUOffloadPolicy(pin_memory=dev.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def train(args, lms=None, timer=None):
    """Train ``args.steps`` steps (under ``lms``, an ``lmsrt.LMS``, if given); the model."""
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = True
    model = llama(args, hidden=2048, layers=26, heads=16, mlp=5632)
    if args.fsdp2_offload:
        _one_process_group(dev)
        model = shard_offloaded(model, dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    else:
        model = model.to(dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                      fused=dev.type == "cuda")
    g = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(model.config.vocab_size, (args.batch, args.seq), generator=g)
               for _ in range(2)]
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16)
    with maybe(lms):
        for step in range(args.steps):
            if timer:
                timer.begin()
            ids = batches[step % 2].to(dev, non_blocking=True)
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if timer:
                timer.end(loss)
    return model


def parse(argv=None):
    ap = add_flags(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=20)
    ap.add_argument("--fsdp2-offload", action="store_true",
                    help="FSDP2 with CPUOffloadPolicy on this one GPU (the peer)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    args = ap.parse_args(argv)
    args.batch = args.batch or 2
    args.seq = args.seq or (32 if args.tiny else 1024)
    return args


if __name__ == "__main__":
    run_script(parse, train, "llama_offload")
