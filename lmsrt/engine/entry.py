"""Entering and leaving a ``with lms:`` block: the hooks pushed and popped, the rebuild recorder
entered and left, and hooks that an exit inside backward left behind."""
from __future__ import annotations

import threading

import torch

from ..hook_stack import remove_own_hooks

__all__ = ["EnterExit"]      # a room of SwapEngine (core.py)


class EnterExit:
    """Entering and leaving of a ``SwapEngine``: what ``LMS.__enter__``/``__exit__`` ask."""

    def enter(self):
        """A ``with lms:`` block begins on this thread: the step's forward begins, this engine's
        saved-tensor hooks (its C++ ones, where they live) go on the thread's stack, and the
        rebuild recorder is entered where recipes are noted. Returns the recorder entered (or
        None), for ``exit``.

        Example::

            recorder = engine.enter()
            try:
                loss = model(x)
            finally:
                engine.exit(recorder)
        """
        self.begin_forward()
        if self._stale_hooks:
            self._pop_stale_hooks(threading.get_ident())
        keeper = self._keeper and self._keeper()
        hooks = self if keeper is None else keeper
        torch._C._autograd._push_saved_tensors_default_hooks(hooks.pack, hooks.unpack)
        if self.rebuilds is not None and self.rebuilds.noting:
            # Records how cheap ops made their outputs (recipes.py, NOTE [ Rebuilt storages ]).
            return self.rebuilds.recorder().__enter__()
        return None

    def exit(self, recorder, exc: BaseException = None, thread: int = None) -> None:
        """The block that ``enter`` began on ``thread`` (this one when None) ends (``exc``: what
        it raised, if anything; an out-of-memory error gets lmsrt's context added to its
        message). Left from another thread (autograd's device thread, inside backward), the
        entering thread's hooks and recorder are taken off by that thread later."""
        here = threading.get_ident()
        thread = here if thread is None else thread
        if recorder is not None:
            self.rebuilds.leave(recorder, thread)
        if thread == here:
            remove_own_hooks(self)
        if torch._C._current_graph_task_id() != -1:
            # Left inside backward: autograd puts back the thread's hooks as they were when
            # backward started, this pair included, once backward ends. The next pack on that
            # thread outside backward pops it (or an extra exit, as torch's own hooks are left);
            # that one save is still handled as usual.
            self._stale_hooks.add(thread)
        self.end_forward()
        if isinstance(exc, torch.OutOfMemoryError):
            # The same exception goes on, with lmsrt's context added to its message.
            self.annotate_oom(exc, "in forward")

    def exit_again(self, thread: int) -> None:
        """An exit on ``thread`` with no block open there: one to match an exit inside
        backward, whose hooks backward put back; they come off now (torch's own hooks are
        left the same way)."""
        if thread in self._stale_hooks:
            self._pop_stale_hooks(thread)

    def _pop_stale_hooks(self, thread: int) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        self._stale_hooks.discard(thread)
        remove_own_hooks(self)
        if self.rebuilds is not None:
            self.rebuilds.pop_stale_recorder()

