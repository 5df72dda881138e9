"""torchvision's reference classification trainer (references/classification/train.py), its loop
as written there, on random images.

    python benchmarks/clients/tv_reference.py --channels-last --steps 40 --json tv.json
    python benchmarks/clients/tv_reference.py --channels-last --checkpoint --gpu-limit 12
    python -m lmsrt run --gpu-limit 12 --stats stats.json benchmarks/clients/tv_reference.py \\
        --channels-last
    python benchmarks/clients/tv_reference.py --tiny --steps 3                         # CPU

resnet152 (torchvision.models, 1000 classes), batch 256 of 3 x 224 x 224, AMP (float16 autocast
and GradScaler), cuDNN's benchmark mode, SGD with momentum 0.9 and weight decay 1e-4, optionally
channels_last. The batches come from pinned host memory, as the reference's DataLoader
(pin_memory=True) gives them. The peer: --checkpoint, torch.utils.checkpoint per bottleneck
(checkpoint_sequential over each of layer1..layer4, one block a segment). --tiny: resnet18, 10
classes, batch 4 of 3 x 32 x 32, no AMP.
"""
import argparse

import torch
from common import add_flags, device, image_batches, maybe, run_script, seed_all
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential


def checkpoint_blocks(model: nn.Module) -> None:
    """Checkpoint each residual block of layer1..layer4, as a user short of memory writes it."""
    for name in ("layer1", "layer2", "layer3", "layer4"):
        layer = getattr(model, name)
        layer.forward = (lambda x, layer=layer:
                         checkpoint_sequential(layer, len(layer), x, use_reentrant=False))


def build(args):
    import torchvision

    dev = device()
    seed_all(args.seed)
    model = (torchvision.models.resnet18(num_classes=10) if args.tiny else
             torchvision.models.get_model(args.model, weights=None, num_classes=1000))
    if args.checkpoint:
        checkpoint_blocks(model)
    model.to(dev)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler(dev.type) if args.amp else None
    return model, criterion, optimizer, scaler


def train(args, lms=None, timer=None):
    """Train ``args.steps`` steps (under ``lms``, an ``lmsrt.LMS``, if given); the model."""
    dev = device()
    torch.backends.cudnn.benchmark = True
    model, criterion, optimizer, scaler = build(args)
    model.train()
    with maybe(lms):
        for image, target in image_batches(args.batch, 32 if args.tiny else 224,
                                           10 if args.tiny else 1000, args.steps, args.seed):
            if timer:
                timer.begin()
            image, target = image.to(dev, non_blocking=True), target.to(dev, non_blocking=True)
            if args.channels_last:
                image = image.contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev.type, enabled=scaler is not None):
                output = model(image)
                loss = criterion(output, target)
            optimizer.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            if timer:
                timer.end(loss)
    return model


def parse(argv=None):
    ap = add_flags(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--model", default="resnet152")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--no-amp", dest="amp", action="store_false", help="train in float32")
    ap.add_argument("--checkpoint", action="store_true",
                    help="torch.utils.checkpoint per residual block (the peer)")
    args = ap.parse_args(argv)
    args.batch = args.batch or (4 if args.tiny else 256)
    args.amp = args.amp and not args.tiny and device().type == "cuda"
    return args


if __name__ == "__main__":
    run_script(parse, train, "tv_reference")
