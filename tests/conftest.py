import os
import signal

# A suite started in the background of a non-interactive shell (`pytest ... &`, as CI harnesses
# may) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt for it: the tests
# that send Ctrl-C to the processes they start (tests/scripts/sigint_runs.py and
# interrupted_steps.py, `lmsrt tune`) would hang or fail. Handling it here makes every process
# the tests start begin with SIGINT's default, whatever started the suite.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Bit-exact comparisons on CUDA need deterministic kernels; cuBLAS reads this at initialisation.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# One CPU thread per test process (and per process a test starts): the tensors are tiny, and
# README's test command runs a worker per core, where OpenMP threads spinning against the other
# workers cost half the suite's CPU time. Read by torch when it is imported, just below.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Processes the tests start neither read nor write records of pinned memory (lmsrt/cache.py):
# a record left by one run would change what the next pins ahead.
os.environ.setdefault("LMSRT_PIN_AHEAD", "off")

import pytest
import torch
from models import rebuild_small_tensors

import lmsrt.cache


@pytest.fixture(autouse=True)
def _records_of_this_test_only(tmp_path, monkeypatch):
    """Each test's LMS objects keep their records of pinned memory (NOTE [ Pinning ahead ]) in
    the test's own folder: another test's, or an earlier run's, must not change what it pins."""
    monkeypatch.setattr(lmsrt.cache, "pins_dir", lambda: str(tmp_path / "pins"))


@pytest.fixture
def small_rebuilds_pay(request, monkeypatch):
    """On CUDA (a test's ``kind`` parameter), the tests' small rebuilds pass the cost rule
    (``models.rebuild_small_tensors``); on the simulated device they do already."""
    callspec = getattr(request.node, "callspec", None)
    rebuild_small_tensors(callspec.params.get("kind", "sim") if callspec else "sim", monkeypatch)


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
