"""The repeated blocks of a model, found from its structure as its modules are first called
(regions.py, NOTE [ Recomputed regions ], Rule 1), and how they are named when said.

Example::

    finder = BlockFinder(refuse=lambda region, why: None)
    finder.scan(model)                 # at a module's first call under LMS (a global hook)
    finder.of.get(model.layers[0])     # -> Region("layers[0]", ...)
"""
from __future__ import annotations

import collections
import weakref
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .plan import UNCALLED
from .safety import BlockState

__all__ = ["BlockCall", "BlockFinder", "Region", "blocks_line", "repeated_children"]

_LEARNING = 2            # a region's first calls whose inputs are watched after it (Rule 5)


class Region:
    """A repeated block (or a stage of a Sequential), its measurements and the plan's choice."""

    __slots__ = ("name", "_modules", "chain", "usable", "why", "unfit", "nbytes", "seconds",
                 "chosen", "state", "param_ids", "copies", "learning", "__weakref__")

    def __init__(self, name: str, modules: tuple, chain: bool):
        # Weakly: the finder maps a region's first module to it in a WeakKeyDictionary, whose
        # entry would otherwise hold its own key, and with it the user's dropped model.
        self._modules = tuple(weakref.ref(m) for m in modules)
        self.name, self.chain = name, chain
        self.usable, self.why = True, ""
        self.unfit = ""             # why its rerun would not fit under the bound (NOTE [ Region
                                    # plan ], 2): never recomputed, though safe to
        self.nbytes, self.seconds = 0, 0.0
        self.chosen = False
        self.state: Optional[BlockState] = None    # what it reads besides its arguments
        self.param_ids: set = set()
        self.copies = False         # copy inputs its ops did not save (Rule 5)
        self.learning = _LEARNING   # calls left whose drop waits for the next region's entry

    @property
    def modules(self) -> tuple:
        """Its modules, in call order (a region is found again if its model is dropped)."""
        return tuple(ref() for ref in self._modules)


class BlockCall:
    """One call of a region, followed through the global module hooks: the module calls running
    inside it and, for a stage, how many of its modules have returned. A region's frame
    (frames.py) and the block account (account.py) follow calls alike."""

    __slots__ = ("region", "depth", "pos")

    def __init__(self, region: Region):
        self.region = region
        self.depth = 1          # module calls running inside it (its first one, at entry)
        self.pos = 0            # a stage's modules returned so far

    def follows(self, module: nn.Module) -> bool:
        """Whether ``module``, called outside its modules, is its stage's next one."""
        if not self.region.chain:
            return False
        modules = self.region.modules
        return self.pos < len(modules) and modules[self.pos] is module

    def enters(self, module: nn.Module) -> bool:
        """``module`` is called while the call is open: whether it is part of the call (inside
        it, or its stage's next module), counted so."""
        if self.depth or self.follows(module):
            self.depth += 1
            return True
        return False

    def returns(self) -> str:
        """A module returned while the call is open: "left" (one around a stage, which the walk
        left before its end), "inside" (one inside a module of the call), "next" (a module of
        a stage with more to come) or "done"."""
        if not self.depth:
            return "left"
        self.depth -= 1
        if self.depth:
            return "inside"
        self.pos += 1
        done = not self.region.chain or self.pos == len(self.region.modules)
        return "done" if done else "next"


def repeated_children(children: Sequence[nn.Module]) -> List[int]:
    """Rule 1: the indices of ``children`` (a container's, in order) whose class appears among
    them more than once: the repeated blocks, for regions (``BlockFinder``) and for compiling
    block by block (compiled.py) alike.

    Example::

        repeated_children(list(model.transformer.h))     # [0, 1, ..., 11]
    """
    counts = collections.Counter(type(c) for c in children)
    return [i for i, c in enumerate(children) if counts[type(c)] > 1]


class BlockFinder:
    """Finds regions (Rule 1) in the modules called under LMS; refuses through ``refuse`` those
    that never could be recomputed (Rule 6)."""

    def __init__(self, refuse: Callable[[Region, str], None]):
        self.refuse = refuse
        self.of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # first module ->
        self.scanned: "weakref.WeakSet" = weakref.WeakSet()
        self.scanned_children: "weakref.WeakSet" = weakref.WeakSet()   # of mixed Sequentials
        self.mixed: list = []           # (name, Sequential) of mixed classes, grouped after step 1
        self.out_bytes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # in the model
        self.kwargs_of: Optional[int] = None     # the id of the global pre-hook given kwargs
        self.found: List[Region] = []   # every region found, in order (its model may be gone)
        self._first: dict = {}          # id of a region's first module -> the region

    def note_output(self, module: nn.Module, output: torch.Tensor) -> None:
        """Step 1: the size of what a child of a mixed Sequential passes on."""
        if module in self.scanned_children:
            self.out_bytes[module] = output.untyped_storage().nbytes()

    def region_of(self, module: nn.Module) -> Optional[Region]:
        """The region ``module`` is the first module of, or None (at every module call: a plain
        dict's lookup, not the weak one's)."""
        region = self._first.get(id(module))
        return region if region is not None and region._modules[0]() is module else None

    def scan(self, module: nn.Module) -> None:
        self.scanned.add(module)
        containers = self._lists_in(module)
        if isinstance(module, nn.Sequential):
            containers.append(module)
        for container in containers:
            children = list(container)
            # Compiled blocks are torch.compile's partitioner's to recompute (Rule 1).
            repeated = [i for i in repeated_children(children)
                        if getattr(children[i], "_compiled_call_impl", None) is None]
            if not repeated or any(c in self.of for c in children):
                continue
            label = self.names.get(container) or type(container).__name__
            chain = (isinstance(container, nn.Sequential)
                     and type(container).forward is nn.Sequential.forward)
            if chain and len({type(c) for c in children}) > 1:
                self.mixed.append((label, container))
                self.scanned_children.update(children)
                continue
            for i in repeated:
                if children[i] not in self.of:     # one object listed twice: one region
                    self.add(Region(f"{label}[{i}]", (children[i],), False))

    def _lists_in(self, module: nn.Module) -> list:
        """The ModuleLists among ``module``'s children, and inside ModuleDicts among them, which
        are never called themselves (nanoGPT's ``transformer.h``); each child named as in the
        model, for what is said."""
        prefix, lists = self.names.get(module, ""), []
        for name, child in module.named_children():
            if child not in self.names:
                self.names[child] = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                lists.append(child)
            elif isinstance(child, nn.ModuleDict):
                lists += self._lists_in(child)
        return lists

    def add(self, region: Region) -> None:
        """Rule 1: ``region`` is found; refused at once where it never could be recomputed
        (Rule 6)."""
        first = region.modules[0]
        self.of[first] = region
        self._first[id(first)] = region
        self.found.append(region)
        if self.kwargs_of is not None and not region.chain:
            # torch calls a pre-hook with kwargs where the module names its id so.
            first._forward_pre_hooks_with_kwargs[self.kwargs_of] = True
        named = []
        for i, m in enumerate(region.modules):
            for n, sub in m.named_modules():
                named.append(((f"[{i}]" + (f".{n}" if n else "")) if region.chain else n, sub))
        region.state = BlockState(named)
        region.param_ids = region.state.ids()
        why = region.state.refusal()
        if why:
            self.refuse(region, why)

    def group(self) -> None:
        """Rule 1: stages of the Sequentials of mixed classes, from step 1's output sizes. A
        stage starts at a module listed once in it (a frame knows its stage by its first
        module); one whose first module is listed again is refused whole."""
        for label, container in self.mixed:
            children = list(container)
            listed = collections.Counter(id(c) for c in children)
            if listed[id(children[0])] > 1:
                region = Region(f"{label}[0:{len(children)}]", tuple(children), True)
                self.add(region)
                self.refuse(region, f"its first module ({type(children[0]).__name__}) is "
                            "listed in it more than once")
                continue
            lead = next((type(c) for c in children if any(True for _ in c.parameters())), None)
            starts = [0]
            for i, c in enumerate(children):
                if type(c) is not lead or i == 0:
                    continue
                j = i                  # earliest parameter-free child before it, after a stage
                while (j - 1 > starts[-1] and not any(True for _ in children[j - 1].parameters())):
                    j -= 1
                # Cut where the tensor passed on is smallest: after child p - 1, p in [j, i].
                sizes = {p: self.out_bytes.get(children[p - 1], 0) for p in range(j, i + 1)
                         if listed[id(children[p])] == 1}
                if sizes:
                    starts.append(min(sizes, key=lambda p: (sizes[p], -p)))
            for a, b in zip(starts, starts[1:] + [len(children)]):
                self.add(Region(f"{label}[{a}:{b}]", tuple(children[a:b]), True))
        self.mixed = []
        self.scanned_children = weakref.WeakSet()


def _spans(regions: List[Region]) -> str:
    """"model.layers[0..23], LlamaDecoderLayer; ..." of regions in forward order."""
    groups: dict = {}
    for r in regions:
        label, _, index = r.name.rpartition("[")
        kind = "stage" if r.chain else type(r.modules[0]).__name__
        groups.setdefault((label, kind), []).append(index.rstrip("]"))
    parts = []
    for (label, kind), indices in groups.items():
        nums = [int(i) for i in indices if i.isdigit()]
        if len(nums) == len(indices) > 2 and nums == list(range(nums[0], nums[0] + len(nums))):
            indices = [f"{nums[0]}..{nums[-1]}"]
        parts.append(f"{label}[{','.join(indices)}], {kind}")
    return "; ".join(parts)


def blocks_line(found: List[Region]) -> str:
    """What is said once: "lmsrt: 24 repeated blocks (model.layers[0..23], LlamaDecoderLayer);
    refused: ..." (NOTE [ Recomputed regions ], Rule 6)."""
    refused = [f"{r.name}: {r.why}" for r in found if not r.usable]
    unfit = [f"{r.name}: {r.unfit}" for r in found if r.usable and r.unfit not in ("", UNCALLED)]
    theirs = [r for r in found if r.usable and r.unfit == UNCALLED]
    return (f"lmsrt: {len(found)} repeated blocks ({_spans(found)})"
            + (f"; refused: {'; '.join(refused)}" if refused else "; none refused")
            + (f"; left to the script's own checkpointing: {_spans(theirs)}" if theirs else "")
            + (f"; too large to rerun: {'; '.join(unfit)}" if unfit else ""))
