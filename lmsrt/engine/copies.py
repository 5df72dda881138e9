"""The copy streams: swap-out, swap-in and views, through lmsrt.copy_path's C++ where it is
built, else through torch's Python bindings (NOTE [ Stream lifetimes ], Rules 1 and 3)."""
from __future__ import annotations

import torch

from ..host import HostSlot
from .records import SwapHandle, bytes_of

__all__ = ["TorchCopies", "NativeCopies", "finish_copies"]


def finish_copies(d2h, h2d) -> None:
    try:
        d2h.synchronize()
        h2d.synchronize()
    except Exception:       # noqa: BLE001 - at exit CUDA may already be gone
        pass


class TorchCopies:
    """Swap-out, swap-in and views through torch's Python bindings."""

    def __init__(self, device, d2h, h2d):
        self.device, self.d2h, self.h2d = device, d2h, h2d
        # Marks "the saving stream got this far" for a copy stream to wait on. One event serves
        # every copy: a stream wait takes the event's state when it is issued, so re-recording it
        # for the next copy (always under the engine's lock, right before its own wait) cannot
        # loosen an earlier wait, and creating an event per copy costs ~1 us more.
        self.ready = device.new_event()
        self.on_d2h = device.stream(d2h)
        self.on_h2d = device.stream(h2d)

    def copy_out(self, storage, slot: HostSlot, stream):
        source = bytes_of(storage)
        self.ready.record(stream)
        self.ready.wait(self.d2h)                          # Rule 1
        with self.on_d2h:
            slot.tensor.copy_(source, non_blocking=True)
            done = self.device.new_event()
            done.record(self.d2h)
        return done

    def copy_in(self, block: torch.Tensor, slot: HostSlot, stream):
        self.ready.record(stream)
        self.ready.wait(self.h2d)                          # Rule 3
        with self.on_h2d:
            block.copy_(slot.tensor, non_blocking=True)
            done = self.device.new_event()
            done.record(self.h2d)
        return done

    @staticmethod
    def view(data: torch.Tensor, ref: "SwapHandle") -> torch.Tensor:
        """The saved tensor, as a view of its storage's bytes (source or restored copy)."""
        return torch.empty(0, dtype=ref.dtype, device=data.device).set_(
            data.untyped_storage(), ref.offset, ref.size, ref.stride)


class NativeCopies:
    """The same through lmsrt.copy_path's C++ (csrc/copy_path.cpp): one native call each."""

    def __init__(self, native, d2h, h2d):
        self.native, self.d2h, self.h2d = native, d2h, h2d
        self.ready = native.Event()

    def copy_out(self, storage, slot: HostSlot, stream):
        return self.native.copy_out(storage, slot.base, slot.offset, self.ready,  # Rule 1
                                    stream, self.d2h)[1]

    def copy_in(self, block: torch.Tensor, slot: HostSlot, stream):
        return self.native.copy_in(block, slot.base, slot.offset, self.ready,     # Rule 3
                                   stream, self.h2d)

    def view(self, data: torch.Tensor, ref: "SwapHandle") -> torch.Tensor:
        return self.native.view(data, ref.dtype, ref.size, ref.stride, ref.offset)

