"""Compiled models and CUDA graphs under lmsrt: a region per block, and stepping aside in capture.

Saved-tensor hooks see a ``torch.compile``'d region's saved tensors all at once, after its
forward, and give them back all at once when its backward starts: swapping lowers GPU memory only
between compiled regions (engine.py warns of it). A model compiled whole is one region, so lmsrt
could not help it at all. While an LMS is live, a model compiled whole (``torch.compile(model)``
or ``model.compile()``) is compiled block by block instead, as torch's "regional compilation"
recipe does by hand: each repeated block (``repeated_blocks``) becomes a region of its own and the
glue between them runs eagerly, so lmsrt swaps between blocks. The blocks run eagerly while the
LMS learns its first step, and are compiled from the next, with the partitioner's recompute
budget set from what that step showed where memory is short (``CompileAdvice``). NOTE [ Regions
under LMS ] has the rules.

CUDA graph capture cannot run saved-tensor hooks that copy, record events or wait (the capture
is invalidated): lmsrt's hooks leave the stack while ``torch.cuda.graph`` captures, and tensors
saved there stay on the GPU, in the graph's pool, as without LMS.

Example::

    lms = lmsrt.LMS()
    model = torch.compile(model)      # under LMS: its blocks one by one (said once)
    with lms:
        loss = loss_fn(model(x), y)
    loss.backward()
"""
from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from typing import Callable, List, Optional

import torch
from torch import nn

from ..hook_stack import hooks_aside
from ..units import format_bytes
from .finder import repeated_children
from .plan import StepFigures, ignore_step, over_bound

__all__ = ["CompileAdvice", "capturing", "hooks_aside", "install", "made_regions",
           "repeated_blocks"]

# NOTE [ Regions under LMS ]
#   1. The choice is made at each call, not at compile time: a script may compile its model
#      before it creates its LMS. Once a call finds an LMS live, the model stays regional for
#      good (its blocks are compiled in place, and the whole-model graph would then trace through
#      them), and it says so once.
#   2. Blocks are the children of an nn.ModuleList or nn.Sequential whose class repeats there
#      (at least twice) and that have children of their own: transformer layers, residual stages.
#      Repeated leaves (two nn.Linear in a Sequential) are not blocks: compiling them one by one
#      would split the model into regions too small to fuse. Only the outermost such containers
#      count. A model without blocks is compiled whole, as asked.
#   3. Blocks are compiled with the caller's arguments (backend, fullgraph, dynamic, options),
#      except that CUDA graphs are left out (mode "reduce-overhead" becomes "default",
#      "max-autotune" becomes "max-autotune-no-cudagraphs"): memory inside a CUDA graph's pool is
#      the graph's, and lmsrt may not move it. Said once when it happens.
#   4. Identical blocks share one compiled graph (dynamo treats their parameters as inputs), so
#      compiling 24 layers costs about one layer's compile.
#      Where dynamo does not (torch < 2.5, inline_inbuilt_nn_modules off) it would compile every
#      block apart and give up after its recompile limit: the model stays whole, said once.
#   5. A block is compiled as ``block.compile()`` would (its ``_compiled_call_impl``, so the
#      model's tree and state_dict keys stay as they are), but through a copy of ``_run_block``
#      per block class, a function taking the block as an argument: dynamo does not compile a
#      frame of torch.nn's own (``nn.Sequential().compile()`` compiles nothing); one function for
#      the blocks of a class keeps Rule 4; and one per class, each its own code object named
#      after the class, gives each class dynamo's recompile limit (8 graphs per code object) and
#      names the class in dynamo's warnings. Blocks of one class that still pass the limit
#      (alike in class, unlike in what dynamo guards on) run eagerly, said once, naming the class.
#   6. The blocks run eagerly until the LMS has learnt a step: their saves are counted, and
#      the step that follows one whose blocks saved something and ran backward compiles them
#      and is learnt afresh (``SwapEngine.relearn``: what the model saves has changed). The
#      choice is made as that step begins (its step listener), or at its first block call
#      where a step begins only at its first save (one ``with`` around the loop, ``lmsrt
#      run``). regions.py leaves compiled blocks alone (its Rule 1). A model that runs no
#      backward under LMS (inference) keeps its blocks eager.
#   7. The budget (``torch._functorch.config.activation_memory_budget``: the share of what
#      the blocks save at torch's default that they may keep) is the policy's
#      (``compiled_budget``, region_plan.memory_budget), from the learnt step: its excess over
#      the bound with everything kept, the blocks' saves, the link's bandwidth, and no compute
#      to hide copies under (a compiled forward's time is not known before it is compiled, and
#      the learning step's is no measure of it: a budget too low costs recompute, ~10% of an
#      uncapped GPT-2 step at 0.3, one too high, copies that stall the step). Under 1.0 the
#      compiled blocks are called under ``config.patch``: the min-cut partitioner (inductor,
#      aot_eager, aot_eager_decomp_partition) reads it as it compiles, dynamo does not guard
#      on it (later calls reuse the graph, patched or not), and AOTAutograd's cache keys on it.
#      A lower budget set by the script stays. Said once, with why. With no excess (the model
#      fits, or the simulated device's copies cost nothing) nothing is patched.
#   8. A learnt step with nothing over the bound, everything kept, needs no swapping: the model
#      goes back to its whole-model graph (fused across the glue between blocks; measured on an
#      H100, GPT-2 medium uncapped took 0.124 s a step compiled block by block against 0.109 s
#      whole), for good, and says so once. A step that began eagerly finishes eagerly.

_CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}

_torch_compile = None           # torch.compile and nn.Module.compile, unwrapped
_module_compile = None
_regional_models = 0


def made_regions() -> bool:
    """True once a model compiled whole was compiled block by block (its one line said)."""
    return _regional_models > 0


def repeated_blocks(model: nn.Module) -> List[nn.Module]:
    """The blocks of ``model`` that lmsrt compiles one by one (NOTE [ Regions under LMS ], Rule 2),
    in the order of ``model.modules()``.

    Example::

        blocks = repeated_blocks(gpt)     # gpt.transformer.h's 12 Block modules
    """
    blocks: List[nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        found = [children[i] for i in repeated_children(children)
                 if next(children[i].children(), None) is not None]
        blocks += found
        inside.update(id(m) for c in found for m in c.modules())
    return blocks


def _block_arguments(kwargs: dict, say: Callable[[str, str], None]) -> dict:
    """The caller's compile arguments for one block: without CUDA graphs (Rule 3)."""
    kwargs = dict(kwargs)
    mode, options = kwargs.get("mode"), dict(kwargs.get("options") or {})
    if mode in _CUDA_GRAPH_MODES or options.get("triton.cudagraphs"):
        say("cudagraphs", f"lmsrt: torch.compile(mode={mode!r}) would capture CUDA graphs, "
            "whose memory lmsrt cannot move; under LMS the blocks are compiled without them "
            f"(mode={_CUDA_GRAPH_MODES.get(mode, mode)!r}). Leave LMS off (lms=0) to keep CUDA "
            "graphs (said once).")
        if mode in _CUDA_GRAPH_MODES:
            kwargs["mode"] = _CUDA_GRAPH_MODES[mode]
        if options:
            options["triton.cudagraphs"] = False
            kwargs["options"] = options
    return kwargs


def _run_block(block: nn.Module, *args, **kwargs):
    """One block's call, in a frame dynamo compiles (NOTE [ Regions under LMS ], Rule 5)."""
    return block._call_impl(*args, **kwargs)


def _block_runner(cls: type) -> Callable:
    """``_run_block`` as a function of its own for the blocks of class ``cls``: its own code
    object, named after the class, which dynamo keys its graphs and recompile limit on and names
    in its warnings (NOTE [ Regions under LMS ], Rule 5)."""
    code = _run_block.__code__
    names = dict(co_name=cls.__name__)
    if hasattr(code, "co_qualname"):            # Python 3.11 and later
        names["co_qualname"] = cls.__qualname__
    return types.FunctionType(code.replace(**names), _run_block.__globals__, cls.__name__)


def _graphs_of(code: types.CodeType) -> Optional[int]:
    """How many graphs dynamo holds for ``code`` (None: this torch does not tell)."""
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    return None if entries is None else len(entries(code))


class CompileAdvice:
    """What a live LMS tells the blocks of a model compiled whole: whether to compile them yet,
    and under which recompute budget (NOTE [ Regions under LMS ], Rules 6 and 7). One per LMS
    that swaps; the decision is the policy's, its effect ``_Regional``'s.

    Example::

        advice = CompileAdvice(engine, say_once)
        advice.ready, advice.budget          # (False, 1.0) until a step is learnt
    """

    def __init__(self, engine, say: Callable[[str, str], None]):
        # (Imported here: regions.py imports the engine, whose diagnostics.py imports this.)
        from .plan import SIM_BANDWIDTH
        self.engine, self.say = engine, say
        self.ready = False             # blocks are compiled from now on
        self.whole = False             # or, the step fitting, the model whole (Rule 8)
        self.budget = 1.0              # their activation_memory_budget (1.0: torch's default)
        self.figures: Optional[StepFigures] = None   # what the budget was chosen from
        self.blocks = 0                # bytes the blocks saved in step ``_step`` (eager)
        self._step = 0
        # The simulated device's copies take no step time (a test sets this to make them cost).
        self.bandwidth: Optional[float] = SIM_BANDWIDTH if engine.device.kind == "sim" else None
        listener = weakref.WeakMethod(self._begin_step)
        engine.step_listeners.append(lambda step: (listener() or ignore_step)(step))

    def compile_now(self) -> bool:
        """Asked at each eager block call: whether the blocks are compiled from this call on."""
        if not self.ready and self.blocks and self.engine.after_backward():
            self._choose()               # the next save begins the step after (Rule 6)
        return self.ready

    def measured(self, call: Callable, *args, **kwargs):
        """``call`` (a block's eager call), its saves counted into ``blocks``."""
        engine = self.engine
        step, before = engine.saved_so_far()
        out = call(*args, **kwargs)
        now, after = engine.saved_so_far()
        if now != self._step:            # a step began (inside this call, or before it)
            self._step, self.blocks = now, 0
        self.blocks += after - (before if now == step else 0)
        return out

    def stats(self) -> Optional[dict]:
        """For ``LMS.stats()["compiled"]``, once blocks were compiled under this LMS: their
        budget, what they saved in the step it was chosen from, and that step's figures."""
        if not self.ready:
            return None
        return dict(budget=self.budget, blocks_bytes=self.blocks, whole=self.whole,
                    figures=dataclasses.asdict(self.figures))

    def _begin_step(self, step: int) -> None:
        if not self.ready and self.blocks and self._step == step - 1:
            self._choose()

    def _choose(self) -> None:
        """Rule 7: the budget, from the step just learnt (the engine's step in flight)."""
        engine = self.engine
        saved, excess = over_bound(engine.current_step(), engine.mark)
        if self.bandwidth is None:
            from .plan import link_bandwidth
            self.bandwidth = link_bandwidth(engine.device)
        # Compiled blocks' saves are fused kernels' outputs: none is rebuilt.
        self.figures = StepFigures(excess, saved, 0, 0.0, 0.0, self.bandwidth)
        self.budget = engine.policy.compiled_budget(self.figures, self.blocks)
        self.ready, self.whole = True, excess <= 0
        engine.relearn()
        if self.whole:
            self.say("whole", f"lmsrt: step {self._step} fitted under the bound with every saved "
                     "tensor kept: the model compiled whole runs as compiled (its blocks one by "
                     "one would only lose fusion between them; said once).")
        if self.budget < 1.0:
            self.say("budget", f"lmsrt: step {self._step} would have passed the bound by "
                     f"{format_bytes(excess)} had it kept what it saved, of which the compiled "
                     f"blocks save {format_bytes(self.blocks)}: they are compiled with "
                     f"torch._functorch.config.activation_memory_budget={self.budget:g}, the "
                     "share of their saves they keep, so their backward recomputes the rest "
                     "rather than wait for copies (said once).")


class _Regional:
    """The forward of a model compiled whole: the whole-model graph while no LMS is live, the
    model run eagerly with its blocks one by one once one is (Rule 1): eager while the LMS
    learns a step, then compiled (Rule 6)."""

    def __init__(self, model: nn.Module, whole: Callable, eager: Callable, kwargs: dict,
                 advice: Callable[[], Optional[CompileAdvice]],
                 say: Callable[[str, str], None]):
        self.model, self.whole, self.eager = model, whole, eager
        self.kwargs, self.advice, self.say = kwargs, advice, say
        self.regional = False
        self.blocks: List[nn.Module] = []
        self.budget: Optional[float] = None    # once its blocks are compiled: under which

    def __call__(self, *args, **kwargs):
        advice = self.advice()
        if not self.regional and advice is not None:
            self.regional = self._split()
        elif self.regional and advice is not None and advice.whole:
            self._join()
        return (self.eager if self.regional else self.whole)(*args, **kwargs)

    def _join(self) -> None:
        """Back to the whole-model graph, for good (Rule 8)."""
        for block in self.blocks:
            block._compiled_call_impl = None
        self.blocks, self.regional = [], False
        self.advice = lambda: None

    def _split(self) -> bool:
        blocks = repeated_blocks(self.model)
        # (A torch without the option, as later ones will be, always inlines.)
        if blocks and not getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", True):
            self.say("one-by-one", f"lmsrt: this torch ({torch.__version__}) would compile "
                     "every block of a model apart (torch._dynamo.config.inline_inbuilt_nn_modules "
                     "is off) and stop compiling after a few, so under LMS a model compiled whole "
                     "stays one region, and swapping cannot lower its peak. Set that option to "
                     "True before the first step, or use torch 2.5 or later (said once).")
            blocks = []
        if not blocks:
            self.advice = lambda: None      # nothing to split: compiled whole, asked no more
            return False
        self.blocks = blocks
        for block in blocks:
            # Called eagerly, then compiled, through a frame of lmsrt's own (Rules 5, 6).
            block._compiled_call_impl = functools.partial(self._call_block, block)
        global _regional_models
        _regional_models += 1
        kinds = sorted({type(b).__name__ for b in blocks})
        self.say("regions", f"lmsrt: torch.compile({type(self.model).__name__}) under LMS "
                 f"compiles its {len(blocks)} {'/'.join(kinds)} blocks one by one, once lmsrt has "
                 "learnt a step (they run eagerly until then), and runs the rest eagerly, so "
                 "that saved tensors can be swapped between blocks (a compiled region hands them "
                 "over only after its forward; said once).")
        return True

    def _call_block(self, block: nn.Module, *args, **kwargs):
        advice = self.advice()
        if advice is not None and not advice.compile_now():
            return advice.measured(block._call_impl, *args, **kwargs)
        if advice is not None and advice.whole:
            return block._call_impl(*args, **kwargs)     # this step ends eagerly (Rule 8)
        self._compile(advice.budget if advice is not None else 1.0)
        return block._compiled_call_impl(*args, **kwargs)

    def _compile(self, budget: float) -> None:
        """Compile the blocks, a function per class (Rules 3-5), under ``budget`` (Rule 7)."""
        import torch._functorch.config as functorch_config  # loaded with torch.compile

        arguments = _block_arguments(self.kwargs, self.say)
        patch = (functorch_config.patch(activation_memory_budget=budget)
                 if budget < functorch_config.activation_memory_budget else None)
        self.budget = min(budget, functorch_config.activation_memory_budget)
        regions: dict = {}
        for block in self.blocks:
            cls = type(block)
            if cls not in regions:
                runner = _block_runner(cls)
                region = _torch_compile(runner, **arguments)
                regions[cls] = (patch(region) if patch is not None else region,
                                runner.__code__)
            # What block.compile() does, through a frame of lmsrt's own (Rule 5).
            block._compiled_call_impl = functools.partial(self._call_compiled, *regions[cls],
                                                          block)

    def _call_compiled(self, region: Callable, code: types.CodeType, block: nn.Module, *args,
                       **kwargs):
        """``block``'s compiled call; says once where dynamo ran it eagerly, past its recompile
        limit for the block's class (Rule 5)."""
        from torch._dynamo.utils import counters
        frames = counters["frames"]
        asked, compiled = frames["total"], frames["ok"]
        out = region(block, *args, **kwargs)
        if frames["total"] == asked or frames["ok"] != compiled:
            return out                       # a graph was reused, or a new one compiled
        config = torch._dynamo.config
        limit = getattr(config, "recompile_limit", None) or config.cache_size_limit
        graphs = _graphs_of(code)
        if graphs is not None and graphs >= limit:
            name = type(block).__qualname__
            self.say(f"eager-{type(block).__module__}.{name}", f"lmsrt: dynamo compiled "
                     f"{graphs} graphs for the {name} blocks, its recompile limit "
                     f"(torch._dynamo.config.recompile_limit={limit}), and runs the {name} "
                     "blocks that need another one eagerly (their saved tensors swap as an "
                     "eager model's do). Blocks of one class that differ in what dynamo guards "
                     "on (shapes, attributes, arguments) each need a graph: raise the limit, "
                     "or make them alike (said once).")
        return out


def install(advice: Callable[[], Optional[CompileAdvice]],
            say: Callable[[str, str], None]) -> None:
    """Wrap ``torch.compile`` and ``nn.Module.compile`` (once per process, when lmsrt is
    imported) so that a model compiled whole is compiled block by block while ``advice()``
    gives a live LMS's advice (None: none is live; torch_patches.py, NOTE [ What lmsrt changes
    in torch ], 6). ``say(key, message)`` warns once per key."""
    global _torch_compile, _module_compile
    if _torch_compile is not None:
        return
    if not hasattr(torch, "compile") or not hasattr(nn.Module, "compile"):
        _torch_compile = True       # a torch without torch.compile: nothing to wrap, ever
        return
    _torch_compile, _module_compile = torch.compile, nn.Module.compile

    @functools.wraps(_torch_compile)
    def compile(model=None, **kwargs):
        if model is None:               # used as @torch.compile(...): comes back with the model
            return lambda model: compile(model, **kwargs)
        compiled = _torch_compile(model, **kwargs)
        if isinstance(model, nn.Module) and compiled is not model and callable(
                getattr(compiled, "forward", None)):
            compiled.forward = _Regional(model, compiled.forward, model.__call__, kwargs, advice,
                                         say)
        return compiled

    @functools.wraps(_module_compile)
    def module_compile(self, **kwargs):
        _module_compile(self, **kwargs)
        self._compiled_call_impl = _Regional(self, self._compiled_call_impl, self._call_impl,
                                             kwargs, advice, say)

    torch.compile = compile
    nn.Module.compile = module_compile


def capturing() -> bool:
    """True while this thread's current CUDA stream captures a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
