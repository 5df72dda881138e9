"""Optimizer state in host memory between optimizer steps (lmsrt/movers/optimizer.py, NOTE
[ Optimizer state on the host ]): parameters after every step ``torch.equal`` to the run without
lmsrt, for the optimizers people use, in plain loops and in closures."""
from __future__ import annotations

import collections
import contextlib
import copy
import gc

import pytest
import torch
from models import DEVICES, make_lms, torch_device

import lmsrt

# name -> (the optimizer for these parameters, state keys it moves)
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    # torch's Adam takes its loop, not foreach, for a tensor learning rate: parts must too
    "adam-tensor-lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2)),
}


@pytest.fixture(autouse=True)
def _close_every_lms(monkeypatch):
    """Each LMS made in a test is closed after it, failed or not: an open one left behind
    would move the state of a later test's reference run (the newest open LMS moves it)."""
    made = []

    class Closed(lmsrt.LMS):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(lmsrt, "LMS", Closed)
    yield
    for lms in made:
        lms.close()


def _model(dev, stack=0):
    """An MLP; ``stack``: of 12 equal layers that wide (256: 0.5 MiB of AdamW state a weight)."""
    torch.manual_seed(0)
    if stack:
        layers = [m for _ in range(12) for m in (torch.nn.Linear(stack, stack), torch.nn.GELU())]
        return torch.nn.Sequential(torch.nn.Linear(64, stack), *layers,
                                   torch.nn.Linear(stack, 64)).to(dev)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 64)).to(dev)


def _train(kind, name, lms=None, steps=4, closure=False, probe=None, stack=0, batch=32):
    """``steps`` optimizer steps; each step's parameters. ``probe(opt)`` runs inside each
    closure (between the step's pre-hook and the optimizer's reads)."""
    dev = torch_device(kind)
    model = _model(dev, stack)
    opt = OPTIMIZERS[name](model.parameters())
    x = torch.randn(batch, 64, device=dev)
    return _loop(model, opt, x, lms, steps, closure=closure, probe=probe), opt, model


def _loop(model, opt, x, lms, steps, closure=False, probe=None, step=None):
    """``steps`` steps of ``model`` on ``x`` (forward under ``lms``), each stepping ``opt``
    (through ``step``, a compiled one, if given); each step's parameters."""
    step = step or opt.step

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with lms or contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        if probe is not None:
            probe(opt)
        return loss

    seen = []
    for _ in range(steps):
        if closure:
            step(forward_backward)
        else:
            forward_backward()
            step()
        # On the CPU: the reference run's copies must not take the capped GPU of the run after.
        seen.append([p.detach().to("cpu", copy=True) for p in model.parameters()])
    return seen


def _assert_same_params(ref, got):
    for step, (a, b) in enumerate(zip(ref, got)):
        for i, (pa, pb) in enumerate(zip(a, b)):
            assert torch.equal(pa.cpu(), pb.cpu()), f"step {step + 1}, parameter {i} differs"


def _host_tensors(opt, least=64 << 10):
    """The state's tensors of ``least`` bytes or more (what lms=64 moves), read past the mover
    (``dict``'s own methods)."""
    return [t for s in dict.values(opt.state) for t in s.values()
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= least]


def _check_exact(kind, name, closure):
    ref, ref_opt, _ = _train(kind, name, closure=closure)
    lms = make_lms(kind, optimizer_state="host", lms=64)
    between = []
    got, opt, _ = _train(kind, name, lms=lms, closure=closure,
                         probe=lambda o: between.append([id(t) for t in _host_tensors(o)]))
    _assert_same_params(ref, got)
    last = lms.stats()["last_step"]
    moved = sum(t.numel() * t.element_size() for t in _host_tensors(opt))
    assert last["optimizer_host_bytes"] == moved > 0
    assert last["optimizer_in_bytes"] == last["optimizer_out_bytes"] == moved
    if kind == "cuda":
        assert all(t.is_cpu and t.is_pinned() for t in _host_tensors(opt))
    # Inside each later step, up to the optimizer's first read (after forward and backward, in a
    # closure), the state is still the host tensors the step before left.
    after = [id(t) for t in _host_tensors(opt)]
    assert between[1:] == [after] * (len(between) - 1)
    # What the optimizer holds is what it holds without lmsrt.
    for s_ref, s_got in zip(ref_opt.state.values(), opt.state.values()):
        for key in s_ref:
            assert torch.equal(s_ref[key].cpu(), s_got[key].cpu()), key
    lms.close()


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_on_the_host_trains_exactly(kind, name):
    if name == "adamw-fused" and kind == "sim":
        try:
            torch.optim.AdamW([torch.zeros(2, requires_grad=True)], fused=True).step()
        except RuntimeError:
            pytest.skip("fused AdamW is not built for the CPU in this torch")
    _check_exact(kind, name, closure=False)


@pytest.mark.parametrize("kind", DEVICES)
def test_optimizer_state_comes_back_after_a_closures_forward_and_backward(kind):
    _check_exact(kind, "adamw", closure=True)


def _check_state_dict(kind):
    """Rule 5: state_dict() between steps gives the exact state, on the CPU; loaded back (as a
    checkpoint resumed), training goes on exactly."""
    ref, ref_opt, ref_model = _train(kind, "adamw", steps=3)
    lms = make_lms(kind, optimizer_state="host", lms=64)
    got, opt, model = _train(kind, "adamw", lms=lms, steps=3)
    saved = opt.state_dict()
    expected = ref_opt.state_dict()
    for i, s in saved["state"].items():
        for key, t in s.items():
            assert torch.equal(t.cpu(), expected["state"][i][key].cpu()), (i, key)
    opt.load_state_dict(saved)                  # a plain dict now, on the device
    assert type(opt.state) is collections.defaultdict
    dev = torch_device(kind)
    x = torch.randn(32, 64, device=dev)
    for m, o, with_lms in ((ref_model, ref_opt, None), (model, opt, lms)):
        torch.manual_seed(1)
        for _ in range(2):
            o.zero_grad()
            with with_lms or contextlib.nullcontext():
                loss = m(x).square().mean()
            loss.backward()
            o.step()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert lms.stats()["last_step"]["optimizer_host_bytes"] > 0     # moved out again
    lms.close()


@pytest.mark.parametrize("kind", DEVICES)
def test_optimizer_state_dict_is_exact_and_loads_back(kind):
    _check_state_dict(kind)


def _check_close(kind):
    """Rule 6: after the LMS closes, the state is back on the device in a plain dict, and the
    optimizer steps on exactly without lmsrt."""
    ref, _, _ = _train(kind, "sgd-momentum", steps=5)
    lms = make_lms(kind, optimizer_state="host", lms=64)
    dev = torch_device(kind)
    model = _model(dev)
    opt = OPTIMIZERS["sgd-momentum"](model.parameters())
    x = torch.randn(32, 64, device=dev)
    got = []
    for step in range(5):
        if step == 3:
            lms.close()
            assert type(opt.state) is collections.defaultdict
            assert all(t.device.type == dev.type and not t.is_pinned() for t in _host_tensors(opt))
        opt.zero_grad()
        with (lms if step < 3 else contextlib.nullcontext()):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        got.append([p.detach().clone() for p in model.parameters()])
    _assert_same_params(ref, got)


@pytest.mark.parametrize("kind", DEVICES)
def test_closing_the_lms_brings_the_optimizer_state_back(kind):
    _check_close(kind)


def _state_peaks(lms, name, stack=256, hook=None, steps=3):
    """Train on ``lms``'s simulated device and read, around each optimizer step, the most
    device memory its state took (the simulated device counts what lmsrt allocates); the
    parameters of each step."""
    device = lms._device
    model = _model(torch.device("cpu"), stack)
    opt = OPTIMIZERS[name](model.parameters())
    if hook is not None:
        opt.register_step_post_hook(hook)
    x = torch.randn(32, 64)
    peaks, seen = [], []
    for _ in range(steps):
        opt.zero_grad()
        with lms:
            loss = model(x).square().mean()
        loss.backward()
        base = device.memory_allocated()
        device.reset_peak()
        opt.step()
        peaks.append(device.peak_allocated() - base)
        seen.append([p.detach().clone() for p in model.parameters()])
    return peaks, seen, opt


@contextlib.contextmanager
def _limited(kind, nbytes, mode="host"):
    """An LMS moving optimizer state (``mode``), under a limit of ``nbytes``: a simulated device
    of that size, or the GPU capped for the process."""
    if kind == "sim":
        from lmsrt.device import SimulatedDevice
        yield lmsrt.LMS(device=SimulatedDevice(capacity=nbytes), lms=64, lms_frac=0.0,
                        optimizer_state=mode)
        return
    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()                # what earlier tests left in cycles, off the capped GPU
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(nbytes / total)
    try:
        yield make_lms("cuda", optimizer_state=mode, lms=64)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("closure", [False, True], ids=["loop", "closure"])
def test_a_step_in_parts_stays_exact(kind, name, closure):
    """Rule 7: a step in parts of a sixteenth of the limit of state each (1 MiB under 16 MiB;
    64 MiB under a GPU capped at 1 GiB, of 192 to 576 MiB of state), the next part coming in
    while one runs. With a closure (which zeroes the gradients), it runs first with the groups
    whole."""
    if name == "adamw-fused" and kind == "sim":
        pytest.skip("fused AdamW's CPU kernel: the whole step's test above")
    width, limit = (256, 16 << 20) if kind == "sim" else (2048, 1 << 30)
    ref, _, _ = _train(kind, name, closure=closure, stack=width)
    with _limited(kind, limit) as lms:
        got, opt, _ = _train(kind, name, lms=lms, closure=closure, stack=width)
        assert sum(t.numel() * t.element_size() for t in _host_tensors(opt)) > 2 * (limit >> 4)
    _assert_same_params(ref, got)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "adam-amsgrad"])
def test_a_step_in_parts_holds_two_parts_of_the_state(name):
    """Rule 7: under a 16 MiB limit, with parts of 1 MiB, the device holds two parts of the
    state at most during the step (the one running and the next coming in), not all of it
    (3 to 9 MiB)."""
    with _limited("sim", 16 << 20) as lms:
        peaks, _, opt = _state_peaks(lms, name)
        state = sum(t.numel() * t.element_size() for t in _host_tensors(opt))
    assert state > 3 << 20
    assert 0 < max(peaks[1:]) <= 2 * (1 << 20) + (64 << 10), (peaks, state)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_where_two_parts_are_more_than_the_room_one_is_held(name, monkeypatch):
    """Rule 9: where the room beside the step holds less than two of its largest parts, none
    comes ahead (``Placement.depth`` 0): the device holds one part of the state at most, and
    the steps are exact."""
    from lmsrt.movers.placement import Placement
    monkeypatch.setattr(Placement, "depth", lambda self, allocated, largest: 0)
    ref = _state_peaks(_Plain(), name)[1]
    with _limited("sim", 16 << 20) as lms:
        peaks, got, _ = _state_peaks(lms, name)
    _assert_same_params(ref, got)
    assert 0 < max(peaks[1:]) <= (1 << 20) + (64 << 10), peaks


def test_auto_runs_a_first_step_that_would_not_fit_whole_in_parts():
    """Rule 1: under an 8 MiB limit AdamW's first step would make 6 MiB of state beside 3 MiB of
    parameters: that step makes it on the host, in parts; then what fits beside the next step's
    parts stays on the device (fetched once more, in step 2), the rest moves each step. Exact."""
    from lmsrt.device import SimulatedDevice

    ref, _, _ = _train("sim", "adamw", stack=256)
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=8 << 20), lms=64, lms_frac=0.0)
    history = []
    got, opt, _ = _train("sim", "adamw", lms=lms, stack=256,
                         probe=lambda o: history.append(lms.stats()["last_step"]))
    _assert_same_params(ref, got)
    state = sum(t.numel() * t.element_size() for t in _host_tensors(opt))
    moving = lms.stats()["last_step"]["optimizer_host_bytes"]
    # Read in step 2's backward: step 1 ended with all its state on the host.
    assert history[1]["optimizer_host_bytes"] == state > 6 << 20
    assert 0 < moving < state
    assert lms.stats()["total"]["optimizer_in_bytes"] == state + 2 * moving


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch's own, from dynamo
def test_a_compiled_optimizer_steps_state_stays_where_it_compiled(caplog):
    """Rule 8: a step compiled with torch.compile guards on its state's addresses; under
    optimizer_state="host" its state stays on the device (said once), so 12 steps compile as
    often as without lmsrt (past dynamo's limit of 8 recompiles, which would fall back to
    eager and its other rounding), and are exact."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def run(lms, steps=12):
        torch._dynamo.reset()
        counters.clear()
        model = _model(torch.device("cpu"), 256)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = torch.compile(opt.step, backend="eager")
        seen = _loop(model, opt, torch.randn(32, 64), lms, steps, step=step)
        return seen, opt, dict(counters["stats"])

    ref, _, compiled = run(None)
    caplog.clear()          # (an LMS another test left open may have said it of the reference)
    with _limited("sim", 16 << 20) as lms:
        got, opt, under = run(lms)
        _assert_same_params(ref, got)
        assert lms.stats()["last_step"]["optimizer_host_bytes"] == 0
        assert type(opt.state) is collections.defaultdict
    assert under.get("unique_graphs") == compiled.get("unique_graphs"), (under, compiled)
    assert sum("step is compiled" in r.getMessage() for r in caplog.records) == 1
    torch._dynamo.reset()


def test_a_users_step_hook_sees_the_whole_step():
    """Rule 7: with a hook of the user's (an average of the weights, updated after each step)
    the step is not cut, so the hook sees every parameter updated; exact, with the whole state
    on the device during the step."""
    from lmsrt.device import SimulatedDevice

    def averaged(runs):
        average = {}

        def hook(opt, args, kwargs):
            for p in (p for g in opt.param_groups for p in g["params"]):
                average[id(p)] = average.get(id(p), 0) + p.detach().sum().item()
        _, seen, _ = runs(hook)
        return sorted(average.values()), seen

    ref_avg, ref = averaged(lambda hook: _state_peaks(_Plain(), "adamw", hook=hook))
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=16 << 20), lms=64, lms_frac=0.0,
                    optimizer_state="host")
    got_avg, got = averaged(lambda hook: _state_peaks(lms, "adamw", hook=hook))
    _assert_same_params(ref, got)
    assert got_avg == ref_avg
    peaks, _, opt = _state_peaks(lms, "adamw", hook=lambda *a: None)
    state = sum(t.numel() * t.element_size() for t in _host_tensors(opt))
    assert peaks[-1] >= state                   # whole
    lms.close()


class _Plain(contextlib.nullcontext):
    """No LMS, and a simulated device that counts nothing: for ``_state_peaks``' reference."""

    class _device:
        @staticmethod
        def memory_allocated():
            return 0

        reset_peak = staticmethod(lambda: None)
        peak_allocated = staticmethod(lambda: 0)


def test_auto_moves_only_the_state_that_does_not_fit():
    """Rule 1: AdamW's 2.5 MiB of state beside a batch of 4096 (its forward's peak some 20 MiB
    on the simulated device, which counts saved tensors). Under 64 MiB it stays. Under a limit
    that the peak plus the state pass, the step fits whole, so the state is made on the device;
    at the step's end what passes the limit moves, and what fits beside the peak (with a margin
    of 1/32 of the limit) stays: the smallest tensors. Exact."""
    from lmsrt.device import SimulatedDevice

    ref, _, _ = _train("sim", "adamw", batch=4096)
    probe = make_lms("sim", lms=64)
    _train("sim", "adamw", lms=probe, steps=1, batch=4096)
    peak = probe.stats()["last_step"]["gpu_peak_bytes"]
    probe.close()
    state = sum(2 * p.numel() * 4 for p in _model("cpu").parameters() if p.numel() * 4 >= 64 << 10)
    moved = {}
    for cap in (64 << 20, (peak + (1 << 20)) * 32 // 29):
        lms = lmsrt.LMS(device=SimulatedDevice(capacity=cap), lms=64, lms_frac=0.0)
        got, opt, _ = _train("sim", "adamw", lms=lms, batch=4096)
        _assert_same_params(ref, got)
        moved[cap] = lms.stats()["last_step"]["optimizer_host_bytes"]     # (opt alive)
        lms.close()
    (roomy, moved_roomy), (tight, moved_tight) = moved.items()
    assert moved_roomy == 0
    assert 0 < moved_tight < state
    assert moved_tight >= peak + state - (tight - (tight >> 4))      # what did not fit moved
    assert peak + state - moved_tight <= tight - (tight >> 4) - (tight >> 5)   # the rest fits


def _counted(device):
    """A step post-hook that has the simulated device count the optimizer's state tensors, as
    a GPU counts them (the simulated device counts only what lmsrt allocates); a hook of the
    user's, so steps are not cut in parts."""
    def count(opt, args, kwargs):
        for state in dict.values(opt.state):
            for t in state.values():
                whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
                if isinstance(t, torch.Tensor) and t.numel() > 1 and whole:
                    device.note_saved(t.untyped_storage())    # (host slots are views: skipped)
    return count


def test_under_cudnns_search_the_next_step_is_judged():
    """Rule 1: where cuDNN's benchmark mode searches algorithms in the step that made the state
    (its workspaces take what memory there is: the simulated device's ``tuning`` stands in for
    it), that step's peak is not the model's, so the state is judged at the next step's end,
    the peak with the state in it: still all on the device after step 1, and after step 2
    moved as much as it would have been after step 1 without the search. Exact."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from lmsrt.device import SimulatedDevice

    ref, _, _ = _train("sim", "adamw", batch=4096)
    probe = make_lms("sim", lms=64)
    _train("sim", "adamw", lms=probe, steps=1, batch=4096)
    peak = probe.stats()["last_step"]["gpu_peak_bytes"]
    probe.close()
    cap = (peak + (1 << 20)) * 32 // 29
    moved = {}
    for tuning in (False, True):
        device = SimulatedDevice(capacity=cap)
        device.tuning = tuning
        lms = lmsrt.LMS(device=device, lms=64, lms_frac=0.0)
        history = []
        handle = register_optimizer_step_post_hook(_counted(device))
        try:
            got, opt, _ = _train("sim", "adamw", lms=lms, batch=4096,
                                 probe=lambda o: history.append(lms.stats()["last_step"]))
        finally:
            handle.remove()
        _assert_same_params(ref, got)
        moved[tuning] = [h["optimizer_host_bytes"] for h in history]
        lms.close()
    assert moved[False][1] > 0 and moved[True][1] == 0          # read in step 2's backward
    assert moved[True][2] == moved[False][2] > 0                # and in step 3's


def test_the_placement_moves_only_what_does_not_fit():
    """Rule 1 as arithmetic (movers/placement.py), under a limit of 1600 bytes: fit means a peak
    within 1500, room is what stays under 1450."""
    from lmsrt.movers.placement import Placement

    def fits(peak):
        return peak <= 1500

    def room(peak):
        return max(0, 1450 - peak)

    auto = Placement("auto", fits, room, part_bytes=100)
    host = Placement("host", fits, room, part_bytes=100)
    assert not auto.moves_before(allocated=800, state=400, temporaries=200)    # 1400: fits
    assert auto.moves_before(allocated=800, state=600, temporaries=200)        # 1600: does not
    assert host.moves_before(allocated=0, state=1, temporaries=0)
    assert not auto.moves_after(peak=1000, made=500) and auto.moves_after(peak=1000, made=600)
    assert not auto.moves_after(peak=2000, made=0) and host.moves_after(peak=0, made=0)
    sizes = {1: 300, 2: 50, 3: 100, 4: 200}
    assert auto.stays(sizes, peak=1100) == {2, 3, 4}           # room 350: 50 + 100 + 200
    assert auto.stays(sizes, peak=1100, began=900) == {2, 3}   # beside 900 + 4 parts: 150
    assert auto.stays(sizes, peak=1500) == set() and host.stays(sizes, peak=0) == set()


class _MyAdamW(torch.optim.AdamW):
    """A subclass (a library's optimizer): its steps are not cut in parts."""


def test_a_closures_step_is_judged_by_the_peak_of_its_forward_and_backward():
    """Rule 1: a step not cut in parts whose forward and backward run in its closure is judged
    by their peak, read once the closure returned: under the limit that moves some of AdamW's
    state after plain steps, the same moves with a closure."""
    from lmsrt.device import SimulatedDevice

    probe = make_lms("sim", lms=64)
    _train("sim", "adamw", lms=probe, steps=1, batch=4096)
    peak = probe.stats()["last_step"]["gpu_peak_bytes"]
    probe.close()
    cap = (peak + (1 << 20)) * 32 // 29
    OPTIMIZERS["my-adamw"] = lambda ps: _MyAdamW(ps, lr=1e-2)
    try:
        moved = []
        for closure in (False, True):
            ref, _, _ = _train("sim", "my-adamw", batch=4096, closure=closure)
            lms = lmsrt.LMS(device=SimulatedDevice(capacity=cap), lms=64, lms_frac=0.0)
            got, opt, _ = _train("sim", "my-adamw", lms=lms, batch=4096, closure=closure)
            _assert_same_params(ref, got)
            moved.append(lms.stats()["last_step"]["optimizer_host_bytes"])
            lms.close()
    finally:
        del OPTIMIZERS["my-adamw"]
    assert moved[0] > 0 and moved[1] == moved[0], moved


def test_a_saved_state_dict_holds_the_state_not_the_pinned_slabs(tmp_path):
    """Rule 5: the host tensors' storages are their own bytes, so torch.save of state_dict()
    writes the state (about what it writes without lmsrt), not the pinned slabs around it."""
    _, ref_opt, _ = _train("sim", "adamw", steps=2)
    torch.save(ref_opt.state_dict(), tmp_path / "ref.pt")
    lms = make_lms("sim", optimizer_state="host", lms=64)
    _, opt, _ = _train("sim", "adamw", lms=lms, steps=2)
    torch.save(opt.state_dict(), tmp_path / "lms.pt")
    lms.close()
    ref, got = (tmp_path / "ref.pt").stat().st_size, (tmp_path / "lms.pt").stat().st_size
    assert got < ref + (64 << 10), (got, ref)


def test_state_made_after_the_first_step_is_sized_into_the_parts(monkeypatch):
    """Rule 7: layers frozen at step 1 (no gradient: no state) and unfrozen at step 2 make their
    state in step 2's parts, sized as it will be (AdamW: two copies of each): step 2 runs in as
    many parts of 1 MiB as all its state needs, not in those of step 1's state alone. Exact."""
    body, calls = _step_body(), []

    def counted(*args, **kwargs):
        calls[-1] += 1
        return body(*args, **kwargs)

    def run(lms):
        model = _model(torch.device("cpu"), 256)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        late = list(model.parameters())[2:20]
        x = torch.randn(32, 64)
        seen = []
        for step in range(3):
            for p in late:
                p.requires_grad_(step > 0)
            opt.zero_grad()
            with lms or contextlib.nullcontext():
                loss = model(x).square().mean()
            loss.backward()
            calls.append(0)
            opt.step()
            seen.append([p.detach().clone() for p in model.parameters()])
        return seen, opt

    ref, _ = run(None)
    monkeypatch.setattr(torch.optim.AdamW.step, "__wrapped__", counted)
    calls.clear()
    with _limited("sim", 16 << 20) as lms:
        got, opt = run(lms)
        state = sum(t.numel() * t.element_size() for t in _host_tensors(opt))
    _assert_same_params(ref, got)
    assert state > 6 << 20 and calls[1] >= state // (1 << 20) - 1, (calls, state)


def test_gpu_keeps_the_state_where_the_optimizer_made_it():
    lms = make_lms("sim", optimizer_state="gpu", lms=64)
    ref, _, _ = _train("sim", "adamw", steps=2)
    got, opt, _ = _train("sim", "adamw", lms=lms, steps=2)
    _assert_same_params(ref, got)
    assert type(opt.state) is collections.defaultdict
    assert lms.stats()["last_step"]["optimizer_host_bytes"] == 0
    lms.close()


def test_a_dropped_optimizer_gives_its_host_memory_back():
    """Three optimizers one after the other under one LMS, each dropped before the next: the
    pinned memory in use (its peak in each last step) is the same for each; none is left held
    by the ones before."""
    import gc

    lms = make_lms("sim", optimizer_state="host", lms=64)
    used = []
    for _ in range(3):
        _, opt, _ = _train("sim", "adamw", lms=lms, steps=2)
        del opt
        gc.collect()
        used.append(lms.stats()["last_step"]["host_peak_bytes"])
    assert used[0] > 2 << 20 and used[2] == used[0], used


class _Lagging:
    """The mover's copies with a D2H stream that lags: a write-back runs only once something
    waits on its event (or a later one's), or the device synchronizes, as on a GPU whose copies
    out are still in flight. Copies in run at once."""

    class _Event:
        def __init__(self, lagging, index):
            self.lagging, self.index = lagging, index

        def wait(self, stream=None):
            self.lagging.run(self.index)

        synchronize = wait

        def query(self):
            return self.lagging.done >= self.index

    def __init__(self, copies, device):
        self.copies, self.d2h, self.h2d = copies, copies.d2h, copies.h2d
        self.pending, self.done, self.count = [], 0, 0
        synchronize = device.synchronize

        def all_then_device():
            self.run(self.count)
            synchronize()
        device.synchronize = all_then_device

    def run(self, index):
        while self.pending and self.pending[0][0] <= index:
            self.done, write = self.pending.pop(0)
            write()

    def copy_out(self, storage, slot, stream):
        source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        target = slot.tensor
        self.count += 1
        self.pending.append((self.count, lambda: target.copy_(source)))
        return self._Event(self, self.count)

    def copy_in(self, block, slot, stream):
        return self.copies.copy_in(block, slot, stream)


def _lagging(lms):
    """``lms``'s optimizer state written back by ``_Lagging`` copies (a test seam: the mover's
    copies, as the engine gives them)."""
    mover = lms._engine.optimizer_mover
    mover.copies = _Lagging(mover.copies, lms._device)
    return mover.copies


@pytest.mark.parametrize("limit", [1 << 30, 16 << 20], ids=["whole", "parts"])
def test_reads_between_steps_wait_for_write_backs_in_flight(limit):
    """Rule 5, with write-backs that lag: state_dict() after each step is the plain run's, bit
    for bit, and a state dict loaded back mid-run trains on exactly (two optimizers, as a GAN's
    loop has)."""
    def run(lms):
        models = [_model(torch.device("cpu"), 256) for _ in range(2)]
        opts = [torch.optim.AdamW(models[0].parameters(), lr=1e-2),
                torch.optim.SGD(models[1].parameters(), lr=1e-2, momentum=0.9)]
        x = torch.randn(32, 64)
        saved, seen = [], []
        for step in range(4):
            for model, opt in zip(models, opts):
                opt.zero_grad()
                with lms or contextlib.nullcontext():
                    loss = model(x).square().mean()
                loss.backward()
                opt.step()
                state = opt.state_dict()["state"]
                saved.append({i: {k: v.clone() for k, v in s.items()} for i, s in state.items()})
                if step == 1:
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            seen.append([p.detach().clone() for m in models for p in m.parameters()])
        return saved, seen

    ref_saved, ref = run(None)
    with _limited("sim", limit) as lms:
        lagging = _lagging(lms)
        saved, got = run(lms)
        assert lagging.count > 0
    _assert_same_params(ref, got)
    for a, b in zip(ref_saved, saved):
        assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


@pytest.mark.parametrize("limit", [1 << 30, 16 << 20], ids=["whole", "parts"])
def test_state_loaded_before_the_first_step_moves_exactly(limit):
    """Rule 1 with Rule 3: a resumed run (state loaded before its first step) moves the state it
    found; in parts, out in the pre-hook and in again part by part, each part's copies in after
    the write-backs (here lagging) that fill its places. Exact against the plain resumed run."""
    def run(lms, state=None, steps=3):
        model = _model(torch.device("cpu"), 256)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if state is not None:           # (load_state_dict keeps the tensors it is given)
            model.load_state_dict(state[0])
            opt.load_state_dict(copy.deepcopy(state[1]))
        seen = _loop(model, opt, torch.randn(32, 64), lms, steps)
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        return seen, saved, opt

    _, saved, _ = run(None, steps=2)
    ref, _, _ = run(None, saved)
    with _limited("sim", limit) as lms:
        lagging = _lagging(lms)
        got, _, opt = run(lms, saved)
        assert lagging.count > 0 and lms.stats()["last_step"]["optimizer_host_bytes"] > 0
    _assert_same_params(ref, got)


def _step_body():
    """AdamW's step body under torch's hook wrapper (which a first AdamW puts on the class):
    what a step in parts runs for each part."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return torch.optim.AdamW.step.__wrapped__


@pytest.mark.parametrize("where", ["first", "third"])
def test_a_step_that_raises_inside_a_part_leaves_the_groups_whole(where, monkeypatch):
    """Rule 7: a step that raises inside a part (an allocation of its state that fails as its
    first part comes in, or its third part's update) leaves the parameter groups whole and the
    state readable; the steps after it update every parameter."""
    with _limited("sim", 16 << 20) as lms:
        model = _model(torch.device("cpu"), 256)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(32, 64)
        count = len(opt.param_groups[0]["params"])

        def step():
            opt.zero_grad()
            with lms:
                loss = model(x).square().mean()
            loss.backward()
            opt.step()

        step()
        calls = []
        if where == "first":                    # the third block the first part's read asks
            device, empty = lms._device, lms._device.empty

            def fails(nbytes):
                calls.append(nbytes)
                if len(calls) == 3:
                    raise torch.OutOfMemoryError("simulated")
                return empty(nbytes)
            monkeypatch.setattr(device, "empty", fails)
        else:                                   # the third part's body
            body = _step_body()

            def fails(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise torch.OutOfMemoryError("simulated")
                return body(*args, **kwargs)
            monkeypatch.setattr(torch.optim.AdamW.step, "__wrapped__", fails)
        with pytest.raises(torch.OutOfMemoryError):
            step()
        assert len(calls) == 3
        monkeypatch.undo()
        assert len(opt.state_dict()["state"]) == count          # readable, whole
        assert len(opt.param_groups[0]["params"]) == count
        before = [p.detach().clone() for p in model.parameters()]
        step()
        step()
        assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_closing_the_lms_gives_the_pinned_memory_back():
    """Rule 6: once the state is back on the device, the host memory it took goes back with the
    LMS, though the optimizer lives on."""
    import gc

    from lmsrt.device import SimulatedDevice
    device = SimulatedDevice(capacity=1 << 30)
    lms = lmsrt.LMS(device=device, lms=64, lms_frac=0.0, optimizer_state="host")
    _, opt, _ = _train("sim", "adamw", lms=lms, steps=2)
    assert device.pinned_total > 0
    lms.close()
    gc.collect()
    assert device.pinned_total == 0 and opt.state


@pytest.mark.cuda
def test_a_resumed_run_moves_the_state_it_loads_as_the_first_run_did():
    """Rule 1: a run resumed from a state dict (loaded before its first step, as the Trainer and
    Lightning resume) moves the state it finds on the GPU as the first run moved the state it
    made: AdamW's 384 MiB beside 192 MiB of parameters under a GPU capped at 1 GiB, in host
    mode (torch's load_state_dict puts the state on the parameters' device, so the cap must
    hold it there through one forward and backward: 768 MiB), exactly."""
    def run(lms, steps, state=None, params=None):
        model = _model(torch.device("cuda"), 2048)
        if params is not None:
            model.load_state_dict(params)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if state is not None:
            opt.load_state_dict(state)
        x = torch.randn(32, 64, device="cuda")
        for _ in range(steps):
            opt.zero_grad()
            with lms or contextlib.nullcontext():
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
        return model, opt

    # On the CPU, the reference run's optimizer dropped: off the GPU capped below.
    ref = [p.detach().cpu() for p in run(None, 4)[0].parameters()]
    with _limited("cuda", 1 << 30) as lms:
        model, opt = run(lms, 2)
        first = lms.stats()["last_step"]["optimizer_host_bytes"]
        # Both on the CPU, as a checkpoint is read, the first run dropped: the second run's cap
        # holds only what it loads (torch's load_state_dict puts the state on the GPU).
        state = copy.deepcopy(opt.state_dict())
        params = {k: v.cpu() for k, v in model.state_dict().items()}
        del model, opt
    with _limited("cuda", 1 << 30) as lms:
        model, opt = run(lms, 2, state, params)
        assert first > 0 and lms.stats()["last_step"]["optimizer_host_bytes"] > 0
    for a, b in zip(ref, model.parameters()):
        assert torch.equal(a, b.cpu())


def test_the_step_hooks_go_with_the_last_mover():
    """lmsrt's two global step hooks are there while a mover is open, and go with the last
    (another test's LMS, held by a graph it left unfinished, may still be open)."""
    from torch.optim import optimizer as optim

    from lmsrt.movers import optimizer as movers

    def ours():
        return [sum(getattr(h, "__module__", "") == movers.__name__ for h in hooks.values())
                for hooks in (optim._global_optimizer_pre_hooks,
                              optim._global_optimizer_post_hooks)]

    lms = make_lms("sim", optimizer_state="host", recompute=False)
    assert ours() == [1, 1]
    lms.close()
    others = any(ref() is not None and not ref().closed for ref in movers._movers)
    assert ours() == ([1, 1] if others else [0, 0])


def test_a_bad_optimizer_state_setting_says_what_to_give():
    with pytest.raises(ValueError, match="optimizer_state must be one of auto, host, gpu"):
        lmsrt.LMS(device="sim", optimizer_state="cpu")


def test_the_plan_of_saved_tensors_is_judged_by_the_training_pass_not_the_update():
    """Rule 9: AdamW's state brought in whole for each step (a step hook of the user's: no parts)
    takes the step's peak past the bound of a simulated device a little larger than it; forward
    and backward stay far under. The saved tensors' plan is judged by the training pass: no
    correction for what the update held (judged by the whole step, it grew every step)."""
    from lmsrt.device import SimulatedDevice

    torch.manual_seed(0)
    model = _model(torch.device("cpu"), 400)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.register_step_post_hook(lambda *args: None)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    device = SimulatedDevice(capacity=state + state // 24)
    lms = lmsrt.LMS(device=device, lms=64, optimizer_state="host")
    x = torch.randn(64, 64)
    peaks, notes, corrections = [], [], []
    for _ in range(8):
        opt.zero_grad()
        with lms:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        peaks.append(device.peak_allocated())
        last = lms.stats()["last_step"]
        notes.append(last["policy_note"])
        corrections.append(lms._engine.policy.correction)
    policy = lms._engine.policy
    assert not policy.learning
    assert min(peaks[2:]) > policy.bound, (peaks, policy.bound)
    assert max(corrections) <= 0, (corrections, notes)
    assert not any("passed the bound" in n for n in notes), notes


def test_a_steps_parts_are_sized_by_the_room_beside_it():
    """Rule 9: a fifth of the room beside what the step begins with, a sixteenth of the limit
    at most, an eighth of that at least."""
    from lmsrt.movers.placement import Placement
    from lmsrt.policy.protocol import LimitShares

    class Limit(LimitShares):
        def __init__(self, limit):
            self.limit = limit

    gib = 1 << 30
    shares = Limit(16 * gib)
    placement = Placement("auto", shares.step_fits, shares.room_beside, part_bytes=gib)
    assert placement.part_size(0) == gib
    room = shares.room_beside(11 * gib)
    assert 0 < room < 5 * gib
    assert placement.part_size(11 * gib) == room // 5 < gib
    assert placement.part_size(16 * gib) == gib >> 3


def test_parts_larger_than_a_fifth_of_the_room_are_held_two_at_a_time():
    """Rule 9: where a part (one parameter's state) is more than a fifth of the room, a part's
    copies in wait for the write-back of the part just before it, not two before."""
    from lmsrt.movers.placement import Placement
    from lmsrt.movers.streamed import Parts

    mib = 1 << 20
    placement = Placement("auto", lambda peak: True, lambda peak: 512 * mib - peak,
                          part_bytes=32 * mib)
    assert placement.depth(384 * mib, 32 * mib) == 2       # 128 MiB of room: four parts
    assert placement.depth(400 * mib, 32 * mib) == 1       # 112 MiB: three
    assert placement.depth(464 * mib, 32 * mib) == 0       # 48 MiB: one, and its temporaries
    model = _model(torch.device("cpu"), 256)
    opt = torch.optim.AdamW(model.parameters())
    per = {id(p): 2 * p.numel() * p.element_size() for p in model.parameters()}
    parts = Parts.plan(opt, per, part_bytes=1 << 20)
    assert parts.largest == max(sum(per[id(p)] for group in part for p in group)
                                for part in parts.parts) >= 1 << 19
    parts.written = ["first", "second", "third"]
    assert parts.paced_by("before") == "second"
    parts.depth = 1
    assert parts.paced_by("before") == "third"
    parts.depth = 0                                        # (none ahead: nothing paces it)
    assert parts.paced_by("before") == "before"
    parts.written = []
    assert parts.paced_by("before") == "before"


def test_a_parts_blocks_are_asked_for_once_the_write_back_before_has_landed():
    """Rule 7: before the blocks of the part after the one running are asked for, the host
    waits for the write-back two parts before (a wait queued on the copy stream alone lets the
    host run ahead of the GPU, and the allocator, finding those blocks still in flight, frees
    its cache to go on): between parts, the host's waits, each before the blocks."""
    with _limited("sim", 16 << 20) as lms:
        lagging = _lagging(lms)
        mover = lms._engine.optimizer_mover
        log, between = [], [False]
        wait = _Lagging._Event.wait

        class Event(_Lagging._Event):
            def synchronize(self):
                if between[0]:
                    log.append(("host waits", self.index, lagging.done))
                wait(self)
        lagging._Event = Event
        empty, next_part = mover.device.empty, mover._next_part

        def asking(nbytes):
            if between[0]:
                log.append(("asks", nbytes, lagging.done))
            return empty(nbytes)

        def next_part_logged(*args):
            between[0] = True
            try:
                next_part(*args)
            finally:
                between[0] = False
        mover.device.empty, mover._next_part = asking, next_part_logged
        _state_peaks(lms, "adamw", steps=3)
    waits = [entry for entry in log if entry[0] == "host waits"]
    # Parts of 1 MiB of 6 MiB of state: from the third part of each later step on.
    assert len(waits) >= 2 * 3, log
    for k, entry in enumerate(log):
        if entry[0] == "asks":
            earlier = [e for e in log[:k] if e[0] == "host waits"]
            assert not earlier or entry[2] >= earlier[-1][1], log


class _Workspace(torch.autograd.Function):
    """The identity, whose backward takes ``nbytes`` of the simulated device for a while (a
    backward's workspace)."""

    @staticmethod
    def forward(ctx, x, device, nbytes):
        ctx.device, ctx.nbytes = device, nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.device.empty(ctx.nbytes)
        return grad, None, None


def test_a_backward_after_one_optimizers_step_is_judged_with_the_training_pass():
    """Rule 9, a GAN's loop: the generator's forward under the LMS, the discriminator's step,
    then the generator's backward (its peak: a 16 MiB workspace) and its step. The training
    pass the policy is judged by holds that backward, though it came after the first
    optimizer's read."""
    from lmsrt.device import SimulatedDevice

    torch.manual_seed(0)
    device = SimulatedDevice(capacity=64 << 20)
    lms = lmsrt.LMS(device=device, lms=64, optimizer_state="host")
    gen = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    disc = torch.nn.Linear(64, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2)
    policy, judged = lms._engine.policy, []
    finish = policy.finish_step

    def finish_step(plan, **figures):
        judged.append(figures["peak"])
        return finish(plan, **figures)
    policy.finish_step = finish_step
    for _ in range(4):
        with lms:
            fake = _Workspace.apply(gen(torch.randn(32, 64)), device, 16 << 20)
        opt_d.zero_grad()
        disc(fake.detach()).sum().backward()
        opt_d.step()
        opt_g.zero_grad()
        disc(fake).sum().backward()
        opt_g.step()
    assert judged and all(peak >= 16 << 20 for peak in judged), judged


@pytest.mark.parametrize("refused", [14, 5])
def test_an_allocation_that_fails_while_a_part_comes_in_leaves_no_copy_unwaited(refused):
    """Rule 3: where asking for a block of the part coming in fails (out of memory, under a
    caller that goes on, as the Trainer's batch-size finder does), the step waits for the copies
    in already started: their tensors are in the state dict, and a later read must find them
    whole. The run then goes on, every step whole again. (In step 2, the 14th block asked for is
    the third part's second; the 5th, the second part's first, asked for right after the first
    part's copies in.)"""
    with _limited("sim", 16 << 20) as lms:
        mover = lms._engine.optimizer_mover
        copies, issued = mover.copies, []

        class Watched:
            def __init__(self, event):
                self.event, self.waited = event, False

            def wait(self, stream=None):
                self.waited = True
                self.event.wait(stream)

        class Copies:
            d2h, h2d = copies.d2h, copies.h2d

            def __getattr__(self, name):
                return getattr(copies, name)

            def copy_in(self, block, slot, stream):
                issued.append(Watched(copies.copy_in(block, slot, stream)))
                return issued[-1]
        mover.copies = Copies()
        empty, asked = mover.device.empty, []

        def failing(nbytes):
            asked.append(nbytes)
            if len(asked) == refused:
                raise torch.OutOfMemoryError("injected")
            return empty(nbytes)
        mover.device.empty = failing
        model = _model(torch.device("cpu"), 256)
        opt = OPTIMIZERS["adamw"](model.parameters())
        x = torch.randn(32, 64)
        failed = []
        for step in range(4):
            opt.zero_grad()
            with lms:
                loss = model(x).square().mean()
            loss.backward()
            try:
                opt.step()
            except torch.OutOfMemoryError:
                failed.append(step)
                # Every copy in started before the failure is waited for (in order on its
                # stream: the last one's wait covers them).
                assert issued and issued[-1].waited
        state = _host_tensors(opt)
        assert failed == [1] and len(asked) > refused
        assert [len(g["params"]) for g in opt.param_groups] == [len(list(model.parameters()))]
        assert all(t.is_cpu for t in state) and all(torch.isfinite(t).all() for t in state)


def test_the_update_of_a_step_whose_state_moved_is_timed_on_the_gpu(monkeypatch):
    """The GPU time of each optimizer step whose state moved, from the training pass's end to
    the update's last copy queued (events on the compute stream), read into the step's
    ``optimizer_update_ms``; nothing where the state stays (auto, where it fits)."""
    from lmsrt.device import _SimEvent
    monkeypatch.setattr(_SimEvent, "elapsed_time", lambda self, other: 2.5)
    for mode, limit in (("host", 16 << 20), ("auto", 1 << 30)):
        with _limited("sim", limit, mode=mode) as lms:
            _train("sim", "adamw", lms=lms, stack=256, steps=3)
            stats = lms.stats()
            total = stats["total"]
        if mode == "host":
            # Steps 1 and 2, finished at the next step's first save: 2.5 ms each.
            assert [s["optimizer_update_ms"] for s in stats["history"]] == [2.5, 2.5]
            assert total["optimizer_update_ms"] >= 5.0
        else:
            assert total["optimizer_update_ms"] == 0.0 and total["optimizer_in_bytes"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 0], ids=["two-held", "one-held"])
def test_parts_over_a_fifth_of_the_room_step_exactly(depth, monkeypatch):
    """Rule 9: 192 MiB of parameters and as much of gradients, and one weight's AdamW state of
    32 MiB: under a GPU capped to leave three such parts of room beside them (what the room
    counts: the limit's margins, and whatever else is allocated, cuBLAS's workspaces of each
    thread), parts are held two at a time (``Placement.depth`` 1); capped to leave one and a
    half, one at a time (0). Exact either way."""
    from lmsrt.movers.placement import Placement
    depths = []
    chosen = Placement.depth
    monkeypatch.setattr(Placement, "depth",
                        lambda self, *a: depths.append(chosen(self, *a)) or depths[-1])
    before = torch.cuda.memory_allocated()
    ref = _train("cuda", "adamw", stack=2048)[0]   # its model and optimizer dropped here
    # What stays allocated once they are (cuBLAS's workspaces), beside 384 MiB of parameters
    # and gradients; the room is the limit less 3/32 of it less what is allocated.
    base = torch.cuda.memory_allocated() - before + (384 << 20)
    room = (96 << 20) if depth else (48 << 20)
    with _limited("cuda", (before + base + room) * 32 // 29) as lms:
        got, _, _ = _train("cuda", "adamw", lms=lms, stack=2048)
        assert lms.stats()["total"]["optimizer_out_bytes"] > 300 << 20
    _assert_same_params(ref, got)
    assert depths and set(depths) == {depth}, (depths, base >> 20)


@pytest.mark.cuda
def test_the_update_is_timed_on_the_gpu():
    """optimizer_update_ms: the GPU time of the updates whose state moved (AdamW over 384 MiB
    of state, in parts, brought in from pinned memory: milliseconds, not zero)."""
    with _limited("cuda", 1 << 30) as lms:
        _train("cuda", "adamw", lms=lms, stack=2048)
        history = lms.stats()["history"]
    # (An update still running when the next step begins counts in that one.)
    assert len(history) >= 2 and sum(s["optimizer_update_ms"] for s in history) > 0, history


@pytest.mark.parametrize("fits", [False, True], ids=["moves", "stays"])
def test_auto_judges_state_loaded_before_the_first_step_as_made_by_it(fits):
    """Rule 1 under auto: a resumed run's state, loaded before its first step, is judged at that
    step's end as if the step had made it: it leaves where it would not fit beside the step (a
    simulated device smaller than it), stays where it fits; exact either way."""
    from lmsrt.device import SimulatedDevice

    def run(lms, state=None, steps=3):
        model = _model(torch.device("cpu"), 256)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(copy.deepcopy(state[1]))
        seen = _loop(model, opt, torch.randn(32, 64), lms, steps)
        return seen, (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())), opt

    _, saved, _ = run(None, steps=2)
    ref, _, _ = run(None, saved)
    state = sum(t.numel() * t.element_size() for s in saved[1]["state"].values()
                for t in s.values() if t.numel() > 1)
    capacity = 4 * state if fits else state - state // 8
    lms = lmsrt.LMS(device=SimulatedDevice(capacity=capacity), lms=64)
    got, _, opt = run(lms, saved)
    moved = lms.stats()["last_step"]["optimizer_host_bytes"]
    _assert_same_params(ref, got)
    if fits:
        assert moved == 0 and not _host_tensors(opt)[0].is_pinned()
    else:       # only what does not fit beside the step leaves (the smallest stay)
        assert 0 < moved < state and state - moved <= capacity - capacity // 16


def test_a_step_captured_in_a_cuda_graph_is_left_alone(monkeypatch):
    """A step captured in a CUDA graph (a capturable optimizer under torch.cuda.graph) must not
    see copies, events or host waits: the mover steps aside, its state stays where the
    optimizer made it, and the steps are exact."""
    import lmsrt.movers.optimizer as mover_module

    ref, _, _ = _train("sim", "adamw", stack=256)
    with _limited("sim", 16 << 20) as lms:
        monkeypatch.setattr(mover_module, "capturing", lambda: True)
        got, opt, _ = _train("sim", "adamw", lms=lms, stack=256)
        assert lms.stats()["last_step"]["optimizer_host_bytes"] == 0
        assert type(opt.state) is collections.defaultdict
    _assert_same_params(ref, got)
