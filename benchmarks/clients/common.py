"""What every client script of benchmarks/clients/ shares: its flags, the GPU cap of a run without
lmsrt, the step timer, and the JSON it writes, out of memory included.

A client is a library's own training loop written as a user writes it (hf_trainer.py,
gpt2_script.py, ...), with ``parse(argv)`` and ``train(args, lms=None, timer=None)``; run as
a script it calls ``run_script(parse, train, name)``, which caps the GPU and calls
``finish(args, run)``, which runs ``train``, catches an out-of-memory error and writes
``--json``:

    {"client", "argv", "outcome": "ok" | "oom", "message", "oom_step", "step_times_s",
     "step_retries", "losses", "peak_bytes", "peak_gib", "device", "torch", "versions",
     "lmsrt_active"}

``step_retries``: the caching allocator's retries in each step (it freed its cache to go on:
a device sync and ~13 ms on an H200), with or without lmsrt.

and exits 3 after an out-of-memory error (the matrix goes on with the next run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, List, Optional

import torch

__all__ = ["GiB", "OOM_EXIT", "StepTimer", "add_flags", "cap_gpu", "device", "finish",
           "image_batches", "is_oom", "llama", "maybe", "seed_all"]

GiB = 2**30
OOM_EXIT = 3
# Set by `lmsrt run` in the process it runs a script in (lmsrt/launch/session.py).
ENV_ACTIVE = "LMSRT_ACTIVE"
LIBRARIES = ("torch", "transformers", "accelerate", "lightning", "timm", "torchvision", "lmsrt")


def add_flags(ap: argparse.ArgumentParser, steps: int = 40) -> argparse.ArgumentParser:
    """The flags every client has."""
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, for the CPU tests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write step times, peak, outcome and losses")
    ap.add_argument("--gpu-limit", type=float, metavar="GIB",
                    help="cap this process's GPU memory (runs without lmsrt; under `lmsrt run` "
                         "its own --gpu-limit applies and this is ignored)")
    return ap


def device() -> torch.device:
    """The GPU if there is one, else the CPU; the CPU also where lmsrt's simulated device is
    asked for (``LMSRT_DEVICE=sim``: CPU tensors stand in for the GPU's, as in the tests)."""
    sim = os.environ.get("LMSRT_DEVICE") == "sim"
    return torch.device("cuda" if torch.cuda.is_available() and not sim else "cpu")


def cap_gpu(limit_gib: Optional[float]) -> None:
    """As a GPU of ``limit_gib`` GiB: before the model is built, as `lmsrt run --gpu-limit`
    does. Not under `lmsrt run`, whose own cap applies, nor without a GPU."""
    if not limit_gib or os.environ.get(ENV_ACTIVE) == "1" or not torch.cuda.is_available():
        return
    from lmsrt import gpu_cap
    gpu_cap.apply(int(limit_gib * GiB), torch.cuda.current_device())


def llama(args, hidden: int, layers: int, heads: int, mlp: int):
    """transformers' LlamaForCausalLM from a config of these sizes (vocab 32000), or with
    ``args.tiny`` a tiny one for the CPU tests; ``args.seq`` positions, seeded with
    ``args.seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    vocab = 32000
    if args.tiny:
        hidden, layers, heads, mlp, vocab = 64, 2, 4, 128, 128
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=mlp, vocab_size=vocab,
                         max_position_embeddings=args.seq)
    seed_all(args.seed)
    return LlamaForCausalLM(config)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def maybe(lms) -> contextlib.AbstractContextManager:
    """``lms`` (an ``lmsrt.LMS``) around the whole loop, or nothing."""
    return contextlib.nullcontext() if lms is None else lms


def image_batches(batch: int, size: int, classes: int, steps: int, seed: int):
    """What an image DataLoader with pin_memory=True yields: (images, labels) in pinned host
    memory (when training on a GPU), two random batches in turn, ``steps`` of them."""
    g = torch.Generator().manual_seed(seed)
    pool = [(torch.randn(batch, 3, size, size, generator=g),
             torch.randint(classes, (batch,), generator=g)) for _ in range(2)]
    if device().type == "cuda":
        pool = [(x.pin_memory(), y.pin_memory()) for x, y in pool]
    for i in range(steps):
        yield pool[i % 2]


class StepTimer:
    """Wall time of each optimizer step, the device synchronised at both ends, the CPU time of
    the process's threads in it (a step whose CPU time is near its wall time is limited by the
    host, not the GPU), the caching allocator's retries in it, and its loss.

    ``begin()`` where a step starts; ``end(loss)`` where it ends. A step that ``begin`` did not
    open runs from the previous ``end`` (so a loop may call ``end`` only)."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self.cpu: List[float] = []
        self.losses: List[Optional[float]] = []
        self.retries: List[int] = []
        self._start: Optional[tuple] = None

    @staticmethod
    def _now() -> tuple:
        retries = 0
        if device().type == "cuda":
            torch.cuda.synchronize()
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        return time.perf_counter(), time.process_time(), retries

    def begin(self) -> None:
        self._start = self._now()

    def end(self, loss=None) -> None:
        now = self._now()
        if self._start is not None:
            self.times.append(now[0] - self._start[0])
            self.cpu.append(now[1] - self._start[1])
            self.retries.append(now[2] - self._start[2])
        self._start = now
        if loss is not None:
            loss = float(loss.detach().float().item() if torch.is_tensor(loss) else loss)
        self.losses.append(loss)

    @property
    def steps(self) -> int:
        return len(self.losses)


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error, also when a library wrapped it in another exception."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "CUBLAS_STATUS_ALLOC_FAILED" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run_script(parse: Callable[[], object], train: Callable, client: str) -> None:
    """A client's command line: its flags (``parse()``), the cap, then ``train(args, timer=...)``
    under ``finish``."""
    args = parse()
    cap_gpu(args.gpu_limit)
    finish(args, lambda timer: train(args, timer=timer), client)


def finish(args, run: Callable[[StepTimer], object], client: str) -> None:
    """Run ``run(timer)``, write ``args.json``, and exit 3 after an out-of-memory error."""
    timer = StepTimer()
    result = {"client": client, "argv": sys.argv[1:], "outcome": "ok", "message": "",
              "oom_step": None, "lmsrt_active": os.environ.get(ENV_ACTIVE) == "1",
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__}
    status = 0
    try:
        run(timer)
    except Exception as e:
        if not is_oom(e):
            raise
        traceback.print_exc()
        result.update(outcome="oom", message=str(e).strip().splitlines()[0][:500],
                      oom_step=timer.steps + 1)
        status = OOM_EXIT
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    result["versions"] = {name: getattr(sys.modules[name], "__version__", None) for name in
                          LIBRARIES if name in sys.modules}
    result.update(step_times_s=timer.times, step_cpu_s=timer.cpu, step_retries=timer.retries,
                  losses=timer.losses,
                  steps_done=timer.steps,
                  peak_bytes=peak, peak_gib=peak / GiB)
    shown = f"{timer.steps} steps"
    if timer.times:
        shown += f", median of the last 10: {statistics.median(timer.times[-10:]):.4f} s"
    print(f"{client}: {result['outcome']} after {shown}, peak {peak / GiB:.2f} GiB",
          file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if status:
        sys.exit(status)

