"""Movers of model state other than saved tensors, each an object the engine holds and calls:

  optimizer.py   OptimizerMover: optimizer state in pinned host memory between optimizer steps
  host_state.py  Place, HostState: a state tensor's host place; the state dict read through it;
                 what is where (in_groups, states, on_host, part_sizes)
  marks.py       StepMarks: the training pass's peak and the updates' GPU time (Rule 9)
  placement.py   Placement: how much of the state leaves the device, and when (the decision)
  streamed.py    Parts: an optimizer step in parts, a part of its state on the GPU at a time
"""
from .optimizer import MODES, OptimizerMover

__all__ = ["OptimizerMover", "MODES"]
