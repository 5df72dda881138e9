"""scripts/host_sampler.py: every thread's stack sampled, steps told by the main thread's
backward, reported per window of steps."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import time, torch
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 64)
for step in range(8):
    out = model(x)
    out.register_hook(lambda g: time.sleep(0.05))    # a backward the samples see
    out.square().mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.03)
"""


def test_the_sampler_reports_each_window_by_thread_and_counts_backwards(tmp_path):
    script, dump = tmp_path / "train.py", tmp_path / "samples.json"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_sampler.py"),
                          "--windows", "2-3,4-6", "--dump", str(dump), "--", str(script)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "== steps 2-3" in run.stderr and "== steps 4-6" in run.stderr, run.stderr
    assert "  main: " in run.stderr and "train.py:<lambda>" in run.stderr, run.stderr
    samples = json.loads(dump.read_text())["samples"]
    steps = {s[0] for s in samples if s[1] == "main"}
    # Eight backwards, each 50 ms under 5 ms samples: the count reaches 7 or 8, one a step.
    assert max(steps) >= 7 and steps >= set(range(7)), sorted(steps)


def test_the_sampler_asks_for_its_command():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_sampler.py"),
                          "--every", "0.01"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "give the command after --" in run.stderr
