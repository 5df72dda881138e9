"""The accelerator seam: real CUDA, or a simulated device for CPU-only tests.

The swap engine never calls ``torch.cuda`` directly; it asks a device for streams, events,
memory figures and buffers. ``CudaDevice`` maps those onto CUDA. ``SimulatedDevice`` runs the
same engine code on a machine without a GPU: CPU tensors stand in for GPU ones, streams and
events are synchronous (every copy is complete when issued), and "allocated memory" is the bytes
of the saved-tensor storages the engine has seen that are still alive, so the mark, the plan and
the release logic are exercised exactly as on a GPU.

``Device`` states what both offer, the surface the engine and the host pool rely on. Pinned host
memory is page-aligned memory registered with the CUDA driver (``cudaHostRegister``), not torch's
pinned caching allocator, which rounds every block up to a power of two; the simulated device
models pinning with a limit (``pin_limit``), a delay and a gate, so CPU tests cover lag.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import mmap
import os
import statistics
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional, Protocol, Sequence

import torch

from . import copy_path, gpu_cap, torch_patches
from .config import cuda_index

__all__ = ["Device", "CudaDevice", "SimulatedDevice", "copy_bandwidth", "resolve_device",
           "sim_capacity", "ENV_SIM_GB"]

_HUGE_PAGE = 2 << 20            # a transparent huge page: a slab is touched in whole ones
_SIM_DEFAULT = 1 << 30          # 1 GiB: the simulated GPU's size when nothing says otherwise


class Device(Protocol):
    """What the swap engine and the host pool ask of an accelerator (``CudaDevice``, or
    ``SimulatedDevice`` on a CPU). Streams and events are ``torch.cuda.Stream``/``Event`` on
    CUDA and stand-ins with the same methods on the simulated device.

    Example::

        def pin_ahead(device: Device) -> torch.Tensor:
            return device.pinned(64 << 20)
    """

    kind: str                   # "cuda" or "sim"
    index: int
    name: str
    torch_device: torch.device
    copy_path: Any              # the C++ copy calls (lmsrt.copy_path), or None
    pin_threads: int            # threads the host pool pins on; 0: on the calling thread

    def owns(self, t: torch.Tensor) -> bool: ...
    def current_stream(self) -> Any: ...
    def stream_key(self) -> Any: ...
    def stream_of(self, key: Any) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self, timing: bool = False) -> Any: ...
    def stream(self, s: Any) -> Any: ...
    def memory_allocated(self) -> int: ...
    def peak_allocated(self) -> int: ...
    def alloc_retries(self) -> int: ...
    def alloc_failures(self) -> int: ...
    def tunes_algorithms(self) -> bool: ...
    def reset_peak(self) -> None: ...
    def memory_limit(self) -> int: ...
    def empty(self, nbytes: int) -> torch.Tensor: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def note_saved(self, storage: Any) -> None: ...
    def free_after(self, t: torch.Tensor, stream: Any) -> None: ...
    def synchronize(self) -> None: ...


class _OnStream:
    """Make ``stream`` current for a block: the raw switch costs ~1 us, where
    ``torch.cuda.stream()`` resolves device indices through several Python layers (~10 us), which
    adds up at two switches per swapped tensor. Setting a stream also makes its device current,
    so the thread's own current device is put back on the way out."""

    __slots__ = ("target", "index", "prev", "prev_device")

    def __init__(self, stream, index: int):
        self.target = (stream.stream_id, stream.device_index, stream.device_type)
        self.index = index
        self.prev = None
        self.prev_device = None

    def __enter__(self):
        self.prev_device = torch._C._cuda_getDevice()
        self.prev = torch._C._cuda_getCurrentStream(self.index)
        sid, idx, kind = self.target
        torch._C._cuda_setStream(stream_id=sid, device_index=idx, device_type=kind)

    def __exit__(self, *exc):
        sid, idx, kind = self.prev
        torch._C._cuda_setStream(stream_id=sid, device_index=idx, device_type=kind)
        if self.prev_device != idx:
            torch._C._cuda_setDevice(self.prev_device)


_RAW_STREAMS = hasattr(torch._C, "_cuda_getCurrentStream") and hasattr(torch._C, "_cuda_setStream")


# cudaHostRegisterPortable: the range counts as pinned in every CUDA context of the process, not
# only in the current one (on systems with unified addressing it is also mapped).
_HOST_REGISTER_PORTABLE = 1


def _unregister(ptr: int, mapping: mmap.mmap) -> None:
    """Unpin ``ptr`` when its slab tensor dies; ``mapping`` is unmapped once this returns and
    nothing else exports it. Errors are ignored: at process exit the driver may be gone, and an
    unpinned range is then released by the OS anyway."""
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:       # noqa: BLE001 - a finalizer must not raise, least of all at exit
        pass


_TOUCH_PIECE = 16 << 20        # a touching thread's share of a pin is at least this much
_touchers: Optional[ThreadPoolExecutor] = None
_touchers_size = 0
_touchers_lock = threading.Lock()


def local_world_size(environ=None) -> int:
    """Processes of this job on this node (torchrun's LOCAL_WORLD_SIZE); 1 if unset or bad."""
    raw = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    try:
        return max(1, int(raw))
    except ValueError:
        return 1


def _touch_threads() -> int:
    """Threads to touch pins on: three quarters of this rank's share of the CPUs this process
    may run on (its affinity mask, as a container or launcher sets it), 1 to 12."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, min(12, cpus // local_world_size() * 3 // 4))


def _touch(address: int, size: int, threads: int) -> None:
    """Write zeros over ``size`` bytes at ``address`` (faulting the pages in), on up to
    ``threads`` threads: ctypes' memset releases the GIL, and the page faults, not the writes,
    are the cost. The pieces go to one first-in first-out pool, so of two pins touched at once
    the first is done first (NOTE [ Pinning ] in host.py, Background)."""
    global _touchers, _touchers_size
    pieces = max(1, min(threads, size // _TOUCH_PIECE))
    if pieces == 1:
        ctypes.memset(address, 0, size)
        return
    with _touchers_lock:
        if _touchers_size != threads:
            if _touchers is not None:
                _touchers.shutdown(wait=False)       # its idle threads end; queued pieces run
            _touchers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmsrt-touch")
            _touchers_size = threads
        touchers = _touchers
    step = -(-size // pieces // _HUGE_PAGE) * _HUGE_PAGE
    futures = [touchers.submit(ctypes.memset, address + start, 0, min(step, size - start))
               for start in range(0, size, step)]
    for future in futures:
        future.result()


class CudaDevice:
    """One CUDA device, as the swap engine sees it."""

    kind = "cuda"
    # Pinning runs off the training thread: two pins at once, so that one registers with the
    # driver (~40 GiB/s on an H200 host, on one thread whatever the number) while the next is
    # touched; the page faults and zeroing that dominate the cost scale with the touching
    # threads (there: 3.8 GiB/s on 1, 17 on 4, 20 on 8, 34 on 16). Touching runs in bursts
    # (the first step, a layout pinned ahead), while the training thread mostly waits.
    pin_threads = 2
    touch_threads = _touch_threads()

    def __init__(self, index: Optional[int] = None):
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        self.name = torch.cuda.get_device_name(self.index)
        self.copy_path = copy_path.load()     # the engine's C++ copy calls, or None
        self.native_hooks = self.copy_path    # and its C++ saved-tensor hooks (the same module)
        if self.copy_path is not None:
            self.memory_allocated = functools.partial(self.copy_path.memory_allocated, self.index)
        torch_patches.keep_peaks_across_resets()
        self.expandable = torch_patches.prefer_expandable_segments()

    def owns(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.get_device() == self.index

    def current_stream(self):
        return torch.cuda.current_stream(self.index)

    def stream_key(self):
        """The current stream of this device, as a tuple that compares cheaply (~0.3 us against
        ~3 us for ``current_stream``)."""
        return torch._C._cuda_getCurrentStream(self.index)

    @staticmethod
    def stream_of(key):
        sid, index, kind = key
        return torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind)

    def new_stream(self):
        return torch.cuda.Stream(self.index)

    @staticmethod
    def new_event(timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def stream(self, s):
        """A reusable context that makes ``s`` the current stream."""
        return _OnStream(s, self.index) if _RAW_STREAMS else torch.cuda.stream(s)

    def memory_allocated(self) -> int:
        # torch.cuda.memory_allocated() flattens the whole stats dict (~100 us); this is ~20 us.
        return torch._C._cuda_memoryStats(self.index)["allocated_bytes"]["all"]["current"]

    def _counts(self) -> tuple:
        """(peak allocated bytes, allocation retries, failed allocations) of the allocator."""
        if self.copy_path is not None:
            return self.copy_path.allocator_counts(self.index)
        stats = torch._C._cuda_memoryStats(self.index)
        return (stats["allocated_bytes"]["all"]["peak"], stats["num_alloc_retries"],
                stats["num_ooms"])

    def alloc_retries(self) -> int:
        """How often the caching allocator has had to free its cache and retry (a device sync)."""
        return self._counts()[1]

    def alloc_failures(self) -> int:
        """How many allocations have failed at the limit, counting those whose out-of-memory
        error the caller caught: cuDNN does, and then runs a convolution with a smaller workspace
        (a slower algorithm, which it keeps for the run)."""
        return self._counts()[2]

    @staticmethod
    def tunes_algorithms() -> bool:
        """Whether cuDNN's benchmark mode is on: the first call of each shape then tries every
        algorithm, with workspaces as large as memory allows, and keeps the fastest."""
        return bool(torch.backends.cudnn.benchmark and torch.backends.cudnn.enabled)

    def peak_allocated(self) -> int:
        """Peak allocated bytes since the last ``reset_peak``, even if the script reset torch's
        counter in between."""
        return max(self._counts()[0], torch_patches.cleared_peaks.get(self.index, 0))

    def reset_peak(self) -> None:
        torch_patches.reset_peak(self.index)

    def memory_limit(self) -> int:
        """The bytes this process may allocate: ``--gpu-limit``'s cap (gpu_cap.py), else the
        device total times torch's per-process fraction."""
        cap = gpu_cap.limit(self.index) if gpu_cap.held_bytes(self.index) else None
        if cap is None:
            total = torch.cuda.get_device_properties(self.index).total_memory
            get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            cap = int(total * (get(self.index) if get else 1.0))
        return cap

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory as a uint8 CPU tensor, exactly (no power-of-two
        rounding): an anonymous page-aligned mapping, registered with the driver, unregistered
        and unmapped when the tensor dies. Raises RuntimeError if the driver refuses. Transparent
        huge pages are asked for (fewer pages to fault and pin), and the mapping is not inherited
        by forked children (data loader workers), which would share pages the GPU writes by DMA.
        """
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
            if hasattr(mmap, advice):
                try:
                    mapping.madvise(getattr(mmap, advice))
                except OSError:            # not supported by this kernel: only slower or unsafe
                    pass                   # under fork, as torch's own pinned memory is
        slab = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        # Touch the pages first: the driver then only locks pages that are there. Registering
        # untouched huge pages faulted them in at 5.9 GiB/s on an H200 host; touched first, the
        # registration runs at ~40 GiB/s. One pin is touched on several threads: a step that
        # waits for its pins waits for one at a time.
        _touch(slab.data_ptr(), size, self.touch_threads)
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.index):  # a pinning thread starts on device 0
            err = cudart.cudaHostRegister(slab.data_ptr(), size, _HOST_REGISTER_PORTABLE)
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {size} bytes: "
                               f"{cudart.cudaGetErrorString(err)}")
        weakref.finalize(slab, _unregister, slab.data_ptr(), mapping)
        return slab

    def note_saved(self, storage) -> None:
        """Only the simulated device needs to be told about saved storages."""

    @staticmethod
    def free_after(t: torch.Tensor, stream) -> None:
        """``t`` may be let go now: its block goes back to the allocator only once the work
        queued on ``stream`` so far has run (a copy out of it; torch's own rule for a tensor
        used on another stream)."""
        t.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)


class _SimEvent:
    """Completes after ``lag`` queries, or at once when a stream waits on it: copies that lag
    behind compute, as they do on a GPU, without any real concurrency."""

    __slots__ = ("lag", "remaining")

    def __init__(self, lag: int = 0):
        self.lag = lag
        self.remaining = 0

    def record(self, stream=None) -> None:
        self.remaining = self.lag

    def query(self) -> bool:
        self.remaining -= 1
        return self.remaining < 0

    def synchronize(self) -> None:
        self.remaining = -1

    def wait(self, stream=None) -> None:
        self.synchronize()

    def elapsed_time(self, other) -> float:
        return 0.0


class _SimStream:
    __slots__ = ()

    def wait_event(self, event) -> None:
        event.wait(self)

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class SimulatedDevice:
    """A GPU stand-in on the CPU, with a memory capacity and synchronous streams.

    Args:
        capacity: the bytes the simulated GPU holds (its ``memory_limit``).
        pin_limit: if set, pinning past this many bytes held in total raises, like a host out of
            pinnable memory (for fault-injection tests); slabs that die give their bytes back.
        pin_threads: threads the host pool pins on. 0 (the default) pins on the calling thread
            and at once, as if everything were pinned ahead; 1 or more model a GPU host, where
            pins run in the background and take ``pin_delay`` seconds each.
        pin_delay: seconds each pin takes (slept on the pinning thread).
        copy_lag: events report "not done" for this many queries, so swapped sources stay held
            the way they do while a GPU copy is in flight.
        strict: a storage that would take allocated memory past ``capacity`` raises
            ``torch.OutOfMemoryError``, as the caching allocator does at its limit. Model memory
            that saves nothing (workspaces, gradients) is scripted with ``empty``.

    ``pin_gate`` (a ``threading.Event``, set) holds every pin while it is cleared: a test clears
    it to keep pins in flight for as long as it likes, then sets it.
    """

    kind = "sim"
    index = 0
    copy_path = None
    native_hooks = None          # a test may set lmsrt.copy_path's module here (CPU-built)
    torch_device = torch.device("cpu")
    name = "simulated"

    def __init__(self, capacity: int = _SIM_DEFAULT, pin_limit: Optional[int] = None,
                 copy_lag: int = 0, strict: bool = False, pin_threads: int = 0,
                 pin_delay: float = 0.0):
        self.capacity = int(capacity)
        self.strict = strict
        self.failures = 0            # allocations refused at the capacity (strict)
        self.tuning = False          # tunes_algorithms(): stands in for cuDNN's benchmark mode
        self.copy_lag = copy_lag
        self.pin_limit = pin_limit
        self.pinned_total = 0
        self.pin_threads = pin_threads
        self.pin_delay = pin_delay
        self.pin_gate = threading.Event()
        self.pin_gate.set()
        self._pin_lock = threading.Lock()
        self._lock = threading.Lock()
        self._live: dict = {}   # id(storage) -> (weakref, nbytes), for storages still alive
        self._by_ref: dict = {}  # id(weakref) -> id(storage)
        # Weakrefs of storages that died, queued by the C ``append`` as their callback: no
        # Python runs where a storage dies (it could swallow a Ctrl-C there), and the count is
        # brought up to date when it is read.
        self._gone: collections.deque = collections.deque()
        self._allocated = 0
        self._peak = 0
        self._default_stream = _SimStream()

    def owns(self, t: torch.Tensor) -> bool:
        return t.is_cpu

    def current_stream(self):
        """One stream, as every thread on a GPU has the same default stream."""
        return self._default_stream

    @staticmethod
    def stream_key() -> int:
        return 0

    def stream_of(self, key):
        return self._default_stream

    @staticmethod
    def new_stream():
        return _SimStream()

    def new_event(self, timing: bool = False):
        return _SimEvent(self.copy_lag)

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    def memory_allocated(self) -> int:
        if self._gone:
            self._forget()
        return self._allocated

    def peak_allocated(self) -> int:
        return self._peak

    def alloc_retries(self) -> int:
        return 0

    def alloc_failures(self) -> int:
        return self.failures

    def tunes_algorithms(self) -> bool:
        return self.tuning            # set by a test that stands in for cuDNN's benchmark mode

    def reset_peak(self) -> None:
        self._peak = self.memory_allocated()

    def memory_limit(self) -> int:
        return self.capacity

    def empty(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.note_saved(t.untyped_storage())
        return t

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pin_gate.wait()
        if self.pin_delay:
            time.sleep(self.pin_delay)
        with self._pin_lock:      # nothing in here allocates, so no finalizer can re-enter it
            refused = self.pin_limit is not None and self.pinned_total + nbytes > self.pin_limit
            if not refused:
                self.pinned_total += nbytes
        if refused:
            raise RuntimeError("simulated: cannot pin host memory (pin_limit reached)")
        slab = torch.empty(nbytes, dtype=torch.uint8)
        weakref.finalize(slab, self._unpinned, nbytes)
        return slab

    def _unpinned(self, nbytes: int) -> None:
        with self._pin_lock:
            self.pinned_total -= nbytes

    def note_saved(self, storage) -> None:
        with self._lock:
            self._drain()
            key = id(storage)
            if key in self._live:
                return
            nbytes = storage.nbytes()
            if self.strict and self._allocated + nbytes > self.capacity:
                self.failures += 1
                del storage     # pytest prints a frame's arguments: a storage's every byte
                raise torch.OutOfMemoryError(
                    f"simulated: out of memory allocating {nbytes} bytes with {self._allocated} "
                    f"of {self.capacity} allocated")
            ref = weakref.ref(storage, self._gone.append)
            self._live[key] = (ref, nbytes)
            self._by_ref[id(ref)] = key
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)

    @staticmethod
    def free_after(t: torch.Tensor, stream) -> None:
        """Nothing to do: a simulated copy has run by the time it returns."""

    def _forget(self) -> None:
        with self._lock:
            self._drain()

    def _drain(self) -> None:
        while self._gone:
            ref = self._gone[0]
            key = self._by_ref.pop(id(ref), None)
            if key is not None and self._live[key][0] is ref:
                self._allocated -= self._live.pop(key)[1]
            self._gone.popleft()

    def synchronize(self) -> None:
        pass


ENV_SIM_GB = "LMSRT_SIM_GB"


def sim_capacity(environ=None) -> int:
    """Bytes the simulated GPU holds: ``LMSRT_SIM_GB`` GiB if set, else 1 GiB (``lmsrt run
    --gpu-limit G`` under ``LMSRT_DEVICE=sim`` makes it G GiB instead).

    Example::

        sim_capacity({"LMSRT_SIM_GB": "0.25"})      # 268435456
    """
    raw = (os.environ if environ is None else environ).get(ENV_SIM_GB, "")
    if not raw:
        return _SIM_DEFAULT
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not (gib > 0 and gib < float("inf")):
        raise ValueError(f"{ENV_SIM_GB}={raw!r} is not a number of GiB > 0; set it to e.g. "
                         f"{ENV_SIM_GB}=0.5, or unset it")
    return int(gib * (1 << 30))


def resolve_device(spec) -> Optional[Device]:
    """Turn ``None``/``"cuda"``/``"cuda:N"``/``"sim"``/a ``torch.device``/a device object into a
    device, or None.

    None means no accelerator is there: the caller runs as a no-op and says so. A malformed
    spec raises whether or not there is a GPU, so a script fails on the laptop it was written on.
    """
    if isinstance(spec, (CudaDevice, SimulatedDevice)):
        return spec
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"device must be None, 'cuda', 'cuda:N', 'sim' or a torch.device, got "
                        f"{type(spec).__name__} {spec!r}")
    if spec in ("sim", "simulated"):
        return SimulatedDevice(capacity=sim_capacity())
    index = cuda_index(spec)
    if not torch.cuda.is_available():
        return None
    if index is not None and index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"device {spec!r} does not exist: this machine has {count} CUDA "
                         f"device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1}); pick "
                         "one of them, or leave device out for the current one.")
    return CudaDevice(index)


def copy_bandwidth(index: int = 0, nbytes: int = 256 << 20, reps: int = 5,
                   directions: Sequence[str] = ("h2d", "d2h")) -> Dict[str, float]:
    """Pinned host <-> GPU ``index`` copy speed in bytes/s, each of ``directions``: the median
    of ``reps`` timed copies of ``nbytes`` after one untimed (first-use costs are no bandwidth).

    Example::

        copy_bandwidth(0)["d2h"] / 1e9     # ~55 on a PCIe Gen5 H100 or H200
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    pairs = {"h2d": (gpu, host), "d2h": (host, gpu)}
    result = {}
    with torch.cuda.device(index):
        for name in directions:
            dst, src = pairs[name]
            dst.copy_(src, non_blocking=True)
            seconds = []
            for _ in range(reps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            result[name] = nbytes / statistics.median(seconds)
    return result
