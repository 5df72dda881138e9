"""A plain Hugging Face GPT-2 training loop (nothing lmsrt-specific): prints each step's loss
exactly (float.hex), so two runs can be compared bit for bit."""
import os, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
model = GPT2LMHeadModel(cfg).cuda()
model.config._attn_implementation = "eager"
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator(device="cpu").manual_seed(1)
for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), generator=g).cuda()
    t = time.perf_counter()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"step {step} loss {out.loss.item().hex()} {time.perf_counter() - t:.3f}s "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
