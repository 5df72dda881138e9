"""NOTE [ Rebuilt storages ]
Under ``recompute`` a storage whose recipe (recompute/recipes.py, NOTE [ Recipes ]) reads only
inputs the engine holds anyway (parameters, storages saved in this forward: kept, swapped or rebuilt
themselves) is offloaded without a copy when the engine would otherwise swap it: its source is
dropped at once, and backward runs the op again at its first use, on its stream, from its inputs (a
swapped input is brought back for it, early by what separates the two uses: an op's output is used
in backward before its input, a stage's first input last of all; the plan counts those bytes, and
moves the storage instead where they would not fit: policy/planner.py). The recipe marks its inputs'
entries as needed (``needed_by``), so an input no handle holds any more still outlives it; kept
inputs are held by their storage. A recipe's signature is trusted once a rebuild of it has matched
bit for bit on this device. The first check is made in forward, as the storage is saved
(``_check_now``: one rebuild, one comparison, one device sync per signature), while the storage and
its inputs are still on the GPU: in the first forward each recipe retains its inputs' storages until
its output is saved (``Recipe.retain_inputs``). Trusted there, the storage is rebuilt from this step
on, and no copy goes out for it: the first step pins and moves only what must move. Where that check
cannot be made (no room for a second copy, an input gone), the storage is swapped as usual and
carries the recipe as a check: its first use rebuilds it beside the copy and compares on the GPU
(``Rebuilds.check``); the step's end reads the comparisons, and that signature's storages are
rebuilt from the next step on. Prefetch walks past rebuilt storages; the plan offloads rebuildable
storages first (policy/auto.py). A planned step that offloads nothing notes no recipes
(``Rebuilds.noting``; under ``with lms:`` per step no recorder is entered at all)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import params
from ..recompute.rebuilds import sample_words
from .records import Kept, NotAtHand, Offloaded, bytes_of, counter_only, modified_error

__all__ = ["RecipeOffload"]      # a room of SwapEngine (core.py)


class RecipeOffload:
    """Storages offloaded by their recipes, and their checks."""

    def _offload(self, t: torch.Tensor, storage, nbytes: int, seq: int, ref, version: int,
                 recipe) -> Optional[Offloaded]:
        """Take storage ``seq`` off the GPU: by its recipe when its signature is trusted, else
        by a copy (checked against its recipe at first use, if it has one: NOTE [ Rebuilt
        storages ])."""
        if recipe is not None:
            rebuilds = self.rebuilds
            if recipe.signature not in rebuilds.trusted:
                self._check_now(recipe, storage, nbytes)
            if recipe.signature in rebuilds.trusted:
                return self._as_recipe(t, nbytes, seq, ref, version, recipe)
            if recipe.signature in rebuilds.refused:
                recipe = None
        s = self._swap_out(t, storage, nbytes, seq, ref, version)
        if s is not None and recipe is not None:
            s.recipe, s.check = recipe, True
            self._need_inputs(s)
        return s

    def _check_now(self, recipe, storage, nbytes: int) -> None:
        """Check ``recipe`` against the ``storage`` it made while both are at hand, if a rebuild
        fits beside what is allocated (``policy.check_fits``): then no copy goes out for a
        check in backward (NOTE [ Rebuilt storages ]). A rebuild may need up to ~3x ``nbytes``
        at once (an autocast cast rebuilt from a LayerNorm's fp32 output, which is rebuilt
        first; the comparison's mask). An input no longer on the GPU, or anything else that
        fails it, leaves the check to backward."""
        if not self.policy.check_fits(self.device.memory_allocated() + 4 * nbytes):
            return
        try:
            self.rebuilds.check_now(recipe, storage, self._input_at_hand)
        except Exception:       # noqa: BLE001 - only a check: backward checks it instead
            pass
        self.gauge.read_now()

    @staticmethod
    def _input_at_hand(inp) -> Optional[torch.Tensor]:
        """A recipe input in forward, as a rebuild in backward would read it: a parameter, the
        saved storage itself while it is on the GPU (raises ``NotAtHand`` once it is not), or
        None for one that its own recipe makes."""
        if inp.entry is None:
            return inp.tensor() if inp.parameter is not None else None
        t = inp.tensor()
        if t is None:
            raise NotAtHand
        return t

    def _as_recipe(self, t: torch.Tensor, nbytes: int, seq: int, ref, version: int,
                   recipe) -> Offloaded:
        key = self.device.stream_key()
        stream = self.compute if key == self._compute_key else self.device.stream_of(key)
        s = Offloaded(nbytes, seq, ref, version, stream, key)
        s.recipe = recipe
        s.counter = counter_only(t.detach())   # NOTE [ Interrupts and versions ], c
        self.prefetch.add(s)        # from here the step boundary releases it if orphaned
        self._need_inputs(s)
        s.sample = sample_words(t.untyped_storage())
        read = [inp.parameter() for inp in recipe.walk() if inp.parameter is not None]
        for p in read:
            self._param_rebuilds.setdefault(id(p), []).append(s)
        if read:
            params.watch(self, parameters=True)
        self.step.count_recipe(nbytes, seq)
        rec = self.state.rec
        if rec is not None:
            # lmsrt holds no source: while the model holds the storage, a learning step reads
            # it as the model's own, so a plan that keeps it must not add it again.
            rec.own_from(seq)
        return s

    def _entry_of(self, t: torch.Tensor):
        """What this forward made of saved tensor ``t``'s storage (a recorder asks, for the
        inputs of the ops it records), or None."""
        storage = t.untyped_storage()
        entry = self.state.by_ptr.get(storage.data_ptr())
        if (entry is None or entry.dead or entry.storage_ref() is not storage
                or entry.version != t._version):
            return None
        return entry

    @staticmethod
    def _available(inp) -> bool:
        """Whether a recipe input's entry will still be there in backward (once marked needed). One
        that is gone (its graph dropped in forward) is forgotten, for good: the input is then
        made by its own recipe, if it has one, in ``walk`` and in ``_recipe_input`` too."""
        entry = inp.entry
        if entry is None:
            return False
        if entry.dead or type(entry) is Kept and entry.storage_ref() is None:
            inp.entry = None
            return False
        return True

    @staticmethod
    def _need_inputs(s: Offloaded) -> None:
        """Mark what ``s``'s recipe reads as needed. ``s.inputs`` is set first and each mark is one
        set insertion, so an interrupt anywhere leaves marks that ``_release_inputs`` removes
        (NOTE [ Interrupts and versions ], b)."""
        held = []
        for inp in s.recipe.walk():
            entry = inp.entry
            if entry is None:
                continue
            if type(entry) is Kept:
                storage = entry.storage_ref()
                if storage is not None:
                    held.append(storage)
            else:
                held.append(entry)
        s.inputs = tuple(held)
        for entry in held:
            if type(entry) is Offloaded:
                if not entry.needed_by:     # (the shared empty frozenset: a set of its own)
                    entry.needed_by = set()
                entry.needed_by.add(id(s))

    def _release_inputs(self, s: Offloaded) -> None:
        for entry in s.inputs:
            if type(entry) is Offloaded:
                if entry.needed_by:
                    entry.needed_by.discard(id(s))
                if not entry.needed_by and not entry.watches and not entry.dead:
                    self._release(entry)
        s.inputs = ()

    def _rebuild(self, s: Offloaded) -> None:
        """Run ``s``'s recipe again, on its own stream (NOTE [ Rebuilt storages ])."""
        if s.stream_key == self.device.stream_key():
            out = self.rebuilds.run(s.recipe, self._recipe_input)
        else:
            with self.device.stream(s.stream):
                out = self.rebuilds.run(s.recipe, self._recipe_input)
        storage = out.untyped_storage()
        self.device.note_saved(storage)
        if s.sample is not None:                # NOTE [ Parameters a rebuild reads ]
            self._samples.append((s.recipe.name, torch.ne(sample_words(storage), s.sample).any()))
        s.fetch_done, s.fetch_waited, s.unpacked = None, True, 0
        s.gpu = bytes_of(storage)
        s.generation += 1
        self.prefetch.arrived(s)
        self.gauge.delta += s.nbytes
        self.step.rebuilt_bytes += s.nbytes
        self.step.rebuilt_tensors += 1

    def materialize(self, parameters) -> None:
        """Rebuild now the storages, not yet made, whose recipes read the parameters whose ids
        are in ``parameters``: they are about to change (params.py, NOTE [ Parameters a rebuild
        reads ]). The rebuilt bytes wait for backward as a restored copy does."""
        if self._dead:
            # Storages whose graphs autograd freed since the last unpack (a backward just
            # finished) are dead, not pending: made again, their bytes would be thrown away, and
            # where the step's forward and backward ran inside the optimizer's step (a closure:
            # Lightning, LBFGS), their parameters changed in the step before. Reaped, what they
            # hold (restored copies) is given back before the optimizer allocates.
            with self._lock:
                self._reap()
        pending = self._param_rebuilds
        if not pending or not any(key in pending for key in parameters):
            return
        with self._lock:
            for key in [key for key in parameters if key in pending]:
                for s in pending.pop(key):
                    if (not s.dead and s.gpu is None and s.host is None and s.recipe is not None
                            and s.storage_ref() is None):
                        self._rebuild(s)

    def check_rebuilt(self) -> None:
        """Raise if a storage rebuilt since the last check differs from the original in the
        words sampled when it was dropped: an input changed where no version counter saw it
        (params.py, NOTE [ Parameters a rebuild reads ]). One device sync, only after rebuilds."""
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return
        differs = torch.stack([d for _, d in samples]).cpu().tolist()
        ops = sorted({name for (name, _), bad in zip(samples, differs) if bad})
        if ops:
            raise RuntimeError(
                f"lmsrt: a saved tensor rebuilt for backward ({', '.join(ops)}) differs from the "
                "one forward saved: an input of that op was changed in place where autograd "
                "cannot see it (through .data, or another alias that bumps no version), so the "
                "gradients of the last backward are wrong. Leave tensors a graph saved unchanged "
                "until its backward, or set recompute=False.")

    def _recipe_input(self, inp) -> Optional[torch.Tensor]:
        """A rebuild's input as its op saw it (``Recipe.rebuild``'s ``resolve``); None for one
        the engine did not save, which its own recipe rebuilds."""
        entry = inp.entry
        if entry is None:
            return inp.tensor() if inp.parameter is not None else None
        if type(entry) is Kept:
            storage = entry.storage_ref()
            if storage is None:
                return None
            t = inp.view(storage)
            key = self.device.stream_key()
            if key != self._compute_key:       # read on a side stream: its block waits for it
                t.record_stream(self.device.stream_of(key))
            return t
        alias = entry.source if entry.source is not None else entry.counter
        if alias is not None and alias._version != entry.version:
            kind = torch.empty(0, dtype=inp.dtype, device=self.device.torch_device).type()
            raise modified_error(kind, inp.size, None,
                                  alias._version, entry.version,
                                  "is the input from which lmsrt rebuilds a saved tensor")
        return inp.view(self._resident(entry, for_recipe=True).untyped_storage())

    def _check_rebuild(self, s: Offloaded, data: torch.Tensor) -> None:
        """The first use of a swapped storage with a recipe: rebuild it beside the copy and
        queue the bitwise comparison (NOTE [ Rebuilt storages ]). Only a check: whatever goes
        wrong in it, backward goes on with the copy, and the signature is not trusted."""
        s.check = False
        try:
            self.rebuilds.check(s.recipe, data.untyped_storage(), self._recipe_input)
        except Exception:       # noqa: BLE001 - e.g. an input modified in place: not trusted
            pass
        finally:
            s.recipe = None
            self._release_inputs(s)

