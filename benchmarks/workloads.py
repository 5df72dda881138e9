"""The models the benchmarks and the GPU check train: built, fed, and stepped the same way."""
from __future__ import annotations

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


def _gpt(d, layers, batch, seq):
    model = nn.Sequential(*[GPTBlock(d, d // 128) for _ in range(layers)])
    return model.to("cuda", torch.bfloat16), torch.randn(batch, seq, d, device="cuda",
                                                          dtype=torch.bfloat16), False


def _seg(batch=16):
    return SegNet().cuda(), torch.randn(batch, 4, 768, 1024, device="cuda"), True


# name -> builder returning (model, input, autocast)
WORKLOADS = {
    "gpt": lambda: _gpt(2048, 16, 8, 2048),
    "gptbig": lambda: _gpt(4096, 8, 4, 4096),
    "seg": _seg,
    "gptsmall": lambda: _gpt(1024, 8, 4, 1024),
}


class Workload:
    """A model, its input, and one training step: forward inside ``ctx``, then backward."""

    def __init__(self, name: str):
        self.name = name
        self.model, self.x, self.autocast = WORKLOADS[name]()

    def forward(self):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            return self.model(self.x).float().square().mean()

    def step(self, ctx, marks=None):
        """One step; ``marks`` (three CUDA events) split its GPU time at the end of forward."""
        if marks:
            marks[0].record()
        with ctx:
            loss = self.forward()
        if marks:
            marks[1].record()
        loss.backward()
        if marks:
            marks[2].record()
        for p in self.model.parameters():
            p.grad = None
        return loss


def build(name: str) -> Workload:
    return Workload(name)
