"""A timm ViT trained the way timm's train.py trains it, on random images.

    python benchmarks/clients/timm_train.py --steps 40 --json timm.json                 # uncapped
    python benchmarks/clients/timm_train.py --checkpoint --gpu-limit 12                  # the peer
    python -m lmsrt run --gpu-limit 18 --stats stats.json benchmarks/clients/timm_train.py
    python benchmarks/clients/timm_train.py --tiny --steps 3                              # CPU

vit_base_patch16_224 (timm.create_model, 1000 classes), batch 256 of 3 x 224 x 224, float16
autocast with timm's NativeScaler, AdamW from timm.optim.create_optimizer_v2 (weight decay 0.05),
timm.loss.LabelSmoothingCrossEntropy(0.1), mixup off: train.py's train_one_epoch. The peer:
--checkpoint, ``model.set_grad_checkpointing()`` (train.py's --grad-checkpointing). --tiny: a
2-block ViT on 3 x 32 x 32, 10 classes, batch 4, no AMP. timm is imported only when a model is
built (it is not in lmsrt's [clients] extra: it pulls a CUDA torch onto CPU machines).
"""
import argparse

import torch
from common import add_flags, device, image_batches, maybe, run_script, seed_all


def build(args):
    import timm
    import timm.loss
    import timm.optim
    import timm.utils

    dev = device()
    seed_all(args.seed)
    if args.tiny:
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10,
                                  img_size=32, patch_size=8, depth=2)
    else:
        model = timm.create_model(args.model, pretrained=False, num_classes=1000)
    if args.checkpoint:
        model.set_grad_checkpointing(enable=True)
    model.to(dev)
    optimizer = timm.optim.create_optimizer_v2(model, opt="adamw", lr=args.lr, weight_decay=0.05)
    loss_fn = timm.loss.LabelSmoothingCrossEntropy(smoothing=args.smoothing).to(dev)
    loss_scaler = timm.utils.NativeScaler() if args.amp else None
    return model, optimizer, loss_fn, loss_scaler


def train(args, lms=None, timer=None):
    """Train ``args.steps`` steps (under ``lms``, an ``lmsrt.LMS``, if given); the model."""
    dev = device()
    model, optimizer, loss_fn, loss_scaler = build(args)
    size, classes = (32, 10) if args.tiny else (224, 1000)
    model.train()
    with maybe(lms):
        for input, target in image_batches(args.batch, size, classes, args.steps, args.seed):
            if timer:
                timer.begin()
            input, target = input.to(dev, non_blocking=True), target.to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.float16, enabled=loss_scaler is not None):
                output = model(input)
                loss = loss_fn(output, target)
            if loss_scaler is not None:
                loss_scaler(loss, optimizer, clip_grad=None, parameters=model.parameters())
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
            if timer:
                timer.end(loss)
    return model


def parse(argv=None):
    ap = add_flags(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--no-amp", dest="amp", action="store_false", help="train in float32")
    ap.add_argument("--checkpoint", action="store_true",
                    help="model.set_grad_checkpointing() (the peer)")
    args = ap.parse_args(argv)
    args.batch = args.batch or (4 if args.tiny else 256)
    args.amp = args.amp and not args.tiny and device().type == "cuda"
    return args


if __name__ == "__main__":
    run_script(parse, train, "timm_train")
