"""This thread's stack of saved-tensor hooks, as lmsrt sees it: which pair on top is lmsrt's.

Kept apart from the engine so that what changes torch (torch_patches.py) can step lmsrt's hooks
aside without importing the engine.

Example::

    from lmsrt.hook_stack import pop_own_hooks
    pair = pop_own_hooks()          # lmsrt's innermost pair, popped; None if it is not on top
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["innermost_is", "pop_own_hooks", "remove_own_hooks", "hooks_aside"]


def innermost_is(owner) -> bool:
    """Whether this thread's innermost saved-tensor hooks are ``owner``'s (an engine, or its C++
    hooks)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__self__", None) is owner


def pop_own_hooks(engine=None):
    """Pop this thread's innermost saved-tensor hooks if they are ``engine``'s (any lmsrt
    engine's when None); return the pair popped, or None if they are someone else's. An engine
    is known by its class attribute ``owns_hooks``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = None if top is None else getattr(top[0], "__self__", None)
    owner = getattr(owner, "engine", owner)         # C++ hooks (native_hooks) name theirs
    if owner is engine if engine is not None else getattr(owner, "owns_hooks", False) is True:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        return top
    return None


def remove_own_hooks(engine) -> None:
    """Take ``engine``'s pair off this thread's saved-tensor hook stack, also from under pairs
    pushed over it inside the block and left there (they stay, in their order): an LMS never
    leaves its hooks behind its exit."""
    over = []
    try:
        while pop_own_hooks(engine) is None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is None:
                return
            torch._C._autograd._pop_saved_tensors_default_hooks()
            over.append(top)
    finally:
        for pack, unpack in reversed(over):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


@contextlib.contextmanager
def hooks_aside():
    """Take lmsrt's saved-tensor hooks off this thread's stack for the block, and put them back
    after it; yields the pairs taken (none when lmsrt's are not on top)."""
    aside = []
    try:
        while (pair := pop_own_hooks()) is not None:
            aside.append(pair)
        yield aside
    finally:
        for pack, unpack in reversed(aside):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
