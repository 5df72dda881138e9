"""NOTE [ Steps that keep everything ]
A model that fits its cap still passes each saved tensor through the hooks, and its forward often
runs on the CPU's time, where the Python hooks cost about 11 us a tensor (docs/design.md,
"Measurements behind the engine's rules"). So a planned step whose plan offloads nothing, with
nothing recorded, held, deferred or noted for rebuilding (``StepState.keeps_all``, set at its first
save as ``policy.lean_step`` allows), takes a lean path in ``_decide``, and where the copy path is
built its packs are decided in C++ (csrc/copy_path.cpp, ``Keeper``; ``native_hooks``): the first
save of the step arms it (``_arm``) with the plan's sizes, the policy's swap levels per point and
the storages kept so far (saved again, each is the storage kept, not a new point), and from
there it keeps each saved tensor as the Python path would (the same eligibility, the same counts)
while the step's sizes follow the plan and GPU use stays under the level. Anything else goes
to ``_take_over``, which first takes over what the C++ side counted (``_absorb``: forward points,
the sizes for the plan, the storages kept, the step's counts; it disarms for the rest of the step)
and then packs in Python, which swaps as the policy decides. The same happens when forward ends or
stats are read. Its handles are tuples (tensor, version, grad_fn name, output number, thread); in
backward, while nothing is to be prefetched or recorded, C++ checks their versions and hands the
tensors back, and anything else (a version changed: autograd's error) goes to ``unpack``. The C++
hooks hold the engine; the engine holds them weakly and the LMS holds them, so a dropped LMS is
freed at once."""
from __future__ import annotations

import weakref

import torch

from .records import Kept

__all__ = ["NativeHandOver"]      # a room of SwapEngine (core.py)


class NativeHandOver:
    """The hand-over between a ``SwapEngine`` and its C++ hooks."""

    # -- C++ hooks for steps that keep everything ---------------------------------------------

    def native_hooks(self):
        """C++ saved-tensor hooks for this engine (csrc/copy_path.cpp, ``Keeper``), or None
        where the copy path is not built. NOTE [ Steps that keep everything ]. They hold the
        engine; it holds them weakly, so the caller (the LMS) must keep them."""
        module = getattr(self.device, "native_hooks", None)
        if module is None or not hasattr(module, "Keeper"):
            return None
        device = self.device
        simulated = device.kind == "sim"
        keeper = module.Keeper(device.torch_device, self.min_bytes, self._take_over, self.unpack,
                               self._after_backward,
                               device.memory_allocated if simulated else None,
                               device.note_saved if simulated else None)
        self._keeper = weakref.ref(keeper)
        return keeper

    def _take_over(self, t: torch.Tensor):
        """The C++ pack's way into the Python one: what it counted first becomes the engine's."""
        if self._armed:
            with self._lock:
                if self._armed:
                    self._absorb(entries=True)
        return self.pack(t)

    def _arm(self) -> None:
        keeper = self._keeper()
        if keeper is None or self.held or self.deferred:
            return
        plan, policy = self.plan, self.policy
        sizes = plan.sequence
        kept = [(storage, entry.version) for entry in self.state.by_ptr.values()
                if type(entry) is Kept and (storage := entry.storage_ref()) is not None]
        keeper.arm(sizes, policy.swap_levels(plan, len(sizes)), list(plan.live), self.state.index,
                   kept)
        self._armed = True

    def _absorb(self, entries: bool) -> None:
        """Take over what the C++ hooks decided since they were armed (``entries``: the storages
        they kept, for the rest of this forward), and disarm them for the rest of the step."""
        self._armed = self.state.keeps_all = False
        index, recorded, kept, counts, largest = self._keeper().take(entries)
        self.state.index = index
        self.plan.current.extend(recorded)
        for storage, version in kept:
            self.state.by_ptr[storage.data_ptr()] = Kept(weakref.ref(storage), version)
        s = self.step
        kept_bytes, kept_tensors, live_bytes, live_tensors, skipped = counts
        s.count_kept(kept_bytes, kept_tensors)
        s.count_kept(live_bytes, live_tensors, live=True)
        s.skipped_tensors += skipped
        self.gauge.delta += kept_bytes + live_bytes
        self.gauge.stale()      # the next decision reads GPU use afresh
        if largest[0] > self.state.largest[0]:
            self.state.largest = tuple(largest)



_TAKE_OVER = NativeHandOver._take_over.__code__   # the frame through which C++ packs reach Python
