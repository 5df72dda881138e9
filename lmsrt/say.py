"""Warnings that lmsrt gives at most once: one helper for all of them.

Example::

    from lmsrt.say import say_once
    say_once("no-gpu", "lmsrt: no CUDA device ...")          # once per process
    say_once("d2h", "lmsrt: copying ... failed", given=seen)  # once per set ``seen``
"""
from __future__ import annotations

import warnings
from typing import Optional, Set

__all__ = ["say_once"]

_said: Set[str] = set()         # keys said once per process


def say_once(key: str, message: str, *, given: Optional[Set[str]] = None,
             stacklevel: int = 1) -> bool:
    """Warn with ``message`` (a ``RuntimeWarning``) unless a warning of ``key`` was given
    before: in ``given`` (a set its owner keeps, e.g. one per engine), else in this process.
    ``stacklevel`` as for ``warnings.warn``, counted from the caller. Returns whether it
    warned."""
    said = _said if given is None else given
    if key in said:
        return False
    said.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    return True
