"""An optimizer step in parts, each holding a part of the state on the GPU (NOTE [ Optimizer
state on the host ], Rule 7, in movers/optimizer.py)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from .. import params

__all__ = ["Parts", "closure_of", "may_cut", "run_closure", "state_to_come", "with_closure"]

# torch.optim classes whose update of a parameter reads only that parameter, its gradient and
# its own state, so that a step in parts does each parameter's arithmetic as the whole step
# does; with the copies of a parameter its state holds, by the group's settings.
_PER_PARAMETER: Dict[type, Callable[[dict], int]] = {
    torch.optim.SGD: lambda group: 1 if group.get("momentum") else 0,
    torch.optim.Adam: lambda group: 3 if group.get("amsgrad") else 2,
    torch.optim.AdamW: lambda group: 3 if group.get("amsgrad") else 2,
    torch.optim.Adagrad: lambda group: 1,
    torch.optim.RMSprop: lambda group: (1 + bool(group.get("momentum"))
                                        + bool(group.get("centered"))),
    torch.optim.Adamax: lambda group: 2,
    torch.optim.NAdam: lambda group: 2,
    torch.optim.RAdam: lambda group: 2,
    torch.optim.Adadelta: lambda group: 2,
}


def may_cut(optimizer) -> bool:
    """Whether ``optimizer``'s step may run in parts (Rule 7)."""
    return (type(optimizer) in _PER_PARAMETER and _only_lmsrt_hooks(optimizer)
            and getattr(type(optimizer).step, "__wrapped__", None) is not None)


def state_to_come(optimizer) -> Dict[int, int]:
    """The bytes of state the first step of ``optimizer`` (one ``may_cut`` allows) will make,
    by id of the parameters that have a gradient."""
    copies = _PER_PARAMETER[type(optimizer)]
    return {id(p): copies(group) * p.numel() * p.element_size()
            for group in optimizer.param_groups for p in group["params"] if p.grad is not None}


def closure_of(args: tuple, kwargs: dict):
    """The closure a step's (args, kwargs) pass (args[0] is the optimizer), or None."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


def run_closure(args: tuple, kwargs: dict) -> tuple:
    """Run the step's closure now, as the step would (grad on), and give the step's (args,
    kwargs) with one that returns what it returned."""
    closure = closure_of(args, kwargs)
    if closure is None:
        return args, kwargs
    with torch.enable_grad():
        ran = _Ran(closure())
    return with_closure(args, kwargs, ran)


class _Ran:
    """A closure that already ran: gives what it gave."""

    def __init__(self, loss):
        self.loss = loss

    def __call__(self):
        return self.loss


class Parts:
    """One step's parts: per part, the parameters of each group in it (``parts[i][g]``).
    ``index`` is the part running; ``ahead`` the event of the next part's copies in, if under
    way; ``written`` the events of the parts' write-backs.

    Example::

        args, kwargs = run_closure(args, kwargs)            # in the step's pre-hook
        parts = Parts.plan(optimizer, state_bytes, part_bytes=1 << 30)   # None: one part
        if parts is not None:
            parts.begin(optimizer)                          # the groups emptied
        ...
        parts.run(optimizer, args, kwargs, between)         # in the post-hook
        parts.end(optimizer)                                # the groups whole
    """

    def __init__(self, parts: List[List[list]]):
        self.parts = parts
        self.index = -1                     # none yet: the groups are empty
        self.whole: List[list] = []         # each group's own parameter list
        self.ahead = None
        self.written: list = []             # the write-back event of each part that ran
        self.foreach: list = []             # each group's own foreach setting
        self.largest = 0                    # bytes of state of the largest part
        self.depth = 2                      # a part's copies in wait for the write-back this
                                            # many parts before (three held; 1: two; 0: none
                                            # ahead, one held)

    @classmethod
    def plan(cls, optimizer, per: Dict[int, int], part_bytes: int) -> Optional["Parts"]:
        """Parts of about ``part_bytes`` of state each (``per``: bytes by id of parameter), in
        the groups' order; None where one part holds it all."""
        groups = optimizer.param_groups
        if any(p.grad is not None and p.grad.is_sparse for g in groups for p in g["params"]):
            return None                 # (Adagrad takes another path per device group then)
        parts, part, size = [], [[] for _ in groups], 0
        for g, group in enumerate(groups):
            for p in group["params"]:
                nbytes = per.get(id(p), 0)
                if size and size + nbytes > part_bytes:
                    parts.append(part)
                    part, size = [[] for _ in groups], 0
                part[g].append(p)
                size += nbytes
        parts.append(part)
        if len(parts) == 1:
            return None
        made = cls(parts)
        made.largest = max(sum(per.get(id(p), 0) for group in part for p in group)
                           for part in parts)
        return made

    def begin(self, optimizer) -> None:
        """In the step's pre-hook, after the closure ran with the groups whole (``run_closure``):
        make the rebuilds that read the parameters (params.py, Rule 1: the pre-hook that makes
        them may come after this one), and empty the groups, so that the step's own body does
        nothing: the parts all run in the post-hook (``run``), where a part that raises leaves
        the groups whole."""
        params.before_step(optimizer)
        groups = optimizer.param_groups
        self.whole = [group["params"] for group in groups]
        # torch chooses foreach or a loop per group from the parameters it steps: a part
        # could choose otherwise than its group (whose rounding may differ), so the group's
        # choice is made once, from the whole group, and held for the parts.
        self.foreach = [group.get("foreach", _ABSENT) for group in groups]
        for group in groups:
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = _foreach_of(optimizer, group)
        self.narrow(optimizer)

    def narrow(self, optimizer) -> None:
        """Each group down to its parameters in the part running (none before the first)."""
        parts = self.parts[self.index] if self.index >= 0 else [[] for _ in self.whole]
        for group, part in zip(optimizer.param_groups, parts):
            group["params"] = part

    def paced_by(self, before):
        """What the copies in of the part after the one running wait for: the write-back of
        the part ``depth`` before the one running (its blocks are let go as it lands, so that
        about three parts are held at depth 2: one going out, one running, one coming in; two at
        depth 1), else ``before``, the last write-back before the step."""
        depth = self.depth
        return self.written[-depth] if depth and len(self.written) >= depth else before

    def following(self) -> list:
        """The parameters of the part after the one running (none after the last)."""
        if self.index + 1 >= len(self.parts):
            return []
        return [p for group in self.parts[self.index + 1] for p in group]

    def run(self, optimizer, args: tuple, kwargs: dict, between: Callable[[], None]) -> None:
        """In the step's post-hook (the step's own body ran on empty groups): every part, each
        as the step's own body (no hooks: they ran once, around the whole), ``between()``
        before each. Whatever raises here, the post-hook's caller makes the groups whole."""
        body = type(optimizer).step.__wrapped__
        args, kwargs = with_closure(args, kwargs, None)
        for self.index in range(len(self.parts)):
            between()
            body(*args, **kwargs)

    def end(self, optimizer) -> None:
        """The groups whole again, each with its own ``foreach``."""
        for group, whole, foreach in zip(optimizer.param_groups, self.whole, self.foreach):
            group["params"] = whole
            if foreach is _ABSENT:
                group.pop("foreach", None)
            else:
                group["foreach"] = foreach


_ABSENT = object()


def _foreach_of(optimizer, group: dict) -> bool:
    """What torch's step would choose for ``group`` as a whole (``foreach=None``): the foreach
    kernels where every parameter with a gradient suits them; Adam's loop where its learning
    rate is a tensor and it is not capturable (as ``torch.optim.adam.adam`` switches)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    if (isinstance(optimizer, torch.optim.Adam) and torch.is_tensor(group.get("lr"))
            and not group.get("capturable")):
        return False
    stepped = [p for p in group["params"] if p.grad is not None]
    return _default_to_fused_or_foreach(stepped, group.get("differentiable", False),
                                        use_fused=False)[1]


def with_closure(args: tuple, kwargs: dict, closure) -> tuple:
    """The step's (args, kwargs) with ``closure`` in place of the one they pass."""
    if len(args) > 1:
        return (args[0], closure, *args[2:]), kwargs
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return args, kwargs


def _only_lmsrt_hooks(optimizer) -> bool:
    """Whether every step hook of ``optimizer``, global or its own, is lmsrt's: another's would
    see one part, not the step."""
    from torch.optim import optimizer as torch_optimizer
    hooks = [*getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
             *getattr(torch_optimizer, "_global_optimizer_post_hooks", {}).values()]
    return (all(getattr(h, "__module__", "").startswith("lmsrt.") for h in hooks)
            and not getattr(optimizer, "_optimizer_step_pre_hooks", None)
            and not getattr(optimizer, "_optimizer_step_post_hooks", None))
