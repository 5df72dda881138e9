"""Compiled models and CUDA graphs under lmsrt: a region per block, and stepping aside in capture.

Saved-tensor hooks see a ``torch.compile``'d region's saved tensors all at once, after its
forward, and give them back all at once when its backward starts: swapping lowers GPU memory only
between compiled regions (engine.py warns of it). A model compiled whole is one region, so lmsrt
could not help it at all. While an LMS is live, a model compiled whole (``torch.compile(model)``
or ``model.compile()``) is compiled block by block instead, as torch's "regional compilation"
recipe does by hand: each repeated block (``repeated_blocks``) becomes a region of its own and the
glue between them runs eagerly, so lmsrt swaps between blocks. NOTE [ Regions under LMS ] has
the rules.

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

import functools
from typing import Callable, List

import torch
from torch import nn

from .hook_stack import hooks_aside

__all__ = ["capturing", "hooks_aside", "install", "made_regions", "repeated_blocks"]

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
#      model's tree and state_dict keys stay as they are), but through ``_run_block``, one
#      function taking the block as an argument: dynamo does not compile a frame of torch.nn's own
#      (``nn.Sequential().compile()`` compiles nothing), and one function for all blocks keeps
#      Rule 4.

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
        counts: dict = {}
        for child in children:
            counts[type(child)] = counts.get(type(child), 0) + 1
        found = [c for c in children
                 if counts[type(c)] >= 2 and next(c.children(), None) is not None]
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


class _Regional:
    """The forward of a model compiled whole: the whole-model graph while no LMS is live, the
    model run eagerly with its blocks compiled one by one once one is (Rule 1)."""

    def __init__(self, model: nn.Module, whole: Callable, eager: Callable, kwargs: dict,
                 live: Callable[[], bool], say: Callable[[str, str], None]):
        self.model, self.whole, self.eager = model, whole, eager
        self.kwargs, self.live, self.say = kwargs, live, say
        self.regional = False

    def __call__(self, *args, **kwargs):
        if not self.regional and self.live():
            self.regional = self._compile_blocks()
        return (self.eager if self.regional else self.whole)(*args, **kwargs)

    def _compile_blocks(self) -> bool:
        blocks = repeated_blocks(self.model)
        if blocks and not getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", False):
            self.say("one-by-one", f"lmsrt: this torch ({torch.__version__}) would compile "
                     "every block of a model apart (torch._dynamo.config.inline_inbuilt_nn_modules "
                     "is off) and stop compiling after a few, so under LMS a model compiled whole "
                     "stays one region, and swapping cannot lower its peak. Set that option to "
                     "True before the first step, or use torch 2.5 or later (said once).")
            blocks = []
        if not blocks:
            self.live = lambda: False       # nothing to split: compiled whole, asked no more
            return False
        region = _torch_compile(_run_block, **_block_arguments(self.kwargs, self.say))
        for block in blocks:
            # What block.compile() does, through a frame of lmsrt's own (Rule 5).
            block._compiled_call_impl = functools.partial(region, block)
        global _regional_models
        _regional_models += 1
        kinds = sorted({type(b).__name__ for b in blocks})
        self.say("regions", f"lmsrt: torch.compile({type(self.model).__name__}) under LMS "
                 f"compiles its {len(blocks)} {'/'.join(kinds)} blocks one by one and runs the "
                 "rest eagerly, so that saved tensors can be swapped between blocks (a compiled "
                 "region hands them over only after its forward; said once).")
        return True


def install(live: Callable[[], bool], say: Callable[[str, str], None]) -> None:
    """Wrap ``torch.compile`` and ``nn.Module.compile`` (once per process, when lmsrt is
    imported) so that a model compiled whole is compiled block by block while ``live()`` says
    an LMS is live (torch_patches.py, NOTE [ What lmsrt changes in torch ], 6). ``say(key,
    message)`` warns once per key."""
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
            compiled.forward = _Regional(model, compiled.forward, model.__call__, kwargs, live,
                                         say)
        return compiled

    @functools.wraps(_module_compile)
    def module_compile(self, **kwargs):
        _module_compile(self, **kwargs)
        self._compiled_call_impl = _Regional(self, self._compiled_call_impl, self._call_impl,
                                             kwargs, live, say)

    torch.compile = compile
    nn.Module.compile = module_compile


def capturing() -> bool:
    """True while this thread's current CUDA stream captures a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
