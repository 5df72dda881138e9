"""Tests for lmsrt.arena: hand-checked allocator cases, randomized cross-checks of
the native and pure-Python implementations, and the native/fallback loader."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import random
import sys
from typing import Any, Callable

import pytest

from lmsrt import arena
from lmsrt.arena import PyOffsetAllocator

try:
    from lmsrt._native import OffsetAllocator as NativeOffsetAllocator
except ImportError as exc:
    NativeOffsetAllocator = None
    native_import_error = str(exc)
else:
    native_import_error = ""

requires_native = pytest.mark.skipif(
    NativeOffsetAllocator is None, reason=f"lmsrt._native is not built ({native_import_error})"
)

AllocatorFactory = Callable[..., Any]


@pytest.fixture(
    params=[
        pytest.param("python"),
        pytest.param("native", marks=requires_native),
    ]
)
def make_allocator(request: pytest.FixtureRequest) -> AllocatorFactory:
    return PyOffsetAllocator if request.param == "python" else NativeOffsetAllocator


def fill_with_blocks(allocator: Any, block_size: int, count: int) -> list[int]:
    offsets = [allocator.alloc(block_size) for _ in range(count)]
    assert offsets == [i * block_size for i in range(count)]
    return offsets


# --------------------------------------------------------------------------- hand-checked cases


def test_best_fit_picks_smallest_fitting_hole(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(100, alignment=1)
    for size in (10, 30, 10, 20, 10, 20):
        allocator.alloc(size)
    allocator.free(10)  # hole of 30 at 10
    allocator.free(50)  # hole of 20 at 50
    assert allocator.free_blocks() == [(10, 30), (50, 20)]

    # First fit would take offset 10; best fit takes the 20-byte hole.
    assert allocator.alloc(15) == 50
    assert allocator.free_blocks() == [(10, 30), (65, 5)]
    assert allocator.alloc(25) == 10
    assert allocator.free_blocks() == [(35, 5), (65, 5)]
    assert allocator.alloc(6) == -1


def test_best_fit_tie_goes_to_lowest_offset(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(100, alignment=1)
    fill_with_blocks(allocator, 10, 10)
    allocator.free(80)
    allocator.free(60)
    allocator.free(20)
    assert allocator.alloc(5) == 20
    assert allocator.alloc(10) == 60
    assert allocator.alloc(10) == 80
    assert allocator.free_blocks() == [(25, 5)]


def test_alignment_rounding(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(1 << 20)
    assert allocator.alignment == 512
    assert allocator.alloc(1) == 0
    assert allocator.alloc(512) == 512
    assert allocator.alloc(513) == 1024
    assert allocator.alloc(100) == 2048
    assert [allocator.size_of(offset) for offset in (0, 512, 1024, 2048)] == [512, 512, 1024, 512]
    assert allocator.used_bytes == 2560
    assert allocator.free_bytes == (1 << 20) - 2560
    assert allocator.num_allocations == 4
    assert allocator.free_blocks() == [(2560, (1 << 20) - 2560)]


def test_capacity_not_a_multiple_of_alignment(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(1000, alignment=512)
    assert allocator.alloc(600) == -1  # rounds up to 1024 > 1000
    assert allocator.alloc(512) == 0
    assert allocator.free_blocks() == [(512, 488)]
    assert allocator.largest_free == 488
    assert allocator.alloc(1) == -1  # rounds up to 512 > 488
    allocator.free(0)
    assert allocator.free_blocks() == [(0, 1000)]
    assert allocator.alloc(1000) == -1


@pytest.mark.parametrize("free_order", list(itertools.permutations(range(3))))
def test_coalescing_restores_one_block(make_allocator: AllocatorFactory,
                                       free_order: tuple[int, ...]) -> None:
    allocator = make_allocator(35, alignment=1)
    offsets = fill_with_blocks(allocator, 10, 3)  # a 5-byte free tail stays at 30
    for index in free_order:
        allocator.free(offsets[index])
    assert allocator.free_blocks() == [(0, 35)]
    assert allocator.largest_free == 35
    assert allocator.used_bytes == 0
    assert allocator.num_allocations == 0


def test_free_merges_with_both_neighbours(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(40, alignment=1)
    fill_with_blocks(allocator, 10, 4)
    allocator.free(0)
    allocator.free(20)
    assert allocator.free_blocks() == [(0, 10), (20, 10)]
    allocator.free(10)
    assert allocator.free_blocks() == [(0, 30)]
    assert allocator.alloc(30) == 0


def test_full_and_fragmented_return_minus_one(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(40, alignment=1)
    fill_with_blocks(allocator, 10, 4)
    assert allocator.alloc(1) == -1
    assert allocator.largest_free == 0
    assert allocator.free_blocks() == []
    allocator.free(0)
    allocator.free(20)
    assert allocator.free_bytes == 20
    assert allocator.alloc(11) == -1  # enough bytes in total, no single hole fits
    assert allocator.alloc(10) == 0
    assert allocator.alloc(1 << 62) == -1


def test_free_and_size_of_reject_unallocated_offsets(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(4096)
    offset = allocator.alloc(1024)
    allocator.free(offset)
    with pytest.raises(KeyError):
        allocator.free(offset)
    with pytest.raises(KeyError):
        allocator.free(512)  # inside a free block
    with pytest.raises(KeyError):
        allocator.free(-512)
    with pytest.raises(KeyError):
        allocator.size_of(offset)
    assert allocator.free_blocks() == [(0, 4096)]


@pytest.mark.parametrize(
    ("capacity", "alignment"),
    [(0, 512), (-4096, 512), (4096, 0), (4096, -512), (4096, 3), (4096, 768)],
)
def test_bad_constructor_arguments(make_allocator: AllocatorFactory, capacity: int,
                                   alignment: int) -> None:
    with pytest.raises(ValueError):
        make_allocator(capacity, alignment)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_bad_alloc_sizes(make_allocator: AllocatorFactory, nbytes: int) -> None:
    with pytest.raises(ValueError):
        make_allocator(4096).alloc(nbytes)


def test_properties_are_read_only(make_allocator: AllocatorFactory) -> None:
    allocator = make_allocator(4096, alignment=64)
    for name in ("capacity", "alignment", "used_bytes", "free_bytes", "largest_free",
                 "num_allocations"):
        with pytest.raises(AttributeError):
            setattr(allocator, name, 1)
    assert (allocator.capacity, allocator.alignment) == (4096, 64)


# --------------------------------------------------------------------------- randomized


def random_request(rng: random.Random, capacity: int) -> int:
    """Log-uniform in [1, capacity // 4], so small and large requests both occur often."""
    return max(1, int(math.exp(rng.uniform(0.0, math.log(capacity // 4)))))


# (seed, capacity, alignment): aligned and unaligned capacities, coarse and byte alignment.
RANDOM_CONFIGS = [
    (0, 64 << 20, 512),
    (1, (64 << 20) + 300, 512),
    (2, 1 << 16, 64),
    (3, 100_003, 1),
    (4, 8 << 20, 4096),
]
RANDOM_OPS = 20_000
SNAPSHOT_EVERY = 100


def snapshot(allocator: Any) -> tuple[Any, ...]:
    return (
        allocator.free_blocks(),
        allocator.used_bytes,
        allocator.free_bytes,
        allocator.largest_free,
        allocator.num_allocations,
    )


def call(method: Callable[[int], Any], argument: int) -> tuple[str, Any]:
    try:
        return ("ok", method(argument))
    except KeyError:
        return ("KeyError", None)


@requires_native
@pytest.mark.parametrize(("seed", "capacity", "alignment"), RANDOM_CONFIGS)
def test_native_and_python_agree(seed: int, capacity: int, alignment: int) -> None:
    rng = random.Random(seed)
    python = PyOffsetAllocator(capacity, alignment)
    native = NativeOffsetAllocator(capacity, alignment)
    live: list[int] = []
    for step in range(RANDOM_OPS):
        roll = rng.random()
        if roll < 0.55 or not live:
            nbytes = random_request(rng, capacity)
            result = call(python.alloc, nbytes)
            assert call(native.alloc, nbytes) == result, (step, nbytes)
            if result[1] >= 0:
                live.append(result[1])
        elif roll < 0.98:
            offset = live.pop(rng.randrange(len(live)))
            assert call(python.size_of, offset) == call(native.size_of, offset), (step, offset)
            freed = call(python.free, offset), call(native.free, offset)
            assert freed == (("ok", None),) * 2, (step, offset)
        else:
            # Double frees and interior offsets must fail identically.
            offset = rng.randrange(capacity)
            assert call(python.free, offset) == call(native.free, offset), (step, offset)
            if offset in live:
                live.remove(offset)
        if step % SNAPSHOT_EVERY == 0:
            assert snapshot(python) == snapshot(native), step
    assert snapshot(python) == snapshot(native)


def check_invariants(allocator: Any, live: dict[int, int]) -> None:
    """Brute-force consistency of the allocator against the model of live blocks."""
    capacity, alignment = allocator.capacity, allocator.alignment
    for offset, size in live.items():
        assert allocator.size_of(offset) == size
        assert offset % alignment == 0 and size % alignment == 0
        assert 0 <= offset and offset + size <= capacity
    free_blocks = allocator.free_blocks()
    assert free_blocks == sorted(free_blocks)
    for (offset, size), (next_offset, _) in zip(free_blocks, free_blocks[1:]):
        assert offset + size < next_offset, "adjacent free blocks were not coalesced"
    # Live and free blocks must tile [0, capacity) exactly: no overlap, no gap.
    cursor = 0
    for offset, size in sorted([*live.items(), *free_blocks]):
        assert offset == cursor, f"overlap or gap at {cursor}"
        assert offset % alignment == 0 and size > 0
        cursor += size
    assert cursor == capacity
    used = sum(live.values())
    assert allocator.used_bytes == used
    assert allocator.free_bytes == capacity - used == sum(size for _, size in free_blocks)
    assert allocator.num_allocations == len(live)
    assert allocator.largest_free == max((size for _, size in free_blocks), default=0)


def expected_best_fit(allocator: Any, nbytes: int) -> int:
    rounded = -(-nbytes // allocator.alignment) * allocator.alignment
    candidates = [(size, offset) for offset, size in allocator.free_blocks() if size >= rounded]
    return min(candidates)[1] if candidates else -1


@pytest.mark.parametrize(("seed", "capacity", "alignment"), RANDOM_CONFIGS[:3])
def test_random_operations_keep_invariants(
    make_allocator: AllocatorFactory, seed: int, capacity: int, alignment: int
) -> None:
    rng = random.Random(seed)
    allocator = make_allocator(capacity, alignment)
    live: dict[int, int] = {}
    for step in range(RANDOM_OPS):
        if rng.random() < 0.55 or not live:
            nbytes = random_request(rng, capacity)
            expected = expected_best_fit(allocator, nbytes)
            offset = allocator.alloc(nbytes)
            assert offset == expected, (step, nbytes)
            if offset >= 0:
                live[offset] = allocator.size_of(offset)
                assert nbytes <= live[offset] < nbytes + alignment
        else:
            offset = rng.choice(list(live))
            allocator.free(offset)
            del live[offset]
        if step % 250 == 0:
            check_invariants(allocator, live)
    check_invariants(allocator, live)
    for offset in list(live):
        allocator.free(offset)
    assert allocator.free_blocks() == [(0, capacity)]


# --------------------------------------------------------------------------- loader


def test_offset_allocator_is_native_iff_extension_imports() -> None:
    try:
        importlib.import_module("lmsrt._native")
    except ImportError:
        native_imports = False
    else:
        native_imports = True
    assert arena.NATIVE is native_imports
    assert (arena.OffsetAllocator is NativeOffsetAllocator) is native_imports
    assert (arena.OffsetAllocator is PyOffsetAllocator) is not native_imports
    assert (arena.native_error is None) is native_imports
    if native_imports:
        assert arena.native_status() == "native (lmsrt._native)"
    else:
        assert arena.native_status().startswith("pure Python (")


def test_fallback_when_extension_cannot_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError, as if the
    # extension were absent; the module is loaded fresh under a private name so
    # the real lmsrt.arena stays untouched.
    monkeypatch.setitem(sys.modules, "lmsrt._native", None)
    spec = importlib.util.spec_from_file_location("lmsrt_arena_without_native", arena.__file__)
    assert spec is not None and spec.loader is not None
    fallback = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fallback)
    assert fallback.NATIVE is False
    assert fallback.OffsetAllocator is fallback.PyOffsetAllocator
    assert fallback.native_error and "lmsrt._native" in fallback.native_error
    assert fallback.native_status() == f"pure Python ({fallback.native_error})"
    assert fallback.OffsetAllocator(4096).alloc(1) == 0
