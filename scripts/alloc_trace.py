"""What the CUDA caching allocator did in each step, and where one step's allocations first part
from the step before's.

    python scripts/alloc_trace.py --steps 3-6 -- lmsrt run --gpu-limit 14 train.py
    python scripts/alloc_trace.py --steps 3-6 --stacks -- train.py --gpu-limit 14
    python scripts/alloc_trace.py --steps 3-6 --dump lmsrt.pickle -- lmsrt run train.py
    python scripts/alloc_trace.py --diff plain.pickle lmsrt.pickle    # where the runs part

Runs the command in this process (as host_sampler.py does) with the allocator's history recorded
(``torch.cuda.memory._record_memory_history``) from the end of step FIRST-2 to the end of step LAST
(step FIRST-1 is recorded to compare FIRST with), a step ending where a backward called on the main
thread returns. Each step boundary allocates and frees one small marker block (a size no other
allocation is likely to have: 512 bytes times 1237 plus the step) and reads the reserved bytes
there, so the trace splits by step and the reserved bytes can be followed through each step. Per
step it prints the allocations and frees, the bytes mapped and unmapped (expandable segments) or
the segments made and freed, the unmap bursts (each a retry, or an ``empty_cache``) with the
allocation that ran short (the first after the burst: the allocator frees its cache, maps afresh,
then records the allocation) and what it found: the bytes reserved and allocated then, the largest
free block (the layout each step leaves is recorded as it ends, and the step's trace replayed over
it), and whether reserved bytes plus the whole request passed torch's per-process cap (the cap
``--gpu-limit`` sets counts the whole request, even where an expandable segment lacks only a few
pages of it, so a run can retry where a GPU of that size would map those pages), the allocator's
out-of-memory events, the peak of reserved bytes inside the step (a script's or lmsrt's resets of
the peak counters do not hide it), and the first entry where the step's sequence of allocations and
frees (sizes, in order) differs from the step before's, with a few entries of each around it (their
Python frames with ``--stacks``). A model that allocates the same sequence every step keeps its
layout; one whose steps differ can need more reserved bytes than its allocated peak says.

Made for this: under lmsrt the Trainer with its own checkpointing retried once every step from
step 3 at 14 GiB, the same run without lmsrt never (benchmarks/results/h200-2026-11-28i-session29):
the allocations are the plain run's, size for size; the layout after lmsrt's learning steps
leaves the logits' 2000 MiB gradient a 1884 MiB free block where the plain run's left 2004, and
12.05 GiB reserved + 2000 MiB passes the 14 GiB cap by about 8 MiB
(benchmarks/results/h200-2026-11-29-session30).
"""
from __future__ import annotations

import argparse
import atexit
import bisect
import pickle
import sys
from typing import Dict, List, Optional, Tuple

from in_process import run_command, split_command

MARK = 512 * 1237          # marker bytes, plus 512 per step
MAX_ENTRIES = 1_000_000    # the allocator's ring of trace entries
GROW = ("segment_map", "segment_alloc")       # pages mapped (expandable), or a cudaMalloc
SHRINK = ("segment_unmap", "segment_free")    # and given back
_MIB = 1 << 20


def marker_size(step: int) -> int:
    return MARK + 512 * step


def split_steps(trace: List[dict], first: int, last: int) -> Dict[int, List[dict]]:
    """The trace's entries by step (``first``..``last``), cut at the marker allocations made at
    the end of steps ``first - 1`` .. ``last``: a block of a marker's size freed at once, its
    free the next entry (the markers themselves left out)."""
    cuts = {}
    for i, e in enumerate(trace[:-1]):
        after = trace[i + 1]
        if (e["action"] == "alloc" and (e["size"] - MARK) % 512 == 0
                and after["action"] == "free_requested" and after.get("addr") == e.get("addr")):
            step = (e["size"] - MARK) // 512
            if first - 1 <= step <= last and step not in cuts:
                cuts[step] = i
    steps = {}
    for step in range(first, last + 1):
        a, b = cuts.get(step - 1), cuts.get(step)
        if a is None or b is None:
            continue
        mark = marker_size(step - 1)
        steps[step] = [e for e in trace[a + 1:b]
                       if not (e["size"] == mark and e["action"] != "alloc")]
    return steps


def step_row(entries: List[dict], reserved_at_start: Optional[int]) -> dict:
    """Counts and bytes of one step's entries; the peak of reserved bytes inside it."""
    row = dict(allocs=0, frees=0, alloc_bytes=0, mapped=0, unmapped=0, unmap_bursts=0, ooms=0,
               peak_reserved=None)
    level = peak = 0
    last_unmap = -2
    for i, e in enumerate(entries):
        action, size = e["action"], e["size"]
        if action == "alloc":
            row["allocs"] += 1
            row["alloc_bytes"] += size
        elif action == "free_requested":
            row["frees"] += 1
        elif action in GROW:
            row["mapped"] += size
            level += size
            peak = max(peak, level)
        elif action in SHRINK:
            row["unmapped"] += size
            level -= size
            row["unmap_bursts"] += last_unmap != i - 1
            last_unmap = i
        elif action == "oom":
            row["ooms"] += 1
    if reserved_at_start is not None:
        row["peak_reserved"] = reserved_at_start + peak
    return row


def sequence(entries: List[dict]) -> List[Tuple[str, int]]:
    return [(e["action"], e["size"]) for e in entries
            if e["action"] in ("alloc", "free_requested")]


def first_difference(before: List[dict], now: List[dict]) -> Optional[Tuple[int, int, int]]:
    """(the index in ``now``'s allocations and frees where it first differs from ``before``'s,
    that index's entry in ``before``, in ``now``), or None where they are the same."""
    a, b = _moves(before), _moves(now)
    for k in range(min(len(a), len(b))):
        if (a[k]["action"], a[k]["size"]) != (b[k]["action"], b[k]["size"]):
            return k, a[k]["_i"], b[k]["_i"]
    if len(a) != len(b):
        k = min(len(a), len(b))
        return k, (a[k]["_i"] if k < len(a) else len(before)), (b[k]["_i"] if k < len(b)
                                                                  else len(now))
    return None


def _moves(entries: List[dict]) -> List[dict]:
    return [dict(e, _i=i) for i, e in enumerate(entries)
            if e["action"] in ("alloc", "free_requested")]


def _entry(e: dict, stacks: int) -> List[str]:
    lines = [f"      {e['action']:15s} {e['size'] / _MIB:10.3f} MiB  stream {e.get('stream', 0)}"]
    for fr in (e.get("frames") or [])[:stacks]:
        name = fr.get("filename", "?")
        cut = name.rfind("site-packages/")
        lines.append(f"          {name[cut + 14:] if cut >= 0 else name}:{fr.get('line')}"
                     f" {fr.get('name')}")
    return lines


def table(steps: Dict[int, List[dict]], reserved: Dict[int, int]) -> List[str]:
    """One line a step: its counts, bytes mapped and unmapped, and the reserved peak in it."""
    lines = ["step  allocs   frees  alloc GiB  mapped GiB  unmapped GiB  unmap bursts  ooms"
             "  peak reserved GiB"]
    gib = 1 << 30
    for step, entries in sorted(steps.items()):
        r = step_row(entries, reserved.get(step - 1))
        peak = "" if r["peak_reserved"] is None else f"{r['peak_reserved'] / gib:.2f}"
        lines.append(f"{step:4d} {r['allocs']:7d} {r['frees']:7d} {r['alloc_bytes'] / gib:10.2f}"
                     f" {r['mapped'] / gib:11.2f} {r['unmapped'] / gib:13.2f}"
                     f" {r['unmap_bursts']:13d} {r['ooms']:5d} {peak:>18s}")
    return lines


def bursts(entries: List[dict]) -> List[Tuple[int, Optional[int]]]:
    """(index of each unmap burst's first unmap, index of the allocation that ran short: the
    first after the burst, as the allocator frees its cache, maps afresh, and only then records
    the allocation; None where the step has none after it)."""
    found = []
    for i, e in enumerate(entries):
        if e["action"] in SHRINK and (i == 0 or entries[i - 1]["action"] not in SHRINK):
            short = next((j for j in range(i + 1, len(entries))
                          if entries[j]["action"] == "alloc"), None)
            found.append((i, short))
    return found


_SMALL = 1 << 20                 # requests of this size or less come from the small pool
_VA_SPAN = 9 / 8                 # an expandable segment's address range: this times the GPU's


def alloc_size(request: int) -> int:
    """The bytes the caching allocator asks of the cap for a request it must map or allocate
    anew: the request rounded to 512 bytes, then to a 2 MiB page (1 MiB or less: the small pool's
    2 MiB segment; under 10 MiB: 20 MiB; else a multiple of 2 MiB), as torch's
    ``get_allocation_size`` does."""
    size = -(-max(request, 1) // 512) * 512
    if size <= _SMALL:
        return 2 * _SMALL
    if size < 10 * _SMALL:
        return 20 * _SMALL
    return -(-size // (2 * _SMALL)) * 2 * _SMALL


def replay(segments: List[tuple], entries: List[dict], upto: int,
           total: Optional[int] = None, expandable: bool = True) -> List[list]:
    """The blocks of the large pool's segments as they lie before entry ``upto``: ``segments``
    (``layout``, as the step before ended) with the step's allocations (more than 1 MiB,
    rounded to 512 bytes as the allocator's blocks are), frees, maps and unmaps applied.
    [address, bytes, allocated, segment], in address order, neighbours of one kind in one
    segment merged (``expandable``: the mapped ranges of an expandable segment are one segment;
    else each ``cudaMalloc``'s is its own); unmapped ranges left out. Maps and unmaps count
    where they fall in the large segments' address range: from the lowest, as far as an
    expandable segment reserves (9/8 of ``total``, the GPU's memory) or, without ``total``, to
    the highest segment's end."""
    big = [s for s in segments if (s[4] if len(s) > 4 else "large") == "large"]
    if not big:
        return []
    low = min(s[0] for s in big)
    high = (low + int(total * _VA_SPAN) if total else max(s[0] + s[2] for s in big))
    blocks: Dict[int, list] = {}
    for s in big:
        segment = "x" if expandable else s[0]
        for a, n, state in s[3]:
            blocks[a] = [n, state.startswith("active"), segment]
    keys = sorted(blocks)

    def mark(address, size, value, segment=None):
        end = address + size
        at = max(bisect.bisect_right(keys, address) - 1, 0)
        hit = []
        while at < len(keys) and keys[at] < end:
            k = keys[at]
            if k + blocks[k][0] > address:
                hit.append(k)
            at += 1
        for k in hit:
            n, v, seg = blocks.pop(k)
            keys.remove(k)
            segment = seg if segment is None else segment
            if k < address:
                blocks[k] = [address - k, v, seg]
                bisect.insort(keys, k)
            if k + n > end:
                blocks[end] = [k + n - end, v, seg]
                bisect.insort(keys, end)
        blocks[address] = [size, value, "x" if segment is None else segment]
        bisect.insort(keys, address)

    for e in entries[:upto]:
        action, address, size = e["action"], e.get("addr", -1), e["size"]
        if not low <= address < high:
            continue
        if action in ("alloc", "free_completed"):
            if size > _SMALL:
                mark(address, -(-size // 512) * 512, action == "alloc")
        elif action == "segment_map":
            mark(address, size, False)
        elif action == "segment_alloc":
            mark(address, size, False, segment=address)
        elif action in SHRINK:
            mark(address, size, None)
    merged: List[list] = []
    for k in keys:
        n, v, seg = blocks[k]
        if v is None:
            continue
        last = merged[-1] if merged else None
        if last and last[0] + last[1] == k and last[2] == v and last[3] == seg:
            last[1] += n
        else:
            merged.append([k, n, v, seg])
    return merged


def before_burst(entries: List[dict], burst: int) -> int:
    """Where the allocator checked the request that ran short: before the frees it completed
    just ahead of its unmap burst (a retry first waits for the frees pending on other streams'
    events, then frees its cache)."""
    at = burst
    while at > 0 and entries[at - 1]["action"] == "free_completed":
        at -= 1
    return at


def short_of(blocks: List[list], request: int, reserved: Optional[int],
             cap: Optional[int]) -> List[str]:
    """Why a request ran short, from the blocks before it (``replay``) and the bytes reserved
    then."""
    if not blocks:
        return []
    gib = 1 << 30
    free = max((b[1] for b in blocks if not b[2]), default=0)
    lines = [f"      {'?' if reserved is None else f'{reserved / gib:.2f}'} GiB reserved, "
             f"{sum(b[1] for b in blocks if b[2]) / gib:.2f} allocated in the large pool; its "
             f"largest free block {free / _MIB:.0f} MiB"]
    asked = alloc_size(request)
    if cap and reserved is not None and free < request and reserved + asked > cap:
        lines.append(f"      reserved + the request ({asked / _MIB:.0f} MiB) passes the cap "
                     f"{cap / gib:.2f} GiB by {(reserved + asked - cap) / _MIB:.0f} MiB: the "
                     "per-process cap counts the whole request, not the pages it lacks")
    return lines


def burst_lines(steps: Dict[int, List[dict]], stacks: int, reserved: Dict[int, int],
                layouts: Optional[Dict[int, list]], cap: Optional[int],
                total: Optional[int] = None) -> List[str]:
    """Each step's first two unmap bursts: the allocation that ran short, and where the step
    before's layout is known the blocks it found (``short_of``)."""
    lines = []
    actions = {e["action"] for entries in steps.values() for e in entries}
    expandable = not actions & {GROW[1], SHRINK[1]}      # no cudaMalloc'd segments
    for step, entries in sorted(steps.items()):
        for i, short in bursts(entries)[:2]:
            lines.append(f"step {step}: an unmap burst at entry {i}, for")
            lines += _entry(entries[short], stacks) if short is not None else ["      (none)"]
            if short is not None and (layouts or {}).get(step - 1):
                start, at = reserved.get(step - 1), before_burst(entries, i)
                level = None if start is None else start + _mapped(entries[:at])
                lines += short_of(replay(layouts[step - 1], entries, at, total, expandable),
                                  entries[short]["size"], level, cap)
    return lines


def _mapped(entries: List[dict]) -> int:
    """Bytes mapped less bytes unmapped over ``entries``."""
    return sum(e["size"] if e["action"] in GROW else -e["size"] if e["action"] in SHRINK else 0
               for e in entries)


def report(steps: Dict[int, List[dict]], reserved: Dict[int, int], stacks: int = 0,
           around: int = 3, layouts: Optional[Dict[int, list]] = None,
           cap: Optional[int] = None, total: Optional[int] = None) -> str:
    """The per-step table; the allocation that ran short at each step's first two unmap bursts
    (a retry), and where the step before's layout is known (``--dump`` records it) the blocks
    it found; then each step's first difference from the step before."""
    lines = table(steps, reserved) + burst_lines(steps, stacks, reserved, layouts, cap, total)
    for step in sorted(steps):
        if step - 1 not in steps:
            continue
        before, now = steps[step - 1], steps[step]
        diff = first_difference(before, now)
        if diff is None:
            lines.append(f"step {step}: the same allocations and frees as step {step - 1}")
            continue
        lines.append(f"step {step}: differs from step {step - 1} at its allocation or free "
                     f"#{diff[0]} (of {len(sequence(now))}; {len(sequence(before))} before)")
        lines += _around(diff, (f"step {step - 1}", before), (f"step {step}", now), stacks,
                         around)
    return "\n".join(lines)


def _around(diff, first: tuple, second: tuple, stacks: int, around: int) -> List[str]:
    """The entries of two sequences around their first difference (``first_difference``)."""
    lines = []
    for (label, entries), at in ((first, diff[1]), (second, diff[2])):
        lines.append(f"    {label}:")
        for e in entries[max(0, at - around):at + around + 1]:
            lines.extend(_entry(e, stacks))
    return lines


def diff_report(a: dict, b: dict, names=("A", "B"), stacks: int = 0, around: int = 3) -> str:
    """Two runs' dumps step by step: the table of each, then where each step of ``b`` first
    differs from the same step of ``a`` (lmsrt's run against the plain one, say)."""
    lines = []
    cut = {}
    for name, d in zip(names, (a, b)):
        cut[name] = split_steps(d["trace"], d["first"], d["last"])
        lines.append(f"== {name}")
        lines += table(cut[name], d["reserved"])
        lines += burst_lines(cut[name], stacks, d["reserved"], d.get("layouts"), d.get("cap"),
                             d.get("total"))
    na, nb = names
    for step in sorted(set(cut[na]) & set(cut[nb])):
        diff = first_difference(cut[na][step], cut[nb][step])
        if diff is None:
            lines.append(f"step {step}: {nb} allocates and frees as {na} does")
            continue
        lines.append(f"step {step}: {nb} differs from {na} at allocation or free #{diff[0]} "
                     f"(of {len(sequence(cut[nb][step]))}; {len(sequence(cut[na][step]))} in "
                     f"{na})")
        lines += _around(diff, (na, cut[na][step]), (nb, cut[nb][step]), stacks, around)
    return "\n".join(lines)


def layout(segments: List[dict]) -> List[tuple]:
    """The allocator's segments as (address, stream, bytes, [(address, bytes, state), ...],
    "large" or "small"): where each block lies as a step ends (state "active_allocated",
    "inactive" ...; an expandable segment shows as one segment a mapped range), for the dump."""
    return [(s["address"], s["stream"], s["total_size"],
             [(b["address"], b["size"], b["state"]) for b in s["blocks"]],
             s.get("segment_type", "large")) for s in segments]


class Recorder:
    """Counts the main thread's backwards; records the allocator's history over steps ``first``
    to ``last`` (from the end of step ``first - 1``, which must be 1 or later)."""

    def __init__(self, first: int, last: int, stacks: bool, dump: Optional[str]):
        self.first, self.last, self.stacks, self.dump = first, last, stacks, dump
        self.step = 0
        self.reserved: Dict[int, int] = {}
        self.trace: Optional[List[dict]] = None
        self.layouts: Dict[int, list] = {}
        self.cap: Optional[int] = None       # torch's per-process cap, bytes (None: none set)
        self.total: Optional[int] = None     # the GPU's memory, bytes

    def install(self) -> None:
        import threading

        import torch
        original = torch.autograd.backward

        def backward(*args, **kwargs):
            result = original(*args, **kwargs)
            if threading.current_thread() is threading.main_thread():
                self.ended()
            return result

        torch.autograd.backward = backward

    def ended(self) -> None:
        import torch
        step, self.step = self.step + 1, self.step + 1
        if not torch.cuda.is_available() or not (self.first - 1 <= step <= self.last):
            return
        if step == self.first - 1:
            index = torch.cuda.current_device()
            self.total = torch.cuda.get_device_properties(index).total_memory
            fraction = torch.cuda.get_per_process_memory_fraction(index)
            self.cap = int(fraction * self.total) if fraction < 1.0 else None  # --gpu-limit's
            # context None: no stacks kept (the default, cheaper); "all": Python frames too.
            torch.cuda.memory._record_memory_history(
                context="all" if self.stacks else None, stacks="python", max_entries=MAX_ENTRIES)
        if step < self.last:     # the layout the next step starts from, for its bursts
            self.layouts[step] = layout(torch.cuda.memory._snapshot()["segments"])
        mark = torch.empty(marker_size(step), dtype=torch.uint8, device="cuda")
        del mark
        # Read after the marker: a page it had mapped is in the level the next step starts from.
        self.reserved[step] = torch.cuda.memory_reserved()
        if step == self.last:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.trace = snapshot["device_traces"][torch.cuda.current_device()]
            if self.dump:
                with open(self.dump, "wb") as f:
                    pickle.dump({"trace": self.trace, "reserved": self.reserved,
                                 "first": self.first, "last": self.last,
                                 "layouts": self.layouts, "cap": self.cap,
                                 "total": self.total}, f)

    def finish(self, stacks: int) -> None:
        if self.trace is None:
            print(f"alloc_trace: no trace: {self.step} backward(s) on the main thread, steps "
                  f"{self.first + 1}-{self.last} asked" + ("" if _cuda() else "; no CUDA device"),
                  file=sys.stderr, flush=True)
            return
        if len(self.trace) >= MAX_ENTRIES:
            print(f"alloc_trace: the allocator's ring of {MAX_ENTRIES} entries was full: the "
                  "first steps asked may be missing; ask for fewer", file=sys.stderr, flush=True)
        steps = split_steps(self.trace, self.first, self.last)
        print(report(steps, self.reserved, stacks, layouts=self.layouts, cap=self.cap,
                     total=self.total), file=sys.stderr, flush=True)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _steps(text: str) -> Tuple[int, int]:
    a, _, b = text.partition("-")
    first, last = int(a), int(b or a)
    if first < 3 or last < first:
        raise argparse.ArgumentTypeError(
            f"bad steps {text!r}: FIRST-LAST, 3 <= FIRST <= LAST (each step is compared with the "
            "one before it, and recording starts as a step ends: CUDA is left alone until then)")
    return first, last


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--diff"]:
        ap = argparse.ArgumentParser(description="two runs' dumps compared step by step")
        ap.add_argument("--diff", nargs=2, metavar=("A", "B"), required=True,
                        help="dumps (--dump) of two runs of the same steps")
        ap.add_argument("--stacks", type=int, default=12, help="frames shown an entry")
        args = ap.parse_args(argv)
        dumps = []
        for path in args.diff:
            with open(path, "rb") as f:
                dumps.append(pickle.load(f))
        print(diff_report(*dumps, names=tuple(args.diff), stacks=args.stacks))
        return
    own, command = split_command("alloc_trace", argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=_steps, default=_steps("3-6"),
                    help="steps to report, FIRST-LAST, counted from 1 (FIRST >= 3)")
    ap.add_argument("--stacks", nargs="?", type=int, const=12, default=0,
                    help="record Python stacks, and show this many frames an entry (12)")
    ap.add_argument("--dump", help="write the trace and the reserved bytes (pickle)")
    args = ap.parse_args(own)
    first, last = args.steps
    recorder = Recorder(first - 1, last, bool(args.stacks), args.dump)
    recorder.install()
    atexit.register(recorder.finish, args.stacks)
    run_command(command)


if __name__ == "__main__":
    main()
