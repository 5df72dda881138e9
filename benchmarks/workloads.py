"""The models the benchmarks and the GPU check train: built, fed, and stepped the same way."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WORKLOADS", "Workload", "build"]


class GPTBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, causal SDPA attention, GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
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


class SegNet(nn.Module):
    """Conv segmentation net: four 7x7/64 conv+BN+ReLU(inplace)+maxpool stages, four
    upsample+conv stages."""

    def __init__(self, c_in: int = 4, c: int = 64, classes: int = 8):
        super().__init__()
        down, up = [], []
        for i in range(4):
            down += [nn.Conv2d(c_in if i == 0 else c, c, 7, padding=3), nn.BatchNorm2d(c),
                     nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            up += [nn.Upsample(scale_factor=2), nn.Conv2d(c, c, 7, padding=3), nn.BatchNorm2d(c),
                   nn.ReLU(inplace=True)]
        self.net = nn.Sequential(*down, *up, nn.Conv2d(c, classes, 1))

    def forward(self, x):
        return self.net(x)


class GPT2LM(nn.Module):
    """GPT-2-style causal LM: token and position embeddings, pre-norm blocks, a final LayerNorm,
    and a head that shares the token embedding's weight, as GPT-2 does."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.blocks = nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


def _square_mean(out):
    return out.float().square().mean()


class Parts(NamedTuple):
    """What a builder returns: the model, the arguments of its forward, whether the step runs
    under bf16 autocast, the loss of the model's output, and the optimizer if the step has one."""
    model: nn.Module
    inputs: tuple
    autocast: bool
    loss: Callable[[torch.Tensor], torch.Tensor] = _square_mean
    optimizer: Optional[torch.optim.Optimizer] = None
    validate_first: bool = False     # a no_grad forward before the first step (a sanity check)


def _gpt(d, layers, batch, seq):
    model = nn.Sequential(*[GPTBlock(d, d // 128) for _ in range(layers)])
    return Parts(model.to("cuda", torch.bfloat16),
                 (torch.randn(batch, seq, d, device="cuda", dtype=torch.bfloat16),), False)


def _seg(batch=16):
    return Parts(SegNet().cuda(), (torch.randn(batch, 4, 768, 1024, device="cuda"),), True)


def _seg_variant(benchmark: bool, channels_last: bool, batch=16):
    """``seg`` with cuDNN's benchmark mode and channels_last weights and inputs on or off."""
    torch.backends.cudnn.benchmark = benchmark
    form = torch.channels_last if channels_last else torch.contiguous_format
    return Parts(SegNet().cuda().to(memory_format=form),
                 (torch.randn(batch, 4, 768, 1024, device="cuda").to(memory_format=form),), True)


def _lm(batch=16, seq=1024, d=1024, layers=24, heads=16, vocab=50304, device="cuda"):
    """GPT-2 medium (355M parameters) trained as a plain script would: fp32 weights, bf16
    autocast, cross-entropy on the full fp32 logits (3.07 GiB at this size, and as much again
    for their gradient), AdamW. Uncapped it should peak near 27.5 GiB: issue 12 measured that on an
    H200, and a count of this code's allocations with fake tensors gives 27.46 GiB."""
    with torch.device(device):
        model = GPT2LM(vocab, seq, d, layers, heads)
        idx = torch.randint(vocab, (batch, seq))
        targets = torch.randint(vocab, (batch, seq))

    def loss(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Parts(model, (idx,), True, loss, torch.optim.AdamW(model.parameters(), lr=3e-4))


# name -> builder returning Parts; keyword arguments (``lm``'s sizes and device) are for tests.
WORKLOADS = {
    "gpt": lambda: _gpt(2048, 16, 8, 2048),
    "gptbig": lambda: _gpt(4096, 8, 4, 4096),
    "seg": _seg,
    "gptsmall": lambda: _gpt(1024, 8, 4, 1024),
    "lm": _lm,
    # seg as most conv training scripts run it (torchvision's references): cuDNN's benchmark
    # mode on, weights and inputs channels_last; and each of the two alone
    "segtuned": lambda: _seg_variant(True, True),
    "segbench": lambda: _seg_variant(True, False),
    "segcl": lambda: _seg_variant(False, True),
    # gpt with a validation forward (no_grad) before training, as Lightning runs by default
    "gptval": lambda: _gpt(2048, 16, 8, 2048)._replace(validate_first=True),
}


class Workload:
    """A model, its input, and one training step: forward inside ``ctx``, backward, then the
    optimizer step if the workload has one."""

    def __init__(self, name: str, **size):
        self.name = name
        (self.model, self.inputs, self.autocast, self.loss, self.optimizer,
         self.validate_first) = WORKLOADS[name](**size)
        self.device = self.inputs[0].device.type

    def model_loss(self):
        """The model's loss on its input, with no autocast of its own."""
        return self.loss(self.model(*self.inputs))

    def forward(self):
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            return self.model_loss()

    def update(self):
        """The optimizer step, if any; then the gradients are dropped."""
        if self.optimizer is not None:
            self.optimizer.step()
        for p in self.model.parameters():
            p.grad = None

    def step(self, ctx, marks=None):
        """One step; ``marks`` (three CUDA events) split its GPU time at the end of forward and
        of backward."""
        if self.validate_first:
            self.validate_first = False
            with ctx, torch.no_grad():
                self.forward()
        if marks:
            marks[0].record()
        with ctx:
            loss = self.forward()
        if marks:
            marks[1].record()
        loss.backward()
        if marks:
            marks[2].record()
        self.update()
        return loss


def build(name: str, **size) -> Workload:
    """The workload ``name``, e.g. ``build("lm").step(contextlib.nullcontext())``; ``size``
    overrides the ``lm`` builder's sizes and device (``build("lm", layers=2, d=64, heads=2,
    vocab=256, seq=32, batch=2, device="cpu")``), for a quick check without a GPU."""
    return Workload(name, **size)
