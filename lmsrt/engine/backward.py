"""Backward: unpack a saved tensor, bringing its storage back (restored or rebuilt) when it is
not on the GPU."""
from __future__ import annotations

from typing import Optional

import torch

from ..units import format_bytes
from .records import KeptHandle, Offloaded, SwapHandle, bytes_of, modified_error

__all__ = ["UnpackSide"]      # a room of SwapEngine (core.py)


class UnpackSide:
    """The unpack side of a ``SwapEngine``."""

    # -- backward: unpack --------------------------------------------------------------------

    def unpack(self, ref):
        if self._forward_open:
            self.end_forward()
        if self.state.rec is None:
            try:
                return self._unpack(ref)
            finally:
                self.state.bwd_point += 1
        with self._lock:                        # a recorded step (policy/auto.py, NOTE [ Auto ])
            self._record(True)
            try:
                return self._unpack(ref)
            finally:
                self.state.bwd_point += 1
                self._recorded()

    def _unpack(self, ref):
        kind = type(ref)
        if kind is tuple:                       # the C++ hooks' handle (native_hooks)
            ref = KeptHandle(ref[0], ref[1], None if ref[2] is None else (ref[2], ref[3]), ref[4])
            kind = KeptHandle
        if kind is KeptHandle:
            self._after_backward.add(ref.thread)
            t = ref.tensor
            if t._version != ref.version:
                raise modified_error(t.type(), t.size(), ref.producer, t._version, ref.version,
                                      "kept on the GPU")
            if self.prefetch.walking:           # every unpack moves prefetch along
                with self._lock:
                    self.prefetch.advance(self.plan, self.state.bwd_point)
            return t
        if kind is not SwapHandle:
            return ref                          # saved while lmsrt stepped aside
        self._after_backward.add(ref.thread)
        with self._lock:
            if self._dead:
                self._reap()
            s = ref.storage
            self._check_version(ref, s)
            try:
                try:
                    data = self._resident(s)
                except torch.OutOfMemoryError:
                    if not self.room_in_backward():
                        raise
                    data = self._resident(s)
            except torch.OutOfMemoryError as e:
                self.annotate_oom(e, f"bringing a saved tensor back for backward: a {ref.dtype} "
                                  f"tensor of shape {tuple(ref.size)}, whose storage of "
                                  f"{format_bytes(s.nbytes)} did not fit")
                raise
            own = s.gpu is None or s.source is not None     # the original's own bytes
            if s.check:
                self._check_rebuild(s, data)
            if self.state.rec is not None:
                self.state.rec.used_at(s.seq, self.state.bwd_point)
            watch = ref.watch
            if watch.generation != s.generation:       # a handle counts once per restored copy
                watch.generation = s.generation
                s.unpacked += 1
            if s.unpacked >= len(s.watches) and s.kept == "held":
                # A source forward kept (NOTE [ Deferred copies ]) is the model's own from
                # here, as a restored copy handed out is: autograd holds it while it reads.
                self.held.used(s)
            if s.unpacked >= len(s.watches) and s.gpu is not None:
                # Every live view has been handed out: autograd's references keep the block
                # alive for as long as it is read; ours would keep it for the rest of backward.
                self.prefetch.drop(s)
                s.consumed = True
            # Viewed under the lock: another thread may release the source alias meanwhile.
            view = self._original_view(ref) if own else None
            if view is None:
                view = self.copies.view(data, ref)
            self.prefetch.advance(self.plan, self.state.bwd_point)
        return view

    def room_in_backward(self) -> bool:
        """An allocation of backward's failed at the limit (a fetch on demand, a rebuild, a
        region's rerun): give back the copies fetched ahead and not yet used, as Caffe's LMS
        dropped clean copies; whether there were any (then the caller tries once more, and the
        step counts it in ``backward_retries``). The policy sees the failure (``alloc_failures``)
        and leaves more room from the next step."""
        with self._lock:
            if not self.prefetch.give_back():
                return False
            self.step.backward_retries += 1
            return True

    @staticmethod
    def _original_view(ref: SwapHandle) -> Optional[torch.Tensor]:
        """The saved tensor as an alias of its base, which still holds its bytes (the source not
        yet dropped, or a storage alive anyway): it shares the base's version counter, as the
        tensor autograd would hand back without hooks does, so an in-place op on it in a custom
        backward counts as a change of the original. None where the base is gone or another
        view (another dtype) of the bytes."""
        base = ref.base_ref()
        if base is None or base.dtype != ref.dtype:
            return None
        alias = base.detach()                   # not a view: an alias with its own strides
        with torch._C._AutoDispatchBelowADInplaceOrView():     # (no version bump)
            alias.set_(alias.untyped_storage(), ref.offset, ref.size, ref.stride)
        return alias

    def _check_version(self, ref: SwapHandle, s: Offloaded) -> None:
        base = ref.base_ref()
        if base is not None:
            now = base._version
        else:
            alias = s.source if s.source is not None else s.counter
            now = ref.version if alias is None else alias._version
        if now != ref.version:
            kind = torch.empty(0, dtype=ref.dtype, device=self.device.torch_device).type()
            raise modified_error(kind, ref.size, ref.producer, now, ref.version,
                                  "swapped to host memory")

    def _resident(self, s: Offloaded, for_recipe: bool = False) -> torch.Tensor:
        """``s``'s bytes on the GPU, ready for the current stream: its source, a restored or
        rebuilt copy, or the storage itself where it lives on. ``for_recipe``: wanted as the
        input of a rebuild, which may come after backward's own last use of it."""
        if s.source is not None:
            return s.source
        if s.gpu is None:
            live = s.storage_ref()
            if live is not None:
                # The source lives on elsewhere, unchanged (checked): use it, move nothing, and
                # keep this storage on the GPU from the next step (plan.lives_on).
                if s.seq not in self.plan.live_now:
                    self.plan.mark_live(s.seq)
                    self.step.count_kept(s.nbytes, live=True)
                return bytes_of(live)
            if s.consumed and not for_recipe:
                self.prefetch.new_pass(s)
            if s.host is None and s.recipe is not None:
                self._rebuild(s)
            else:
                self.step.prefetch_misses += 1
                self.prefetch.fetch(s)
        else:
            self.step.prefetch_hits += 1
        if not s.fetch_waited:
            self._wait_fetch(s)
        key = self.device.stream_key()
        if key != s.stream_key:                            # Rule 3: another consumer stream
            consumer = self.device.stream_of(key)
            done = s.fetch_done
            if done is None:                               # rebuilt, on its own stream
                done = self.device.new_event()
                done.record(s.stream)
            done.wait(consumer)
            s.gpu.record_stream(consumer)
        return s.gpu

    def _wait_fetch(self, s: Offloaded) -> None:
        stream = s.stream
        if s.fetch_done.query():
            s.fetch_done.wait(stream)
        else:
            start, end = self.device.new_event(timing=True), self.device.new_event(timing=True)
            start.record(stream)
            s.fetch_done.wait(stream)                      # Rule 3: wait before the first use
            end.record(stream)
            self._timed_waits.append(("swapin_wait_ms", start, end))
        s.fetch_waited = True
