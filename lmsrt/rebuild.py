"""Rebuilding cheap saved tensors in backward instead of moving them: recipes, and a census.

NOTE [ Recipes ]
Many tensors autograd saves are cheap, deterministic functions of other tensors that stay
available anyway: GELU's output (the input of the next Linear) from GELU's input, which GELU
saves itself; a LayerNorm's output from its input, which LayerNorm saves; under autocast, a
weight's bf16 copy from its fp32 parameter. Running the same kernel on the same inputs again in
backward costs one memory-bound kernel; moving the tensor costs two PCIe copies (DESIGN.md: the
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
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                         _get_current_dispatch_mode, _pop_mode)

from .options import spelled

__all__ = ["REBUILDABLE", "Recipe", "Recorder", "Rebuilds", "census", "view_of"]

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
                 "stride", "offset", "nbytes", "device", "held", "_signature", "__weakref__")

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
        self.held: Optional[tuple] = None    # its inputs' storages, while a check may want them
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

    def hold(self) -> None:
        """Keep the inputs' storages alive until ``let_go``: a check in forward reads them
        where the engine has already let them go (a GELU's input, copied out before the GELU's
        output is saved)."""
        self.held = tuple(i.storage_ref() for i in self.inputs
                          if i.parameter is None and not i.inplace)

    def let_go(self) -> None:
        """Stop holding the inputs, this recipe's and those of the recipes it reaches."""
        self.held = None
        for inp in self.inputs:
            if inp.recipe is not None and inp.recipe.held is not None:
                inp.recipe.let_go()

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
        with torch.no_grad(), _disable_current_modes(), torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
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
                 holding: Callable[[], bool] = lambda: False,
                 noting: Callable[[], bool] = lambda: True):
        super().__init__()
        self._recipes = RecipeTable() if recipes is None else recipes
        self._entry_of = entry_of
        self._holding = holding      # whether new recipes hold their inputs (``Recipe.hold``)
        self._noting = noting        # whether to note recipes at all (the step may rebuild)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code runs compiled, not op by op through this mode (which would make
        # it fall back to eager); its saved tensors are not rebuilt.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
        if self._holding():
            recipe.hold()
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
    threads. A storage's death queues its reference by a deque's C ``append``: no Python frame
    runs while autograd frees a graph, so a Ctrl-C cannot land in one and be lost as an
    "Exception ignored" (NOTE [ Interrupts and versions ] in engine.py). ``note`` and ``sweep``
    drop the dead entries later; until then a lookup tells a dead one by its reference."""

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


# A rebuild is worth it while it takes less GPU time than the two copies it saves (out in
# forward, back in backward): their bytes over the link each way (half the ~55 GB/s measured for
# pinned copies: a bound no listed op comes near; they are memory-bound, ~100x faster) and each
# copy's own cost beside its bytes (pack_overhead on an H200: a swapped tensor costs ~50 us more
# than one kept). The rebuild is timed by events around it: on an idle GPU that includes its
# launch, which for a small tensor is most of it.
_LINK_BYTES_PER_S = 25e9
_COPY_FIXED_S = 25e-6
# A rebuild's events also time whatever ran beside it: backward's kernels on the compute stream
# while it runs on a side stream, the learning step's copies. Measured on an H200 (an LM's gelu,
# 128 MiB): 18.9 ms in the first step of one run, fast enough to be rebuilt in another; refused
# on that one reading, the run moved 3 GiB more a step, 30% slower. So a signature is refused for
# speed only when the fastest of its first _SAMPLES timings is slower than its copies.
_SAMPLES = 3


class Rebuilds:
    """What a swap engine knows of rebuilding (NOTE [ Recipes ]): the recipe table its threads'
    recorders write, which signatures have been checked bit for bit, and the rebuilds' GPU time.

    A signature is trusted only after a rebuild of it matched the original bit for bit on this
    device. In forward, while the original and its inputs are still on the GPU and there is room
    for a second copy, the engine rebuilds and compares at once (``check_now``, one device sync
    per signature). Else it swaps the tensor as usual and, when backward brings it back,
    rebuilds it too and compares (``check``); those comparisons are read once, at the end of the
    step (``finish_step``). A mismatch, and that signature is never rebuilt again in this run;
    so too once the fastest of its first ``_SAMPLES`` rebuilds was slower than the two copies it
    saves."""

    def __init__(self, device, entry_of: Callable[[torch.Tensor], object]):
        self.device = device
        self.recipes = RecipeTable()
        self.entry_of = entry_of
        self.trusted: set = set()
        self.refused: Dict[tuple, str] = {}      # signature -> why it is not rebuilt
        self._checks: list = []                  # (recipe, differs?, start, end), this step
        self._timed_runs: list = []              # (signature, bytes, start, end): rebuilds
        self._fastest: Dict[tuple, list] = {}    # signature -> [fastest s, timings] (_SAMPLES)
        self._checked_now = 0                    # checks made in forward, this step
        self._mismatched: set = set()            # ops whose check did not match, this step
        self.holding = False                     # new recipes hold their inputs (the engine sets)
        self.noting = True                       # recorders note recipes (the engine sets)

    def recorder(self) -> Recorder:
        """A recorder for one thread, writing this table."""
        return Recorder(self.recipes, self.entry_of, lambda: self.holding, lambda: self.noting)

    def pop_stale_recorder(self) -> None:
        """Take off this thread's mode stack a recorder of this table that autograd put back:
        ``with lms:`` was left inside backward, which restores the thread's modes as they were
        when it began (the recorder's own exit already ran)."""
        top = _get_current_dispatch_mode()
        if isinstance(top, Recorder) and top._recipes is self.recipes:
            _pop_mode()

    def usable(self, t: torch.Tensor, available: Callable[[_Input], bool]) -> Optional[Recipe]:
        """The recipe of saved tensor ``t`` if there is one, not refused, whose inputs are all
        ``available``."""
        storage = t.untyped_storage()
        found = self.recipes.get(id(storage))
        if found is None or found[0]() is not storage:
            return None
        recipe = found[1]
        if not recipe.fits(t) or recipe.signature in self.refused:
            return None
        return recipe if recipe.inputs_saved(available) else None

    def let_go(self, storage=None) -> None:
        """Let the recipe of ``storage`` (every recipe, by default) stop holding its inputs."""
        if storage is not None:
            found = self.recipes.get(id(storage))
            if found is not None and found[1].held is not None:
                found[1].let_go()
            return
        self.recipes.sweep()
        for _, recipe in list(self.recipes.values()):
            if recipe.held is not None:
                recipe.let_go()

    def _timed(self, recipe: Recipe, resolve) -> tuple:
        """(output, start, end): ``recipe`` run between two timing events, its inputs brought
        back first (not the rebuild's time)."""
        args = recipe.arguments(resolve)
        start, end = self.device.new_event(timing=True), self.device.new_event(timing=True)
        start.record()
        out = recipe.run(args)
        end.record()
        return out, start, end

    def run(self, recipe: Recipe, resolve: Callable[[_Input], Optional[torch.Tensor]]):
        """Rebuild ``recipe``'s output (timed on the GPU)."""
        out, start, end = self._timed(recipe, resolve)
        self._timed_runs.append((recipe.signature, recipe.nbytes, start, end))
        return out

    def check(self, recipe: Recipe, original, resolve: Callable[[_Input], Optional[torch.Tensor]]
              ) -> None:
        """Rebuild ``recipe``'s output and queue a bitwise comparison with the ``original``
        storage on the GPU; read at the end of the step."""
        out, start, end = self._timed(recipe, resolve)
        differs = torch.ne(_words(out.untyped_storage()), _words(original)).any()
        self._checks.append((recipe, differs, start, end))

    def check_now(self, recipe: Recipe, original,
                  resolve: Callable[[_Input], Optional[torch.Tensor]]) -> None:
        """Rebuild ``recipe``'s output, compare it with the ``original`` storage and judge its
        signature at once (one device sync): in forward, where the original is still on the GPU
        and need not be copied out for a check in backward. Raises what the rebuild raises (an
        input not at hand): then nothing is judged."""
        out, start, end = self._timed(recipe, resolve)
        differs = bool(torch.ne(_words(out.untyped_storage()), _words(original)).any())
        del out
        self._judge(recipe, differs, start.elapsed_time(end) / 1e3)
        self._checked_now += 1

    def _judge(self, recipe: Recipe, differs: bool, took: float) -> None:
        """Trust or refuse ``recipe``'s signature by one check that took ``took`` seconds."""
        sig = recipe.signature
        if differs:
            self.refused[sig] = "did not rebuild bit for bit"
            self.trusted.discard(sig)
            self._mismatched.add(recipe.name)
            return
        if sig not in self.refused:
            self.trusted.add(sig)
            self._timed_once(sig, recipe.nbytes, took)

    def _timed_once(self, sig: tuple, nbytes: int, took: float) -> None:
        """One timing of a trusted signature's rebuild of ``nbytes``: refused once the fastest
        of its first ``_SAMPLES`` is slower than its copies (see _SAMPLES)."""
        fastest = self._fastest.setdefault(sig, [float("inf"), 0])
        if fastest[1] >= _SAMPLES or sig not in self.trusted:
            return
        fastest[0], fastest[1] = min(fastest[0], took), fastest[1] + 1
        copies = 2 * (_COPY_FIXED_S + nbytes / _LINK_BYTES_PER_S)
        if fastest[1] == _SAMPLES and fastest[0] > copies:
            self.refused[sig] = (f"rebuilt in {fastest[0] * 1e3:.3f} ms at best of {_SAMPLES}, "
                                 f"slower than its copies ({copies * 1e3:.3f} ms)")
            self.trusted.discard(sig)

    def finish_step(self) -> tuple:
        """Read this step's comparisons (one device sync when there were any) and the rebuilds'
        time; return (rebuild ms, checks made, names of the ops that did not match)."""
        checks, self._checks = self._checks, []
        made, self._checked_now = self._checked_now + len(checks), 0
        mismatched, self._mismatched = self._mismatched, set()
        if checks:
            self.device.synchronize()   # the comparisons ran on backward's streams
        ms, pending = 0.0, []
        for sig, nbytes, start, end in self._timed_runs:
            if end.query():
                took = start.elapsed_time(end)
                ms += took
                self._timed_once(sig, nbytes, took / 1e3)
            else:
                pending.append((sig, nbytes, start, end))
        self._timed_runs = pending
        if checks:
            differs = torch.stack([d for _, d, _, _ in checks]).cpu().tolist()
            for (recipe, _, start, end), bad in zip(checks, differs):
                self._judge(recipe, bad, start.elapsed_time(end) / 1e3)
            mismatched |= self._mismatched
            self._mismatched = set()
        return ms, made, sorted(mismatched)


    def refusals(self) -> Dict[str, str]:
        """Why each op is not rebuilt, by op name (a signature's first item is its op)."""
        return {sig[0].overloadpacket.__name__: why for sig, why in self.refused.items()}


def _words(storage) -> torch.Tensor:
    """``storage``'s bytes as the widest integers that tile them: comparing two storages then
    makes a mask of an eighth of their bytes, not of as many."""
    n = storage.nbytes()
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if n % size == 0:
            return _view(storage, dtype, 0, (n // size,), (1,))
    return _view(storage, torch.uint8, 0, (n,), (1,))


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
