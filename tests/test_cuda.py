"""Checks that only mean something on a real GPU: races, peaks, leaks."""
import pytest
import torch
from models import assert_same, make_lms, train_step, transformer

pytestmark = pytest.mark.cuda


@pytest.fixture(params=["python", "C++"])
def copy_path(request):
    """Run a check through each copy path: torch's Python bindings, and csrc/copy_path.cpp (when
    `lmsrt build` has built it for this torch)."""
    import lmsrt.copy_path
    lmsrt.copy_path.set_enabled(request.param == "C++")
    if request.param == "C++" and lmsrt.copy_path.load() is None:
        pytest.skip(f"C++ copy path: {lmsrt.copy_path.status()}")
    yield request.param
    lmsrt.copy_path.set_enabled(True)


def _stall(stream, cycles=5_000_000):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def test_race_stalled_streams_inplace_ops_exact(copy_path):
    """Stall each stream in turn around in-place ops and freshly reused blocks. A copy issued
    before its source was written (Rule 1), a source freed before its copy finished (Rule 2), or a
    restored tensor read before its copy landed (Rule 3) shows up as a wrong bit or a NaN."""
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                               torch.nn.ReLU(inplace=True)).cuda()
    head = torch.nn.Conv2d(16, 3, 3, padding=1).cuda()
    x = torch.randn(8, 3, 64, 64, device="cuda")

    def fwd(lms):
        h = x
        for i in range(6):
            if lms is not None:
                _stall(torch.cuda.current_stream())      # the producer is late (Rule 1)
                _stall(lms._engine.d2h)                  # the copies are late (Rule 2)
            h = conv(h)                                  # ReLU in place on the BN output
            h = head(h)
            h.add_(1.0).mul_(0.5)                        # in place on a tensor not yet saved
            torch.empty_like(h).fill_(float("nan"))      # scribble over any block freed early
        out = h.square().mean()
        if lms is not None:
            # Backward starts with the H2D stream stalled: restored reads must wait (Rule 3).
            out.register_hook(lambda g: (_stall(lms._engine.h2d), g)[1])
        return out

    ref_loss = fwd(None)
    params = list(conv.parameters()) + list(head.parameters())
    ref = torch.autograd.grad(ref_loss, params)
    lms = make_lms("cuda")
    for _ in range(3):
        with lms:
            loss = fwd(lms)
        got = torch.autograd.grad(loss, params)
        assert torch.equal(ref_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert lms.stats()["total"]["out_tensors"] > 0
    assert (lms.copy_path == "native") == (copy_path == "C++")


def _peak_of(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_below_half_on_transformer_stack_at_frac_zero():
    torch.manual_seed(0)
    model = transformer(d=512, layers=8, heads=8).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    train_step(model, x)                             # warm up kernels and grads
    plain = _peak_of(lambda: train_step(model, x))
    lms = make_lms("cuda", lms=64, lms_frac=0.0)
    train_step(model, x, lms=lms)
    swapped = _peak_of(lambda: train_step(model, x, lms=lms))
    assert swapped < plain / 2, (swapped / 2**20, plain / 2**20)


def test_forward_waits_on_late_copies_are_timed():
    """Copies out held back (the D2H stream stalled) under a level of 0 with 16 MiB let held
    while they run: forward must wait for them before it goes on, and the time its stream
    stood still is counted."""
    torch.manual_seed(0)
    model = transformer(d=512, layers=8, heads=8).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    lms = make_lms("cuda", lms=64, lms_frac=0.0, prefetch_mb=16)
    train_step(model, x, lms=lms)
    with lms:
        _stall(lms._engine.d2h, 50_000_000)      # the first copies land ~25 ms late or more
        loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    step = lms.stats()["last_step"]
    assert step["swapout_waits"] > 0, step
    assert step["swapout_wait_ms"] > 1.0, step


def test_no_leak_over_20_steps(copy_path):
    torch.manual_seed(0)
    model = transformer(d=256, layers=4, heads=4).cuda()
    x = torch.randn(4, 128, 256, device="cuda")
    lms = make_lms("cuda", lms=16, lms_frac=0.0)
    ref = train_step(model, x)
    train_step(model, x, lms=lms)
    with lms:
        pass
    torch.cuda.synchronize()
    gpu0, host0 = torch.cuda.memory_allocated(), lms._engine.host.used_bytes
    pinned0 = lms._engine.host.pinned_bytes
    for _ in range(20):
        assert_same(ref, train_step(model, x, lms=lms))
        with lms:                  # step boundary: reaps what the last backward freed
            pass
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == gpu0
        assert lms._engine.host.used_bytes == host0 == 0
        assert lms._engine.host.pinned_bytes == pinned0


def test_step_peak_survives_the_scripts_own_peak_reset():
    """A training loop that resets torch's peak counter (to print its own per-step peak) must not
    hide the step's peak from lmsrt's stats: the reset after a large backward is folded in."""
    torch.manual_seed(0)
    model = transformer(d=256, layers=2).cuda()
    x = torch.randn(8, 256, 256, device="cuda")
    lms = make_lms("cuda", lms_frac=1.0)            # no swapping: only the counters matter
    for _ in range(2):
        with lms:
            loss = model(x).float().square().mean()
        loss.backward()
        big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")   # 256 MiB, then freed
        del big
        torch.cuda.reset_peak_memory_stats()        # what the script does after printing
    with lms:                                       # step 3 starts: step 2 is finished
        model(x).float().square().mean()
    history = lms.stats()["history"]
    assert history[-1]["gpu_peak_bytes"] >= 256 << 20, history[-1]
    assert torch.cuda.max_memory_allocated() < history[-1]["gpu_peak_bytes"]   # torch's was reset
    lms.close()
