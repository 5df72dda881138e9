"""Recompute: what lmsrt runs again in backward instead of keeping or moving it.

Two scales of one idea, each with its plan:

    recipes.py    NOTE [ Recipes ]: a saved tensor rebuilt from its inputs by its one op (GELU's
                  output from GELU's input); the recorder (a TorchDispatchMode) that notes them,
                  the recipe table, and ``census`` of what a model could rebuild
    rebuilds.py   what the engine knows of rebuilding: which signatures were checked bit for
                  bit, their GPU time, when the recorder sleeps or stops for the run
    finder.py     NOTE [ Recomputed regions ], Rule 1: repeated blocks (``repeated_children``,
                  shared with compiled.py) and the stages of a conv net's Sequential
    safety.py     Rule 6: what a rerun restores (RNG, autocast, flags) and what is refused
    frames.py     Rule 4: a region's saved tensors held while it runs, and its exact rerun
    regions.py    the global module hooks, a step's regions, the plan's steps (NOTE [ Region
                  plan ])
    plan.py       the plan as data: ``StepFigures``, ``choose_regions``, ``calibrated``,
                  ``memory_budget`` (the compiled path's share)
    compiled.py   NOTE [ Regions under LMS ]: a model compiled whole is compiled block by block,
                  and torch's partitioner recomputes inside them under lmsrt's budget

The engine (lmsrt/engine) holds a ``Rebuilds`` and asks it about recipes; ``LMS`` owns a
``Regions`` under ``recompute=True``; the compiled path is installed at import (lms.py).
"""
