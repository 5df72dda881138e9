"""``lmsrt.LMS``: the context manager users put around their forward pass."""
from __future__ import annotations

import atexit
import functools
import threading
import weakref
from typing import Callable, Dict, Optional, Union

import torch

from . import arena, torch_patches
from .config import LMSConfig
from .device import resolve_device
from .engine import SwapEngine
from .options import OPTIONS, describe, spelled
from .recompute import compiled
from .recompute.regions import Regions
from .say import say_once
from .stats import StepStats
from .summary import format_summary

__all__ = ["LMS", "open_lms"]

_live_engines: "weakref.WeakSet[SwapEngine]" = weakref.WeakSet()
_made: "weakref.WeakSet[LMS]" = weakref.WeakSet()     # every LMS that swaps (open_lms)


def open_lms() -> list:
    """The LMS objects of this process that swap and are not closed (``lmsrt profile`` shows
    the blocks of a script's own)."""
    return [lms for lms in list(_made) if lms._engine is not None and not lms._engine.closed]
# Out-of-memory errors in backward carry lmsrt's context (torch_patches, NOTE, 4).
torch_patches.annotate_backward_ooms(_live_engines)


_advice: "weakref.WeakSet[compiled.CompileAdvice]" = weakref.WeakSet()


def _live_advice() -> Optional[compiled.CompileAdvice]:
    """The advice of an LMS that swaps and is open in this process, if any."""
    return next((a for a in list(_advice) if not a.engine.closed), None)


# Also at import: a model compiled whole is compiled block by block while an LMS is live
# (recompute/compiled.py; torch_patches, NOTE, 6).
compiled.install(_live_advice, functools.partial(say_once, stacklevel=3))


@atexit.register
def _close_all() -> None:
    # Pinned slabs go back before CUDA tears down (a static buffer that outlived the driver
    # crashed Caffe LMS at exit). atexit runs handlers last-registered first: this one is
    # registered when lmsrt is imported, after torch's import-time handlers, so it runs before
    # them; the CUDA context itself goes only after every handler. Graphs still alive keep their
    # handles, which close() leaves harmless.
    for engine in list(_live_engines):
        try:
            engine.close()
        except Exception:   # noqa: BLE001 - at exit, close what can be closed
            pass


class _Default:
    """``lms`` or ``lms_frac`` not given: its default (``OPTIONS``), or the config's."""

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()


class LMS:
    """Large model support: swap tensors saved for backward to pinned host memory and back.

    Create it once and reuse it every step (its pinned pools and its plan persist). Around the
    forward pass only; backward brings swapped tensors back, prefetched, by itself.

    Args (the settings of ``lmsrt.options.OPTIONS``; ``lms`` and ``lms_frac`` may be given by
    position, the others by keyword):
<settings>
        config: an ``LMSConfig`` instead of the settings above (``device`` may still be given,
            also as a ``torch.device``).

    Threads may share one LMS, each entering it, when they run forward on the same CUDA stream
    (``NOTE [ Stream lifetimes ]``, Rule 6). An out-of-memory error raised inside the block
    leaves it as the same ``torch.OutOfMemoryError``, with lmsrt's context added to its message.

    Example::

        lms = lmsrt.LMS(lms=1000, lms_frac=0.4)
        for x, y in loader:
            with lms:
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
        print(lms.summary())
    """

    def __init__(self, lms: float = _DEFAULT, lms_frac: Union[float, str] = _DEFAULT, *,
                 device=None, config: Optional[LMSConfig] = None, **settings):
        unknown = [name for name in settings if name not in OPTIONS]
        if unknown:
            raise TypeError(f"LMS() got an unexpected keyword argument {unknown[0]!r}; its "
                            f"settings are {', '.join(OPTIONS)}")
        if isinstance(device, torch.device):
            device = str(device)
        # lms and lms_frac not given take their defaults, and do not clash with a config.
        given = {k: v for k, v in dict(lms=lms, lms_frac=lms_frac).items() if v is not _DEFAULT}
        given.update(settings)
        if config is None:
            spec = device if device is None or isinstance(device, str) else None
            config = LMSConfig(device=spec, **given)
        elif not isinstance(config, LMSConfig):
            raise TypeError(f"config must be an lmsrt.LMSConfig, got {type(config).__name__}; "
                            "build one with lmsrt.LMSConfig(lms=..., lms_frac=...)")
        else:
            clash = list(given)
            if clash:
                raise TypeError(f"pass either config or {', '.join(clash)}, not both: put "
                                f"them in the config, e.g. "
                                f"dataclasses.replace(config, {clash[0]}=...)")
        self.config = config
        self._device = resolve_device(device if device is not None else config.device)
        self._engine: Optional[SwapEngine] = None
        self._hooks = None
        self._regions: Optional[Regions] = None
        self._compile_advice: Optional[compiled.CompileAdvice] = None
        # Per thread that entered it: (hooks pushed?, its recorder or None). A dict, not a
        # threading.local: a block left inside backward may be left from autograd's thread.
        self._active: Dict[int, tuple] = {}
        if self._device is None:
            if config.enabled:
                # Once per process: a CPU-only run that builds an LMS per model or per epoch
                # needs one line.
                say_once("no-gpu", "lmsrt: no CUDA device is available, so LMS does nothing; "
                         "run on a GPU machine, or simulate one on the CPU: device='sim' (under "
                         f"lmsrt run: {spelled('device', 'sim')}).", stacklevel=2, warn=True)
        elif config.enabled:
            if not arena.NATIVE:
                say_once("native", f"lmsrt: the native allocator is not in use "
                         f"({arena.native_error}); the pure-Python one gives the same results "
                         "with slower bookkeeping. Reinstall with a C++ compiler present to "
                         "build it.", stacklevel=2)
            self._engine = SwapEngine(config, self._device)
            _live_engines.add(self._engine)
            _made.add(self)
            # When and how blocks of a model compiled whole are compiled (recompute/compiled.py).
            self._compile_advice = compiled.CompileAdvice(
                self._engine, functools.partial(say_once, stacklevel=4))
            _advice.add(self._compile_advice)
            # C++ hooks where the copy path is built (the engine holds them weakly).
            self._hooks = self._engine.native_hooks()
            # Repeated blocks recomputed in backward where that beats moving them; with recompute
            # off, found only, to say what each one's saved tensors became (stats()["blocks"]).
            self._regions = Regions(self._engine, self._hooks or self._engine, config.recompute)

    @classmethod
    def from_env(cls, **overrides) -> "LMS":
        """An LMS configured from ``LMSRT_*`` environment variables (as ``lmsrt run`` sets them).

        Example::

            lms = lmsrt.LMS.from_env()    # LMSRT_LMS=1000 LMSRT_LMS_FRAC=0.4 python train.py
        """
        return cls(config=LMSConfig.from_env(**overrides))

    @property
    def enabled(self) -> bool:
        """True when this LMS swaps (a device is there and ``lms > 0``)."""
        return self._engine is not None

    @property
    def copy_path(self) -> str:
        """``"native"`` when swaps go through lmsrt's C++ copy path, else ``"python"``."""
        return "native" if self._engine is not None and self._device.copy_path else "python"

    def add_step_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(step)`` as each step begins, with the step's number (1, 2, ...), before
        anything of that step is held. An exception it raises leaves through the ``with`` entry
        or the saved-tensor hook that began the step (``lmsrt run`` under ``LMSRT_MAX_STEPS`` ends a
        script with ``SystemExit`` this way). Nothing is called when the LMS does not swap.

        Example::

            starts = []
            lms.add_step_listener(lambda step: starts.append(time.perf_counter()))
        """
        if self._engine is not None:
            self._engine.step_listeners.append(listener)

    def __enter__(self) -> "LMS":
        thread = threading.get_ident()
        if thread in self._active:
            raise RuntimeError("this LMS is already active on this thread; `with lms:` blocks "
                               "cannot be nested. Use one block around the whole forward pass.")
        if self._engine is None:
            self._active[thread] = (False, None)
            return self
        engine = self._engine
        if engine.closed:
            raise RuntimeError("this LMS was closed; create a new lmsrt.LMS to keep swapping.")
        if compiled.capturing():
            # Copies and event waits would invalidate the capture (recompute/compiled.py).
            say_once("capture", "lmsrt: LMS entered while a CUDA graph is being captured steps "
                     "aside: tensors saved in the captured region stay on the GPU, in the "
                     "graph's pool (said once). Enter LMS outside the capture to swap.",
                     stacklevel=3)
            self._active[thread] = (False, None)
            return self
        self._active[thread] = (True, engine.enter())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        thread = threading.get_ident()
        in_backward = torch._C._current_graph_task_id() != -1
        active = self._active.pop(thread, None)
        if active is None and in_backward and len(self._active) == 1:
            # Left inside a backward that runs on autograd's device thread: the block is the
            # one thread that entered it, whose stacks only that thread can pop.
            thread, active = self._active.popitem()
        engine = self._engine
        if active is None:
            if engine is not None and not in_backward:
                engine.exit_again(thread)       # an exit to match the one left in backward
            return
        pushed, recorder = active
        if pushed and self._regions is not None and thread == threading.get_ident():
            self._regions.leave()               # no region frame outlives the block
        if pushed:
            engine.exit(recorder, exc, thread)

    def stats(self) -> Dict[str, object]:
        """Counters of the last step and of the whole run, as a dict (bytes, counts, ms).

        ``last_step`` is the step in flight (once its backward is over, the last one run),
        ``total`` the sums over the run, ``history`` the last steps. ``regions`` is the region
        plan (None with ``recompute=False``). ``blocks`` is that step per block, a dict each, in
        forward order, then the tensors saved outside any block (``"outside blocks"``):
        ``block`` (its name, ``"model.layers[3]"``), ``kept_bytes`` (stayed on the GPU),
        ``moved_bytes`` (swapped to host memory), ``rebuilt_bytes`` (rebuilt from a recipe),
        ``rerun_bytes`` (dropped, the block rerun in backward), ``rerun_ms`` (those reruns' GPU
        time, None where none was read). Each column's sum is the step's: ``kept_bytes +
        live_bytes``, ``out_bytes``, ``recipe_bytes``, ``recomputed_bytes``
        (lmsrt/recompute/account.py, NOTE [ Block account ]). Empty where LMS is off.

        Example::

            for row in lms.stats()["blocks"]:
                print(row["block"], row["moved_bytes"], row["rerun_bytes"])
        """
        if self._regions is not None:
            self._regions.read_times()          # recomputes finished since: into their step
        step = self._engine.current_step() if self._engine else StepStats()
        totals = self._engine.run_stats.totals(step) if self._engine else {}
        return {
            "enabled": self.enabled,
            "off_reason": None if self.enabled else (
                "no CUDA device" if self._device is None else "lms <= 0"),
            "device": getattr(self._device, "name", None),
            "config": self.config.as_dict(),
            "allocator": arena.native_status(),
            "copy_path": self.copy_path,
            "mark_bytes": self._engine.mark if self._engine else 0,
            "limit_bytes": self._engine.limit if self._engine else 0,
            # What the last run of this command used, pinned as this LMS was created (cache.py):
            # the pins started, less any that failed, not what the record asked for.
            "pinned_ahead_bytes": self._engine.host.pinned_ahead if self._engine else 0,
            "last_step": step.as_dict(),
            "total": totals or {k: v for k, v in StepStats().as_dict().items() if k != "mode"}
            | {"steps": 0},
            "rebuild_refused": self._engine.rebuilds.refusals()
            if self._engine and self._engine.rebuilds else {},
            "history": [s.as_dict() for s in self._engine.run_stats.history]
            if self._engine else [],
            "regions": self._regions.stats() if self.config.recompute and self._regions else None,
            "blocks": self._regions.blocks() if self._regions else [],
            "compiled": self._compile_advice.stats() if self._compile_advice else None,
        }

    def summary(self, full: bool = True) -> str:
        """The headline (GPU peak against the limit, what a step swapped, rebuilt and
        recomputed, what lmsrt changed) and, with ``full``, the table of every counter
        (docs/run.md explains each). One line when LMS is off."""
        return format_summary(self.stats(), full=full)

    def close(self) -> None:
        """Finish copies in flight and give back pinned memory; the LMS cannot be used after."""
        if self._regions is not None:
            self._regions.close()
        if self._engine is not None:
            self._engine.close()


LMS.__doc__ = LMS.__doc__.replace("<settings>", describe(indent=8))
