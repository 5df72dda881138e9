"""One call of a recomputed region: what autograd holds for its saved tensors, and its rerun
in backward (regions.py, NOTE [ Recomputed regions ], Rules 3-5).

Example::

    frame = Frame(regions, region, args, (engine_pack, engine_unpack))   # as a region is entered
    rerun(frame)                          # in backward, at the first unpack of a dropped tensor
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .engine.records import counter_only, modified_error
from .options import spelled

__all__ = ["Frame", "rerun"]


class _Handle:
    """What autograd holds for a tensor saved inside a region."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: "Frame", index: int):
        self.frame, self.index = frame, index


class Frame:
    """One call of a region in one forward: its inputs, its saved tensors' metadata and, while
    it runs (or for good, Rule 3), the tensors themselves."""

    def __init__(self, regions, region, args: tuple, outer):
        self.regions, self.region = regions, region
        self.outer_unpack = outer[1]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # Tensors go through the engine's hooks (kept or swapped), the rest as they are.
        self.args = tuple((True, outer[0](a), a.requires_grad) if isinstance(a, torch.Tensor)
                          else (False, a, False) for a in args)
        self.input_versions = [(a, a._version) for a in tensors]
        self.input_ptrs = {a.untyped_storage().data_ptr() for a in tensors}
        self.device = tensors[0].device if tensors else torch.device("cpu")
        kind = self.device.type
        self.autocast = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                         for k in dict.fromkeys(("cpu", kind))]
        self.cpu_rng = torch.get_rng_state()
        self.gpu_rng = torch.cuda.get_rng_state(self.device) if kind == "cuda" else None
        self.meta: list = []          # per saved tensor: [counter, version, shape, dtype]
        self.saved: Dict[int, torch.Tensor] = {}   # held (forward, Rule 3) or kept (parameters)
        self.params: set = set()      # indices of parameters (and views of them): always kept
        self.again: Optional[Dict[int, torch.Tensor]] = None   # from the last recompute
        self.dropped = False
        self.nbytes = 0               # bytes dropped (storages other than inputs and parameters)
        self._seen: Optional[set] = set()
        self.hooks: Optional[saved_tensors_hooks] = saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> _Handle:
        index = len(self.meta)
        alias = t.detach()
        self.meta.append([alias, t._version, t.shape, t.dtype])
        self.saved[index] = alias
        if _is_parameter(t):
            self.params.add(index)
        else:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._seen and ptr not in self.input_ptrs:
                self._seen.add(ptr)
                self.nbytes += storage.nbytes()
        return _Handle(self, index)

    def close(self, keep_why: str) -> None:
        """The region returned (Rule 3): drop what its ops saved, unless ``keep_why``."""
        self.hooks.__exit__(None, None, None)
        self.hooks = self._seen = None          # (the hooks hold this frame: no cycle left)
        if not keep_why:
            keep_why = next(("it changed an input in place" for a, v in self.input_versions
                             if a._version != v), "")
        self.input_versions = []
        if keep_why:
            self.region.usable, self.region.why = False, keep_why
            return
        for index, meta in enumerate(self.meta):
            if index not in self.params:
                del self.saved[index]
                meta[0] = counter_only(meta[0])
        self.dropped = True

    def unpack(self, handle: _Handle) -> torch.Tensor:
        index = handle.index
        counter, version, shape, _ = self.meta[index]
        if counter._version != version:
            raise modified_error("tensor", shape, None, counter._version, version,
                                  f"was saved inside the recomputed region {self.region.name}")
        tensor = self.saved.get(index)
        if tensor is not None:
            return tensor
        if torch.is_grad_enabled():
            # A backward that builds a graph of its own (create_graph=True) would need the
            # recomputed tensors' history, which the rerun does not keep.
            raise RuntimeError(
                f"lmsrt: region {self.region.name} was recomputed, and a backward with "
                "create_graph=True (double backward) cannot use recomputed tensors. Turn "
                f"recompute off for such models (recompute=False, {spelled('recompute', False)}).")
        if self.again is None or index not in self.again:
            self.regions.recompute(self)
        tensor = self.again.pop(index, None)
        if tensor is None:
            raise RuntimeError(
                f"lmsrt: recomputing region {self.region.name} saved fewer tensors than its "
                "forward did: its forward does not repeat itself (control flow on data or on "
                f"global state). Turn recompute off (recompute=False, "
                f"{spelled('recompute', False)}).")
        return tensor


def _is_parameter(t: torch.Tensor) -> bool:
    """A trainable leaf or a view of one: alive anyway, so kept rather than recomputed."""
    base = t if t._base is None else t._base
    return base.requires_grad and base.is_leaf


class _Stop(Exception):
    """Every tensor the region dropped is back: the rest of its rerun is skipped (Rule 4)."""


class _Collect:
    """The saved-tensor hooks of a recompute: each saved tensor goes to the frame by position."""

    def __init__(self, frame: Frame):
        self.frame, self.index = frame, 0
        self.left = sum(1 for i in range(len(frame.meta)) if i not in frame.saved)
        frame.again = {}

    def pack(self, t: torch.Tensor) -> int:
        index, self.index = self.index, self.index + 1
        frame = self.frame
        if index < len(frame.meta) and index not in frame.saved:
            _, _, shape, dtype = frame.meta[index]
            if t.shape != shape or t.dtype != dtype:
                raise RuntimeError(
                    f"lmsrt: recomputing region {frame.region.name} saved a {t.dtype} tensor of "
                    f"shape {list(t.shape)} where its forward saved {dtype} {list(shape)}: its "
                    "forward does not repeat itself (control flow on data or on global state). "
                    f"Turn recompute off (recompute=False, {spelled('recompute', False)}).")
            frame.again[index] = t.detach()
            self.left -= 1
            if not self.left:
                raise _Stop
        return index

    @staticmethod
    def unpack(index: int):
        raise RuntimeError("lmsrt: a recomputed region's own graph is never run backward")


def rerun(frame: Frame) -> None:
    """Run ``frame``'s region again, collecting what its ops save (NOTE [ Recomputed regions ],
    Rule 4, in regions.py)."""
    region = frame.region
    inputs = [frame.outer_unpack(a).detach().requires_grad_(grad) if tensor else a
              for tensor, a, grad in frame.args]
    # Rule 4: the rerun updates copies of the running statistics, which then go (the
    # buffers themselves are never written: they may be saved tensors too).
    norms = [m for module in region.modules for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.training
             and m.track_running_stats]
    devices = [frame.device] if frame.gpu_rng is not None else []
    with contextlib.ExitStack() as stack:
        for m in norms:
            stack.callback(m._buffers.update, dict(m._buffers))
            m._buffers.update((k, b.clone()) for k, b in m._buffers.items() if b is not None)
        stack.enter_context(torch.random.fork_rng(devices=devices))
        torch.set_rng_state(frame.cpu_rng)
        if frame.gpu_rng is not None:
            torch.cuda.set_rng_state(frame.gpu_rng, frame.device)
        for kind, enabled, dtype in frame.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        stack.enter_context(torch.enable_grad())
        collect = _Collect(frame)
        stack.enter_context(saved_tensors_hooks(collect.pack, collect.unpack))
        try:
            if region.chain:
                x = inputs[0]
                for m in region.modules:
                    x = m(x)
            else:
                region.modules[0](*inputs)
        except _Stop:
            pass
