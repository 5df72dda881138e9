"""Regions recomputed without being asked reproduce forward exactly, or are refused and said (issue
47; NOTE [ Recomputed regions ] in lmsrt/recompute/regions.py). Each case trains the same seeded
model with and without an LMS whose plan recomputes every region, and compares the losses, the
gradients and every buffer with ``torch.equal``; a refusal is asserted with its reason. Each
check runs on the simulated device, and on CUDA under the marker:

    python -m pytest -q tests/test_region_exact.py              # CUDA twins skipped
    python -m pytest -q -m cuda tests/test_region_exact.py      # on a GPU machine
"""
import contextlib
import gc
import random
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from models import DEVICES, assert_same_steps, lmsrt_warnings, run_threads, torch_device
from torch import nn

import lmsrt


def _lms(kind: str) -> lmsrt.LMS:
    """An LMS whose plan recomputes every usable region (as test_regions.py's)."""
    lms = lmsrt.LMS(lms=1, lms_frac=0.0, device=kind)
    lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    return lms


def _train(model, x, steps, lms=None, loss_of=None, between=None, seed=0):
    """Per step: the loss, the gradients and the buffers after it."""
    out = []
    for step in range(steps):
        torch.manual_seed(seed + step)
        random.seed(step)
        with lms if lms is not None else contextlib.nullcontext():
            y = model(x) if loss_of is None else loss_of(model, x)
            loss = (y[0] if isinstance(y, tuple) else y).float().square().mean()
        if between is not None:
            between(model)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()],
                    [b.clone() for b in model.buffers()]))
        model.zero_grad(set_to_none=True)
    return out


def _exact(kind, make, x, steps=4, tuning=False, **kw) -> lmsrt.LMS:
    """Train ``make()`` without and with a forced-regions LMS; assert both the same.
    ``tuning``: the simulated device stands in for cuDNN's benchmark mode."""
    dev = torch_device(kind)
    torch.manual_seed(0)
    plain_model = make().to(dev)
    model = make().to(dev)
    model.load_state_dict(plain_model.state_dict())
    lms = _lms(kind)
    if tuning:
        lms._device.tuning = True
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)        # bit-exact comparisons on CUDA
    try:
        plain = _train(plain_model, x.to(dev), steps, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            under = _train(model, x.to(dev), steps, lms, **kw)
    finally:
        torch.use_deterministic_algorithms(was)
    assert_same_steps(plain, under)
    return lms


def _regions(lms) -> dict:
    return lms.stats()["regions"]


def _recomputed(lms) -> int:
    return lms.stats()["total"]["recomputed_regions"]


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class Stack(nn.Module):
    def __init__(self, block=MLP, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


# -- keyword and nested arguments (issue 46, issue 47 case 3) ---------------------------------

class KwargsLayer(nn.Module):
    """Called as a transformers decoder layer is: keyword arguments, a tuple of tensors, a
    dict, non-tensor leaves; returns a tuple."""

    def __init__(self, d=32):
        super().__init__()
        self.mlp, self.ln = MLP(d), nn.LayerNorm(d)

    def forward(self, hidden, attention_mask=None, position_embeddings=None, extra=None,
                use_cache=False):
        cos, sin = position_embeddings
        h = self.ln(hidden) * cos + sin * extra["scale"] + attention_mask
        assert use_cache is False
        return self.mlp(h), None


class KwargsModel(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.layers = nn.ModuleList(KwargsLayer(d) for _ in range(n))
        self.cos = nn.Parameter(torch.randn(d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        cos, sin = self.cos.tanh(), self.drop(self.cos.sin())
        mask = torch.zeros_like(x)
        for layer in self.layers:
            x, _ = layer(x, attention_mask=mask, position_embeddings=(cos, sin),
                         extra={"scale": sin * 2, "name": "x"}, use_cache=False)
        return x


def _check_kwargs(kind):
    lms = _exact(kind, KwargsModel, torch.randn(8, 16, 32))
    assert _regions(lms)["refused"] == {} and _regions(lms)["recomputed"] == 4


@pytest.mark.parametrize("kind", DEVICES)
def test_keyword_and_nested_arguments_are_recomputed_exactly(kind):
    _check_kwargs(kind)


class Pair(nn.Module):
    """Takes and returns ``(x, state)``, as a Sequential of stateful cells passes it."""

    def __init__(self, d=32):
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d), nn.Dropout(0.3)

    def forward(self, pair):
        x, state = pair
        return self.drop(torch.tanh(self.fc(x) + state)), state + 1


def _check_nested_rng(kind):
    """Dropout's draws come back in the rerun for a region whose only tensors are nested in a
    tuple (on CUDA: the RNG state of the device they live on)."""
    def loss_of(model, x):
        return model((x, torch.ones_like(x)))[0]

    lms = _exact(kind, lambda: nn.Sequential(*[Pair() for _ in range(3)]), torch.randn(8, 32),
                 loss_of=loss_of)
    assert _recomputed(lms) > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_tensors_nested_in_an_argument_are_packed_and_their_rng_restored(kind):
    _check_nested_rng(kind)


class Carry(nn.Module):
    """Passes ``(x, state)`` through its cells and scales the state in place after each (the
    cells' ops do not save it)."""

    def __init__(self):
        super().__init__()
        self.cells = nn.ModuleList(Pair() for _ in range(3))

    def forward(self, x):
        state = torch.ones_like(x)
        for cell in self.cells:
            x, new = cell((x, state))
            state.mul_(2.0).add_(new)
        return x


def test_a_nested_input_changed_after_its_region_trains_exactly():
    lms = _exact("sim", Carry, torch.randn(8, 32), steps=5)
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4,
                                     n_positions=64)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gpt2], ids=["llama", "gpt2"])
def test_transformers_decoder_layers_are_recomputed_exactly(make):
    make()                                    # skips without transformers
    ids = torch.randint(0, 64, (2, 16))

    def loss_of(model, x):
        return model(input_ids=x, labels=x).loss

    lms = _exact("sim", make, ids, steps=3, loss_of=loss_of)
    regions = _regions(lms)
    assert regions["refused"] == {} and regions["recomputed"] == 3, regions
    assert lms.stats()["total"]["recomputed_bytes"] > 0


class _KeyCache:
    """Appends each layer's keys at its call, as transformers' DynamicCache does."""

    def __init__(self):
        self.keys = {}

    def update(self, i, k):
        self.keys[i] = k if i not in self.keys else torch.cat([self.keys[i], k])
        return self.keys[i]


class CachedLayer(nn.Module):
    def __init__(self, i, d=32):
        super().__init__()
        self.i, self.fc = i, nn.Linear(d, d)

    def forward(self, x, cache):
        k = cache.update(self.i, self.fc(x))     # as many keys as calls of this layer so far
        return x + torch.tanh(x @ k.t()) @ k / k.shape[0]


class CachedStack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(CachedLayer(i) for i in range(n))

    def forward(self, x):
        self.cache = _KeyCache()
        for b in self.blocks:
            x = b(x, cache=self.cache)
        return x


@pytest.mark.parametrize("kind", DEVICES)
def test_an_argument_its_forward_changes_is_as_forward_found_it_in_the_rerun(kind):
    """A rerun in backward got the caller's cache after forward had appended to it: it ran
    with twice the keys (here its saves had other shapes and backward raised; transformers'
    Llama, whose layers are called with a DynamicCache, was left with the cache twice its
    length). Now it runs from a copy as forward found it, and the caller's cache is the run
    without lmsrt's."""
    made = []

    def make():
        made.append(CachedStack())
        return made[-1]

    x = torch.randn(8, 32)
    lms = _exact(kind, make, x, steps=3)
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}, _regions(lms)
    plain, under = made
    assert [k.shape[0] for k in under.cache.keys.values()] == [8, 8, 8]
    assert all(torch.equal(plain.cache.keys[i], under.cache.keys[i]) for i in range(3))


# -- a kept frame's tensors go to the engine (issue 47, kwargs item) ----------------------------

class InPlace(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x.mul_(1.0))))


def test_a_kept_region_hands_its_saved_tensors_to_the_engine():
    """Every region keeps (each changes its input in place): what they saved is swapped as
    without regions, not held on the GPU by the frames."""
    def make():
        return nn.Sequential(nn.Linear(64, 64), nn.Sequential(*[InPlace() for _ in range(4)]))

    x = torch.randn(64, 64)
    lms = _exact("sim", make, x, steps=2)
    regions = _regions(lms)
    assert set(regions["refused"].values()) == {"it changed an input in place"}
    assert regions["kept_calls"] == 4 and _recomputed(lms) == 0
    torch.manual_seed(0)
    off = lmsrt.LMS(lms=1, lms_frac=0.0, device="sim", recompute=False)
    _train(make(), x, 2, off)
    kept, plain = lms.stats()["last_step"], off.stats()["last_step"]
    # (and the inputs packed as each region was entered, before it changed them)
    assert kept["out_bytes"] >= plain["out_bytes"] > 0


# -- state a block changes, or reads from elsewhere (cases 1, 2) ------------------------------

def _sn_old():
    return nn.utils.spectral_norm(nn.Linear(32, 32))


class SpectralBlock(nn.Module):
    def __init__(self, parametrized=True):
        super().__init__()
        self.fc = (nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32)) if parametrized
                   else _sn_old())

    def forward(self, x):
        return F.leaky_relu(self.fc(x), 0.2)


@pytest.mark.parametrize("parametrized", [True, False], ids=["parametrizations", "hook"])
def test_spectral_norm_blocks_are_refused(parametrized):
    lms = _exact("sim", lambda: Stack(lambda: SpectralBlock(parametrized), 3),
                 torch.randn(8, 32))
    refused = _regions(lms)["refused"]
    assert len(refused) == 3 and _recomputed(lms) == 0
    why = next(iter(refused.values()))
    assert ("forward hooks" in why) if not parametrized else ("changed buffer" in why), why


class QatBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.fq = torch.ao.quantization.FakeQuantize()

    def forward(self, x):
        return F.relu(self.fq(self.fc(x)))


def test_fake_quantize_observers_are_refused():
    lms = _exact("sim", lambda: Stack(QatBlock, 3), torch.randn(8, 32))
    refused = _regions(lms)["refused"]
    assert len(refused) == 3 and all("changed buffer 'fq." in w for w in refused.values())


class PyRandom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return F.gelu(self.fc(x)) * (1.0 + random.random())


class OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x):
        noise = torch.rand(x.shape, generator=self.gen)
        return F.gelu(self.fc(x)) * noise


def test_python_random_and_a_generator_of_its_own_are_refused():
    # (The plain run and the LMS run each start from the same generator state.)
    lms = _exact("sim", lambda: Stack(PyRandom, 3), torch.randn(8, 32))
    assert all("Python's random" in w for w in _regions(lms)["refused"].values())
    assert len(_regions(lms)["refused"]) == 3
    lms = _exact("sim", lambda: Stack(OwnGenerator, 3), torch.randn(8, 32))
    refused = _regions(lms)["refused"]
    assert len(refused) == 3 and all("torch.Generator" in w for w in refused.values())


# -- parameters changed between forward and backward (case 4) ---------------------------------

class Embedded(nn.Module):
    """Reads a parameter its ops do not save (autograd alone would not notice it changed)."""

    def __init__(self, d=32):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d))
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(F.gelu(x + self.bias))


def _decay(model):
    for p in model.parameters():
        p.data.mul_(0.9)                   # decoupled weight decay, EMA: no version bump


@pytest.mark.parametrize("kind", DEVICES)
def test_parameters_written_through_data_before_backward_recompute_exactly(kind):
    lms = _exact(kind, lambda: Stack(Embedded, 3), torch.randn(8, 32), between=_decay)
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}


def test_a_parameter_changed_in_place_before_backward_is_refused_with_the_reason():
    torch.manual_seed(0)
    model, x = Stack(Embedded, 3), torch.randn(8, 32)
    lms = _lms("sim")
    _train(model, x, 3, lms)
    with lms:
        loss = model(x).square().mean()
    with torch.no_grad():
        model.blocks[2].bias.mul_(0.9)
    with pytest.raises(RuntimeError, match="blocks\\[2\\] needs the parameters.*parameter "
                                           "'bias' was changed in place"):
        loss.backward()
    assert "blocks[2]" in _regions(lms)["refused"]


# -- ambient flags, train/eval (cases 5, 11) --------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, -1)).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).flatten(2))


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return x + F.relu(self.conv(x))


def _check_backend_contexts(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(model, x):
        with sdpa_kernel(SDPBackend.MATH):
            return model(x)

    def mkldnn(model, x):
        with torch.backends.mkldnn.flags(enabled=False), torch.backends.cudnn.flags(
                enabled=False):
            return model(x)

    assert _recomputed(_exact(kind, lambda: Stack(Attention, 3), torch.randn(2, 16, 32),
                              loss_of=sdpa)) > 0
    assert _recomputed(_exact(kind, lambda: Stack(Conv, 3), torch.randn(2, 8, 32, 32),
                              loss_of=mkldnn)) > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_backend_contexts_of_forward_hold_in_the_rerun(kind):
    _check_backend_contexts(kind)


@pytest.mark.parametrize("kind", DEVICES)
def test_eval_mode_set_before_backward_leaves_the_rerun_in_training_mode(kind):
    def make():
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32),
                                             nn.Dropout(0.3)) for _ in range(3)])

    def to_eval(model):
        model.eval()

    def loss_of(model, x):
        model.train()
        return model(x)

    lms = _exact(kind, make, torch.randn(16, 32), loss_of=loss_of, between=to_eval)
    assert _recomputed(lms) > 0


# -- user hooks (case 6) ----------------------------------------------------------------------

def test_blocks_with_forward_hooks_are_refused_and_the_hooks_run_once():
    calls = []

    def make():
        stack = Stack(MLP, 4)
        for b in stack.blocks:
            b.fc1.register_forward_hook(lambda m, a, o: calls.append(1))
        return stack

    lms = _exact("sim", make, torch.randn(8, 32), steps=5)
    assert len(calls) == 2 * 5 * 4
    refused = _regions(lms)["refused"]
    assert len(refused) == 4 and all("fc1 has forward hooks" in w for w in refused.values())


# -- frames never outlive their forward (case 7) ----------------------------------------------

def _vgg():
    layers = []
    for c_in in (3, 8, 8):
        layers += [nn.Conv2d(c_in, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                   nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers)


def _walk(features, x, stop: int):
    """A perceptual loss: the features up to layer ``stop``, walked one layer at a time."""
    for i, layer in enumerate(features):
        x = layer(x)
        if i == stop:
            return x
    return x


def test_a_walk_that_stops_inside_a_stage_leaves_no_hooks():
    top = torch._C._autograd._top_saved_tensors_default_hooks
    lms = _exact("sim", _vgg, torch.randn(2, 3, 16, 16), steps=5,
                 loss_of=lambda model, x: (_walk(model, x, 7).mean() + model(x).mean()
                                           + _walk(model, x, 12).mean()))
    assert top(False) is None
    # An autograd save anywhere afterwards works.
    a = torch.randn(4, requires_grad=True)
    (a * a).sum().backward()
    assert _recomputed(lms) > 0


class Flaky(nn.Module):
    """Raises once when armed, after its ops ran (an out-of-memory error, caught and the
    step's forward run again)."""

    armed = False

    def __init__(self):
        super().__init__()
        self.inner = MLP()

    def forward(self, x):
        y = self.inner(x)
        if Flaky.armed:
            Flaky.armed = False
            raise torch.OutOfMemoryError("out of memory (a test)")
        return y


def test_an_error_caught_mid_forward_and_retried_trains_exactly():
    steps = []

    def loss_of(model, x):
        steps.append(1)
        Flaky.armed = len(steps) % 5 == 4          # in step 4 of each run
        try:
            return model(x)
        except torch.OutOfMemoryError:
            return model(x)

    lms = _exact("sim", lambda: Stack(Flaky, 3), torch.randn(8, 32), steps=5, loss_of=loss_of)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}


# -- structure: shared modules, TorchScript, in-place residuals (cases 8-10) ------------------

def _shared_pools():
    pool, up = nn.MaxPool2d(2), nn.Upsample(scale_factor=2)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), pool, nn.Conv2d(8, 8, 3, padding=1),
              nn.ReLU(), pool, up, nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), up,
              nn.Conv2d(8, 2, 1)]
    return nn.Sequential(*layers)


def test_one_module_listed_several_times_in_a_sequential_trains_exactly():
    lms = _exact("sim", _shared_pools, torch.randn(2, 3, 16, 16), steps=5)
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}


def test_torchscript_blocks_are_refused():
    def make():
        stack = Stack(MLP, 3)
        stack.blocks = nn.ModuleList(torch.jit.script(b) for b in stack.blocks)
        return stack

    lms = _exact("sim", make, torch.randn(8, 32))
    refused = _regions(lms)["refused"]
    assert len(refused) == 3 and all("TorchScript" in w for w in refused.values())


class NoSave(nn.Module):
    """Its ops do not save its input: ReLU saves its output, the Linear the ReLU's."""

    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(F.relu(x))


class InPlaceResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(NoSave() for _ in range(4))

    def forward(self, x):
        x = self.first(x)
        for b in self.blocks:
            x += b(x)
        return x


@pytest.mark.parametrize("tuning", [False, True], ids=["", "checked"])
def test_an_in_place_residual_on_an_input_its_block_did_not_save_trains_exactly(tuning):
    """Checked (NOTE [ Reruns under cuDNN's benchmark mode ]), a call whose input was changed
    after it keeps without a check: its rerun would find the input changed."""
    lms = _exact("sim", InPlaceResidual, torch.randn(8, 32), steps=5, tuning=tuning)
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}


class _Cache(list):
    """What a block writes its tensors into, passed by its caller (transformers' DynamicCache)."""


class CachingBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, cache):
        y = torch.tanh(self.fc(x))
        cache.append(y)
        return x + self.out(y)


class Caching(nn.Module):
    caches: list = []                    # weak references to every forward's cache

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CachingBlock() for _ in range(4))

    def forward(self, x):
        cache = _Cache()
        Caching.caches.append(weakref.ref(cache))
        for b in self.blocks:
            x = b(x, cache=cache)
        return x


def test_a_cache_the_rerun_writes_into_is_freed_with_its_step():
    """A block argument that is no tensor (a cache) stays the frame's until backward, and the
    rerun writes its tensors into it; their autograd nodes hold the rerun's hooks, which must
    not hold the frame (a cycle through autograd's graph, which the collector cannot see: on a
    transformers Llama, every recomputed layer's inputs and cache were kept for the run)."""
    Caching.caches.clear()
    lms = _exact("sim", Caching, torch.randn(8, 32), steps=4)
    assert _recomputed(lms) > 0
    gc.collect()
    held = [i for i, cache in enumerate(Caching.caches) if cache() is not None]
    assert len(Caching.caches) == 8 and not held, held


# -- threads and evaluation steps (cases 12, 13) ----------------------------------------------

def test_two_threads_sharing_one_lms_train_exactly():
    torch.manual_seed(0)
    models = [Stack(MLP, 4) for _ in range(2)]
    refs = [Stack(MLP, 4) for _ in range(2)]
    for r, m in zip(refs, models):
        r.load_state_dict(m.state_dict())
    xs = [torch.randn(8, 32) for _ in range(2)]
    for m in models + refs:
        for b in m.blocks:
            b.drop.p = 0.0                 # the threads share the default generator
    lms = _lms("sim")
    results, errors = [None, None], []

    def work(i):
        try:
            results[i] = _train(models[i], xs[i], 6, lms)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run_threads(work, [(0,), (1,)])
    assert not errors, errors
    for i in range(2):
        assert_same_steps(_train(refs[i], xs[i], 6), results[i])


def test_an_evaluation_forward_first_leaves_recompute_on():
    torch.manual_seed(0)
    model, ref = Stack(MLP, 4), Stack(MLP, 4)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 32)
    lms = _lms("sim")
    for _ in range(2):                      # two evaluations, as a script's first iterations
        model.eval()
        with lms, torch.no_grad():
            model(x)
        model.train()
    assert_same_steps(_train(ref, x, 4), _train(model, x, 4, lms))
    assert _regions(lms)["recomputed"] == 4


# -- what is said (issue 47, "say once") ------------------------------------------------------

def test_the_blocks_found_and_refused_are_said_once():
    def make():
        stack = Stack(MLP, 4)
        stack.blocks[3] = QatBlock()
        stack.blocks.append(QatBlock())
        return stack

    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 32)
    lms = _lms("sim")
    with lmsrt_warnings() as said:
        _train(model, x, 5, lms)
    lines = [text for text in said if "repeated blocks" in text]
    assert len(lines) == 1, lines
    assert lines[0].startswith("lmsrt: 5 repeated blocks (blocks[0..2], MLP; blocks[3,4], "
                               "QatBlock); refused: blocks[3]: its forward changed buffer"), lines
    assert set(_regions(lms)["refused"]) == {"blocks[3]", "blocks[4]"}


# -- cuDNN's benchmark mode: its choices are per thread ----------------------------------------

class ConvBlock(nn.Module):
    """A residual conv block of a torchvision-style net."""

    def __init__(self, c=64):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_conv_blocks_under_cudnn_benchmark_mode_are_recomputed_exactly(kind, channels_last):
    """torchvision's reference trainer turns cuDNN's benchmark mode on. Its choices of algorithm
    are cached per thread (cuDNN's execution plans), and a region's rerun runs on autograd's
    thread: there cuDNN times its algorithms again (1.1 s more in the timing step of resnet152 at
    12 GiB on an H200) and may choose another forward algorithm than forward's thread did, whose
    rounding differs (NOTE [ Reruns under cuDNN's benchmark mode ]). The gradients must still be
    those of the run without lmsrt, bit for bit, deterministic mode on (the plain run is not
    reproducible without it): the blocks are recomputed, or refused for that reason. On the
    simulated device (one thread, its own choice) they are recomputed: the check compares what
    backward reads (batch norm's running statistics, which the rerun updates copies of, apart)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(*((16, 64, 56, 56) if kind == "cuda" else (2, 64, 16, 16)))
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        lms = _exact(kind, lambda: Stack(ConvBlock, 4).to(memory_format=fmt),
                     x.to(memory_format=fmt), tuning=kind == "sim")
    finally:
        torch.backends.cudnn.benchmark = was
    refused = _regions(lms)["refused"]
    if kind == "sim":
        assert _recomputed(lms) > 0 and not refused, refused
    assert (_recomputed(lms) > 0 if not refused
            else all("benchmark mode" in why for why in refused.values())), _regions(lms)


class ChosenPerThread(nn.Module):
    """Stands in for a kernel whose algorithm cuDNN's benchmark mode chooses per thread: run
    inside backward (a region's rerun, on autograd's thread), it rounds otherwise."""

    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        if torch._C._current_graph_task_id() != -1:
            h = h * (1 + 2 ** -20)
        return x + F.gelu(h)


@pytest.mark.parametrize("block", [MLP, ChosenPerThread], ids=["same-bits", "other-bits"])
def test_reruns_under_a_device_that_tunes_its_algorithms_are_checked_bit_for_bit(block):
    """NOTE [ Reruns under cuDNN's benchmark mode ]: a rerun that computes other bits than its
    forward is caught by the check of its kind of call: the originals go to backward, the
    regions are refused, and every step is exact; one that computes the same bits drops from
    the next step on."""
    lms = _exact("sim", lambda: Stack(block, 4), torch.randn(8, 32), steps=5, tuning=True)
    refused = _regions(lms)["refused"]
    if block is MLP:
        assert not refused and _recomputed(lms) > 0, _regions(lms)
    else:
        assert len(refused) == 4 and all("benchmark mode" in why for why in refused.values()), \
            refused


def test_a_check_whose_rerun_fails_gives_backward_what_it_kept(monkeypatch):
    """A check's rerun that raises (out of memory with nothing to give back, an input changed
    in place) fails no backward: backward gets what the call kept, and the kind is checked
    again in a later step."""
    import lmsrt.recompute.regions as regions
    real, failed = regions.rerun, []

    def rerun(frame):
        if frame.checking and not failed:
            failed.append(frame.region.name)
            raise RuntimeError("simulated: the rerun could not run")
        return real(frame)

    monkeypatch.setattr(regions, "rerun", rerun)
    lms = _exact("sim", lambda: Stack(MLP, 4), torch.randn(8, 32), steps=5, tuning=True)
    check = lms._regions._rerun_check
    assert failed and check.verdicts and all(check.verdicts.values()), check.verdicts
    assert not _regions(lms)["refused"] and _recomputed(lms) > 0, _regions(lms)


def _step_biases(model):
    biases = [b.bias for b in model.blocks]       # read by an add, which saves nothing
    for b in biases:
        b.grad = torch.ones_like(b)
    torch.optim.SGD(biases, lr=0.1).step()
    for b in biases:
        b.grad = None


@pytest.mark.parametrize("change", [_decay, _step_biases], ids=["data", "optimizer-step"])
def test_a_check_is_given_up_when_parameters_change_before_backward(change):
    """A checked call's rerun would read parameters changed between forward and backward (a
    ``p.data`` write, an optimizer step: GAN loops, EMA) and compute other bits: its check is
    given up instead, no block is refused, and a later step that leaves them alone checks it."""
    calls = []                      # (the models of both runs)

    def early(model):               # in the first three steps
        calls.append(model)
        if calls.count(model) <= 3:
            change(model)

    lms = _exact("sim", lambda: Stack(Embedded, 3), torch.randn(8, 32), steps=6, tuning=True,
                 between=early)
    check = lms._regions._rerun_check
    assert check.verdicts and all(check.verdicts.values()), check.verdicts
    assert _recomputed(lms) > 0 and _regions(lms)["refused"] == {}, _regions(lms)


class FirstCallUnused(nn.Module):
    """Three calls of one kind of block; the first one's output is never used."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(2))

    def forward(self, x):
        self.blocks[0](x)                   # (a probe, say: no backward goes through it)
        return self.blocks[1](self.blocks[0](x))


def test_a_kind_whose_first_call_has_no_backward_is_checked_by_its_next_call():
    """The check of a kind whose first call is never rerun (no backward through it) is made in
    the next step by the kind's next call: else it would never be made, and no call of that
    kind recomputed."""
    lms = _exact("sim", FirstCallUnused, torch.randn(8, 32), steps=6, tuning=True)
    check = lms._regions._rerun_check
    assert check.verdicts and all(check.verdicts.values()), check.verdicts
    assert _recomputed(lms) > 0, _regions(lms)


def test_every_kind_is_checked_in_one_step_and_the_plan_then_holds():
    """Every stage of a conv net is a kind of call of its own. A check keeps its call's saved
    tensors through the engine, as keeping does, so a step checks every kind it calls (the
    first with a backward) and saves the sequence a keeping step saves; the kinds then trusted
    drop, the policy learns that once, and the steps after it follow their plan. (Checks that
    held their originals on the GPU beside dropping ran a conv net out of memory at 85% of its
    peak on an H200; made one a step, every step left the plan learnt before it.)"""
    from test_regions import _segnet

    from lmsrt.device import SimulatedDevice
    torch.manual_seed(0)
    plain_model, model = _segnet(), _segnet()
    model.load_state_dict(plain_model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    kept = lmsrt.LMS(lms=1, lms_frac=1.0, device=SimulatedDevice(capacity=1 << 30))
    _train(_segnet(), x, 2, kept)                   # what a step saves, kept
    peak = kept.stats()["last_step"]["gpu_peak_bytes"]
    device = SimulatedDevice(capacity=int(peak * 1.3))
    lms = lmsrt.LMS(lms=1, lms_frac="auto", device=device)
    lms._regions.bandwidth, lms._regions.worth = 1.0, 0
    device.tuning = True
    check = lms._regions._rerun_check
    checked = []
    plain = _train(plain_model, x, 9)
    under = _train(model, x, 9, lms, between=lambda m: checked.append(len(check.verdicts)))
    assert_same_steps(plain, under)
    checked.append(len(check.verdicts))         # (the last step's, after its backward)
    kinds = len(check.verdicts)
    assert kinds > 2 and all(check.verdicts.values()), check.verdicts
    first = next(i for i, n in enumerate(checked) if n)
    assert checked[first + 1] == kinds, checked          # all in one step
    stats = lms.stats()
    steps = stats["history"] + [stats["last_step"]]
    notes = [(s["mode"], s["policy_note"]) for s in steps]
    assert _regions(lms)["planned"] > 0, _regions(lms)
    assert all(s["mode"] == "plan" for s in steps[-4:]), notes
