import logging
import os
import signal
import sys

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


@pytest.fixture(autouse=True)
def _no_mode_left_on_the_stack():
    """A test leaves no dispatch mode of lmsrt's on this thread's mode stack: one left there
    runs every later op through Python, and its table holds what it noted (a recorder left
    by one CUDA test held 2 GiB that the capped tests after it counted against their cap)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    before = list(_get_current_dispatch_mode_stack())
    yield
    left = [m for m in _get_current_dispatch_mode_stack() if m not in before]
    if left:
        from torch.utils._python_dispatch import _pop_mode
        while len(_get_current_dispatch_mode_stack()) > len(before):
            _pop_mode()
        pytest.fail(f"the test left {[type(m).__name__ for m in left]} on the mode stack")


@pytest.fixture
def small_rebuilds_pay(request, monkeypatch):
    """On CUDA (a test's ``kind`` parameter), the tests' small rebuilds pass the cost rule
    (``models.rebuild_small_tensors``); on the simulated device they do already."""
    callspec = getattr(request.node, "callspec", None)
    rebuild_small_tensors(callspec.params.get("kind", "sim") if callspec else "sim", monkeypatch)


class _NotesOnStderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(f"lmsrt: {record.getMessage()}\n")


@pytest.fixture
def notes_on_stderr():
    """lmsrt's notes (the ``lmsrt`` logger) on stderr, one ``lmsrt: ...`` line each, as ``lmsrt
    run`` prints them: a test reads them with ``capsys``."""
    handler = _NotesOnStderr()
    logging.getLogger("lmsrt").addHandler(handler)
    yield
    logging.getLogger("lmsrt").removeHandler(handler)


def pytest_configure(config):
    if torch.cuda.is_available():
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


# The tests that take 5 s or more on a 2-core CPU machine (each starts processes, builds C++ or
# soaks), marked `slow`, so that README's quick command (-m "not slow") runs the rest in about a
# minute; CI runs them all. Named here, not in each file, so that one list says which.
SLOW = {
    "tests/launch/test_cli.py::test_bootstrap_enables_lms_in_workers_only_and_chains_sitecustomize",
    "tests/launch/test_cli.py::test_sigterm_writes_the_stats_and_exits_143",
    "tests/launch/test_cli.py::test_stats_file_of_an_unmodified_script",
    "tests/launch/test_cli.py::test_torchrun_workers_enable_lms",
    "tests/launch/test_first_hour.py::test_bad_summary_variable_exits_2_before_the_script",
    "tests/launch/test_first_hour.py::test_no_gpu_warning_is_one_line_with_the_launchers_way",
    "tests/launch/test_first_hour.py::test_summary_headline_and_table",
    "tests/launch/test_first_hour.py::test_what_python_runs_lmsrt_runs_with_the_same_file_and_path",
    "tests/launch/test_tune.py::test_bisection_sweep_end_to_end",
    "tests/launch/test_tune.py::test_ctrl_c_keeps_the_finished_trials",
    "tests/launch/test_tune.py::test_every_way_a_trial_ends",
    "tests/launch/test_tune.py::test_param_sweep_substitutes_the_scripts_flag",
    "tests/launch/test_tune.py::test_timeout_kills_the_trial_and_what_it_started",
    "tests/launch/test_tune_noise.py::test_the_same_crash_twice_stops_tune_and_blames_the_script",
    "tests/profiler/test_report.py::test_profile_as_a_process",
    "tests/profiler/test_report.py::test_segnet_example_answers_from_shapes",
    "tests/test_arena.py::test_random_operations_keep_invariants",
    "tests/test_compiled.py::test_lmsrt_run_compiles_a_whole_model_block_by_block",
    "tests/test_compiled.py::test_model_compiled_whole_swaps_between_blocks",
    "tests/test_copy_path.py::test_a_second_cache_in_one_process_builds_and_loads_there",
    "tests/test_copy_path.py::test_first_use_on_a_gpu_builds_once_for_concurrent_processes",
    "tests/test_examples.py::test_gpt_example_compiled_under_lmsrt_run_on_cpu",
    "tests/test_examples.py::test_gpt_example_on_cpu_direct_and_under_lmsrt_run",
    "tests/test_examples.py::test_segnet_example_on_cpu",
    "tests/test_integrity.py::test_lmsrt_run_exits_130_on_every_ctrl_c",
    "tests/test_integrity.py::test_soak_threads_keep_counts_host_and_python_memory_flat",
    "tests/test_integrity.py::test_torch_func_script_under_lmsrt_run",
    "tests/test_multigpu.py::test_fsdp2_losses_identical_with_lms",
    "tests/test_native_hooks.py::test_a_step_that_keeps_everything_is_decided_in_cpp_with_the_same_counts",
    "tests/test_policy.py::test_batches_of_changing_size_train_exactly",
    "tests/test_rebuild.py::test_an_interrupt_anywhere_in_a_rebuild_leaves_the_lms_usable",
    "tests/test_rebuild.py::test_the_recorder_loads_no_compiler_until_one_is_loaded",
    "tests/test_reliability.py::test_interrupts_and_exits_leave_a_clean_process",
    "tests/test_reliability.py::test_soak_1000_steps_with_changing_shapes",
    "tests/test_reliability.py::test_torch_compile_is_detected_and_stays_exact",
}
SLOW_FIXTURES = {"native"}        # builds the C++ copy path for the CPU first (about 100 s)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW or SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def _free_what_earlier_tests_held() -> None:
    """A CUDA test starts with the GPU memory of the tests before it given back: pytest keeps
    the last failure's traceback (``sys.last_traceback``, for post-mortem debugging), whose
    frames hold that test's tensors, and a test that caps the GPU would then count them
    against its cap (two capped tests failed one after the other that way, each for the one
    before it)."""
    import gc
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace for each stream it ran on (32 MiB or more each on Hopper), in
    # the caching allocator and counted as allocated: tests that run matmuls on side streams
    # leave dozens, which a later test's cap would count.
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _cuda_memory_given_back(request):
    """A CUDA test that passes gives back the GPU memory it allocated (within 64 MiB): what one
    keeps (a table, a cache, a dropped model still referenced) a later capped test counts
    against its cap, and a user's process would hold it for good."""
    if not request.node.get_closest_marker("cuda") or not torch.cuda.is_available():
        yield
        return
    before = torch.cuda.memory_allocated()
    yield
    if hasattr(sys, "last_value"):
        return          # the test failed: its traceback holds its tensors (and says why)
    _free_what_earlier_tests_held()
    left = torch.cuda.memory_allocated() - before
    if left > 64 << 20:
        pytest.fail(f"the test left {left / 2**20:.0f} MiB of GPU memory allocated")


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("cuda"):
        _free_what_earlier_tests_held()
    if item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 or more CUDA GPUs")
