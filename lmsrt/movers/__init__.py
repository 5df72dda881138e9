"""Movers of model state other than saved tensors, each an object the engine holds and calls:

  optimizer.py   OptimizerMover: optimizer state in pinned host memory between optimizer steps
  streamed.py    Parts: an optimizer step in parts, a part of its state on the GPU at a time
"""
from .optimizer import MODES, OptimizerMover

__all__ = ["OptimizerMover", "MODES"]
