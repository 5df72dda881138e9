"""Where a host-bound training step's time goes: every thread's Python stack, sampled.

    python scripts/host_sampler.py -- lmsrt run --gpu-limit 12 train.py --epochs 1
    python scripts/host_sampler.py --windows 5-19,20-39 --every 0.005 -- train.py --lr 0.1
    python scripts/host_sampler.py --dump samples.json -- lmsrt run train.py

Runs the command in this process (``lmsrt run ...`` as ``python -m lmsrt run ...`` would, or a
script as ``python script.py`` would) while a thread reads every other thread's Python stack
each ``--every`` seconds: the training thread, autograd's device threads (where backward's hooks,
and so lmsrt's reruns, run: a profiler of the main thread never sees them) and lmsrt's own. A
step ends where a backward of the main thread does, as the samples see it (no hook is set: an
optimizer step hook would change what lmsrt does with optimizer state). At exit, per window of
steps and per thread, the innermost frames and the innermost frames of lmsrt's code, in samples
a step; the collector's seconds a step; on a GPU, the SM clock. A sample holds no frame past
itself (a held frame keeps its locals, tensors included, alive: measured, a Trainer's peak 3.5
GiB higher).

Found this way: resnet152's forward spent ~20 ms a step in the rebuild recorder's Python
(benchmarks/results/h200-2026-11-28h-session28). The samples cost the run a few percent of its
step time: compare runs under the sampler with each other, not with runs without it.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import gc
import json
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from in_process import run_command, split_command

_LMSRT = os.sep + "lmsrt" + os.sep


class Sampler:
    """The samples of one run: (step, thread, innermost frame, innermost lmsrt frame)."""

    def __init__(self, every: float):
        self.every, self.step = every, 0
        self.samples: List[Tuple[int, str, str, Optional[str]]] = []
        self.clocks: List[Tuple[int, int]] = []
        self.gc_s: Dict[int, float] = collections.defaultdict(float)
        self._stop = threading.Event()
        self._names: Dict[int, str] = {}
        self._gc_start: Optional[float] = None

    def start(self) -> None:
        gc.callbacks.append(self._gc)
        threading.Thread(target=self._sample, name="host-sampler", daemon=True).start()
        threading.Thread(target=self._clock, name="host-sampler-clock", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _gc(self, phase: str, info: dict) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s[self.step] += time.perf_counter() - self._gc_start

    def _name(self, ident: int) -> str:
        name = self._names.get(ident)
        if name is None:
            found = [t.name for t in threading.enumerate() if t.ident == ident]
            name = self._names[ident] = (
                "main" if ident == threading.main_thread().ident
                else found[0] if found else f"native-{len(self._names)}")
        return name

    def _sample(self) -> None:
        me, main = threading.get_ident(), threading.main_thread().ident
        in_backward = False
        while not self._stop.wait(self.every):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                inner, lms, backward = _where(frame.f_code), None, False
                f = frame
                while f is not None:
                    code = f.f_code
                    if lms is None and _LMSRT in code.co_filename:
                        lms = _where(code)
                    backward = backward or code.co_name == "_engine_run_backward"
                    f = f.f_back
                if ident == main:
                    if in_backward and not backward:
                        self.step += 1          # the main thread's backward ended
                    in_backward = backward
                self.samples.append((self.step, self._name(ident), inner, lms))
            frame = f = None        # a held frame keeps its locals alive: none past a sample

    def _clock(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:           # noqa: BLE001 - no GPU, no NVML: no clocks
            return
        while not self._stop.wait(0.1):
            try:
                self.clocks.append((self.step, pynvml.nvmlDeviceGetClockInfo(
                    handle, pynvml.NVML_CLOCK_SM)))
            except Exception:       # noqa: BLE001 - a failed read is a missing sample
                pass

    def report(self, windows: List[Tuple[int, int]], top: int) -> str:
        """Per window of steps (ended steps, so a window's first step is the one after its
        first ended), per thread: the innermost frames and lmsrt's, in samples a step."""
        lines = []
        for a, b in windows:
            steps = b - a + 1
            here = [s for s in self.samples if a <= s[0] <= b]
            lines.append(f"== steps {a + 1}-{b + 1} ({len(here)} samples, one each "
                         f"{self.every * 1e3:g} ms)")
            threads = collections.Counter(s[1] for s in here)
            for thread, count in threads.most_common():
                if thread.startswith(("lmsrt-touch", "host-sampler")) or count < steps:
                    continue
                mine = [s for s in here if s[1] == thread]
                lines.append(f"  {thread}: {len(mine) / steps:.1f} samples a step")
                for label, key in (("inner", 2), ("lmsrt", 3)):
                    counts = collections.Counter(s[key] or "-" for s in mine)
                    for where, n in counts.most_common(top):
                        lines.append(f"    {label} {n / steps:6.1f}  {where}")
            clocks = sorted(c for s, c in self.clocks if a <= s <= b)
            if clocks:
                lines.append(f"  SM clock MHz min/median/max {clocks[0]}/"
                             f"{clocks[len(clocks) // 2]}/{clocks[-1]}")
            gc_s = sum(v for k, v in self.gc_s.items() if a <= k <= b)
            lines.append(f"  collector, main thread: {gc_s / steps * 1e3:.1f} ms a step")
        return "\n".join(lines)


def _where(code) -> str:
    path = code.co_filename
    for mark in ("site-packages" + os.sep, _LMSRT):
        i = path.rfind(mark)
        if i >= 0:
            path = path[i + len(mark):] if mark != _LMSRT else "lmsrt/" + path[i + len(mark):]
            break
    return f"{path}:{code.co_name}"


def _windows(text: str) -> List[Tuple[int, int]]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        first, last = int(a), int(b or a)
        if first < 1 or last < first:
            raise argparse.ArgumentTypeError(f"bad window {part!r}: FIRST-LAST, 1 <= FIRST <= LAST")
        out.append((first - 1, last - 1))
    return out


def main(argv: Optional[List[str]] = None) -> None:
    own, command = split_command("host_sampler", sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.005, help="seconds between samples")
    ap.add_argument("--windows", type=_windows, default=_windows("5-19,20-39"),
                    help="steps to report, FIRST-LAST[,FIRST-LAST...], counted from 1")
    ap.add_argument("--top", type=int, default=10, help="frames shown per thread")
    ap.add_argument("--dump", help="write every sample as JSON")
    args = ap.parse_args(own)
    sampler = Sampler(args.every)

    def finish() -> None:
        sampler.stop()
        print(sampler.report(args.windows, args.top), file=sys.stderr, flush=True)
        if args.dump:
            with open(args.dump, "w") as f:
                json.dump({"every": args.every, "samples": sampler.samples,
                           "clocks": sampler.clocks, "gc_s": sampler.gc_s}, f)

    atexit.register(finish)
    sampler.start()
    run_command(command)


if __name__ == "__main__":
    main()
