"""Movers of model state other than saved tensors, each an object the engine holds and calls:

  optimizer.py   OptimizerMover: optimizer state in pinned host memory between optimizer steps
"""
from .optimizer import MODES, OptimizerMover

__all__ = ["OptimizerMover", "MODES"]
