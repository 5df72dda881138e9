"""Every change lmsrt makes to torch, in one place.

NOTE [ What lmsrt changes in torch ]
lmsrt changes these things of torch's, and nothing else. 1-6 are made once per process and stay,
each for the reason given; 7 to 9 are counted (``CountedPatch``): made when the first LMS that
needs them does, undone when the last of them closes or is collected.

  1. ``torch.autograd.graph.disable_saved_tensors_hooks`` is wrapped when lmsrt is imported
     (``step_aside_where_hooks_are_disabled``): inside it lmsrt's hooks leave the thread's
     stack and come back after it, so torch.func's transforms run under ``lmsrt run``. At
     import, and for good, because dynamo recognises the context manager by identity from a
     table it builds when it is first imported: undone, the one scripts call would be unknown to it.
  2. ``torch.cuda.reset_peak_memory_stats`` (and ``torch.cuda.memory``'s) is wrapped when the
     first CUDA device is made (``keep_peaks_across_resets``): a script's own reset folds the
     peak it clears into ``cleared_peaks`` first, so lmsrt's step peak covers the whole step.
     For good: a device outlives its LMS, and the wrap costs one read per reset, none per op.
  3. The caching allocator's expandable segments are turned on when a CUDA device is made,
     unless the user configured them (``prefer_expandable_segments``). For good: segments made
     under the setting keep it, turning it off again would not undo them.
  4. ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and ``torch.autograd.grad``
     are wrapped when lmsrt is imported (``annotate_backward_ooms``): an out-of-memory error
     raised in backward while an LMS holds saved tensors carries lmsrt's context, as one raised
     in forward does. The same exception goes on. A live engine's rebuild recorder also leaves
     the thread's mode stack as backward begins, until the next forward (``Rebuilds.sleep``).
     At import, and for good, so that a script's ``from torch.autograd import grad`` after
     ``import lmsrt`` takes the wrap; it costs one frame per backward, none per op.
  5. ``torch.cuda.graph``'s ``__enter__``/``__exit__`` are wrapped when lmsrt is imported
     (``step_aside_in_capture``): lmsrt's hooks leave the stack while a CUDA graph is captured
     (also for ``make_graphed_callables`` and inductor's CUDA graphs). For good: a capture begun
     under the wrap must end under it, or the hooks it took aside would never come back; it
     costs one call per capture.
  6. ``torch.compile`` and ``nn.Module.compile`` are wrapped when lmsrt is imported, so that a
     model compiled whole is compiled block by block while an LMS is live. For good, because
     scripts compile their model before they create their LMS. The wrap is the region mechanism
     itself, so it is made in recompute/compiled.py (``install``, which lms.py calls).
  7. ``torch.nn.Parameter.data`` becomes a property (``parameter_data_patch``) from the first
     rebuild that reads a parameter (params.py, NOTE [ Parameters a rebuild reads ], Rule 2).
     Counted: it slows every ``p.data`` of the process (a Python call each), so it goes with the
     last engine that needed it, and ``Parameter.data`` is torch's own descriptor again.
  8. A global optimizer step pre-hook (``optimizer_step_patch``) while an engine that rebuilds
     lives (params.py, Rule 1). Counted, as 7.
  9. A global optimizer step pre-hook and post-hook while an engine moves optimizer state
     (movers/optimizer.py, NOTE [ Optimizer state on the host ]). Counted, as 7. The state dict
     of an optimizer whose state it moves is replaced by one whose reads go through the mover:
     a change to the user's object, not to torch, undone when the LMS closes.

Held only while in use, and not counted here: the saved-tensor hooks lmsrt pushes (per ``with
lms:``), the global module forward hooks of region recompute (per LMS, recompute/regions.py)
and of the profiler (per profiled step, profiler/recorder.py).

Example::

    from lmsrt import torch_patches
    torch_patches.keep_peaks_across_resets()     # idempotent; 2 above
    hook = torch_patches.optimizer_step_patch(before_step)
    hook.add_user(engine)     # 8 above: made now, undone when the last user goes
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from typing import Callable, Dict, Optional

import torch

from .hook_stack import hooks_aside
from .say import say_once

__all__ = ["step_aside_where_hooks_are_disabled", "keep_peaks_across_resets", "cleared_peaks",
           "reset_peak", "prefer_expandable_segments", "annotate_backward_ooms",
           "step_aside_in_capture", "CountedPatch", "parameter_data_patch",
           "optimizer_step_patch"]


_torch_disable_hooks = None       # torch.autograd.graph.disable_saved_tensors_hooks, unwrapped


def step_aside_where_hooks_are_disabled() -> None:
    """Wrap ``torch.autograd.graph.disable_saved_tensors_hooks`` (once per process, when lmsrt is
    imported) so that lmsrt's hooks leave this thread's stack for the region and come back after
    it.

    torch.func's transforms (grad, vjp, jacrev, hessian, vmap of them) and other code that
    cannot work with saved-tensor hooks run inside that context manager, which raises as it is
    entered if any hooks are set: under ``lmsrt run`` an unmodified script using torch.func
    would fail. Tensors saved in the region stay on the GPU, as without LMS."""
    global _torch_disable_hooks
    if _torch_disable_hooks is not None:
        return
    _torch_disable_hooks = original = torch.autograd.graph.disable_saved_tensors_hooks

    @functools.wraps(original)
    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message: str):
        with hooks_aside() as aside:
            if aside:
                say_once("aside", "lmsrt: saved-tensor hooks are not allowed inside this "
                         "region (torch.func transforms such as grad, vjp, jacrev and hessian, "
                         "or torch.autograd.graph.disable_saved_tensors_hooks), so lmsrt steps "
                         "aside there: tensors saved inside stay on the GPU, as without LMS "
                         "(said once).", stacklevel=3)
            with original(error_message):
                yield

    torch.autograd.graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks


def _allocated_peak(index: int) -> int:
    return torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]["peak"]


# Peaks that a script's own torch.cuda.reset_peak_memory_stats() cleared since lmsrt last reset
# the counter, per device index. CUDA keeps one peak counter per device, and training loops often
# reset it to print a per-step peak: without this, lmsrt's step peak (and `lmsrt tune`'s GPU
# column) would cover only what follows the script's reset.
cleared_peaks: dict = {}
_torch_reset_peak = None


def keep_peaks_across_resets() -> None:
    """Wrap torch.cuda.reset_peak_memory_stats (once per process) so that it first folds the peak
    it is about to clear into ``cleared_peaks``; it then resets as before."""
    global _torch_reset_peak
    if _torch_reset_peak is not None:
        return
    _torch_reset_peak = original = torch.cuda.memory.reset_peak_memory_stats

    @functools.wraps(original)
    def reset_peak_memory_stats(device=None):
        try:
            index = torch.cuda._utils._get_device_index(device, optional=True)
            cleared_peaks[index] = max(cleared_peaks.get(index, 0), _allocated_peak(index))
        except Exception:       # noqa: BLE001 - never let bookkeeping break the script's call
            pass
        return original(device)

    torch.cuda.memory.reset_peak_memory_stats = reset_peak_memory_stats   # reset_max_... too
    torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats


def reset_peak(index: int) -> None:
    """Reset device ``index``'s peak counter for lmsrt itself: through torch's own reset, which
    folds nothing into ``cleared_peaks``, and forget the peaks a script cleared before."""
    (_torch_reset_peak or torch.cuda.memory.reset_peak_memory_stats)(index)
    cleared_peaks.pop(index, None)


def prefer_expandable_segments() -> bool:
    """Turn on the caching allocator's expandable segments unless the user configured them
    (``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` names ``expandable_segments``), and
    say whether they are on. Under LMS the GPU runs near its limit with blocks of every size
    coming and going; fixed segments then strand memory reserved but unallocated (measured: 0.75
    GiB of a 6.8 GiB cap on an LM head, enough to run out where the plan fit). The setting
    applies to segments made from here on; it is the allocator's own, numerics do not change."""
    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_ALLOC_CONF",
                                                           "PYTORCH_CUDA_ALLOC_CONF"))
    if "expandable_segments" in conf:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch._C, "_cuda_setAllocatorSettings", None))
    if setter is None:
        return False
    try:
        setter("expandable_segments:True")
    except Exception:       # noqa: BLE001 - a build without them keeps fixed segments
        return False
    return True


_torch_backward = None            # torch.autograd.backward and grad, unwrapped


def annotate_backward_ooms(engines) -> None:
    """Wrap ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and
    ``torch.autograd.grad`` (once per process, when lmsrt is imported) so that an out-of-memory
    error raised in backward while an LMS holds saved tensors carries lmsrt's context, as one
    raised in forward does: autograd's own allocations (a gradient, a kernel's workspace) fail
    there, not in lmsrt's code. ``engines``: the live swap engines (a weak set the caller keeps).
    The same exception goes on. Each engine's rebuild recorder also leaves this thread's mode
    stack as backward begins (``Rebuilds.sleep``), until the next forward."""
    global _torch_backward
    if _torch_backward is not None:
        return
    _torch_backward = (torch.autograd.backward, torch.autograd.grad)

    def wrap(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            for engine in list(engines):
                if not engine.closed and engine.rebuilds is not None:
                    engine.rebuilds.sleep()     # backward notes no recipes (recompute/rebuilds.py)
            try:
                return original(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                for engine in list(engines):
                    if not engine.closed and engine.step.step:
                        engine.annotate_oom(exc, "in backward")
                        break
                raise
        return call

    torch.autograd.backward, torch.autograd.grad = map(wrap, _torch_backward)


def step_aside_in_capture() -> None:
    """lmsrt's hooks leave the stack while ``torch.cuda.graph`` captures (also when it captures
    for ``make_graphed_callables`` or inductor's CUDA graphs)."""
    graph = getattr(getattr(torch.cuda, "graphs", None), "graph", None)
    if graph is None:
        return
    enter, leave = graph.__enter__, graph.__exit__

    @functools.wraps(enter)
    def __enter__(self):
        aside = hooks_aside()
        self._lmsrt_aside = aside
        aside.__enter__()
        try:
            return enter(self)
        except BaseException:
            self._lmsrt_aside = None
            aside.__exit__(None, None, None)
            raise

    @functools.wraps(leave)
    def __exit__(self, *exc):
        try:
            return leave(self, *exc)
        finally:
            aside: Optional[contextlib.AbstractContextManager] = getattr(self, "_lmsrt_aside", None)
            if aside is not None:
                self._lmsrt_aside = None
                aside.__exit__(None, None, None)

    graph.__enter__, graph.__exit__ = __enter__, __exit__


class CountedPatch:
    """A change to torch made while at least one user needs it (NOTE [ What lmsrt changes in
    torch ], 7 to 9). ``install()`` makes the change and returns what undoes it; it runs when
    the first user is added, and the undo when the last is removed or collected.

    Example::

        patch = CountedPatch("a hook", lambda: register_hook(...).remove)
        patch.add_user(engine)        # installed
        patch.remove_user(engine)     # the last user: undone
    """

    def __init__(self, name: str, install: Callable[[], Callable[[], None]]):
        self.name = name
        self._install = install
        self._undo: Optional[Callable[[], None]] = None
        self._users: Dict[int, weakref.finalize] = {}      # id(user) -> its finalizer
        # Reentrant: a finalizer may run from the collector while this thread holds the lock.
        self._lock = threading.RLock()

    @property
    def installed(self) -> bool:
        return self._undo is not None

    def add_user(self, user: object) -> None:
        """Count ``user`` (once, however often it is added) until ``remove_user(user)`` or until
        it is collected; install the change if it is not."""
        key = id(user)
        if key in self._users:
            return
        # Made before the lock is taken: a collection it sets off may remove another user.
        done = weakref.finalize(user, self._forget, key)
        done.atexit = False             # at exit torch goes too: nothing to undo
        with self._lock:
            self._users[key] = done
            if self._undo is None:
                self._undo = self._install()

    def remove_user(self, user: object) -> None:
        """No longer count ``user``; undo the change if it was the last."""
        done = self._users.get(id(user))
        if done is not None:
            done()                      # runs _forget once, and never again at collection

    def _forget(self, key: int) -> None:
        with self._lock:
            if self._users.pop(key, None) is None or self._users or self._undo is None:
                return
            undo, self._undo = self._undo, None
            undo()


def parameter_data_patch(before_change: Callable[[torch.Tensor], None]) -> CountedPatch:
    """``torch.nn.Parameter.data`` as a property that calls ``before_change(p)`` before ``p.data``
    is read or set (7 above); undone, ``Parameter.data`` is torch's own descriptor again."""
    data = torch._C.TensorBase.data                  # the tensor's own ``data`` descriptor

    def get(self):
        before_change(self)
        return data.__get__(self)

    def set(self, value) -> None:
        before_change(self)
        data.__set__(self, value)

    def install() -> Callable[[], None]:
        own = torch.nn.Parameter.__dict__.get("data")   # None: inherited from TensorBase
        torch.nn.Parameter.data = property(get, set, doc=data.__doc__)

        def undo() -> None:
            if own is None:
                del torch.nn.Parameter.data
            else:
                torch.nn.Parameter.data = own
        return undo

    return CountedPatch("torch.nn.Parameter.data", install)


def optimizer_step_patch(pre: Callable, post: Optional[Callable] = None) -> CountedPatch:
    """``pre`` as a global torch.optim step pre-hook, and ``post`` (if given) as a post-hook (8
    and 9 above)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def install() -> Callable[[], None]:
        handles = [register_optimizer_step_pre_hook(pre)]
        if post is not None:
            handles.append(register_optimizer_step_post_hook(post))

        def undo() -> None:
            for handle in handles:
                handle.remove()
        return undo

    return CountedPatch("torch.optim step hooks", install)


# At import, before torch.compile is used: dynamo recognises the context manager by identity,
# from a table it builds when it is first imported.
step_aside_where_hooks_are_disabled()
step_aside_in_capture()
