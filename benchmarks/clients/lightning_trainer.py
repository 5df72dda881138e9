"""Lightning's Trainer on a GPT-style LightningModule, its validation sanity check included.

    python benchmarks/clients/lightning_trainer.py --steps 40 --json lightning.json   # uncapped
    python benchmarks/clients/lightning_trainer.py --checkpoint --gpu-limit 12         # the peer
    python -m lmsrt run --gpu-limit 18 --stats stats.json benchmarks/clients/lightning_trainer.py
    python benchmarks/clients/lightning_trainer.py --tiny --steps 3                     # CPU

A decoder-only transformer of PyTorch's own layers (nn.TransformerEncoderLayer, pre-norm, GELU,
24 x 1024 wide, 16 heads, called with keyword arguments: ``src_mask``, ``is_causal``), vocab
32000, batch 8 x 2048 random tokens, AdamW (foreach: Lightning refuses to clip a fused one's
gradients), ``lightning.Trainer(precision="bf16-mixed",
gradient_clip_val=1.0, num_sanity_val_steps=2)`` with a validation loader, so two validation
batches run under no_grad with the model in eval mode before the first step. The peer:
--checkpoint, the module's own torch.utils.checkpoint per layer. Each step is timed by a
Callback (on_train_batch_start/end), the device synchronised at both ends.
"""
import argparse

import torch
import torch.nn.functional as F
from common import add_flags, device, maybe, run_script
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def make_module(args):
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            d, heads, layers, self.vocab = ((32, 2, 2, 64) if args.tiny else
                                            (1024, 16, 24, 32000))
            self.embed = nn.Embedding(self.vocab, d)
            self.pos = nn.Embedding(args.seq, d)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, self.vocab, bias=False)

        def forward(self, idx):
            seq = idx.size(1)
            x = self.embed(idx) + self.pos(torch.arange(seq, device=idx.device))
            mask = nn.Transformer.generate_square_subsequent_mask(seq, device=idx.device)
            for layer in self.layers:
                if args.checkpoint and self.training:
                    x = checkpoint(layer, x, src_mask=mask, is_causal=True, use_reentrant=False)
                else:
                    x = layer(x, src_mask=mask, is_causal=True)
            return self.head(self.norm(x))

        def _loss(self, batch):
            x, y = batch
            return F.cross_entropy(self(x).view(-1, self.vocab), y.reshape(-1))

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            return self._loss(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    return LitGPT()


def build(args, timer=None):
    """The Trainer, the module and its two loaders, ready to ``fit``."""
    import lightning as L

    class StepTimes(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            timer.begin()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            timer.end(outputs["loss"])

    L.seed_everything(args.seed, verbose=False)
    module = make_module(args)
    vocab, on_gpu = module.vocab, device().type == "cuda"
    train_data = DataLoader(RandomTokens(args.steps * args.batch, args.seq, vocab, args.seed),
                            batch_size=args.batch, pin_memory=on_gpu)
    val_data = DataLoader(RandomTokens(2 * args.batch, args.seq, vocab, args.seed + 1),
                          batch_size=args.batch, pin_memory=on_gpu)
    trainer = L.Trainer(max_steps=args.steps, precision=args.precision, num_sanity_val_steps=2,
                        limit_val_batches=2, gradient_clip_val=1.0, enable_checkpointing=False,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="gpu" if on_gpu else "cpu", devices=1,
                        callbacks=[StepTimes()] if timer is not None else [])
    return trainer, module, train_data, val_data


def train(args, lms=None, timer=None):
    """Train ``args.steps`` steps (under ``lms``, an ``lmsrt.LMS``, if given); the module."""
    trainer, module, train_data, val_data = build(args, timer)
    with maybe(lms):
        trainer.fit(module, train_data, val_data)
    return module


def parse(argv=None):
    ap = add_flags(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--checkpoint", action="store_true",
                    help="the module's own torch.utils.checkpoint per layer (the peer)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--precision", help='Lightning\'s precision (default "bf16-mixed"; --tiny: '
                                        '"32-true")')
    args = ap.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (32 if args.tiny else 2048)
    args.precision = args.precision or ("32-true" if args.tiny else "bf16-mixed")
    return args


if __name__ == "__main__":
    run_script(parse, train, "lightning_trainer")
