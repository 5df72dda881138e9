"""The models benchmarks/overhead.py trains, each with its batch, its loss, its repeated blocks
and the user's own way of checkpointing them: a transformers Llama, and a torchvision-style
ResNet of Bottleneck blocks (written out here: torchvision is not needed)."""
from __future__ import annotations

from typing import Callable, List, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["MODELS", "Workload", "Bottleneck", "ResNet", "add_workload_arguments"]


class Workload(NamedTuple):
    model: nn.Module
    opt: torch.optim.Optimizer
    blocks: List[nn.Module]          # its repeated blocks: what a region reruns
    loss: Callable[[], torch.Tensor]     # one forward, with grad
    checkpoint: Callable[[], None]      # the user's checkpointing of every block, on


def llama(args) -> Workload:
    """transformers' LlamaForCausalLM from a config, under transformers' own checkpointing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=2 * args.hidden, vocab_size=128,
                         max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(128, (args.batch, args.seq), generator=g)
    return Workload(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                    list(model.model.layers), lambda: model(input_ids=x, labels=x).loss,
                    lambda: model.gradient_checkpointing_enable({"use_reentrant": False}))


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 Bottleneck: 1x1, 3x3 (strided), 1x1 convolutions, each with
    batch norm, ReLU in place, and the shortcut added in place."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None):
        super().__init__()
        width = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, width, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet: a 7x7 stem, max pooling, ``layer1..layer4`` as Sequentials of
    Bottlenecks (``blocks`` of them: resnet152's are 3, 8, 36, 3), average pooling, a head."""

    def __init__(self, blocks=(3, 8, 36, 3), width: int = 64, classes: int = 1000):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        self.layer1 = self._layer(width, blocks[0])
        self.layer2 = self._layer(width * 2, blocks[1], stride=2)
        self.layer3 = self._layer(width * 4, blocks[2], stride=2)
        self.layer4 = self._layer(width * 8, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, classes)

    def _layer(self, planes: int, n: int, stride: int = 1) -> nn.Sequential:
        out = planes * Bottleneck.expansion
        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride, bias=False),
                                       nn.BatchNorm2d(out))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = out
        layers += [Bottleneck(out, planes) for _ in range(1, n)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint`` (non-reentrant), as a user wraps it."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def resnet(args) -> Workload:
    """``ResNet`` with ``args.blocks`` per stage, ``args.width`` channels in its stem, trained
    on ``args.batch`` random images of ``args.size`` squared pixels a step, labelled at random
    (one batch, always the same, it learns by heart in a few steps: its loss would be 0), with
    SGD as torchvision's reference trainer uses it (momentum 0.9, weight decay 1e-4)."""
    torch.manual_seed(args.seed)
    model = ResNet(tuple(int(n) for n in args.blocks.split(",")), args.width, classes=10)
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, 3, args.size, args.size)
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]

    def wrap():
        for stage in stages:
            for i, block in enumerate(stage):
                stage[i] = _Checkpointed(block)

    return Workload(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9,
                                           weight_decay=1e-4),
                    [b for stage in stages for b in stage],
                    lambda: F.cross_entropy(model(torch.randn(shape, generator=g)),
                                            torch.randint(10, (args.batch,), generator=g)),
                    wrap)


MODELS = {"llama": llama, "resnet": resnet}


def add_workload_arguments(ap, steps: int, layers: int, cap: float) -> None:
    """The options that pick a workload of ``MODELS``, its shape and the simulated device's
    capacity, for a benchmark that trains one (``ap``: an ``argparse.ArgumentParser``)."""
    ap.add_argument("--model", default="llama", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--layers", type=int, default=layers, help="llama: its decoder layers")
    ap.add_argument("--hidden", type=int, default=64, help="llama: its hidden size")
    ap.add_argument("--seq", type=int, default=64, help="llama: tokens a sequence")
    ap.add_argument("--blocks", default="3,8,36,3", help="resnet: Bottlenecks a stage")
    ap.add_argument("--width", type=int, default=8, help="resnet: its stem's channels")
    ap.add_argument("--size", type=int, default=32, help="resnet: an image's side, pixels")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap", type=float, default=cap,
                    help="the simulated device's capacity, a share of a kept step's peak")
