"""Pinning on this host: touch rate by threads, register rate, concurrency, THP."""
import ctypes, mmap, os, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
GiB = 1 << 30
cud = torch.cuda.cudart()
torch.cuda.init(); torch.empty(1, device="cuda")
for f in ("enabled", "defrag", "khugepaged/defrag"):
    try: print("thp", f, open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
    except OSError as e: print("thp", f, e)
print("kernel", os.uname().release, "cpus", os.cpu_count())
print(subprocess.run("lscpu | grep -i -E 'numa|model name|socket'", shell=True, capture_output=True, text=True).stdout)
print(subprocess.run("grep -i -E 'huge|MemAvail' /proc/meminfo", shell=True, capture_output=True, text=True).stdout)

def mapping(size, huge=True, populate=False):
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    m = mmap.mmap(-1, size, flags=flags)
    if huge: m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    return m, t

pool = ThreadPoolExecutor(32)
def touch(addr, size, n):
    step = -(-size // n // (2 << 20)) * (2 << 20)
    fs = [pool.submit(ctypes.memset, addr + s, 0, min(step, size - s)) for s in range(0, size, step)]
    for f in fs: f.result()

def reg(ptr, size):
    t = time.perf_counter(); e = cud.cudaHostRegister(ptr, size, 1); assert e == cud.cudaError.success, e
    return time.perf_counter() - t
def unreg(ptr):
    t = time.perf_counter(); cud.cudaHostUnregister(ptr); return time.perf_counter() - t

def huge_of(m):
    # AnonHugePages of this mapping via smaps would be costly; use /proc/self/smaps_rollup
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"): return line.split()[1]

size = 4 * GiB
for huge in (True, False):
    for n in (1, 2, 4, 8, 16):
        m, t = mapping(size, huge)
        a = time.perf_counter(); touch(t.data_ptr(), size, n); tt = time.perf_counter() - a
        ah = huge_of(m)
        r = reg(t.data_ptr(), size); u = unreg(t.data_ptr())
        print(f"huge={huge} threads={n:2} touch {size/GiB/tt:6.1f} GiB/s  register {size/GiB/r:6.1f} GiB/s ({r*1e3:.0f} ms) unregister {u*1e3:.0f} ms  AnonHuge kB {ah}", flush=True)
        del t, m
# register without touch
for huge in (True, False):
    m, t = mapping(size, huge); r = reg(t.data_ptr(), size); u = unreg(t.data_ptr())
    print(f"untouched huge={huge}: register {size/GiB/r:.1f} GiB/s", flush=True); del t, m
# MAP_POPULATE
a = time.perf_counter(); m, t = mapping(size, True, True); tt = time.perf_counter() - a
r = reg(t.data_ptr(), size); unreg(t.data_ptr())
print(f"MAP_POPULATE (no madvise before populate): map {size/GiB/tt:.1f} GiB/s register {size/GiB/r:.1f} GiB/s", flush=True); del t, m
# concurrent registration: 8 x 512 MiB, touched first
for conc in (1, 2, 4, 8):
    ms = [mapping(GiB // 2) for _ in range(8)]
    for m, t in ms: touch(t.data_ptr(), GiB // 2, 8)
    a = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda mt: reg(mt[1].data_ptr(), GiB // 2), ms))
    w = time.perf_counter() - a
    print(f"register 8 x 512 MiB on {conc} threads: {4/w:.1f} GiB/s", flush=True)
    for m, t in ms: unreg(t.data_ptr())
    del ms
# whole pipeline concurrently: 8 pins of 1 GiB each touched on 2 threads, in 4 pinning threads
def pin(sz, n):
    m, t = mapping(sz); touch(t.data_ptr(), sz, n); reg(t.data_ptr(), sz); return m, t
for workers, n in ((1, 16), (2, 8), (4, 4), (8, 2), (8, 8), (16, 1)):
    a = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        got = list(ex.map(lambda _: pin(GiB, n), range(8)))
    w = time.perf_counter() - a
    print(f"8 x 1 GiB pinned, {workers} pins at once, touch on {n}: {8/w:.1f} GiB/s", flush=True)
    for m, t in got: unreg(t.data_ptr())
    del got
# cudaHostAlloc via torch
a = time.perf_counter(); x = torch.empty(4 * GiB, dtype=torch.uint8, pin_memory=True); w = time.perf_counter() - a
print(f"torch pin_memory 4 GiB: {4/w:.2f} GiB/s")
# copies while pinning: D2H bandwidth alone vs with a pin running
g = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
h = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
def bw():
    torch.cuda.synchronize(); a = time.perf_counter()
    for _ in range(5): h.copy_(g, non_blocking=True)
    torch.cuda.synchronize(); return 10 / (time.perf_counter() - a)
print(f"D2H alone {bw():.1f} GiB/s")
th = threading.Thread(target=lambda: [unreg(pin(GiB, 8)[1].data_ptr()) for _ in range(12)]); th.start()
time.sleep(0.05); print(f"D2H while pinning {bw():.1f} GiB/s"); th.join()
