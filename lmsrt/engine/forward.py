"""Forward: pack a saved tensor, and decide whether its storage is kept or offloaded."""
from __future__ import annotations

import sys
import weakref
from _thread import get_ident as _get_ident

import torch

from .native import _TAKE_OVER
from .records import Kept, Offloaded, SwapHandle, Watch, kept_handle, producer_of

__all__ = ["PackSide"]      # a room of SwapEngine (core.py)

# An exact GPU-use reading costs ~10-20 us (the allocator builds a stats dict). Between readings
# the engine estimates: the last reading plus what lmsrt itself added since (saved storages,
# restored copies), never minus what it dropped (another reference may keep a dropped block
# alive), so the estimate errs high on lmsrt's part. It reads again after this many estimates, or
# as soon as the estimate comes within 1/16 of the mark, where decisions change. It cannot see the
# model's own allocations (activations not saved, transients), so a decision about a storage of
# _EXACT_BYTES or more, whose copy takes 100x a reading, always reads: measured on an H100, a
# segmentation net at a 16 GiB cap (1.5 GiB activations) ran 0.54 s a step on estimates, which let
# held sources crowd out cuDNN's workspace, and 0.29 s on exact readings. The C++ copy path reads
# exactly in ~0.3 us and never estimates.
_EXACT_EVERY = 8
_EXACT_BYTES = 64 << 20

# Saved tensors of a torch.compile'd region reach pack from AOTAutograd's autograd.Function, all
# at once after the region's forward; Function.apply is then the Python frame that called pack.
_FUNCTION_APPLY = torch.autograd.Function.apply.__func__.__code__


class PackSide:
    """The pack side of a ``SwapEngine``."""

    # -- forward: pack -----------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        thread = _get_ident()
        if self._after_backward and thread in self._after_backward \
                and torch._C._current_graph_task_id() == -1:
            # One `with lms:` around a whole loop (or `lmsrt run`): a forward that follows a
            # backward of this thread's saved tensors starts a new step. Packs inside backward
            # (checkpoint recompute) do not, nor another thread's forward.
            self.begin_forward()
        if self._stale_hooks and thread in self._stale_hooks:
            self._pop_stale_hooks(thread)
        storage = self._eligible_storage(t)
        if storage is None:
            self.step.skipped_tensors += 1
            return kept_handle(t, thread)
        with self._lock:
            if self._dead:
                self._reap()
            version = t._version
            entry = self._by_ptr.get(storage.data_ptr())
            if (entry is None or entry.storage_ref() is not storage or entry.version != version
                    or entry.dead):                 # released: its handles all died meanwhile
                entry = self._new_storage(t, storage, version)
            elif type(entry) is Offloaded and entry.stream_key != self.device.stream_key():
                return kept_handle(t, thread)                 # Rule 9
            if type(entry) is Kept:
                return kept_handle(t, thread)
            return self._handle(entry, t, thread)

    def _handle(self, s: Offloaded, t: torch.Tensor, thread: int) -> SwapHandle:
        """A handle for autograd, counted in ``s.watches`` in one step (NOTE [ Interrupts and
        versions ], a and b): until its watch is in the set, a lost handle frees nothing."""
        ref = SwapHandle(s, t, producer_of(t.grad_fn, t), thread)
        watch = Watch(ref, self._dead.append)
        watch.storage, watch.generation = s, -1
        ref.watch = watch
        s.watches.add(id(watch))
        return ref

    def _eligible_storage(self, t: torch.Tensor):
        """The storage to swap for saved tensor ``t``, or None if swapping it would free nothing
        or cannot be done.

        Parameters and other trainable leaves (and views of them) live for the whole run, so
        they stay. Tensors without a grad_fn are not excluded as such: pooling indices and masks
        are saved that way and can be the largest tensors of a step (a max-pool's int64 indices
        at full resolution). Nested tensors and tensor subclasses other than parameters have no
        one flat storage to copy: they stay, and a warning says so once.
        """
        if type(t) is not torch.Tensor or t.is_nested:
            if not isinstance(t, torch.nn.Parameter) and self.device.owns(t):
                self.diagnostics.unswappable(t)
            return None                          # parameters, subclasses, nested tensors
        if not self.device.owns(t):
            return None                          # other devices
        base = t if t._base is None else t._base
        if base.requires_grad and base.is_leaf:
            return None                          # trainable leaves and views of them
        if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.is_quantized:
            return None
        storage = t.untyped_storage()
        return storage if storage.nbytes() >= self.min_bytes else None

    def _new_storage(self, t: torch.Tensor, storage, version: int):
        nbytes = storage.nbytes()
        index = self._index
        self._index += 1
        if self._base is None:
            self._begin_plan(nbytes)
        if not self._keeps_all and "compile" not in self.diagnostics.given:
            # (A step that keeps everything has nothing to warn about.)
            caller = sys._getframe(1).f_back       # what called pack; None on autograd's threads
            if caller is not None and caller.f_code is _TAKE_OVER:
                caller = caller.f_back             # through the C++ hooks
            if caller is not None and caller.f_code is _FUNCTION_APPLY:
                self.diagnostics.compiled_region(caller.f_back)
        self.device.note_saved(storage)
        if self._rec is not None:
            self._record(False, nbytes)
            try:
                return self._decide(t, storage, version, nbytes, index)
            finally:
                self._recorded()
        entry = self._decide(t, storage, version, nbytes, index)
        if self._keeps_all and self._keeper is not None and not self._armed:
            self._arm()
        return entry

    def _decide(self, t: torch.Tensor, storage, version: int, nbytes: int, index: int):
        """Swap, keep, or keep as alive anyway, the storage saved at forward point ``index``."""
        if nbytes > self._largest[0]:
            self._largest = (nbytes, index)
        self._use_delta += nbytes
        plan = self.plan
        if self._keeps_all and not self._held and not self._deferred:
            # NOTE [ Steps that keep everything ]
            ref = weakref.ref(storage)
            plan.offload(index, nbytes)                 # records it; offloads nothing
            if plan.matched:
                level = self.policy.swap_at(plan, index)
                if self._gpu_use(nbytes, level) - self._held_bytes <= level:
                    step = self.step
                    if index in plan.live:
                        step.live_bytes += nbytes
                        step.live_tensors += 1
                    else:
                        step.kept_bytes += nbytes
                        step.kept_tensors += 1
                    entry = self._by_ptr[storage.data_ptr()] = Kept(ref, version)
                    return entry
            return self._choose(t, storage, version, nbytes, index, ref, False)
        rec = self._rec
        ref = weakref.ref(storage) if rec is None else rec.watch(storage, index)
        if self._held:
            self._release_finished()
        if self._deferred:
            self._settle_deferred()
        return self._choose(t, storage, version, nbytes, index, ref, plan.offload(index, nbytes))

    def _choose(self, t: torch.Tensor, storage, version: int, nbytes: int, index: int, ref,
                planned: bool):
        """``_decide`` for a storage already recorded in the plan (``planned``: whether the
        plan offloads it)."""
        if self.plan.lives_on(index):
            # Last step's copy of this storage freed nothing: something else kept it alive
            # through backward (an input batch, a buffer, a frozen weight held as a tensor).
            self.step.live_bytes += nbytes
            self.step.live_tensors += 1
            entry = self._by_ptr[storage.data_ptr()] = Kept(ref, version)
            return entry
        # Sources still being copied out will be freed anyway: swap more only if GPU use would
        # stay over the level once they are (else copies that lag forward would look like demand).
        recipe = None
        if self.rebuilds is not None and self.rebuilds.recipes:
            recipe = self.rebuilds.usable(t, self._available)
            if recipe is not None:
                self._sigs[index] = recipe.signature
        policy, plan = self.policy, self.plan
        level = 0 if planned else policy.swap_at(plan, index)
        hold = policy.hold_to(plan, index)
        used = None if planned else self._gpu_use(nbytes, level or hold)
        entry = None
        if planned or used - self._held_bytes > level:
            over = None if planned else used - self._held_bytes
            entry = self._offload(t, storage, nbytes, index, ref, version, recipe)
            if entry is not None and over is not None:
                self._beyond_plan += nbytes
                if self._over is None and plan.mode == "plan":
                    # The first point at which the plan's prediction fell short (policy.py,
                    # NOTE [ Auto ], 4): GPU use there, from the step's base.
                    self._over = (index, over - self._base)
        if entry is None:
            entry = Kept(ref, version)
            self.step.kept_bytes += nbytes
            self.step.kept_tensors += 1
        self._by_ptr[storage.data_ptr()] = entry
        if self.rebuilds is not None and self.rebuilds.holding:
            self.rebuilds.let_go(storage)        # its check, if any, is done
        if self._held:
            self._bound_held(self._gpu_use(nbytes, hold) if used is None else used, hold)
        return entry

    def _record(self, backward: bool, nbytes: int = 0) -> None:
        """A point of a recorded step (policy.py, NOTE [ Auto ], 1): GPU use now and its peak
        since the last point, less what lmsrt held meanwhile."""
        device = self.device
        used, peak = device.memory_allocated(), device.peak_allocated()
        self._use_read, self._use_delta, self._use_age = used, 0, 0
        if peak > self._step_peak:
            self._step_peak = peak
        base = self._base
        self._rec.record(backward, used - base, peak - base, self._rec_hold,
                         self._hold(), nbytes)

    def _hold(self) -> int:
        """What a recorded profile counts as lmsrt's: held sources and restored copies, less
        deferred sources (NOTE [ Deferred copies ]): held for long, and the model may still be
        using them itself (a residual stream), so they count as the model's own, on the safe
        side."""
        hold = self._held_bytes + self._ahead
        if self._deferred:
            hold -= sum(s.nbytes for s in self._deferred if s.source is not None)
        return hold

    def _recorded(self) -> None:
        self._rec_hold = self._hold()
        self.device.reset_peak()

    def _gpu_use(self, nbytes: int, level: int) -> int:
        """GPU use, exact near ``level`` (the policy's level for the decision at hand) or for a
        decision about ``nbytes`` >= _EXACT_BYTES, estimated otherwise (see _EXACT_EVERY). At a
        level of 0 any use is over it, so no reading is needed."""
        estimate = self._use_read + self._use_delta
        if level == 0 or (self._use_age < self._exact_every and nbytes < _EXACT_BYTES
                          and estimate < level - (level >> 4)):
            self._use_age += 1
            return estimate
        self._use_read, self._use_delta, self._use_age = self.device.memory_allocated(), 0, 0
        return self._use_read

