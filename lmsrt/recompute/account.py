"""What the saved tensors of each block became in the step in flight: kept on the GPU, moved to
host memory, rebuilt from a recipe, or dropped and recomputed by rerunning the block
(``LMS.stats()["blocks"]``; one per ``Regions``, which calls it from its module hooks).

Example::

    account = BlockAccount(engine, finder.region_of, hooks)
    account.pre(module); account.post(module)      # from the global module hooks
    account.rows()      # [{"block": "blocks[0]", "kept_bytes": ..., ...}, ..., outside blocks]

NOTE [ Block account ]
  1. A block's call covers the engine's forward points from its entry to its exit
     (``SwapEngine.save_point``); a block called inside it is part of it. Each storage is the
     call's that was open when it was first saved. What a recomputed call's frame hands the
     engine after its exit (what it keeps at its close, or at the next block's entry; copies
     of its inputs) is its block's too (``late``): later spans win over earlier ones.
  2. The engine counts the points it moved and rebuilt (``StepStats.count_out``,
     ``count_recipe``); the plan has the size of every point (``OffloadPlan.current``); kept is
     the rest. So each column's sum is the step's: ``out_bytes``, ``recipe_bytes``,
     ``kept_bytes + live_bytes`` (but for a moved storage that backward found alive: the step
     counts it moved and live, here it is moved), and ``recomputed_bytes`` (what dropped
     frames saved, ``Frame.nbytes``, counted as they drop).
  3. Only this step's: the spans and drops start afresh with each step (``restart``).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..hook_stack import innermost_is
from .finder import BlockCall

__all__ = ["BlockAccount", "OUTSIDE"]

OUTSIDE = "outside blocks"      # the row of what was saved outside any block


class _Call(BlockCall):
    """One call of a block, and its span of forward points."""

    __slots__ = ("start", "end")

    def __init__(self, region, start: int, end: Optional[int] = None):
        super().__init__(region)
        self.start, self.end = start, end


class BlockAccount:
    """Per block, what the step in flight did with its saved tensors (NOTE [ Block account ])."""

    def __init__(self, engine, region_of: Callable[[nn.Module], object], owner):
        self.engine = engine
        self.region_of = region_of      # a block's first module -> its Region, else None
        self.owner = owner              # whose saved-tensor hooks save into the engine
        self._local = threading.local()  # this thread's open call
        self.spans: List[_Call] = []    # this step's calls, and frames' late saves, in order
        self.dropped: Dict[object, int] = {}      # region -> bytes its frames dropped
        self.rerun_ms: Dict[object, float] = {}   # region -> GPU ms of its reruns, read so far

    def restart(self) -> None:
        """A step begins: a call still open goes on in it, from its first point."""
        call = getattr(self._local, "call", None)
        self.spans = []
        if call is not None:
            call.start = 0
            self.spans.append(call)
        self.dropped, self.rerun_ms = {}, {}

    # -- block calls (as regions.py's frames follow them: NOTE [ Recomputed regions ], Rule 3) --

    def pre(self, module: nn.Module) -> None:
        local = self._local
        call = getattr(local, "call", None)
        if call is not None:
            if call.enters(module):
                return
            self._end(call)             # a walk left the stage before its end
        region = self.region_of(module)
        if (region is None or not torch.is_grad_enabled()
                or torch._C._current_graph_task_id() != -1 or not innermost_is(self.owner)):
            return
        local.call = call = _Call(region, self.engine.save_point())
        self.spans.append(call)

    def post(self, module: nn.Module) -> None:
        call = getattr(self._local, "call", None)
        if call is not None and call.returns() in ("left", "done"):
            self._end(call)

    def _end(self, call: _Call) -> None:
        call.end = self.engine.save_point()
        self._local.call = None

    def late(self, region, start: int) -> None:
        """``region``'s frame handed the engine the storages from point ``start`` on, just now
        (NOTE [ Block account ], 1)."""
        end = self.engine.save_point()
        if end > start:
            self.spans.append(_Call(region, start, end))

    def drop(self, region, nbytes: int) -> None:
        """A call of ``region`` dropped ``nbytes``, to rerun in backward."""
        self.dropped[region] = self.dropped.get(region, 0) + nbytes

    def rerun(self, region, ms: float) -> None:
        self.rerun_ms[region] = self.rerun_ms.get(region, 0.0) + ms

    # -- the rows ------------------------------------------------------------------------------

    def rows(self, order: List[object]) -> List[Dict[str, object]]:
        """One dict a block that had a call or a drop this step, in ``order`` (regions in
        forward order) then as first called, and the row of what was saved outside blocks."""
        step = self.engine.current_step()       # (takes over what the C++ hooks counted)
        sizes = self.engine.plan.current
        owner: List[object] = [None] * len(sizes)
        for call in self.spans:
            end = len(sizes) if call.end is None else min(call.end, len(sizes))
            owner[call.start:end] = [call.region] * max(0, end - call.start)
        owned = set(owner)
        regions = list(dict.fromkeys([r for r in order if r in self.dropped or r in owned]
                                     + [c.region for c in self.spans] + list(self.dropped)))
        figures = {r: [0, 0, 0] for r in regions + [None]}      # saved, moved, rebuilt
        for point, nbytes in enumerate(sizes):
            figures[owner[point]][0] += nbytes
        for column, points in ((1, step.out_points), (2, step.recipe_points)):
            for point, nbytes in points:
                figures[owner[point] if point < len(owner) else None][column] += nbytes
        rows = []
        for region in regions + [None]:
            saved, moved, rebuilt = figures[region]
            ms = self.rerun_ms.get(region)
            rows.append(dict(block=OUTSIDE if region is None else region.name,
                             kept_bytes=saved - moved - rebuilt, moved_bytes=moved,
                             rebuilt_bytes=rebuilt, rerun_bytes=self.dropped.get(region, 0),
                             rerun_ms=None if ms is None else round(ms, 3)))
        return rows
