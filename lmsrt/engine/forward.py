"""Forward: pack a saved tensor, and decide whether its storage is kept or offloaded."""
from __future__ import annotations

import sys
import weakref
from _thread import get_ident as _get_ident

import torch

from .native import _TAKE_OVER
from .records import Kept, Offloaded, SwapHandle, Watch, kept_handle, producer_of

__all__ = ["PackSide"]      # a room of SwapEngine (core.py)

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
            entry = self.state.by_ptr.get(storage.data_ptr())
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
        watch = Watch(ref, self._dead_append)
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
        st = self.state
        index = st.index
        st.index += 1
        if st.base is None:
            self._begin_plan(nbytes)
        if not st.keeps_all and "compile" not in self.diagnostics.given:
            # (A step that keeps everything has nothing to warn about.)
            caller = sys._getframe(1).f_back       # what called pack; None on autograd's threads
            if caller is not None and caller.f_code is _TAKE_OVER:
                caller = caller.f_back             # through the C++ hooks
            if caller is not None and caller.f_code is _FUNCTION_APPLY:
                self.diagnostics.compiled_region(caller.f_back)
        self.device.note_saved(storage)
        if st.rec is not None:
            self._record(False, nbytes)
            try:
                return self._decide(t, storage, version, nbytes, index)
            finally:
                self._recorded()
        entry = self._decide(t, storage, version, nbytes, index)
        if st.keeps_all and self._keeper is not None and not self._armed:
            self._arm()
        return entry

    def _decide(self, t: torch.Tensor, storage, version: int, nbytes: int, index: int):
        """Swap, keep, or keep as alive anyway, the storage saved at forward point ``index``."""
        st = self.state
        if nbytes > st.largest[0]:
            st.largest = (nbytes, index)
        self.gauge.delta += nbytes
        plan = self.plan
        if st.keeps_all and not self.held and not self.deferred:
            # NOTE [ Steps that keep everything ]
            ref = weakref.ref(storage)
            plan.offload(index, nbytes, t)              # records it; offloads nothing
            if plan.matched:
                level = self.policy.swap_at(plan, index)
                if self.gauge.use(nbytes, level) - self.held.bytes <= level:
                    self.step.count_kept(nbytes, live=index in plan.live)
                    entry = st.by_ptr[storage.data_ptr()] = Kept(ref, version, index)
                    return entry
            return self._keep_or_offload(t, storage, version, nbytes, index, ref, False)
        rec = st.rec
        ref = weakref.ref(storage) if rec is None else rec.watch(storage, index)
        if self.held:
            self.held.release_finished()
        if self.deferred:
            self.deferred.settle()
        return self._keep_or_offload(t, storage, version, nbytes, index, ref,
                                     plan.offload(index, nbytes, t))

    def _keep_or_offload(self, t: torch.Tensor, storage, version: int, nbytes: int, index: int,
                         ref, planned: bool):
        """Keep or offload a storage already recorded in the plan (``planned``: whether the plan
        offloads it), as the policy's levels say; ``_decide`` chose this path."""
        st = self.state
        if self.plan.lives_on(index):
            # Last step's copy of this storage freed nothing: something else kept it alive
            # through backward (an input batch, a buffer, a frozen weight held as a tensor).
            self.step.count_kept(nbytes, live=True)
            entry = st.by_ptr[storage.data_ptr()] = Kept(ref, version, index)
            return entry
        # Sources still being copied out will be freed anyway: swap more only if GPU use would
        # stay over the level once they are (else copies that lag forward would look like demand).
        recipe = None
        policy, plan = self.policy, self.plan
        if self.rebuilds is not None and self.rebuilds.recipes:
            recipe = self.rebuilds.usable(t, self._available)
            if recipe is not None:
                st.sigs[index] = (recipe.signature, recipe.input_points())
                if planned and index in plan.swapped:
                    recipe = None           # its rebuild would not fit: moved (plan.py)
        level = 0 if planned else policy.swap_at(plan, index)
        hold = policy.hold_to(plan, index)
        used = None if planned else self.gauge.use(nbytes, level or hold)
        entry = None
        if planned or used - self.held.bytes > level:
            over = None if planned else used - self.held.bytes
            entry = self._offload(t, storage, nbytes, index, ref, version, recipe)
            if entry is not None and over is not None:
                st.beyond_plan += nbytes
                if st.over is None and plan.mode == "plan":
                    # The first point at which the plan's prediction fell short (policy/auto.py,
                    # NOTE [ Auto ], 4): GPU use there, from the step's base.
                    st.over = (index, over - st.base)
        if entry is None:
            entry = Kept(ref, version, index)
            self.step.count_kept(nbytes)
        st.by_ptr[storage.data_ptr()] = entry
        if self.rebuilds is not None and self.rebuilds.retaining:
            self.rebuilds.let_go(storage)        # its check, if any, is done
        if self.held:
            self.held.bound(self.gauge.use(nbytes, hold) if used is None else used, hold)
        return entry

    def _record(self, backward: bool, nbytes: int = 0) -> None:
        """A point of a recorded step (policy/auto.py, NOTE [ Auto ], 1): GPU use now and its peak
        since the last point, less what lmsrt held meanwhile."""
        device = self.device
        used, peak = device.memory_allocated(), device.peak_allocated()
        self.gauge.restart(used)
        st = self.state
        if peak > st.step_peak:
            st.step_peak = peak
        base = st.base
        st.rec.record(backward, used - base, peak - base, st.rec_lmsrt, self._lmsrt_bytes(), nbytes)

    def _lmsrt_bytes(self) -> int:
        """What a recorded profile counts as lmsrt's: held sources and restored copies, less
        deferred sources (NOTE [ Deferred copies ]): held for long, and the model may still be
        using them itself (a residual stream), so they count as the model's own, on the safe
        side."""
        own = self.held.bytes + self.prefetch.ahead
        if self.deferred:
            own -= self.deferred.held_bytes()
        return own

    def _recorded(self) -> None:
        self.state.rec_lmsrt = self._lmsrt_bytes()
        self.device.reset_peak()
