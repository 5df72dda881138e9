"""
Train a SegNet-like segmentation net on random 4x769x1025 images, with or without lmsrt.

An encoder of conv+BN+ReLU stages with max pooling, a decoder that unpools with the pooling
indices, a per-pixel cross-entropy loss; bf16 autocast and SGD. The inputs and labels are random,
so the loss shows that training runs, not that it learns. Each step prints its time and peak GPU
memory; the LMS summary comes at the end.

    python examples/train_segnet.py                                   # plain PyTorch
    python examples/train_segnet.py --lms 1000                        # LMS enabled by the script
    lmsrt run --lms 1000 examples/train_segnet.py                     # LMS enabled by the launcher
    python examples/train_segnet.py --gpu-limit 6                     # as on a smaller GPU: OOM
    python examples/train_segnet.py --gpu-limit 6 --lms 1000       # trains (lms_frac auto)

At full resolution each image saves about 1.6 GiB for backward, most of it in the first and last
stage, so the default batch of 6 saves about 10 GiB: more than an 8 GB card holds. Pick a
--gpu-limit below the peak the first command prints.

On a machine without a GPU it runs on the CPU, LMS on a simulated GPU (for tests):

    python examples/train_segnet.py --size 65x97 --width 4 --stages 2 --batch-size 2 --steps 3 \
        --lms 1 --lms-frac 0

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
parser.add_argument("--batch-size", type=int, default=6)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--stages", type=int, default=5, help="encoder (and decoder) stages")
parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
parser.add_argument("--size", default="769x1025", help="input HxW")
parser.add_argument("--classes", type=int, default=12)
parser.add_argument("--gpu-limit", type=float, default=None, help="cap GPU memory at this many GiB")
parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
args = parser.parse_args()
height, width = (int(v) for v in args.size.lower().split("x"))

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


def conv_bn_relu(c_in, c_out):
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True)]


class SegNet(nn.Module):
    def __init__(self, c_in, width, stages, classes):
        super().__init__()
        chans = [min(width * 2**i, 8 * width) for i in range(stages)]     # 64 128 256 512 512
        self.encoders = nn.ModuleList(
            nn.Sequential(*conv_bn_relu(c_in if i == 0 else chans[i - 1], c), *conv_bn_relu(c, c))
            for i, c in enumerate(chans))
        self.decoders = nn.ModuleList(
            nn.Sequential(*conv_bn_relu(c, c), *conv_bn_relu(c, chans[max(i - 1, 0)]))
            for i, c in reversed(list(enumerate(chans))))
        self.pool = nn.MaxPool2d(2, 2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2, 2)
        self.head = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x):
        sizes, indices = [], []
        for encoder in self.encoders:
            x = encoder(x)
            sizes.append(x.shape[-2:])       # odd sizes (769x1025) floor when pooled
            x, i = self.pool(x)
            indices.append(i)
        for decoder in self.decoders:
            x = decoder(self.unpool(x, indices.pop(), output_size=sizes.pop()))
        return self.head(x)


torch.manual_seed(0)
model = SegNet(4, args.width, args.stages, args.classes).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
      f"input {args.batch_size}x4x{height}x{width}")
images = torch.randn(args.batch_size, 4, height, width, device=device)
labels = torch.randint(args.classes, (args.batch_size, height, width), device=device)
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
                    loss = F.cross_entropy(model(images).float(), labels)
            else:
                loss = F.cross_entropy(model(images).float(), labels)
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
                  "lmsrt run --lms 1000 examples/train_segnet.py ...")
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
