"""How lmsrt speaks: through the ``lmsrt`` logger, each note at most once.

lmsrt's notes (the host budget was reached, a copy failed, the allocator retried, ...) are log
records of the logger ``lmsrt`` or one of its children (``lmsrt.engine``), at level WARNING. As a
library should, lmsrt gives that logger only a ``NullHandler``: a script's own logging set-up
decides where they go (``logging.basicConfig()`` prints them; ``logging.getLogger("lmsrt")
.setLevel(logging.ERROR)`` silences them). ``lmsrt run`` adds one plain stderr handler
(``install_stderr_handler``) that prints each as one ``lmsrt: ...`` line, and steps aside once
the script configures the root logger, so that nothing prints twice.

What a library user must act on (``LMS()`` without a GPU does nothing) is a ``RuntimeWarning``
as well: ``say_once(..., warn=True)``.

Example::

    from lmsrt.say import say_once
    say_once("no-gpu", "lmsrt: no CUDA device ...")          # once per process
    say_once("d2h", "lmsrt: copying ... failed", given=seen)  # once per set ``seen``
"""
from __future__ import annotations

import logging
import sys
import warnings
from typing import Optional, Set

__all__ = ["say_once", "say", "logger", "install_stderr_handler", "PREFIX"]

PREFIX = "lmsrt: "
logger = logging.getLogger("lmsrt")
logger.addHandler(logging.NullHandler())

_said: Set[str] = set()         # keys said once per process


def say(message: str, *, level: int = logging.WARNING, name: str = "lmsrt") -> None:
    """Log ``message`` (its leading ``"lmsrt: "`` dropped: the handler writes it) to the logger
    ``name``, a child of ``lmsrt``."""
    text = message[len(PREFIX):] if message.startswith(PREFIX) else message
    logging.getLogger(name).log(level, text)


def say_once(key: str, message: str, *, given: Optional[Set[str]] = None,
             stacklevel: int = 1, warn: bool = False, name: str = "lmsrt") -> bool:
    """Log ``message`` (a WARNING of the logger ``name``) unless a message of ``key`` was given
    before: in ``given`` (a set its owner keeps, e.g. one per engine), else in this process.
    ``warn``: also a ``RuntimeWarning`` (``stacklevel`` as for ``warnings.warn``, counted from
    the caller), for what a library user must act on. Returns whether it said it."""
    said = _said if given is None else given
    if key in said:
        return False
    said.add(key)
    if warn:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    else:
        say(message, name=name)
    return True


class _StderrHandler(logging.StreamHandler):
    """One ``lmsrt: ...`` line on the stderr of the moment (a test or a script may replace
    ``sys.stderr``); silent while the root logger has handlers, which then get the record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(PREFIX + "%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logger.propagate and logging.getLogger().handlers:
            return
        self.stream = sys.stderr
        super().emit(record)


def install_stderr_handler() -> logging.Handler:
    """Print lmsrt's notes on stderr, one ``lmsrt: ...`` line each (``lmsrt run`` does this);
    returns the handler, to ``logger.removeHandler`` later. Installed once per process."""
    for handler in logger.handlers:
        if isinstance(handler, _StderrHandler):
            return handler
    handler = _StderrHandler()
    logger.addHandler(handler)
    return handler
