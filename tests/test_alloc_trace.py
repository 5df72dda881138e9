"""scripts/alloc_trace.py: the allocator's trace cut into steps at its markers, counted per step,
and each step's first difference from the step before."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import alloc_trace as at  # noqa: E402

MIB = 1 << 20


def _e(action, size, **kw):
    return dict(action=action, size=size, **kw)


def _step(sizes, extra=()):
    """A step that allocates ``sizes`` in order, then frees them in reverse, with ``extra``
    entries (segment maps, unmaps, out-of-memory) after its first allocation."""
    out = [_e("alloc", sizes[0] * MIB), *extra]
    out += [_e("alloc", s * MIB) for s in sizes[1:]]
    out += [_e("free_requested", s * MIB) for s in reversed(sizes)]
    return out


def _trace(steps, first):
    """Marker allocations (freed at once) at the end of step ``first - 1`` and each after."""
    trace = []
    for k, entries in enumerate([[]] + steps):
        if k:
            trace += entries
        mark, addr = at.marker_size(first - 1 + k), 0x7000 + k
        trace += [_e("alloc", mark, addr=addr), _e("free_requested", mark, addr=addr),
                  _e("free_completed", mark, addr=addr)]
    return trace


def test_the_trace_is_cut_into_steps_at_the_markers_and_counted():
    # (a block of a marker's size that is not freed at once is no marker)
    steps = [_step([4, 2]) + [_e("alloc", at.marker_size(5), addr=1)],
             _step([4, 2], [_e("segment_map", 20 * MIB)]),
             _step([4, 2, 1], [_e("segment_unmap", 20 * MIB), _e("segment_unmap", 40 * MIB),
                               _e("segment_map", 80 * MIB), _e("oom", 0)])]
    cut = at.split_steps(_trace(steps, first=4), 4, 6)
    assert sorted(cut) == [4, 5, 6]
    assert cut[4] == steps[0] and cut[6] == steps[2]      # markers and their frees left out
    row = at.step_row(cut[6], reserved_at_start=1000 * MIB)
    assert (row["allocs"], row["frees"], row["alloc_bytes"]) == (3, 3, 7 * MIB)
    assert (row["mapped"], row["unmapped"], row["unmap_bursts"], row["ooms"]) == (
        80 * MIB, 60 * MIB, 1, 1)
    # reserved: 1000 MiB at the start, 60 unmapped, then 80 mapped: 1020 at most
    assert row["peak_reserved"] == 1020 * MIB
    assert at.step_row(cut[5], 100 * MIB)["peak_reserved"] == 120 * MIB


def test_a_step_is_compared_with_the_one_before_by_its_allocations_in_order():
    same, other = _step([4, 2]), _step([4, 3])
    assert at.first_difference(same, _step([4, 2], [_e("segment_map", MIB)])) is None
    k, i, j = at.first_difference(same, other)
    assert k == 1 and same[i]["size"] == 2 * MIB and other[j]["size"] == 3 * MIB
    longer = _step([4, 2, 1])
    assert at.first_difference(same, longer)[0] == 2
    text = at.report({4: same, 5: _step([4, 2]), 6: other}, {3: 0, 4: 0, 5: 0})
    assert "step 5: the same allocations and frees as step 4" in text
    assert "step 6: differs from step 5 at its allocation or free #1" in text
    assert "3.000 MiB" in text and "2.000 MiB" in text


def test_frames_are_shown_with_each_differing_entry():
    frame = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 7, "name": "linear"}
    before = _step([4, 2])
    now = [_e("alloc", 4 * MIB), _e("alloc", 5 * MIB, frames=[frame])]
    text = at.report({4: before, 5: now}, {}, stacks=3)
    assert "torch/nn/functional.py:7 linear" in text


def test_the_tool_asks_for_steps_it_can_compare_and_says_why_there_is_no_trace(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.ones(3, requires_grad=True)\n"
                      "for _ in range(4):\n    (x * 2).sum().backward()\n")
    tool = str(ROOT / "scripts" / "alloc_trace.py")
    bad = subprocess.run([sys.executable, tool, "--steps", "1-2", "--", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "3 <= FIRST" in bad.stderr
    run = subprocess.run([sys.executable, tool, "--steps", "3-9", "--", str(script)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "no trace: 4 backward(s) on the main thread, steps 3-9" in run.stderr, run.stderr


def test_two_runs_dumps_are_compared_step_by_step(tmp_path):
    """``--diff A B``: each step of B against the same step of A (lmsrt's run against the plain
    one): where B's allocations and frees first part from A's."""
    import pickle
    plain = [_step([4, 2]), _step([4, 2])]
    frame = {"filename": "/w/lmsrt/engine/forward.py", "line": 9, "name": "pack"}
    lmsrt = [_step([4, 2]), [_e("alloc", 4 * MIB), _e("alloc", 64 * MIB, frames=[frame])]]
    paths = []
    for name, steps in (("plain", plain), ("lmsrt", lmsrt)):
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(pickle.dumps({"trace": _trace(steps, first=4), "first": 4, "last": 5,
                                       "reserved": {3: 0, 4: 0}}))
        paths.append(str(path))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "alloc_trace.py"), "--diff",
                          *paths, "--stacks", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"step 4: {paths[1]} allocates and frees as {paths[0]} does" in out, out
    assert f"step 5: {paths[1]} differs from {paths[0]} at allocation or free #1" in out, out
    assert "64.000 MiB" in out and "lmsrt/engine/forward.py:9 pack" in out, out


def test_the_allocation_that_ran_short_is_shown_with_each_unmap_burst():
    """The allocator frees its cache, maps afresh, and only then records the allocation that
    ran short: the first after the burst."""
    frame = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"}
    step = [_e("alloc", 4 * MIB), _e("segment_unmap", 20 * MIB), _e("segment_unmap", 20 * MIB),
            _e("segment_map", 96 * MIB), _e("alloc", 96 * MIB, frames=[frame]),
            _e("free_requested", 4 * MIB)]
    assert at.bursts(step) == [(1, 4)]
    text = at.report({4: step}, {3: 0}, stacks=2)
    assert "step 4: an unmap burst at entry 1, for" in text
    assert "96.000 MiB" in text and "torch/nn/functional.py:3 linear" in text


def test_a_burst_is_explained_from_the_layout_the_step_before_left():
    """The blocks before the allocation that ran short are the step before's layout with the
    step's own large allocations and frees applied, up to the frees the allocator completed just
    ahead of its burst (the retry's own wait for pending frees); where reserved bytes plus the
    whole request, rounded as the allocator rounds it, pass a per-process cap, the report says
    by how much and that the cap counted the whole request."""
    base = 1 << 32
    layout = [(base, 0, 100 * MIB, [(base, 40 * MIB, "active_allocated"),
                                    (base + 40 * MIB, 60 * MIB, "inactive")], "large"),
              (base * 2, 0, 2 * MIB, [(base * 2, 2 * MIB, "inactive")], "small")]
    step = [_e("alloc", 30 * MIB, addr=base + 40 * MIB),
            _e("alloc", 10 * MIB, addr=base + 70 * MIB),
            _e("free_completed", 10 * MIB, addr=base + 70 * MIB),
            _e("alloc", 512 << 10, addr=base + 99 * MIB),      # the small pool's size: not here
            _e("alloc", 4 * MIB, addr=base + 80 * MIB),
            _e("free_completed", 4 * MIB, addr=base + 80 * MIB),   # completed for the retry
            _e("segment_unmap", 16 * MIB, addr=base + 84 * MIB),
            _e("segment_map", 50 * MIB, addr=base + 84 * MIB),
            _e("alloc", 50 * MIB, addr=base + 70 * MIB)]
    assert at.before_burst(step, 6) == 5
    blocks = at.replay(layout, step, 5)
    assert [b[:3] for b in blocks] == [[base, 70 * MIB, True], [base + 70 * MIB, 10 * MIB, False],
                                       [base + 80 * MIB, 4 * MIB, True],
                                       [base + 84 * MIB, 16 * MIB, False]], blocks
    text = at.report({4: step}, {3: 102 * MIB}, layouts={3: layout}, cap=120 * MIB)
    assert "0.10 GiB reserved, 0.07 allocated in the large pool" in text, text
    assert "largest free block 16 MiB" in text
    assert "passes the cap 0.12 GiB by 32 MiB" in text and "counts the whole request" in text
    roomy = at.report({4: step}, {3: 102 * MIB}, layouts={3: layout}, cap=200 * MIB)
    assert "largest free block 16 MiB" in roomy and "counts the whole request" not in roomy


def test_free_blocks_merge_within_a_segment_and_requests_round_as_the_allocator_rounds():
    """Two neighbouring free segments of their own (fixed segments, one ``cudaMalloc`` each) are
    two blocks; an expandable segment's neighbouring ranges are one. The bytes a request asks
    of the cap: 2 MiB for the small pool's, 20 MiB under 10 MiB, else whole 2 MiB pages."""
    base = 1 << 32
    layout = [(base, 0, 10 * MIB, [(base, 10 * MIB, "inactive")], "large"),
              (base + 10 * MIB, 0, 10 * MIB, [(base + 10 * MIB, 10 * MIB, "inactive")], "large")]
    assert len(at.replay(layout, [], 0, expandable=False)) == 2
    assert [b[1] for b in at.replay(layout, [], 0)] == [20 * MIB]
    assert at.alloc_size(100) == 2 * MIB and at.alloc_size(3 * MIB) == 20 * MIB
    assert at.alloc_size(2000 * MIB) == 2000 * MIB and at.alloc_size(2000 * MIB + 1) == 2002 * MIB


def test_the_recorder_records_from_the_step_before_the_first_and_cuts_at_its_markers(
        monkeypatch, capsys):
    """``Recorder`` over a fake CUDA: history recorded from the end of step FIRST-2 (with
    arguments the allocator's recorder takes), a marker at each step end from there, a snapshot
    and the recording stopped at step LAST; the report has steps FIRST-1 to LAST."""
    import torch
    calls, trace, state = [], [], {"on": False}
    real_empty = torch.empty

    def record(enabled="all", context="all", stacks="all", max_entries=0, **kw):
        assert enabled in (None, "state", "all") and context in (None, "state", "alloc", "all")
        assert stacks in ("python", "all") and isinstance(max_entries, int)
        calls.append((enabled, context, stacks))
        state["on"] = enabled is not None

    def empty(n, dtype=None, device=None):
        if device == "cuda" and state["on"]:
            addr = 0x9000 + len(trace)
            trace.extend([_e("alloc", n, addr=addr), _e("free_requested", n, addr=addr)])
        return real_empty(n, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 64 * MIB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda: {"device_traces": [trace], "segments": []})
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("Props", (), {"total_memory": 1 << 34})())
    monkeypatch.setattr(torch, "empty", empty)
    rec = at.Recorder(first=4, last=6, stacks=False, dump=None)     # --steps 5-6
    for step in range(1, 8):
        if state["on"]:
            trace.extend(_step([step, 1]))                          # the step's own
        rec.ended()
    assert calls == [("all", None, "python"), (None, "all", "all")], calls
    assert sorted(rec.reserved) == [3, 4, 5, 6] and rec.trace is trace
    monkeypatch.setattr(torch, "empty", real_empty)
    rec.finish(stacks=0)
    err = capsys.readouterr().err
    assert "step 5: differs from step 4 at its allocation or free #0" in err, err
    assert [line.split()[0] for line in err.splitlines()[1:4]] == ["4", "5", "6"], err
