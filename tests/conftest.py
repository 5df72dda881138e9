import os

# Bit-exact comparisons on CUDA need deterministic kernels; cuBLAS reads this at initialisation.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# One CPU thread per test process (and per process a test starts): the tensors are tiny, and
# README's test command runs a worker per core, where OpenMP threads spinning against the other
# workers cost half the suite's CPU time. Read by torch when it is imported, just below.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch


def pytest_configure(config):
    if torch.cuda.is_available():
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 or more CUDA GPUs")
