"""Rebuilding cheap saved tensors in backward instead of moving them: recipes, and a census.

NOTE [ Recipes ]
Many tensors autograd saves are cheap, deterministic functions of other tensors that stay
available anyway: GELU's output (the input of the next Linear) from GELU's input, which GELU
saves itself; a LayerNorm's output from its input, which LayerNorm saves; under autocast, a
weight's bf16 copy from its fp32 parameter. Running the same kernel on the same inputs again in
backward costs one memory-bound kernel; moving the tensor costs two PCIe copies (docs/design.md: the
transfer floor). A ``Recorder`` (a TorchDispatchMode, so below autograd: it sees the kernels that
run, not the Python that called them) notes, for the output of each op in ``REBUILDABLE``, the
op, its arguments, and each tensor argument's storage (by weak reference: a recipe keeps
nothing alive) and version: a ``Recipe``, keyed by the output's storage.

A recipe can stand in for its output when the output is saved as it was made (same version) and
each tensor input will still be there, unchanged, when backward needs the output: an input that
is a parameter, or one that is saved itself (``Recipe.inputs_saved``; autograd runs the
consumer's backward, which needs the output, before the producer's, which holds the input).
Rebuilding runs the op again without autograd (``Recipe.rebuild``); the result is bit for bit
the output, since the kernel and its inputs are the same. An input changed in place since the
op ran fails the rebuild as autograd fails a modified saved tensor.

Only ops that draw no random numbers are listed (not dropout), and nothing a rebuild writes
but its output: batch norm in training updates running statistics as it normalises, so its
rebuild is given fresh zeros in their place, whose update is dropped (its output depends only on
the batch, in training). An in-place activation (ReLU after BatchNorm) applied to a storage that
has a recipe makes a recipe of its own: rebuild that one, then apply the activation again.
"""
from __future__ import annotations

import collections
import sys
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
)

from ..options import spelled

__all__ = ["REBUILDABLE", "Recipe", "Recorder", "RecipeTable", "census", "view_of"]

_aten = torch.ops.aten

class _Op(NamedTuple):
    """How a listed op is recorded and run again."""

    output: int = 0                 # the output a recipe rebuilds (the others, e.g. LayerNorm's
                                    # mean and rstd, are small and saved as they are)
    scratch: Tuple[int, ...] = ()   # arguments it updates besides (running statistics): fresh
                                    # zeros in a rebuild, their update dropped
    training: Optional[int] = None  # the argument that says training: recorded only then
    inplace: bool = False           # writes its first argument: recorded over that one's recipe


_BATCH_NORM = _Op(scratch=(3, 4), training=5)

# The ops whose outputs recipes rebuild. Each takes its tensors as arguments of their own, not in
# lists: a recipe looks at the top level only.
REBUILDABLE: Dict[object, _Op] = {
    _aten.gelu.default: _Op(),
    _aten.silu.default: _Op(),
    _aten.sigmoid.default: _Op(),
    _aten.tanh.default: _Op(),
    _aten.relu.default: _Op(),
    _aten.native_layer_norm.default: _Op(),
    _aten._to_copy.default: _Op(),          # dtype casts: autocast's copies of weights and inputs
    _aten.native_batch_norm.default: _BATCH_NORM,
    _aten._native_batch_norm_legit.default: _BATCH_NORM,
    _aten._native_batch_norm_legit.no_stats: _Op(training=3),
    _aten.cudnn_batch_norm.default: _BATCH_NORM,
    _aten.relu_.default: _Op(inplace=True),
    _aten.silu_.default: _Op(inplace=True),
    _aten.hardtanh_.default: _Op(inplace=True),     # ReLU6(inplace=True)
}


class _Scratch(NamedTuple):
    """An argument that a rebuild gives fresh zeros of this shape and dtype."""

    size: tuple
    dtype: torch.dtype


_DEPTH = 3             # ops a chain of recipes may reach back (LayerNorm, then a cast)
_TENSOR = object()      # where a tensor argument goes, in a recipe's flattened arguments
# Autocast must not touch a rebuild: the recorded op is the one that ran below it.
_Exclude = torch._C._ExcludeDispatchKeyGuard
_AUTOCAST = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
             | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))


def _view(storage, dtype, offset, size, stride) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


class _Input:
    """A tensor argument of a recipe: its storage (weakly), version and view."""

    __slots__ = ("storage_ref", "tensor_ref", "version", "dtype", "size", "stride", "offset",
                 "parameter", "recipe", "entry", "inplace")

    def __init__(self, t: torch.Tensor, recipe: Optional["Recipe"], entry: object = None):
        self.storage_ref = weakref.ref(t.untyped_storage())
        self.recipe = recipe          # how this input was made, if it was by a listed op
        self.entry = entry            # what the swap engine made of it when it was saved, if it was
        # Its version counter lives as long as its base or a view of it (a view holds its
        # base): with all of them gone, nothing can write it in place any more.
        self.tensor_ref = weakref.ref(t if t._base is None else t._base)
        self.version = t._version
        self.dtype, self.size, self.stride = t.dtype, tuple(t.shape), t.stride()
        self.offset = t.storage_offset()
        self.parameter = weakref.ref(t) if isinstance(t, torch.nn.Parameter) else None
        # The storage an in-place op wrote: as the op saw it, it is gone (the op's own output
        # took its place), so only its recipe makes it again.
        self.inplace = False

    def unchanged(self) -> bool:
        t = self.tensor_ref()
        return self.inplace or t is None or t._version == self.version

    def tensor(self) -> Optional[torch.Tensor]:
        """The input as the op saw it, if its storage is still alive."""
        if self.inplace:
            return None
        if self.parameter is not None:
            return self.parameter()
        storage = self.storage_ref()
        return None if storage is None else self.view(storage)

    def view(self, storage) -> torch.Tensor:
        """The input's view, taken of ``storage`` (its own, or a rebuilt one)."""
        return _view(storage, self.dtype, self.offset, self.size, self.stride)


def _changed(recipe: "Recipe", inp: _Input) -> RuntimeError:
    now = inp.tensor_ref()._version
    if inp.parameter is not None:
        return RuntimeError(
            f"lmsrt: a parameter ({inp.dtype} {list(inp.size)}) was modified in place between "
            f"forward and backward (version {now}, was {inp.version}), and lmsrt rebuilds the "
            f"output of {recipe.name} from it for backward (recompute), so it cannot give "
            "backward the bytes forward saved. Without recompute this runs: set "
            f"recompute=False ({spelled('recompute', False)}), or modify parameters only after "
            "backward.")
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: the input of {recipe.name} is at version {now}; expected version "
        f"{inp.version} instead. lmsrt rebuilds that op's output for backward from the input "
        "the op saw; without LMS autograd raises this same error at the op's own backward.")


def _hashable(a):
    if isinstance(a, (list, tuple)):
        return tuple(_hashable(b) for b in a)
    return "tensor" if a is _TENSOR else a


class Recipe:
    """How to make a saved tensor again: ``func(*args, **kwargs)[index]``, with the tensor
    arguments given by ``inputs`` (NOTE [ Recipes ])."""

    __slots__ = ("func", "nargs", "keys", "flat", "inputs", "index", "version", "dtype", "size",
                 "stride", "offset", "nbytes", "device", "retained", "_signature", "__weakref__")

    def __init__(self, func, args, kwargs, op: _Op, out: torch.Tensor,
                 describe: Callable[[torch.Tensor], _Input] = lambda t: _Input(t, None)):
        self.func, self.index = func, op.output
        flat = [*args, *kwargs.values()]
        for i in op.scratch:
            if isinstance(flat[i], torch.Tensor):
                flat[i] = _Scratch(tuple(flat[i].shape), flat[i].dtype)
        self.nargs, self.keys = len(args), tuple(kwargs)
        self.inputs: List[_Input] = [describe(a) for a in flat if isinstance(a, torch.Tensor)]
        # The arguments with each tensor's place marked, filled in again by ``rebuild``.
        self.flat = [_TENSOR if isinstance(a, torch.Tensor) else a for a in flat]
        self.device = out.device
        self.version = out._version
        self.dtype, self.size, self.stride = out.dtype, tuple(out.shape), out.stride()
        self.offset = out.storage_offset()
        self.nbytes = out.untyped_storage().nbytes()
        self.retained: Optional[tuple] = None   # its inputs' storages, while a check may want them
        self._signature = None

    @property
    def name(self) -> str:
        return str(self.func.overloadpacket.__name__)

    @property
    def signature(self) -> tuple:
        """What decides which kernel runs and what it computes: the op, its other arguments,
        and each input's dtype, shape, strides and offset (the offset sets its alignment: the
        engine's copies of an input start where the allocator's blocks do). Rebuilds of one
        signature are checked bit for bit once (``Rebuilds``), then trusted."""
        if self._signature is None:
            self._signature = (
                self.func, self.keys, _hashable(self.flat), self.dtype, self.size,
                self.stride,
                tuple((i.dtype, i.size, i.stride, i.offset,
                       None if i.recipe is None else i.recipe.signature) for i in self.inputs))
        return self._signature

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (the output or a view of it: a Linear saves its input reshaped) is as
        the op made it: nothing wrote its storage since (views share one version counter)."""
        return t._version == self.version and t.untyped_storage().nbytes() == self.nbytes

    def inputs_saved(self, saved: Callable[[_Input], bool], depth: int = _DEPTH) -> bool:
        """Whether every tensor input is a parameter, or an input for which ``saved`` is true,
        unchanged since the op ran, or was itself made by a recipe whose inputs are (a
        LayerNorm's output cast to bf16 by autocast: the fp32 output is not saved, the
        LayerNorm's input is), at most ``depth`` ops deep."""
        for inp in self.inputs:
            if inp.parameter is not None:
                p = inp.parameter()
                if p is None or p._version != inp.version:
                    return False
                continue
            if not inp.inplace and saved(inp) and inp.unchanged():
                continue
            if inp.recipe is None or depth == 0 or not inp.recipe.inputs_saved(saved, depth - 1):
                return False
        return True

    def retain_inputs(self) -> None:
        """Keep the inputs' storages alive until ``let_go``: a check in forward reads them
        where the engine has already let them go (a GELU's input, copied out before the GELU's
        output is saved)."""
        self.retained = tuple(i.storage_ref() for i in self.inputs
                          if i.parameter is None and not i.inplace)

    def let_go(self) -> None:
        """Stop retaining the inputs, this recipe's and those of the recipes it reaches."""
        self.retained = None
        for inp in self.inputs:
            if inp.recipe is not None and inp.recipe.retained is not None:
                inp.recipe.let_go()

    def input_points(self) -> tuple:
        """The forward points of the saved storages a rebuild reads (``walk``'s entries that
        the engine placed: engine/records.py)."""
        return tuple(e.seq for e in (inp.entry for inp in self.walk())
                     if e is not None and e.seq >= 0)

    def walk(self):
        """The inputs a rebuild reads: this recipe's, and for one that the engine did not save
        (no ``entry``) and made by a recipe, that recipe's, depth first."""
        for inp in self.inputs:
            yield inp
            if inp.entry is None and inp.recipe is not None:
                yield from inp.recipe.walk()

    def rebuild(self, resolve: Optional[Callable[[_Input], torch.Tensor]] = None) -> torch.Tensor:
        """Run the op again and return its output (whose storage stands in for the old one:
        a saved view is taken of it as of the old). ``resolve`` gives each input's tensor (the
        engine's restored copy of a swapped input), None for one it does not have; by default
        the input's own storage."""
        return self.run(self.arguments(resolve))

    def arguments(self, resolve: Optional[Callable[[_Input], torch.Tensor]] = None) -> list:
        """The op's arguments for a rebuild: each input resolved (or rebuilt by its own
        recipe), checked unchanged where it is read as it is."""
        tensors = []
        for inp in self.inputs:
            t = resolve(inp) if resolve is not None else inp.tensor()
            if t is not None and not inp.unchanged():
                raise _changed(self, inp)
            if t is None and inp.recipe is not None:
                t = inp.view(inp.recipe.rebuild(resolve).untyped_storage())
            if t is None:
                raise RuntimeError(f"lmsrt: cannot rebuild the output of {self.name}: an input "
                                   "is gone")
            tensors.append(t)
        given = iter(tensors)
        return [next(given) if a is _TENSOR else
                torch.zeros(a.size, dtype=a.dtype, device=self.device) if type(a) is _Scratch
                else a for a in self.flat]

    def run(self, flat: list) -> torch.Tensor:
        """Run the op on ``arguments``' result; return the output it rebuilds."""
        n = self.nargs
        with torch.no_grad(), _disable_current_modes(), _Exclude(_AUTOCAST):
            out = self.func(*flat[:n], **dict(zip(self.keys, flat[n:])))
        if isinstance(out, (tuple, list)):
            out = out[self.index]
        if tuple(out.shape) != self.size or out.stride() != self.stride or out.dtype != self.dtype:
            raise RuntimeError(f"lmsrt: {self.name} rebuilt a tensor of another layout "
                               f"({tuple(out.shape)}, {out.stride()}) than it made "
                               f"({self.size}, {self.stride})")
        return out


class Recorder(TorchDispatchMode):
    """Notes a ``Recipe`` for each output of an op in ``REBUILDABLE`` made while it is on, in
    forward (not in backward: what backward makes is not saved for it).

    ``recipes`` is the table it writes (recorders of several threads share one); ``entry_of``
    tells, for a tensor input, what the swap engine made of it if it saved it (inputs are saved
    before their op runs, so it is known here; the engine may have let the input's storage go
    by the time the op's output is saved)."""

    def __init__(self, recipes: Optional[RecipeTable] = None,
                 entry_of: Callable[[torch.Tensor], object] = lambda t: None,
                 retaining: Callable[[], bool] = lambda: False,
                 noting: Callable[[], bool] = lambda: True, dispatched: Optional[list] = None):
        super().__init__()
        self._dispatched = [0] if dispatched is None else dispatched   # ops passed on, counted
        self._recipes = RecipeTable() if recipes is None else recipes
        self._entry_of = entry_of
        self._retaining = retaining   # whether new recipes retain their inputs (``retain_inputs``)
        self._noting = noting        # whether to note recipes at all (the step may rebuild)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code runs compiled, not op by op through this mode (which would make
        # it fall back to eager); its saved tensors are not rebuilt.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._dispatched[0] += 1
        kwargs = kwargs or {}
        op = REBUILDABLE.get(func)
        # Not in backward, nor where autograd saves nothing (no_grad, inference mode, whose
        # tensors have no version counter to check a recipe by).
        if (op is None or not self._noting() or torch._C._current_graph_task_id() != -1
                or not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
                or not all(t is torch.Tensor or t is torch.nn.Parameter for t in types)
                or not all(_plain(a) for a in args if isinstance(a, torch.Tensor))):
            return func(*args, **kwargs)
        if op.inplace:
            return self._in_place(func, op, args, kwargs)
        out = func(*args, **kwargs)
        if op.training is not None and not (len(args) > op.training and args[op.training]):
            return out
        made = out[op.output] if isinstance(out, (tuple, list)) else out
        if _whole(made):
            self._note(made, Recipe(func, args, kwargs, op, made, self._input))
        return out

    def _in_place(self, func, op: _Op, args, kwargs):
        target = args[0]
        over = self.recipe_for(target) if _whole(target) else None
        if over is None:
            return func(*args, **kwargs)
        first = _Input(target, over)     # before the op writes it: its version as it was
        first.inplace = True
        out = func(*args, **kwargs)
        recipe = Recipe(func, args, kwargs, op, target,
                        lambda t: first if t is target else self._input(t))
        # Autograd counts the write once the kernel returns, above this mode: the output's
        # version is one past the input's.
        recipe.version = first.version + 1
        self._note(target, recipe)
        return out

    def _note(self, made: torch.Tensor, recipe: Recipe) -> None:
        if self._retaining():
            recipe.retain_inputs()
        self._recipes.note(made.untyped_storage(), recipe)

    def _input(self, t: torch.Tensor) -> _Input:
        made_by = None if isinstance(t, torch.nn.Parameter) else self.recipe_for(t)
        entry = None if isinstance(t, torch.nn.Parameter) else self._entry_of(t)
        return _Input(t, made_by, entry)

    def recipe_for(self, t: torch.Tensor) -> Optional[Recipe]:
        """The recipe that made ``t``'s storage, unchanged since, or None."""
        storage = t.untyped_storage()
        found = self._recipes.get(id(storage))
        if found is None or found[0]() is not storage:
            return None
        recipe = found[1]
        return recipe if recipe.fits(t) else None

    def __len__(self) -> int:
        self._recipes.sweep()
        return len(self._recipes)


def _defer_dynamo(mode: type) -> None:
    """Keep ``mode``'s first op from importing torch._dynamo while nothing compiles.

    TorchDispatchMode wraps a subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
    which imports torch._dynamo (and sympy) at the first op the mode sees, to keep compilation
    out of the mode's frames: 1 s on a CPU here, 4.4 s measured on an H200 host, inside the
    first training step. Until torch._dynamo is loaded nothing can compile, so nothing needs
    keeping out: the wrapper finds, where it caches torch's disabled function, one that runs
    the mode directly until then and switches to torch's once torch._dynamo is loaded. A torch
    whose wrapper works otherwise is left as it is (it then only costs the import)."""
    inner = mode.__dict__.get("__torch_dispatch__")
    raw = getattr(inner, "__wrapped__", None)
    if raw is None or getattr(raw, "__dynamo_disable", None) is not None:
        return

    def run(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        disable = getattr(dynamo, "disable", None)
        if disable is None:                 # not loaded (or half way): nothing compiles
            return raw(*args, **kwargs)
        disabled = disable(raw, recursive=True)
        setattr(raw, "__dynamo_disable", disabled)
        return disabled(*args, **kwargs)
    setattr(raw, "__dynamo_disable", run)


_defer_dynamo(Recorder)


def _plain(t: torch.Tensor) -> bool:
    """A dense strided tensor with one storage (not nested, sparse, or a subclass's wrapper)."""
    return t.layout == torch.strided and not t.is_nested and not t.is_inference()


def _whole(t) -> bool:
    """Whether ``t`` is a plain tensor that is the whole of its storage's start (not a view)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t._base is None
            and t.storage_offset() == 0)


class _Key(weakref.ref):
    """A recipe table's reference to an output storage, which knows its key."""

    __slots__ = ("key",)


class RecipeTable(dict):
    """Recipes by output storage: ``id(storage) -> (_Key, Recipe)``, for the recorders of all
    threads. A storage's death queues its reference by a deque's C ``append``: no Python frame runs
    while autograd frees a graph, so a Ctrl-C cannot land in one and be lost as an "Exception
    ignored" (NOTE [ Interrupts and versions ] in engine/records.py). ``note`` and ``sweep`` drop
    the dead entries later; until then a lookup tells a dead one by its reference."""

    def __init__(self) -> None:
        super().__init__()
        self._dead: collections.deque = collections.deque()

    def note(self, storage, recipe: "Recipe") -> None:
        self.sweep()
        ref = _Key(storage, self._dead.append)
        ref.key = key = id(storage)
        self[key] = (ref, recipe)

    def sweep(self) -> None:
        """Drop the entries of storages freed since. Threads share the queue without a lock:
        each takes a reference by one atomic pop, and an empty queue (another thread took the
        last one since) ends the sweep; a pop is never guarded by a check of the length. A
        thread may drop an entry that another just noted at the same id: a lookup then finds
        no recipe, and that storage is moved instead of rebuilt."""
        dead = self._dead
        while True:
            try:
                ref = dead.popleft()
            except IndexError:
                return
            found = self.get(ref.key)
            if found is not None and found[0] is ref:    # not a new storage at the same id
                self.pop(ref.key, None)


def view_of(rebuilt: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """``saved``'s view of the storage, taken of ``rebuilt``'s storage instead."""
    return _view(rebuilt.untyped_storage(), saved.dtype, saved.storage_offset(), saved.shape,
                 saved.stride())


def census(forward: Callable[[], object], min_bytes: int = 0) -> dict:
    """What of the tensors one forward saves for backward could be rebuilt instead of moved.

    Runs ``forward()`` with saved-tensor hooks and a ``Recorder`` on, and returns
    ``{"saved_bytes", "rebuildable_bytes", "by_op": {op: bytes}, "saved": [(tensor, recipe or
    None)]}``; storages count once, those under ``min_bytes`` not at all. The tensors are kept
    in ``saved`` (``view_of`` checks a rebuild against them), so the caller frees them by
    dropping the result."""
    seen: Dict[int, object] = {}
    saved_storages: Dict[int, object] = {}
    order: List[tuple] = []
    by_op: Dict[str, int] = collections.defaultdict(int)
    recorder = Recorder()

    def is_saved(inp) -> bool:
        storage = inp.storage_ref()
        return storage is not None and saved_storages.get(id(storage)) is storage

    def pack(t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or not t.layout == torch.strided:
            return t
        storage = t.untyped_storage()
        if id(storage) in seen or storage.nbytes() < min_bytes:
            return t
        recipe = recorder.recipe_for(t)
        if recipe is not None and not recipe.inputs_saved(is_saved):
            recipe = None
        seen[id(storage)] = storage
        saved_storages[id(storage)] = storage
        order.append((t, recipe))
        if recipe is not None:
            by_op[recipe.name] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        out = forward()
    total = sum(t.untyped_storage().nbytes() for t, _ in order)
    rebuildable = sum(by_op.values())
    return {"saved_bytes": total, "rebuildable_bytes": rebuildable, "by_op": dict(by_op),
            "saved": order, "output": out}
