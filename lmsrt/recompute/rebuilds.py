"""``Rebuilds``: what a swap engine knows of rebuilding (recipes.py, NOTE [ Recipes ]): which
signatures are trusted, running and checking rebuilds, and their GPU time.

Example::

    rebuilds = Rebuilds(device, entry_of)
    with rebuilds.recorder():                    # notes how cheap ops made their outputs
        y = model(x)
    recipe = rebuilds.usable(t, available)       # one whose inputs the engine holds, or None
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

from ..say import say_once
from .recipes import Recipe, RecipeTable, Recorder, _Input, _view

__all__ = ["Rebuilds", "sample_words"]


# A rebuild is worth it while it takes less GPU time than the two copies it saves (out in
# forward, back in backward): their bytes over the link each way (half the ~55 GB/s measured for
# pinned copies: a bound no listed op comes near; they are memory-bound, ~100x faster) and each
# copy's own cost beside its bytes (pack_overhead on an H200: a swapped tensor costs ~50 us more
# than one kept). The rebuild is timed by events around it: on an idle GPU that includes its
# launch, which for a small tensor is most of it.
_LINK_BYTES_PER_S = 25e9
_COPY_FIXED_S = 25e-6
# A rebuild's events also time whatever ran beside it: backward's kernels on the compute stream
# while it runs on a side stream, the learning step's copies. Measured on an H200 (an LM's gelu,
# 128 MiB): 18.9 ms in the first step of one run, fast enough to be rebuilt in another; refused
# on that one reading, the run moved 3 GiB more a step, 30% slower. So a signature is refused for
# speed only when the fastest of its first _SAMPLES timings is slower than its copies.
_SAMPLES = 3
# While the recorder is on the thread's mode stack each op of forward, whatever its size, runs
# through Python: measured under a Trainer on an H200's host, ~75 us an op beside the op's own
# dispatch (4,400 ops a forward of a 24-layer Llama, 0.28 s a step; the step took 0.45 s where
# the copies that its 2.2 GiB of rebuilds saved would take ~0.08). A planned step whose ops cost
# more this way than the copies its rebuilds saved stops noting recipes for the run.
_DISPATCH_S = 50e-6
_MATERIAL_S = 0.01     # and only where that cost is more than this a step


class Rebuilds:
    """What a swap engine knows of rebuilding (NOTE [ Recipes ]): the recipe table its threads'
    recorders write, which signatures have been checked bit for bit, and the rebuilds' GPU time.

    A signature is trusted only after a rebuild of it matched the original bit for bit on this
    device. In forward, while the original and its inputs are still on the GPU and there is room
    for a second copy, the engine rebuilds and compares at once (``check_now``, one device sync
    per signature). Else it swaps the tensor as usual and, when backward brings it back,
    rebuilds it too and compares (``check``); those comparisons are read once, at the end of the
    step (``finish_step``). A mismatch, and that signature is never rebuilt again in this run;
    so too once the fastest of its first ``_SAMPLES`` rebuilds was slower than the two copies it
    saves."""

    def __init__(self, device, entry_of: Callable[[torch.Tensor], object]):
        self.device = device
        self.recipes = RecipeTable()
        self.entry_of = entry_of
        self.trusted: set = set()
        self.refused: Dict[tuple, str] = {}      # signature -> why it is not rebuilt
        self._checks: list = []                  # (recipe, differs?, start, end), this step
        self._timed_runs: list = []              # (signature, bytes, start, end): rebuilds
        self._fastest: Dict[tuple, list] = {}    # signature -> [fastest s, timings] (_SAMPLES)
        self._checked_now = 0                    # checks made in forward, this step
        self._mismatched: set = set()            # ops whose check did not match, this step
        self.retaining = False                   # new recipes retain their inputs (the engine sets)
        self.noting = True                       # recorders note recipes (the engine sets)
        self._asleep: Dict[int, Recorder] = {}   # thread -> its recorder, off its mode stack
        self.dispatched = [0]                    # ops the recorders passed on, this step
        # Seconds an op costs under a recorder (0 on the simulated device, whose copies cost no
        # step time); ``worthwhile`` goes False for the run where that outweighs the copies
        # saved (``judge_recorder``).
        self.dispatch_s = 0.0 if device.kind == "sim" else _DISPATCH_S
        self.worthwhile = True

    def recorder(self) -> Recorder:
        """A recorder for one thread, writing this table."""
        return Recorder(self.recipes, self.entry_of, lambda: self.retaining, lambda: self.noting,
                        self.dispatched)

    def follow_noting(self) -> None:
        """As a step's forward begins: wake this thread's recorder (back on its mode stack) if
        ``noting``, else put it to sleep (``sleep``)."""
        if not self.noting:
            self.sleep()
            return
        recorder = self._asleep.pop(threading.get_ident(), None)
        if recorder is not None:
            _push_mode(recorder)

    def sleep(self) -> None:
        """Take this thread's recorder off its mode stack until the next forward that notes
        (``follow_noting``): as backward begins, and for steps that note nothing. On the stack,
        even a mode that passes every op straight on runs each kernel through Python, and
        autograd carries the stack into backward's threads (measured under ``lmsrt run``, one
        block around the whole loop: a Trainer step 0.34-0.45 s against 0.25 with it off).
        Only the top of the stack is taken: a mode the script entered after it stays where it
        is, and the recorder with it."""
        thread = threading.get_ident()
        if thread not in self._asleep and self._own(_get_current_dispatch_mode()):
            self._asleep[thread] = _pop_mode()

    def leave(self, recorder: Recorder, thread: Optional[int] = None) -> None:
        """``recorder``'s block, entered on ``thread`` (this one when None), ends: forgotten if
        asleep, else off this thread's mode stack. Left from another thread (autograd's device
        thread, inside backward), a recorder on the entering thread's stack is that thread's to
        take off (``pop_stale_recorder``); one asleep is forgotten here, or the entering
        thread's next forward would wake it into a block already left, on its stack for good."""
        here = threading.get_ident()
        thread = here if thread is None else thread
        if self._asleep.get(thread) is recorder:
            del self._asleep[thread]
        elif thread == here:
            recorder.__exit__(None, None, None)

    def _own(self, mode) -> bool:
        return isinstance(mode, Recorder) and mode._recipes is self.recipes

    def pop_stale_recorder(self) -> None:
        """Take off this thread's mode stack a recorder of this table that autograd put back:
        ``with lms:`` was left inside backward, which restores the thread's modes as they were
        when it began (the recorder's own exit already ran)."""
        if self._own(_get_current_dispatch_mode()):
            _pop_mode()

    def usable(self, t: torch.Tensor, available: Callable[[_Input], bool]) -> Optional[Recipe]:
        """The recipe of saved tensor ``t`` if there is one, not refused, whose inputs are all
        ``available``."""
        storage = t.untyped_storage()
        found = self.recipes.get(id(storage))
        if found is None or found[0]() is not storage:
            return None
        recipe = found[1]
        if not recipe.fits(t) or recipe.signature in self.refused:
            return None
        return recipe if recipe.inputs_saved(available) else None

    def let_go(self, storage=None) -> None:
        """Let the recipe of ``storage`` (every recipe, by default) stop retaining its inputs."""
        if storage is not None:
            found = self.recipes.get(id(storage))
            if found is not None and found[1].retained is not None:
                found[1].let_go()
            return
        self.recipes.sweep()
        for _, recipe in list(self.recipes.values()):
            if recipe.retained is not None:
                recipe.let_go()

    def _timed(self, recipe: Recipe, resolve) -> tuple:
        """(output, start, end): ``recipe`` run between two timing events, its inputs brought
        back first (not the rebuild's time)."""
        args = recipe.arguments(resolve)
        start, end = self.device.new_event(timing=True), self.device.new_event(timing=True)
        start.record()
        out = recipe.run(args)
        end.record()
        return out, start, end

    def run(self, recipe: Recipe, resolve: Callable[[_Input], Optional[torch.Tensor]]):
        """Rebuild ``recipe``'s output (timed on the GPU)."""
        out, start, end = self._timed(recipe, resolve)
        self._timed_runs.append((recipe.signature, recipe.nbytes, start, end))
        return out

    def check(self, recipe: Recipe, original, resolve: Callable[[_Input], Optional[torch.Tensor]]
              ) -> None:
        """Rebuild ``recipe``'s output and queue a bitwise comparison with the ``original``
        storage on the GPU; read at the end of the step."""
        out, start, end = self._timed(recipe, resolve)
        differs = torch.ne(_words(out.untyped_storage()), _words(original)).any()
        self._checks.append((recipe, differs, start, end))

    def check_now(self, recipe: Recipe, original,
                  resolve: Callable[[_Input], Optional[torch.Tensor]]) -> None:
        """Rebuild ``recipe``'s output, compare it with the ``original`` storage and judge its
        signature at once (one device sync): in forward, where the original is still on the GPU
        and need not be copied out for a check in backward. Raises what the rebuild raises (an
        input not at hand): then nothing is judged."""
        out, start, end = self._timed(recipe, resolve)
        differs = bool(torch.ne(_words(out.untyped_storage()), _words(original)).any())
        del out
        self._judge(recipe, differs, start.elapsed_time(end) / 1e3)
        self._checked_now += 1

    def _judge(self, recipe: Recipe, differs: bool, took: float) -> None:
        """Trust or refuse ``recipe``'s signature by one check that took ``took`` seconds."""
        sig = recipe.signature
        if differs:
            self.refused[sig] = "did not rebuild bit for bit"
            self.trusted.discard(sig)
            self._mismatched.add(recipe.name)
            return
        if sig not in self.refused:
            self.trusted.add(sig)
            self._timed_once(sig, recipe.nbytes, took)

    def _timed_once(self, sig: tuple, nbytes: int, took: float) -> None:
        """One timing of a trusted signature's rebuild of ``nbytes``: refused once the fastest
        of its first ``_SAMPLES`` is slower than its copies (see _SAMPLES)."""
        fastest = self._fastest.setdefault(sig, [float("inf"), 0])
        if fastest[1] >= _SAMPLES or sig not in self.trusted:
            return
        fastest[0], fastest[1] = min(fastest[0], took), fastest[1] + 1
        copies = 2 * (_COPY_FIXED_S + nbytes / _LINK_BYTES_PER_S)
        if fastest[1] == _SAMPLES and fastest[0] > copies:
            self.refused[sig] = (f"rebuilt in {fastest[0] * 1e3:.3f} ms at best of {_SAMPLES}, "
                                 f"slower than its copies ({copies * 1e3:.3f} ms)")
            self.trusted.discard(sig)

    def finish_step(self) -> tuple:
        """Read this step's comparisons (one device sync when there were any) and the rebuilds'
        time; return (rebuild ms, checks made, names of the ops that did not match)."""
        checks, self._checks = self._checks, []
        made, self._checked_now = self._checked_now + len(checks), 0
        mismatched, self._mismatched = self._mismatched, set()
        if checks:
            self.device.synchronize()   # the comparisons ran on backward's streams
        ms, pending = 0.0, []
        for sig, nbytes, start, end in self._timed_runs:
            if end.query():
                took = start.elapsed_time(end)
                ms += took
                self._timed_once(sig, nbytes, took / 1e3)
            else:
                pending.append((sig, nbytes, start, end))
        self._timed_runs = pending
        if checks:
            differs = torch.stack([d for _, d, _, _ in checks]).cpu().tolist()
            for (recipe, _, start, end), bad in zip(checks, differs):
                self._judge(recipe, bad, start.elapsed_time(end) / 1e3)
            mismatched |= self._mismatched
            self._mismatched = set()
        return ms, made, sorted(mismatched)


    def judge_recorder(self, step, forward_s: float = 0.0, step_s: float = 0.0,
                       planned: bool = True) -> bool:
        """After each step (its ``StepStats``, or None) that rebuilt storages: whether noting
        recipes is still worth its cost in forward (``_DISPATCH_S`` an op of the step's forward)
        against the step time that copying those storages instead would add: their copies'
        launches, and what of their bytes the link could not hide beside the copies the step
        made, out under its forward (``forward_s`` of wall time) and in under the rest of it
        (``step_s`` less that, up to twice forward). Once not, never again in this run (said
        once). Measured on resnet152 at a 12 GiB cap on an H200: the recorder took ~20 ms of
        forward's host time a step to save copies of 1.2 GiB that the link had room for under
        a 0.08 s forward, and its plan (state moved for the rebuilds' room) ran 0.25 s a step
        against 0.19 with the recorder off.

        A step without a plan (not ``planned``: the first, or one that learns again; its times
        hold first calls' costs) is judged only against the most its copies could add: all of
        them shown, at half the nominal link (the Trainer with its own checkpointing: 2,143
        ops, ~107 ms, to rebuild 0.06 GiB whose copies take ~2 ms; it took step 2's forward,
        and its judge's probe step 3's)."""
        ops, self.dispatched[0] = self.dispatched[0], 0
        if not self.worthwhile or step is None or not step.rebuilt_bytes:
            return self.worthwhile
        cost = ops * self.dispatch_s
        if cost <= _MATERIAL_S:
            return True
        rebuilt = step.rebuilt_bytes
        if not planned:
            most = 2 * (step.rebuilt_tensors * _COPY_FIXED_S + rebuilt / (_LINK_BYTES_PER_S / 2))
            return self._weigh(ops, cost, most, rebuilt, "could add at most")
        from .plan import link_bandwidth
        try:
            bandwidth = link_bandwidth(self.device)
        except RuntimeError:         # (no room for the probe's copy at the cap: the nominal)
            bandwidth = _LINK_BYTES_PER_S
        # Backward as the rest of the step, up to twice forward (the rest holds the optimizer,
        # the next batch's loading, an evaluation: no copies of backward's hide there).
        back = min(step_s - forward_s, 2 * forward_s)
        saved = (2 * step.rebuilt_tensors * _COPY_FIXED_S
                 + exposed(step.out_bytes, rebuilt, bandwidth, forward_s)
                 + exposed(step.in_bytes, rebuilt, bandwidth, back))
        return self._weigh(ops, cost, saved, rebuilt, "would add (the link hides the rest)")

    def _weigh(self, ops: int, cost: float, saved: float, rebuilt: int, how: str) -> bool:
        """Off for the run where the recorder's ``cost`` passes the copies' ``saved`` time."""
        if cost > saved:
            self.worthwhile = False
            say_once("recorder-cost",
                     f"lmsrt: rebuilding saved tensors costs more than it saves here: {ops} ops "
                     f"a forward pass through the rebuild recorder (~{cost * 1e3:.0f} ms of "
                     f"Python) against ~{saved * 1e3:.0f} ms of step time that copying the "
                     f"{rebuilt / 2**30:.2f} GiB it rebuilds {how}; those tensors are moved "
                     "or kept from the next step on (said once).")
        return self.worthwhile

    def refusals(self) -> Dict[str, str]:
        """Why each op is not rebuilt, by op name (a signature's first item is its op)."""
        return {sig[0].overloadpacket.__name__: why for sig, why in self.refused.items()}


def exposed(moved: int, extra: int, bandwidth: float, seconds: float) -> float:
    """Seconds that ``extra`` more bytes on a link of ``bandwidth`` bytes/s add to a pass of
    ``seconds`` that copies ``moved`` bytes already: only what runs past the pass shows.

    Example::

        exposed(0, 1 << 30, 50e9, 0.08)       # 0.0: 21 ms of copies under an 80 ms pass
    """
    over = max(0.0, seconds)
    return (max(0.0, (moved + extra) / bandwidth - over)
            - max(0.0, moved / bandwidth - over))


def _words(storage) -> torch.Tensor:
    """``storage``'s bytes as the widest integers that tile them: comparing two storages then
    makes a mask of an eighth of their bytes, not of as many."""
    n = storage.nbytes()
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if n % size == 0:
            return _view(storage, dtype, 0, (n // size,), (1,))
    return _view(storage, torch.uint8, 0, (n,), (1,))


_SAMPLE_WORDS = 64


def sample_words(storage) -> torch.Tensor:
    """``_SAMPLE_WORDS`` words spread evenly over ``storage``, copied: a rebuild of it must
    match them (params.py, NOTE [ Parameters a rebuild reads ]). One small kernel."""
    words = _words(storage)
    return words[::max(1, words.numel() // _SAMPLE_WORDS)][:_SAMPLE_WORDS].clone()
