"""One call of a recomputed region: what autograd holds for its saved tensors, and its rerun
in backward (regions.py, NOTE [ Recomputed regions ], Rules 3-7).

Example::

    frame = Frame(regions, region, args, kwargs, (engine_pack, engine_unpack))   # at entry
    frame.close("")                      # at its exit: drops what its ops saved, or keeps them
    rerun(frame)                         # in backward, at the first unpack of a dropped tensor
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import _get_current_function_mode_stack
from torch.utils import _pytree
from torch.utils._device import DeviceContext
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..engine.records import counter_only, counters_only, modified_error
from ..hook_stack import remove_own_hooks
from ..options import spelled
from .finder import BlockCall
from .safety import ambient, as_called, generator_states, restore_ambient, updates_running_stats

__all__ = ["Frame", "RERUNS", "flatten", "rerun", "running_norms"]

_TURN_OFF = f"Turn recompute off (recompute=False, {spelled('recompute', False)})."


class _Reruns(threading.local):
    depth = 0


# This thread's reruns under way: regions.py's module hooks stand aside in them, at every module
# a rerun calls (they would find nothing to do: no frame opens in backward, and the rerun's
# calls nest inside any walk of a frame still open).
RERUNS = _Reruns()


# The leaves' spec, where this torch's pytree has what ``_flatten`` uses; else None.
_LEAF = (getattr(_pytree, "_LEAF_SPEC", None)
         if all(hasattr(_pytree, name) for name in ("tree_is_leaf", "_get_node_type",
                                                     "SUPPORTED_NODES", "TreeSpec")) else None)


def _flatten(node, leaves: list):
    """``tree_flatten``'s work, as its own recursive helper does it, but a function of the module:
    its helper is a closure made at each call that refers to itself through a cell, a cycle that
    leaves garbage for the collector at every region call."""
    if _pytree.tree_is_leaf(node):
        leaves.append(node)
        return _LEAF
    node_type = _pytree._get_node_type(node)
    children, context = _pytree.SUPPORTED_NODES[node_type].flatten_fn(node)
    return _pytree.TreeSpec(node_type, context, [_flatten(child, leaves) for child in children])


def flatten(tree) -> tuple:
    """``tree_flatten(tree)``: its leaves and its spec, made without garbage where this torch's
    pytree has the pieces ``_flatten`` uses."""
    if _LEAF is None:
        return tree_flatten(tree)
    leaves: list = []
    return leaves, _flatten(tree, leaves)


def _agrees() -> bool:
    """Whether ``_flatten`` gives what this torch's ``tree_flatten`` gives (the pieces it uses
    are private: a torch that builds its specs otherwise keeps torch's own function)."""
    sample = ((1, [2, None]), {"a": (3,), "b": {"c": 4.0}}, BlockCall)
    try:
        leaves: list = []
        return (leaves, _flatten(sample, leaves)) == tree_flatten(sample)
    except Exception:  # noqa: BLE001 - anything this torch's pytree raises: not ours to use
        return False


if _LEAF is not None and not _agrees():
    _LEAF = None


def _device_ctx():
    """The ``torch.device`` context forward ran under, for the rerun (as torch's checkpoint)."""
    if not torch._C._len_torch_function_stack():
        return None                     # (no mode on: the common case, read at every region)
    modes = _get_current_function_mode_stack()
    return next((m for m in reversed(modes) if isinstance(m, DeviceContext)), None)


class Frame(BlockCall):
    """One call of a region in one forward: its inputs (every tensor in its arguments, nested
    ones and keyword ones included, through the engine), the state its rerun restores, its saved
    tensors' metadata and, while it runs, the tensors themselves."""

    def __init__(self, regions, region, args: tuple, kwargs: dict, outer):
        super().__init__(region)
        self.regions = regions
        self.outer_pack, self.outer_unpack = outer
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            leaves, self.spec = list(args), None    # (tree_flatten's result, without its cost)
        else:
            leaves, self.spec = flatten((args, kwargs))
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        # Tensors go through the engine's hooks (kept or swapped), the rest as they are now
        # (Rule 3: an object forward changes, transformers' DynamicCache, copied).
        self.leaves = [(True, outer[0](t), t.requires_grad) if isinstance(t, torch.Tensor)
                       else (False, as_called(t), False) for t in leaves]
        self.inputs = [(i, t, t._version) for i, t in tensors]   # until the frame settles
        self.input_ptrs = {t.untyped_storage().data_ptr(): i for i, t in tensors}
        self.unsaved = set(self.input_ptrs.values())    # inputs its ops did not save
        # Rule 6: RNG of the CPU and of every CUDA device its tensors live on (and the current
        # one); autocast of each device type; the ambient flags; each module's train flag.
        devices = {t.device for _, t in tensors}
        kinds = {"cpu"} | {d.type for d in devices}
        self.autocast = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                         for k in sorted(kinds) if torch.amp.is_autocast_available(k)]
        self.cpu_rng = torch.get_rng_state()
        cuda = {d for d in devices if d.type == "cuda"}
        if torch.cuda.is_initialized():
            cuda.add(torch.device("cuda", torch.cuda.current_device()))
        self.gpu_rng = [(d, torch.cuda.get_rng_state(d)) for d in cuda]
        self.ambient = ambient()
        self.device_ctx = _device_ctx()
        state = region.state
        self.modes = state.modes()
        self.versions = state.versions()
        self.generators = state.generators()
        # Per saved tensor, by index: its alias (a version counter once dropped), the version it
        # was saved at, its shape and dtype. Lists side by side, not a list per tensor: a tensor
        # then adds no container of its own for the collector to track (its shape is a plain
        # tuple of ints, which CPython stops tracking).
        self.counters: list = []
        self.saved_versions: list = []
        self.shapes: list = []
        self.dtypes: list = []
        self.saved: Dict[int, torch.Tensor] = {}   # held (forward, Rule 3) or parameters
        self.outer: Dict[int, object] = {}         # kept: the engine's handles (Rule 3)
        self.params: set = set()      # indices of parameters (and views of them): always kept
        self.again: Optional[Dict[int, torch.Tensor]] = None   # from the last recompute
        self.checking = False         # kept, and rerun once in backward to check (reruns.py)
        self.kind = None              # its kind of call, while checked (reruns.py)
        self.dropped = False
        self.nbytes = 0               # bytes dropped (storages other than inputs and parameters)
        self.span = None              # its forward's timing span, in a timing step
        self.blind = False            # called with keyword arguments its entry did not see
        self.unpacked = False         # backward used what it holds before it settled
        self._seen: Optional[set] = set()
        self.hooks: Optional[saved_tensors_hooks] = saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> int:
        # What autograd holds is the tensor's index: its unpack hook is this frame's own.
        index = len(self.counters)
        alias = t.detach()
        self.counters.append(alias)
        self.saved_versions.append(t._version)
        self.shapes.append(tuple(t.shape))
        self.dtypes.append(t.dtype)
        self.saved[index] = alias
        base = t._base
        if base is None:
            base = t
        if base.requires_grad and base.is_leaf:
            # A trainable leaf or a view of one: alive anyway, so kept rather than recomputed.
            self.params.add(index)
        else:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.input_ptrs:
                self.unsaved.discard(self.input_ptrs[ptr])
            elif ptr not in self._seen:
                self._seen.add(ptr)
                self.nbytes += storage.nbytes()
        return index

    def close(self, keep_why: str) -> str:
        """It returned, raised (``keep_why``), or a walk left it (Rule 3): its own hooks come
        off the stack, wherever they are. Returns why its region is refused from now on, or
        "" (then ``settle`` drops or keeps what it saved)."""
        remove_own_hooks(self)
        self.hooks = self._seen = None          # (the hooks hold this frame: no cycle left)
        if keep_why:
            self.keep()
            return ""
        state = self.region.state
        after = state.versions()
        moved = state.moved(self.versions, after)
        why = (next(("it changed an input in place" for _, t, v in self.inputs
                     if t._version != v), "")
               or (f"its forward changed {moved} in place" if moved else "")
               or state.drew(self.generators, self.generators and generator_states()))
        self.versions = after           # what the rerun must find (Rule 7)
        if why:
            self.keep()
        return why

    def moved(self) -> bool:
        """Whether an input its ops did not save was changed in place since it returned
        (``x += block(x)``): its rerun could not start from it (Rule 5)."""
        return any(t._version != v for i, t, v in self.inputs if i in self.unsaved)

    def settle(self) -> bool:
        """Drop what its ops saved (Rule 3), unless an input its ops did not save was changed
        in place since it returned (``moved``): then keep them. Returns whether kept."""
        moved = self.moved()
        self.inputs = []
        if self.unpacked:               # backward came first: it has what it needs
            return False
        if moved:
            self.keep()
            return True
        params, saved, dropped = self.params, self.saved, []
        for index, alias in enumerate(self.counters):
            if index not in params:
                del saved[index]
                dropped.append(alias)
        counters_only(dropped)          # (the aliases in ``counters`` become counters in place)
        self.dropped = True
        return False

    def copy_unsaved(self) -> None:
        """Hand the engine copies of the inputs its ops did not save, as they are now: an
        in-place change after the region (``x += block(x)``) leaves the rerun's inputs alone."""
        start = self.regions.engine.save_point()
        for i, t, _ in self.inputs:
            if i in self.unsaved:
                _, _, grad = self.leaves[i]
                self.leaves[i] = (True, self.outer_pack(t.detach().clone()), grad)
        self.unsaved = set()
        self.regions.account.late(self.region, start)

    def keep(self, checking: bool = False) -> None:
        """Nothing is recomputed: what its ops saved goes to the engine, which keeps or swaps
        it like any saved tensor; its inputs are not needed (Rule 3). ``checking``: they are,
        for one rerun in backward that is compared with what it kept (reruns.py)."""
        start = self.regions.engine.save_point()
        for index, alias in list(self.saved.items()):
            if index not in self.params:
                self.outer[index] = self.outer_pack(alias)
                del self.saved[index]
                self.counters[index] = counter_only(alias.detach())
        self.checking = checking
        self.inputs = None
        if not checking:
            self.leaves = None
        self.regions.account.late(self.region, start)   # NOTE [ Block account ], 1

    def uncheck(self) -> None:
        """Its check gives no verdict (reruns.py): it keeps, like any kept call."""
        self.checking, self.again, self.leaves = False, None, None

    def unpack(self, index: int) -> torch.Tensor:
        counter, version = self.counters[index], self.saved_versions[index]
        if counter._version != version:
            raise modified_error("tensor", self.shapes[index], None, counter._version, version,
                                  f"was saved inside the recomputed region {self.region.name}")
        tensor = self.saved.get(index)
        if tensor is not None:
            self.unpacked = True
            return tensor
        if self.checking:               # reruns.py: once, compared with what it kept
            try:
                self.regions.recompute(self)
            except RuntimeError:        # (out of memory included) no verdict: a later step's
                self.uncheck()
        if index in self.outer:
            originals = self.again if self.again is not None else {}
            tensor = originals.pop(index, None)     # brought back for the check
            return tensor if tensor is not None else self.outer_unpack(self.outer[index])
        if torch.is_grad_enabled():
            # A backward that builds a graph of its own (create_graph=True) would need the
            # recomputed tensors' history, which the rerun does not keep.
            raise RuntimeError(
                f"lmsrt: region {self.region.name} was recomputed, and a backward with "
                f"create_graph=True (double backward) cannot use recomputed tensors. {_TURN_OFF}")
        if self.again is None or index not in self.again:
            self.regions.recompute(self)
        tensor = self.again.pop(index, None)
        if tensor is None:
            raise RuntimeError(
                f"lmsrt: recomputing region {self.region.name} saved fewer tensors than its "
                "forward did: its forward does not repeat itself (control flow on data or on "
                f"global state). {_TURN_OFF}")
        return tensor

    def input_of_rerun(self, i: int) -> torch.Tensor:
        """Input ``i`` back from the engine, as forward saw it."""
        _, handle, grad = self.leaves[i]
        try:
            t = self.outer_unpack(handle)
        except RuntimeError as e:
            if i not in self.unsaved or "modified by an inplace operation" not in str(e):
                raise
            self.regions.refuse(self.region, "an input its ops did not save was changed in "
                                "place after it returned")
            raise RuntimeError(
                f"lmsrt: an input of region {self.region.name}, which its ops did not save, was "
                "changed in place after the region returned. Autograd allows that, but "
                "recomputing the region needs the input as it was, so this backward cannot "
                "go on; lmsrt keeps what the region saves from now on (said once). Run the "
                f"step again, or keep the input unchanged until backward. {_TURN_OFF}") from None
        return t.detach().requires_grad_(grad)


def _put_rng(cpu: torch.Tensor, gpus: list) -> None:
    torch.set_rng_state(cpu)
    for device, state in gpus:
        torch.cuda.set_rng_state(state, device)


def running_norms(region) -> list:
    """The region's norms whose running statistics a forward in training mode updates: the
    rerun updates copies of them (Rule 4)."""
    return [m for module in region.modules for m in _modules_in(module) if updates_running_stats(m)]


# norm -> (weak references to the buffers its stand-ins were made for, the stand-ins)
_STAND_INS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stand_ins(m: nn.Module) -> dict:
    """Tensors a rerun of batch norm ``m`` in training mode updates in place of its running
    statistics (Rule 4). Its output reads none of them (batch statistics in training mode), and
    what the rerun writes into them is never read: made once per set of buffers, from copies,
    not copied at every rerun (resnet152: 405 small copies a step, each a kernel and an
    allocation on a host-bound backward)."""
    bufs = {k: b for k, b in m._buffers.items() if b is not None}
    made = _STAND_INS.get(m)
    if made is None or made[0].keys() != bufs.keys() or any(
            made[0][k]() is not b for k, b in bufs.items()):
        made = ({k: weakref.ref(b) for k, b in bufs.items()},
                {k: b.detach().clone() for k, b in bufs.items()})
        _STAND_INS[m] = made
    return made[1]


def _modules_in(module: nn.Module) -> list:
    """``list(module.modules())`` (the same modules in the same order, each once), without the
    names ``named_modules`` joins for each: read at every rerun."""
    out, memo, todo = [], set(), [module]
    while todo:
        m = todo.pop()
        if m in memo:
            continue
        memo.add(m)
        out.append(m)
        todo += [c for c in reversed(m._modules.values()) if c is not None]
    return out


class _Stop(Exception):
    """Every tensor the region dropped is back: the rest of its rerun is skipped (Rule 4)."""


class _Collect:
    """The saved-tensor hooks of a recompute: each saved tensor goes to the frame by position."""

    def __init__(self, frame: Frame):
        self.frame, self.index = frame, 0
        self.left = sum(1 for i in range(len(frame.counters))
                        if i not in frame.saved and (frame.checking or i not in frame.outer))
        frame.again = {}

    def pack(self, t: torch.Tensor) -> int:
        index, self.index = self.index, self.index + 1
        frame = self.frame
        if index < len(frame.counters) and index not in frame.saved:
            shape, dtype = frame.shapes[index], frame.dtypes[index]
            if t.shape != shape or t.dtype != dtype:
                raise RuntimeError(
                    f"lmsrt: recomputing region {frame.region.name} saved a {t.dtype} tensor of "
                    f"shape {list(t.shape)} where its forward saved {dtype} {list(shape)}: its "
                    "forward does not repeat itself (control flow on data or on global state). "
                    f"{_TURN_OFF}")
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
    Rules 4 and 6, in regions.py)."""
    region = frame.region
    leaves = [frame.input_of_rerun(i) if tensor else as_called(a)     # (Rule 3)
              for i, (tensor, a, _) in enumerate(frame.leaves)]
    args, kwargs = (tuple(leaves), {}) if frame.spec is None else tree_unflatten(leaves,
                                                                                  frame.spec)
    with contextlib.ExitStack() as stack:
        RERUNS.depth += 1
        stack.callback(setattr, RERUNS, "depth", RERUNS.depth - 1)
        region.state.restore_modes(stack, frame.modes)
        # Rule 7: what it reads besides its arguments is as forward saw it, or nothing runs.
        moved = region.state.moved(frame.versions, region.state.versions())
        if moved:
            frame.regions.refuse(region, f"{moved}, which it reads, was changed in place "
                                 "between forward and backward")
            raise RuntimeError(
                f"lmsrt: recomputing region {region.name} needs the parameters and buffers it "
                f"read in forward, but {moved} was changed in place between forward and "
                "backward (outside an optimizer step and .data, which lmsrt sees coming). "
                "Change parameters after backward; lmsrt keeps what this region saves from "
                f"now on (said once). {_TURN_OFF}")
        # Rule 4: the rerun updates stand-ins for the running statistics (the buffers
        # themselves are never written: they may be saved tensors too).
        for m in running_norms(region):
            stack.callback(m._buffers.update, dict(m._buffers))
            m._buffers.update(_stand_ins(m))
        # (torch.random.fork_rng's save and restore, without its generator's cost)
        stack.callback(_put_rng, torch.get_rng_state(),
                       [(d, torch.cuda.get_rng_state(d)) for d, _ in frame.gpu_rng])
        _put_rng(frame.cpu_rng, frame.gpu_rng)
        restore_ambient(stack, frame.ambient)
        for kind, enabled, dtype in frame.autocast:
            # Where autocast is as forward had it, entering it again would change nothing the
            # rerun computes (its cache is dropped at the outermost exit; none is added while
            # it is off, and while on, an outer autocast holds the cache as forward's did).
            if (enabled, dtype) != (torch.is_autocast_enabled(kind),
                                    torch.get_autocast_dtype(kind)):
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        if frame.device_ctx is not None:
            stack.enter_context(frame.device_ctx)
        stack.enter_context(torch.enable_grad())
        collect = _Collect(frame)
        stack.enter_context(saved_tensors_hooks(collect.pack, collect.unpack))
        try:
            if region.chain:
                x = args[0]
                for m in region.modules:
                    x = m(x)
            else:
                region.modules[0](*args, **kwargs)
        except _Stop:
            pass
        finally:
            # What the rerun made may outlive it in an argument the frame holds (transformers'
            # DynamicCache): their graph, never run backward, holds these hooks, which must not
            # hold the frame (a cycle through autograd's graph, which no collector sees).
            collect.frame = None
