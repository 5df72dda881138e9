"""``--gpu-limit``'s cap (lmsrt/gpu_cap.py, NOTE [ Capping a GPU ]): the memory above the cap held
from the driver, or torch's per-process fraction where that cannot be done."""
import subprocess
import sys

import pytest
import torch
from processes import clean_env

from lmsrt import gpu_cap

GiB = 1 << 30
HOLD = {"LMSRT_GPU_CAP": "hold", "LMSRT_GPU_CAP_SPARE_MB": "0"}      # held, nothing beside


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda as a 100 GiB GPU with 90 GiB free and 2 GiB reserved by torch's allocator; the
    calls gpu_cap makes are recorded in the returned dict."""
    seen = {"fractions": [], "taken": [], "freed": []}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 100 * GiB}))
    monkeypatch.setattr(cuda, "mem_get_info", lambda i: (90 * GiB, 100 * GiB))
    monkeypatch.setattr(cuda, "memory_reserved", lambda i: 2 * GiB)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "device", lambda i: _Nothing())
    monkeypatch.setattr(cuda, "synchronize", lambda i=None: None)
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction",
                        lambda f, i=None: seen["fractions"].append(f))

    def take(nbytes):
        seen["taken"].append(nbytes)
        return 0xABC000

    monkeypatch.setattr(gpu_cap, "_driver_alloc", take)
    monkeypatch.setattr(gpu_cap, "_driver", lambda: type("Lib", (), {
        "cuMemFree_v2": staticmethod(lambda p: seen["freed"].append(p.value) or 0)}))
    yield seen
    gpu_cap._caps.clear()
    gpu_cap._held.clear()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_way_is_the_fraction_unless_told(fake_gpu):
    assert gpu_cap.way({}) == "fraction"
    assert gpu_cap.way({"LMSRT_GPU_CAP": " Hold "}) == "hold"
    assert gpu_cap.apply(25 * GiB, 0, {}) == "fraction"
    assert fake_gpu["fractions"] == [0.25] and fake_gpu["taken"] == []
    with pytest.raises(ValueError, match="LMSRT_GPU_CAP='half' is not one of fraction, hold"):
        gpu_cap.way({"LMSRT_GPU_CAP": "half"})


def test_hold_takes_what_is_free_above_the_cap_and_leaves_the_fraction_at_one(fake_gpu):
    assert gpu_cap.apply(14 * GiB, 0, HOLD) == "hold"
    # 90 GiB free; the allocator may grow from its 2 GiB reserved to the 14 GiB cap: 12 of it.
    assert fake_gpu["taken"] == [78 * GiB]
    assert fake_gpu["fractions"] == [1.0]
    assert gpu_cap.limit(0) == 14 * GiB and gpu_cap.held_bytes(0) == 78 * GiB
    assert gpu_cap.limit(1) is None


def test_a_hold_leaves_room_beside_the_cap_for_what_cuda_maps_later(fake_gpu):
    gpu_cap.apply(14 * GiB, 0, {"LMSRT_GPU_CAP": "hold"})
    assert fake_gpu["taken"] == [78 * GiB - (256 << 20)]
    gpu_cap.apply(14 * GiB, 0, {"LMSRT_GPU_CAP": "hold", "LMSRT_GPU_CAP_SPARE_MB": "1024"})
    assert fake_gpu["taken"][-1] == 77 * GiB
    assert gpu_cap.limit(0) == 14 * GiB
    for bad in ("-1", "lots", "inf"):
        with pytest.raises(ValueError, match="LMSRT_GPU_CAP_SPARE_MB=.* is not a number of MiB"):
            gpu_cap.spare({"LMSRT_GPU_CAP_SPARE_MB": bad})


def test_a_second_cap_gives_the_first_hold_back(fake_gpu):
    gpu_cap.apply(14 * GiB, 0, HOLD)
    gpu_cap.apply(20 * GiB, 0, HOLD)
    assert fake_gpu["freed"] == [0xABC000]
    assert fake_gpu["taken"] == [78 * GiB, 72 * GiB]
    assert gpu_cap.limit(0) == 20 * GiB and gpu_cap.held_bytes(0) == 72 * GiB
    gpu_cap.release(0)
    assert fake_gpu["freed"] == [0xABC000, 0xABC000]
    assert gpu_cap.limit(0) is None and gpu_cap.held_bytes(0) == 0
    assert fake_gpu["fractions"][-1] == 1.0


def test_the_fraction_where_the_driver_refuses(fake_gpu, monkeypatch):
    monkeypatch.setattr(gpu_cap, "_driver_alloc", lambda nbytes: None)
    assert gpu_cap.apply(25 * GiB, 0, {"LMSRT_GPU_CAP": "hold"}) == "fraction"
    assert fake_gpu["fractions"] == [0.25]
    assert gpu_cap.limit(0) == 25 * GiB and gpu_cap.held_bytes(0) == 0


def test_the_fraction_where_too_little_is_free_to_hold_and_no_cap_past_the_gpu(fake_gpu):
    # 90 GiB free, 2 reserved: a cap of 92 GiB leaves nothing to hold.
    assert gpu_cap.apply(92 * GiB, 0, HOLD) == "fraction"
    assert fake_gpu["taken"] == [] and fake_gpu["fractions"] == [0.92]
    assert gpu_cap.held_bytes(0) == 0 and gpu_cap.limit(0) == 92 * GiB
    with pytest.raises(ValueError, match="a cap of 120 GiB is more than GPU 0 has"):
        gpu_cap.apply(120 * GiB, 0, {})


def test_the_fraction_where_asked_or_where_ranks_share_a_gpu(fake_gpu):
    assert gpu_cap.apply(25 * GiB, 0, {"LMSRT_GPU_CAP": "fraction"}) == "fraction"
    # Two local ranks on one GPU: the first to hold would take what the second needs.
    assert gpu_cap.apply(25 * GiB, 0, {"LMSRT_GPU_CAP": "hold",
                                       "LOCAL_WORLD_SIZE": "2"}) == "fraction"
    assert gpu_cap.apply(25 * GiB, 0, {"LMSRT_GPU_CAP": "hold", "LOCAL_WORLD_SIZE": "1",
                                       "LMSRT_GPU_CAP_SPARE_MB": "0"}) == "hold"
    assert fake_gpu["taken"] == [67 * GiB]
    assert fake_gpu["fractions"] == [0.25, 1.0, 0.25, 1.0, 1.0]


@pytest.mark.cuda
def test_a_held_cap_stops_the_allocator_at_the_cap_and_goes_back():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lmsrt.device import CudaDevice

    index = torch.cuda.current_device()
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_reserved(index) + 2 * GiB
    free_before = torch.cuda.mem_get_info(index)[0]
    try:
        assert gpu_cap.apply(cap, index, HOLD) == "hold"
        assert CudaDevice(index).memory_limit() == cap
        a = torch.empty(GiB, dtype=torch.uint8, device="cuda")          # fits under the cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")     # 3 GiB would not
        del a
    finally:
        gpu_cap.release(index)
        torch.cuda.empty_cache()
    assert gpu_cap.limit(index) is None
    assert CudaDevice(index).memory_limit() == torch.cuda.get_device_properties(index).total_memory
    assert torch.cuda.mem_get_info(index)[0] > free_before - GiB        # the hold went back


@pytest.mark.parametrize("var, raw", [("LMSRT_GPU_CAP", "half"),
                                      ("LMSRT_GPU_CAP_SPARE_MB", "-5")])
def test_lmsrt_run_refuses_a_bad_cap_setting_before_the_script_runs(tmp_path, var, raw):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    bad = subprocess.run([sys.executable, "-m", "lmsrt", "run", str(script)], capture_output=True,
                         text=True, timeout=120, env=clean_env(**{var: raw}))
    assert bad.returncode == 2 and var in bad.stderr and "ran" not in bad.stdout
