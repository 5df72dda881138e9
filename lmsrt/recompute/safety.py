"""Whether a region's rerun can reproduce its forward, and the state a rerun restores
(regions.py, NOTE [ Recomputed regions ], Rules 6 and 7).

What a block reads besides its arguments must be the same in backward as in forward, or the
region is refused. Checked once per region (``BlockState``): TorchScript, a ``torch.Generator``
held by a module. Checked per call, O(modules in the block): user hooks on its modules or
global ones other than lmsrt's; the versions of its parameters and buffers (batch norm's running
statistics in training mode apart: the rerun puts them back); Python's and numpy's global
generators (on a region's first calls only: reading them costs ~10 us). Restored in the rerun:
the backend flags, ``sdpa_kernel``'s choice, deterministic mode, default dtype and autocast's
cache (``ambient``), each module's train/eval flag (``BlockState.modes``), and the objects among
its arguments as they were at its call (``as_called``).

Not seen: a ``torch.Generator`` the block reaches other than as a module attribute, and
writes that bump no version counter (``.data`` inside forward). Such blocks are not refused.

Example::

    state = BlockState(named_modules)          # once per region
    why = state.refusal() or state.hooks()     # "" when the region may be recomputed
"""
from __future__ import annotations

import contextlib
import copy
import enum
import random
import sys
import weakref
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["BlockState", "ambient", "as_called", "restore_ambient", "generator_states",
           "updates_running_stats", "RANDOM_CHECKS"]

RANDOM_CHECKS = 4      # a region's calls whose Python/numpy generator use is checked
_NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _flag(name: str) -> Tuple[Callable, Callable]:
    get, put = getattr(torch._C, f"_get_{name}"), getattr(torch._C, f"_set_{name}")
    return get, (lambda v: put(*v)) if isinstance(get(), tuple) else put


def _ambient_flags() -> List[Tuple[Callable, Callable]]:
    """(get, set) of the global settings a kernel choice reads, as this torch names them."""
    flags = []
    for name in ("mkldnn_enabled", "mkldnn_deterministic", "cudnn_enabled", "cudnn_benchmark",
                 "cudnn_deterministic", "cudnn_allow_tf32", "cublas_allow_tf32",
                 "cublas_allow_fp16_reduced_precision_reduction",
                 "cublas_allow_bf16_reduced_precision_reduction",
                 "cpu_allow_fp16_reduced_precision_reduction", "float32_matmul_precision",
                 "sdp_priority_order"):
        try:
            flags.append(_flag(name))
        except (AttributeError, TypeError, RuntimeError):
            pass
    for name in ("flash", "mem_efficient", "math", "cudnn", "overrideable"):
        get = getattr(torch._C, f"_get_{name}_sdp_enabled", None)
        put = getattr(torch._C, f"_set_sdp_use_{name}", None)
        if get is not None and put is not None:
            flags.append((get, put))
    flags.append((lambda: (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled()),
                  lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])))
    flags.append((torch.get_default_dtype, torch.set_default_dtype))
    flags.append((torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled))
    return flags


_FLAGS = _ambient_flags()
_GETS = [get for get, _ in _FLAGS]


def ambient() -> tuple:
    """The backend flags, ``sdpa_kernel``'s backends, deterministic mode, default dtype and
    autocast's cache as they are now (a few C calls)."""
    return tuple([get() for get in _GETS])


def restore_ambient(stack: contextlib.ExitStack, values: tuple) -> None:
    """Set what differs from ``values`` (``ambient()`` of forward) until ``stack`` closes."""
    if ambient() == values:
        return
    for (get, put), value in zip(_FLAGS, values):   # (one read each: some set others too)
        now = get()
        if now != value:
            stack.callback(put, now)
            put(value)


def generator_states() -> tuple:
    """Python's global generator state, and numpy's position where numpy is imported."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state()[2] if np is not None else None)


# Arguments copied by ``as_called`` no deeper than this (transformers' DynamicCache: the cache,
# its list of layers, each layer, its tensors).
_DEPTH = 6
_SHARED = (torch.Tensor, nn.Module, int, float, complex, str, bytes, bool, type(None), type,
           slice, range, enum.Enum, torch.dtype, torch.device, torch.layout,
           torch.memory_format, torch.Size)


def as_called(obj, memo: Optional[dict] = None, depth: int = 0):
    """``obj`` as a region's forward was called with it, for its rerun (NOTE [ Recomputed
    regions ], Rule 3): lists, tuples, dicts and plain objects (those with a ``__dict__``) are
    copied, tensors, modules, callables and whatever cannot be copied are shared. An argument
    that forward changes (transformers' DynamicCache, which each layer's attention appends its
    keys to) stays, in the copy, as forward found it; the rerun changes a copy of the copy."""
    if isinstance(obj, _SHARED) or callable(obj) or depth > _DEPTH:
        return obj
    memo = {} if memo is None else memo
    seen = memo.get(id(obj))
    if seen is not None:
        return seen
    kind = type(obj)
    if kind in (list, tuple, dict):
        memo[id(obj)] = obj             # (a cycle through it: shared)
        if kind is dict:
            out = {k: as_called(v, memo, depth + 1) for k, v in obj.items()}
        else:
            out = kind(as_called(v, memo, depth + 1) for v in obj)
    else:
        state = getattr(obj, "__dict__", None)
        if type(state) is not dict:
            return obj
        try:
            out = copy.copy(obj)
        except Exception:  # noqa: BLE001 - an object that will not be copied is shared
            return obj
        if out is obj or type(getattr(out, "__dict__", None)) is not dict:
            return obj
        memo[id(obj)] = out             # (before its attributes: a cycle back to it)
        out.__dict__.update((k, as_called(v, memo, depth + 1)) for k, v in state.items())
    memo[id(obj)] = out
    return out


def updates_running_stats(m: nn.Module) -> bool:
    """Whether ``m`` is a batch norm whose running statistics a forward in training mode
    updates: its rerun updates copies of them and puts them back, so they are not watched."""
    return isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats


def _lmsrt_hook(hook) -> bool:
    return getattr(hook, "__module__", "").startswith("lmsrt.")


def _foreign_global_hooks() -> str:
    for hooks in (_module._global_forward_pre_hooks, _module._global_forward_hooks):
        for hook in hooks.values():
            if not _lmsrt_hook(hook):
                return getattr(hook, "__qualname__", type(hook).__name__)
    return ""


class BlockState:
    """What one region reads besides its arguments: its modules by name, and the checks."""

    __slots__ = ("_named", "calls")

    def __init__(self, named: List[Tuple[str, nn.Module]]):
        # (qualified name, module) of every module in the region, the modules held weakly
        # (as ``Region.modules``: a dropped model is freed).
        self._named = [(name, weakref.ref(m)) for name, m in named]
        self.calls = 0              # calls checked for Python's and numpy's generators

    @property
    def named(self) -> List[Tuple[str, nn.Module]]:
        return [(name, m) for name, ref in self._named if (m := ref()) is not None]

    def _alive(self) -> List[nn.Module]:
        return [m for _, ref in self._named if (m := ref()) is not None]

    def refusal(self) -> str:
        """Why the region can never be recomputed (checked once), or ""."""
        for name, m in self.named:
            if isinstance(m, torch.jit.ScriptModule):
                return (f"{name or type(m).__name__} is TorchScript, whose interpreter cannot "
                        "stop a rerun early")
            for key, value in vars(m).items():
                if isinstance(value, torch.Generator):
                    return (f"{name or type(m).__name__}.{key} is a torch.Generator, whose "
                            "draws a rerun cannot replay")
        return ""

    def hooks(self) -> str:
        """Forward hooks that would run again in the rerun (the user's), or ""."""
        for name, ref in self._named:
            m = ref()
            if m is not None and (m._forward_hooks or m._forward_pre_hooks):
                return (f"{name or type(m).__name__} has forward hooks of its own, which a "
                        "rerun would call again")
        foreign = _foreign_global_hooks()
        return (f"a global module hook ({foreign}) would run again in the rerun" if foreign
                else "")

    def _tensors(self):
        """(kind, module name, key, tensor) of its parameters and buffers, in ``versions``'
        order: what a moved version is said as."""
        for name, ref in self._named:
            m = ref()
            if m is None:
                continue
            for key, t in m._parameters.items():
                if t is not None:
                    yield "parameter", name, key, t
            if m._buffers:
                put_back = updates_running_stats(m)
                for key, t in m._buffers.items():
                    if t is not None and not (put_back and key in _NORM_STATS):
                        yield "buffer", name, key, t

    def versions(self) -> list:
        """The version counters of its parameters and buffers (``_tensors``), read three times
        a call of a recomputed region: one loop, no names, no tuples."""
        out: list = []
        append = out.append
        for _, ref in self._named:
            m = ref()
            if m is None:
                continue
            for t in m._parameters.values():
                if t is not None:
                    append(t._version)
            if m._buffers:
                put_back = updates_running_stats(m)
                for key, t in m._buffers.items():
                    if t is not None and not (put_back and key in _NORM_STATS):
                        append(t._version)
        return out

    def moved(self, before: list, now: list) -> str:
        """The first parameter or buffer whose version is not in ``now`` what it was in
        ``before`` (``versions()`` both), said as "buffer 'u'", or ""."""
        if now == before:
            return ""
        for (kind, name, key, _), was, is_ in zip(self._tensors(), before, now):
            if was != is_:
                return f"{kind} '{name}.{key}'" if name else f"{kind} '{key}'"
        return "parameters and buffers"

    def ids(self) -> set:
        """ids of its parameters (what ``p.data`` and optimizer steps name)."""
        return {id(t) for kind, _, _, t in self._tensors() if kind == "parameter"}

    def generators(self):
        """Python's and numpy's global generator states on a region's first calls, else None."""
        if self.calls >= RANDOM_CHECKS:
            return None
        self.calls += 1
        return generator_states()

    @staticmethod
    def drew(before, after) -> str:
        """Which global generator the block drew from between ``generators()`` calls, or ""."""
        if before is None or after is None:
            return ""
        return ("its forward drew from Python's random module, which a rerun would draw from "
                "again" if before[0] != after[0] else
                "its forward drew from numpy's global generator, which a rerun would draw from "
                "again" if before[1] != after[1] else "")

    def modes(self) -> list:
        return [m.training for m in self._alive()]

    def restore_modes(self, stack: contextlib.ExitStack, modes: list) -> None:
        """Each module's train/eval flag as in forward, until ``stack`` closes."""
        for m, training in zip(self._alive(), modes):
            if m.training != training:
                stack.callback(setattr, m, "training", m.training)
                m.training = training
