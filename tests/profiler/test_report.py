"""`lmsrt.memory_report` and `lmsrt profile`: figures checked against hand-computed ones on the CPU
(and the meta device); the predicted peak against the measured one on CUDA."""
import gc
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from models import transformer
from processes import ROOT
from torch import nn

import lmsrt
from lmsrt._cli import main
from lmsrt.device import SimulatedDevice
from lmsrt.profiler.recorder import OUTSIDE, StepRecorder
from lmsrt.profiler.report import build_report, headroom
from lmsrt.units import GiB, MiB, format_bytes

F32 = 4
LINEAR_PARAMS = (64 * 64 + 64) * F32


def linear_stack():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.ReLU())])


def rows_by_name(report):
    return {r.name: r for r in report.rows}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_linear_stack_figures(device):
    with torch.device(device):
        model = linear_stack()
        x = torch.randn(8, 64)
    report = lmsrt.memory_report(model, x, optimizer=torch.optim.Adam(model.parameters()))
    rows = rows_by_name(report)
    act = 8 * 64 * F32
    assert [r.name for r in report.rows] == ["Sequential", "0", "1", "2", "3", "4", "5"]
    # Linear 0 saves the model input (a leaf, still saved); each ReLU its output; Linears 2 and
    # 4 save the ReLU output before them, already counted there (but their backward reads it).
    assert [rows[n].saved_bytes for n in "012345"] == [act, act, 0, act, 0, act]
    assert [rows[n].saved_used_bytes for n in "012345"] == [act] * 6
    assert report.saved_bytes == 4 * act and sorted(report.saved_sizes) == [act] * 4
    for n in "024":
        assert rows[n].param_bytes == rows[n].grad_bytes == LINEAR_PARAMS
        # Adam: exp_avg and exp_avg_sq per parameter; the step scalars live on the CPU.
        steps = 2 * F32 if device == "cpu" else 0
        assert rows[n].optimizer_bytes == 2 * LINEAR_PARAMS + steps
        assert rows[n].output_shape == "8x64" and rows[n].calls == 1
    assert all(rows[n].param_bytes == 0 for n in "135")
    assert report.param_bytes == report.grad_bytes == 3 * LINEAR_PARAMS
    assert report.output_bytes == 0            # the ReLU saved the output
    assert not report.measured and report.rows[1].transient_bytes is None
    # NOTE [ The predicted peak ]: the Adam update (one more copy of the parameters) tops the turn.
    state = report.param_bytes + report.grad_bytes + report.optimizer_bytes
    turn = state + 4 * act + 2 * act          # largest transient: a layer's input + output
    assert report.predicted_peak_bytes == max(turn, state + report.param_bytes)
    assert all(p.grad is None for p in model.parameters())


def test_conv_bn_relu_figures():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
    x = torch.randn(2, 3, 16, 16)
    report = lmsrt.memory_report(model, x, loss_fn=lambda out: out.square().mean())
    conv, bn, relu = (rows_by_name(report)[n] for n in "012")
    act = 2 * 8 * 16 * 16 * F32
    assert conv.saved_bytes == x.numel() * F32
    assert bn.saved_bytes == act + 2 * 8 * F32                  # its input, batch mean and invstd
    assert relu.saved_bytes == act                              # the BN output, ReLU'd in place
    assert conv.param_bytes == conv.grad_bytes == (8 * 3 * 9 + 8) * F32
    assert bn.param_bytes == 4 * 8 * F32 + 8                    # + running stats, batch count
    assert bn.grad_bytes == 2 * 8 * F32
    assert report.optimizer_bytes == 0
    assert any("no optimizer step" in n for n in report.notes)
    # square() saves the output, the ReLU'd storage: nothing more, and no extra output held.
    assert report.saved_bytes == conv.saved_bytes + bn.saved_bytes + relu.saved_bytes
    assert report.output_bytes == 0
    assert relu.output_bytes == 0 and bn.output_bytes == act    # one storage, made by the BN


def test_views_of_one_storage_count_once():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 64)

        def forward(self, x):
            a, b = self.lin(x).chunk(2, dim=-1)       # two views of one storage
            return a * b.sigmoid()

    model = Gate()
    report = lmsrt.memory_report(model, torch.randn(4, 32))
    gate, lin = rows_by_name(report)["Gate"], rows_by_name(report)["lin"]
    assert lin.saved_bytes == 4 * 32 * F32
    # mul saves `a` (a view of the Linear output) and sigmoid's result; sigmoid saves that too.
    assert gate.saved_bytes == 4 * 64 * F32 + 4 * 32 * F32
    assert gate.output_shape == "4x32" and lin.output_shape == "4x64"
    assert report.output_bytes == 4 * 32 * F32           # held by the caller, saved by nobody


def test_meta_matches_cpu_for_a_conv_net():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(16, 4, 1))
    figures = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model, x = build(), torch.randn(2, 3, 32, 32)
        report = lmsrt.memory_report(model, x, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9))
        figures.append([(r.name, r.output_shape, r.saved_bytes, r.saved_used_bytes,
                         r.param_bytes, r.grad_bytes, r.optimizer_bytes) for r in report.rows])
    assert figures[0] == figures[1]
    pool = next(f for f in figures[0] if f[0] == "3")
    assert pool[2] == 2 * 16 * 16 * 16 * 8                      # int64 indices


def test_verdict_fits_moves_or_cannot():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)])
    report = lmsrt.memory_report(model, torch.randn(512, 256))    # 512 KiB activations
    peak = report.predicted_peak_bytes
    assert report.verdict() is None                              # no GPU, no size given
    assert "gpu_size=" in report.format()

    roomy = report.verdict(4 * peak / GiB)
    assert roomy.fits and roomy.move_bytes == 0 and roomy.lms_kb is None
    assert "LMS is not needed" in str(roomy)

    size = int(0.8 * peak)
    tight = report.verdict(size / GiB)
    usable = tight.gpu_size_bytes - headroom(tight.gpu_size_bytes)
    assert not tight.fits and tight.possible
    assert tight.move_bytes == peak - usable
    assert tight.lms_kb == 512            # no saved tensor reaches 1000 KB: the ones of 512 KiB
    layer = report.largest_layer
    need = layer.working_set_bytes - layer.param_bytes - layer.grad_bytes
    expect = int((usable - report.grad_bytes - need) / tight.gpu_size_bytes * 100) / 100
    assert tight.lms_frac == pytest.approx(max(0.0, expect))
    assert f"--lms {tight.lms_kb} --lms-frac {tight.lms_frac:.2f}" in str(tight)

    hopeless = report.verdict(0.5 * tight.floor_bytes / GiB)
    assert not hopeless.fits and not hopeless.possible and hopeless.lms_frac is None
    assert "Not even LMS" in str(hopeless)


def test_optimizer_state_that_leaves_no_room_moves_in_the_verdict():
    """AdamW's state (128 MiB) beside 128 MiB of parameters and gradients: on a GPU too small
    for its update whole, the state lives on the host and the update runs in parts, so the
    verdict says so; on one too small for the parameters, gradients and three parts of the
    update, not even that."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU())
                                for _ in range(4)])
        x = torch.randn(64, 2048)
    report = lmsrt.memory_report(model, x, optimizer=torch.optim.AdamW(model.parameters()))
    assert report.optimizer_bytes > 120 * MiB and report.optimizer_step_bytes > 300 * MiB
    v = report.verdict(224 / 1024)
    assert not v.fits and v.possible and v.state_moves_bytes == report.optimizer_bytes
    assert v.move_bytes == report.optimizer_bytes            # the saved tensors fit beside
    assert "optimizer state" in str(v) and "--optimizer-state" in str(v)
    assert report.param_bytes + report.grad_bytes < v.floor_bytes < report.optimizer_step_bytes
    assert not report.verdict(144 / 1024).possible


def test_lms_threshold_is_1000_kb_when_big_tensors_suffice():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU())
                                for _ in range(4)])
        x = torch.randn(1024, 1024)                                # 4 MiB activations
    report = lmsrt.memory_report(model, x)
    v = report.verdict(0.7 * report.predicted_peak_bytes / GiB)
    assert not v.fits and v.possible and v.lms_kb == 1000


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 150 * 2**20, 9.5 * GiB)] == [
        "0 B", "1023 B", "1.50 KiB", "3.00 MiB", "150 MiB", "9.50 GiB"]
    assert format_bytes(None) == "n/a"


class _MeteredSim(SimulatedDevice):
    """The simulated device posing as an allocator, to drive the measured path on the CPU."""

    kind = "cuda"


def test_measured_path_records_transients_peak_and_phases():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = StepRecorder(meter=_MeteredSim())
    rec.add_root(model)
    with rec:
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    report = build_report(rec, "mlp")
    assert rec.done and report.measured and report.gpu_size_bytes == _MeteredSim().capacity
    assert all(r.transient_bytes is not None for r in report.rows if r.calls)
    phases = [s.phase for s in report.timeline]
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    assert report.measured_peak_bytes == max(s.peak for s in report.timeline) > 0
    assert report.measured_peak_where.startswith(("forward of", "backward of"))
    assert "n/a" not in report.format()


# -- lmsrt profile ------------------------------------------------------------------------------

# Knows nothing of lmsrt: an evaluation forward first (not a step), then training steps.
TRAIN_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with torch.no_grad():
        model(torch.randn(1, 3, 16, 16))
    for step in range(int(sys.argv[1])):
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        print(f"trained step {step}")
""")

# No optimizer: a step ends at the next forward after a backward, or at the script's end.
BACKWARD_ONLY_SCRIPT = textwrap.dedent("""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
    print("script finished")
""")

OOM_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn

    class Huge(nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB. More")

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), Huge())
    model(torch.randn(4, 16)).sum().backward()
""")


def write(tmp_path, text, name="train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_profile_prints_the_table_and_writes_html_and_png(tmp_path):
    script = write(tmp_path, TRAIN_SCRIPT)
    html, png = tmp_path / "r.html", tmp_path / "t.png"
    plot = ["--png", str(png)] if importlib.util.find_spec("matplotlib") else []
    result = CliRunner().invoke(main, ["profile", "--gpu-size", "0.001", "--html", str(html),
                                       *plot, "--", script, "5"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "trained step" not in out          # stopped at the end of the first optimizer step
    assert "step 1 of Sequential in train.py" in out
    for text in ("BatchNorm2d", "4x8x16x16", "CrossEntropyLoss", "predicted peak",
                 "largest layer", "fits a GPU of 1.02 MiB", "ESTIMATE"):
        assert text in out
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "<table>" in page and "MaxPool2d" in page
    if not plot:
        assert not png.exists() and "matplotlib is not installed" in page
    else:
        assert png.read_bytes().startswith(b"\x89PNG") and "data:image/png;base64," in page


def test_profile_nth_step_counts_earlier_optimizer_state(tmp_path):
    script = write(tmp_path, TRAIN_SCRIPT)
    result = CliRunner().invoke(main, ["profile", "--steps", "3", script, "5"])
    assert result.exit_code == 0, result.output
    assert result.output.count("trained step") == 2 and "step 3 of Sequential" in result.output
    result = CliRunner().invoke(main, ["profile", "--steps", "9", script, "2"])
    assert result.exit_code == 1 and "ended before step 9 began" in result.output


def test_profile_without_optimizer(tmp_path):
    script = write(tmp_path, BACKWARD_ONLY_SCRIPT)
    result = CliRunner().invoke(main, ["profile", script])
    assert result.exit_code == 0, result.output
    assert "script finished" not in result.output and "no optimizer step" in result.output
    result = CliRunner().invoke(main, ["profile", "--steps", "2", script])
    assert result.exit_code == 0 and "script finished" in result.output


def test_profile_out_of_memory_gives_a_partial_report(tmp_path):
    result = CliRunner().invoke(main, ["profile", write(tmp_path, OOM_SCRIPT)])
    assert result.exit_code == 1
    assert "partial: ran out of GPU memory in forward of 2 (Huge)" in result.output
    assert "Tried to allocate 9.00 GiB" in result.output


def test_profile_as_a_process(tmp_path):
    script = write(tmp_path, TRAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "lmsrt", "profile", "--gpu-size", "8", "--",
                           script, "3"], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "fits a GPU of 8.00 GiB" in proc.stdout and OUTSIDE not in proc.stdout


def test_segnet_example_answers_from_shapes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "segnet_memory.py"),
                           "--device", "meta", "--table"], capture_output=True, text=True,
                          env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    for text in ("Caffe-style data", "Why B needs more than A", "Why Caffe's line fell short",
                 "What LMS does about it", "enc.0.conv", "1x64x769x1025", "ESTIMATE"):
        assert text in proc.stdout, text
    # The docstring's story agrees with what the example prints: net B fits the 8 GB card.
    peak = re.search(r"The step's peak is ([0-9.]+) GiB", proc.stdout).group(1)
    doc = (ROOT / "examples" / "segnet_memory.py").read_text().split('"""')[1]
    assert f"about {float(peak):.1f} GiB" in " ".join(doc.split()) and "LMS is not needed" in \
        proc.stdout and "needed 9.5 GB" not in doc


# -- CUDA ---------------------------------------------------------------------------------------

def _conv_net():
    """Ten conv/BN/ReLU(inplace) stages at 256x256: activations dominate, as where LMS is used."""
    c, layers = 32, []
    for i in range(10):
        layers += [nn.Conv2d(3 if i == 0 else c, c, 3, padding=1), nn.BatchNorm2d(c),
                   nn.ReLU(inplace=True)]
    layers += [nn.MaxPool2d(2), nn.Upsample(scale_factor=2), nn.Conv2d(c, 2, 1)]
    return nn.Sequential(*layers), (16, 3, 256, 256)


def _transformer():
    return transformer(d=256, layers=12, heads=4), (16, 256, 256)


@pytest.mark.cuda
@pytest.mark.parametrize("build", [_conv_net, _transformer], ids=["conv", "transformer"])
def test_predicted_peak_within_10_percent_of_measured(build):
    """The predicted peak against a steady-state step's max_memory_allocated."""
    warm = nn.Linear(64, 64).cuda()          # cuBLAS workspaces (both threads) before the base
    warm(torch.randn(8, 64, device="cuda")).sum().backward()
    del warm
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model, shape = build()
    model = model.cuda()
    x = torch.randn(*shape, device="cuda")
    opt = torch.optim.Adam(model.parameters())

    def loss_fn(out):
        return out.float().square().mean()
    report = lmsrt.memory_report(model, x, optimizer=opt, loss_fn=loss_fn)
    assert report.measured and report.measured_peak_bytes > 0
    assert all(r.transient_bytes is not None for r in report.rows if r.calls)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = model(x)
    loss_fn(out).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = report.predicted_peak_bytes
    assert abs(predicted - measured) <= 0.10 * measured, (
        f"predicted {format_bytes(predicted)}, measured {format_bytes(measured)}\n{report}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_outputs_this_machine_cannot_make_exit_2_before_the_script(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    script = write(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    result = CliRunner().invoke(main, ["profile", "--snapshot", str(tmp_path / "s.pickle"),
                                       script])
    assert result.exit_code == 2 and "--snapshot needs a CUDA GPU" in result.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if not installed
    result = CliRunner().invoke(main, ["profile", "--png", str(tmp_path / "t.png"), script])
    assert result.exit_code == 2 and "pip install matplotlib" in result.output
    assert not marker.exists() and not (tmp_path / "t.png").exists()
