"""transformers' Trainer on a Llama-style model built from a config, as a user writes it.

    python benchmarks/clients/hf_trainer.py --steps 40 --json hf.json            # uncapped
    python benchmarks/clients/hf_trainer.py --gradient-checkpointing --gpu-limit 14
    python -m lmsrt run --gpu-limit 20 --stats stats.json benchmarks/clients/hf_trainer.py
    python benchmarks/clients/hf_trainer.py --tiny --steps 3                     # CPU, seconds

LlamaForCausalLM (hidden 1024, 24 layers, 16 heads, MLP 2816, vocab 32000: 370M parameters),
batch 8 x 2048 random tokens, bf16, fused AdamW, no evaluation, nothing saved. The library's own
memory saver is --gradient-checkpointing (TrainingArguments' activation checkpointing). Each
optimizer step is timed by a TrainerCallback, the device synchronised at both ends.
"""
import argparse
import tempfile

import torch
from common import add_flags, device, llama, maybe, run_script
from torch.utils.data import Dataset


class RandomTokens(Dataset):
    """``n`` sequences of random tokens, the same for a seed; labels are the inputs (the model
    shifts them)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        self.n, self.seq, self.vocab, self.seed = n, seq, vocab, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids}


def build(args, timer=None):
    """The Trainer, ready to ``train()``; ``timer`` (common.StepTimer) times its steps."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            if state.global_step == 0:
                timer.begin()

        def on_step_end(self, args_, state, control, **kw):
            timer.end()

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "loss" in logs and timer.losses:
                timer.losses[-1] = float(logs["loss"])

    model = llama(args, hidden=1024, layers=24, heads=16, mlp=2816)
    on_gpu = device().type == "cuda"
    # transformers 5.2x calls it activation_checkpointing; gradient_checkpointing before.
    saver = ("activation_checkpointing" if "activation_checkpointing"
             in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing")
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_trainer_"),
        per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=3e-4,
        bf16=not args.tiny, optim="adamw_torch_fused" if on_gpu else "adamw_torch",
        use_cpu=not on_gpu, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
        **{saver: args.gradient_checkpointing})
    data = RandomTokens(args.steps * args.batch, args.seq, model.config.vocab_size, args.seed)
    return Trainer(model=model, args=training, train_dataset=data,
                   callbacks=[StepTimes()] if timer is not None else [])


def train(args, lms=None, timer=None):
    """Train ``args.steps`` steps (under ``lms``, an ``lmsrt.LMS``, if given); the model."""
    trainer = build(args, timer)
    with maybe(lms):
        trainer.train()
    return trainer.model


def parse(argv=None):
    ap = add_flags(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="the Trainer's own activation checkpointing (the peer)")
    ap.add_argument("--max-steps", dest="steps", type=int, default=argparse.SUPPRESS,
                    help="the same as --steps")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    args = ap.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (64 if args.tiny else 2048)
    return args


if __name__ == "__main__":
    run_script(parse, train, "hf_trainer")
