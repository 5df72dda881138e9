"""`lmsrt run` and `lmsrt info`, on the CPU: LMS runs on the simulated device (LMSRT_DEVICE=sim).

In-process runs go through click's CliRunner; what only a real process shows (exit status,
stderr, torchrun, the worker bootstrap) runs `python -m lmsrt` in a subprocess.
"""
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from processes import clean_env, write

import lmsrt.launch.session
from lmsrt import arena
from lmsrt._cli import main
from lmsrt.launch.output import check_output_file, write_atomic
from lmsrt.launch.session import BOOTSTRAP_DIR

# A script that does not know about lmsrt: an MLP trained for argv[1] steps on the CPU.
MLP_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                  for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f}")
""")

# Prints what the script sees, on one line, for the pass-through tests.
ARGV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    print("SEEN=" + json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                                "active": os.environ.get("LMSRT_ACTIVE")}))
""")


def lmsrt_process(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmsrt", *args], capture_output=True, text=True,
                          cwd=cwd, env=env or clean_env(), timeout=180)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env=clean_env())


def seen(output: str) -> dict:
    line = next(ln for ln in output.splitlines() if ln.startswith("SEEN="))
    return json.loads(line[len("SEEN="):])


# -- passing the script its arguments -------------------------------------------------------------

@pytest.mark.parametrize("before, after, expected", [
    ([], ["--help", "-x", "3"], ["--help", "-x", "3"]),             # after the script
    (["--"], ["--help"], ["--help"]),                                # after --
    ([], ["--", "--help"], ["--help"]),                              # -- after it: dropped
    ([], ["-x", "--", "--help"], ["-x", "--", "--help"]),            # a later -- is the script's
    (["--lms", "1", "--lms-frac", "0"], ["--lms", "5"], ["--lms", "5"]),   # same names as ours
])
def test_script_gets_its_arguments_untouched(tmp_path, before, after, expected):
    script = write(tmp_path / "dir" / "show.py", ARGV_SCRIPT)
    result = invoke("run", *before, script, *after)
    assert result.exit_code == 0, result.output
    got = seen(result.output)
    assert got["argv"] == [script, *expected]
    assert got["path0"] == str(tmp_path / "dir")          # the script's directory, as python does
    assert got["name"] == "__main__" and got["active"] == "1"


def test_help_after_script_reaches_script_in_a_real_process(tmp_path):
    script = write(tmp_path / "show.py", ARGV_SCRIPT)
    result = lmsrt_process("run", "--lms", "1", script, "--help")
    assert result.returncode == 0, result.stderr
    assert seen(result.stdout)["argv"] == [script, "--help"]


def test_module_mode(tmp_path, monkeypatch):
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "train.py", ARGV_SCRIPT)
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--lms", "1", "-m", "pkg.train", "--help", "a")
    assert result.exit_code == 0, result.output
    got = seen(result.output)
    assert got["argv"][1:] == ["--help", "a"] and got["argv"][0].endswith("train.py")
    assert got["name"] == "__main__" and got["path0"] == str(tmp_path)


# -- bad input: exit status 2 and a message, before the script starts -----------------------------

def no_exec(*args):
    raise AssertionError(f"lmsrt run handed over to torchrun: {args}")


@pytest.mark.parametrize("args, message", [
    (["--lms-frac", "1.5"], "is not in [0, 1]"),
    (["--lms-frac", "-0.1"], "is not in [0, 1]"),
    (["--lms-frac", "nan"], "nan is not a finite number"),
    (["--lms", "abc"], "'abc' is not a number"),
    (["--lms", "inf"], "inf is not a finite number; give the size threshold in KiB"),
    (["--lms", "nan"], "nan is not a finite number"),
    (["--lms", "1e308"], "1e308 is not in [-9.0072e+15, 9.0072e+15]"),     # 1e308 KB: inf bytes
    (["--prefetch-mb", "-5"], "-5 is not in [0, 8.79609e+12]"),
    (["--prefetch-mb", "1e308"], "1e308 is not in [0, 8.79609e+12]; give MiB"),
    (["--host-budget-gb", "lots"], "is not a number"),
    (["--host-budget-gb", "1e300"], "1e300 is not in [0, 8.58993e+09]"),
    (["--gpu-limit", "0"], "is not > 0"),
    (["--gpu-limit", "-2"], "is not > 0"),
    (["--gpu-limit", "12GB"], "is not a number"),
    (["--gpu-limit", "inf"], "inf is not a finite number"),
    (["--bogus"], "no such option '--bogus'"),
    (["--node-rank", "first"], "is not a valid integer"),
    # torchrun's options, checked before the hand-over (torchrun ended in a traceback, exit 1)
    (["--nproc-per-node", "abc"], "'abc' is not a number of workers >= 1, or auto, cpu, gpu"),
    (["--nproc-per-node", "0"], "is not a number of workers >= 1"),
    (["--nnodes", "2:1"], "'2:1' is not N or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "x"], "'x' is not N or MIN:MAX"),
    (["--master-port", "70000"], "70000 is not in the range"),
    (["--redirects", "7"], "'7' is not 0-3 or LOCAL_RANK:N"),
    (["--tee", "0:9"], "'0:9' is not 0-3 or LOCAL_RANK:N"),
    (["--local-ranks-filter", "a"], "'a' is not local ranks separated by commas"),
    (["--monitor-interval", "inf"], "inf is not a finite number"),
])
def test_bad_option_exits_2_before_the_script(tmp_path, monkeypatch, args, message):
    monkeypatch.setattr(os, "execv", no_exec)
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    result = invoke("run", *args, script)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not marker.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_nproc_per_node_gpu_without_one_exits_2(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "execv", no_exec)
    result = invoke("run", "--nproc-per-node", "gpu", write(tmp_path / "s.py", ""))
    assert result.exit_code == 2 and "this machine has none" in result.output


@pytest.mark.parametrize("args, message", [
    ([], "no script given"),
    (["missing.py"], "script 'missing.py' does not exist"),
    (["-m", "no_such_module_for_lmsrt"], "no module named 'no_such_module_for_lmsrt'"),
])
def test_missing_script_exits_2(args, message):
    result = invoke("run", "--lms", "1", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_bad_env_setting_exits_2(tmp_path):
    script = write(tmp_path / "s.py", "")
    result = CliRunner().invoke(main, ["run", script], env=clean_env(LMSRT_LMS_FRAC="lots"))
    assert result.exit_code == 2 and "LMSRT_LMS_FRAC='lots' is not a number" in result.output


@pytest.mark.parametrize("torchrun", [[], ["--nproc-per-node", "2"]])
@pytest.mark.parametrize("var, value, message", [
    ("LMSRT_LMS", "1e306", "LMSRT_LMS must be in [-9.0072e+15, 9.0072e+15] KiB"),
    ("LMSRT_PREFETCH_MB", "1e308", "LMSRT_PREFETCH_MB must be in [0, 8.79609e+12] MiB"),
    ("LMSRT_GPU_LIMIT_GB", "nan", "LMSRT_GPU_LIMIT_GB='nan' is not a number of GiB > 0"),
])
def test_huge_env_setting_exits_2_before_the_script(tmp_path, monkeypatch, torchrun, var, value,
                                                    message):
    # Under torchrun the launcher checks them: each worker would otherwise fail alone.
    monkeypatch.setattr(os, "execv", no_exec)
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    result = CliRunner().invoke(main, ["run", *torchrun, script], env=clean_env(**{var: value}))
    assert result.exit_code == 2, result.output
    assert message in result.output and f"e.g. {var}=" in result.output
    assert not marker.exists()


@pytest.mark.cuda
def test_gpu_limit_larger_than_the_gpu_exits_2(tmp_path):
    script = write(tmp_path / "s.py", "")
    result = CliRunner().invoke(main, ["run", "--gpu-limit", "100000", script])
    assert result.exit_code == 2 and "more than GPU 0 has" in result.output


# -- what the run leaves behind -------------------------------------------------------------------

def test_stats_file_of_an_unmodified_script(tmp_path):
    script = write(tmp_path / "mlp.py", MLP_SCRIPT)
    stats = tmp_path / "out" / "stats.json"
    result = lmsrt_process("run", "--lms", "1", "--lms-frac", "0", "--stats", str(stats),
                           script, "6")
    assert result.returncode == 0, result.stderr
    assert "step 5 loss" in result.stdout
    assert result.stderr.count("a step swapped") == 1                # the headline, once
    data = json.loads(stats.read_text())
    for key in ("enabled", "device", "config", "allocator", "total", "history", "last_step",
                "step_times_s", "step_time_median_s", "rank", "world_size"):
        assert key in data
    assert data["enabled"] and data["device"] == "simulated" and data["rank"] == 0
    assert data["config"]["lms"] == 1 and data["config"]["lms_frac"] == 0
    assert data["total"]["steps"] == 6 and len(data["history"]) == 5
    assert data["total"]["out_bytes"] > 0 and data["total"]["in_bytes"] > 0
    assert all(step["out_bytes"] > 0 for step in data["history"])
    assert len(data["step_times_s"]) == 4                            # starts of steps 2..6
    assert data["step_time_warmup"] == 2 and data["step_time_median_s"] > 0


@pytest.mark.parametrize("body, status", [
    ("import sys; sys.exit(7)", 7),
    ("import sys; sys.exit(None)", 0),
    ("raise ValueError('boom')", 1),
])
def test_script_exit_status_propagates(tmp_path, body, status):
    script = write(tmp_path / "s.py", MLP_SCRIPT + body + "\n")
    stats = tmp_path / "stats.json"
    result = invoke("run", "--lms", "1", "--lms-frac", "0", "--stats", str(stats), script, "2")
    assert result.exit_code == status, result.output
    assert json.loads(stats.read_text())["total"]["out_bytes"] > 0   # written however it ended


def test_stats_write_that_fails_keeps_the_old_file_and_fails_the_run(tmp_path, monkeypatch,
                                                                    notes_on_stderr):
    stats = tmp_path / "stats.json"
    stats.write_text('{"old": 1}')

    def half_then_disk_full(data, f, **kwargs):
        f.write('{"enabled": tr')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lmsrt.launch.session.json, "dump", half_then_disk_full)
    script = write(tmp_path / "mlp.py", MLP_SCRIPT)
    result = invoke("run", "--lms", "1", "--lms-frac", "0", "--stats", str(stats), script, "2")
    assert result.exit_code == 1, result.output          # the script's 0 would claim stats
    assert "could not write the stats" in result.output and "No space left" in result.output
    assert stats.read_text() == '{"old": 1}'                 # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.py", "stats.json"]   # no temp


def special_stats_path(tmp_path: Path, kind: str) -> Path:
    """Something at the --stats path that is not a regular file, or a path nothing can create."""
    path = tmp_path / "stats.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "target.json").write_text("keep")
        path.symlink_to(tmp_path / "target.json")
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere.json")
    elif kind == "directory":
        path.mkdir()
    elif kind == "under a file":
        (tmp_path / "file").write_text("keep")
        path = tmp_path / "file" / "stats.json"
    return path


@pytest.mark.parametrize("kind, message", [
    ("fifo", "is a FIFO, not a regular file; lmsrt writes only regular files"),
    ("symlink", "is a symlink; lmsrt does not write through links"),
    ("dangling symlink", "is a symlink"),
    ("directory", "is a directory, not a regular file"),
    ("under a file", "is a file, not a directory"),
])
def test_stats_path_that_is_no_regular_file_exits_2_before_the_script(tmp_path, kind, message):
    path = special_stats_path(tmp_path, kind)
    before = os.lstat(path).st_mode if os.path.lexists(path) else None
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    result = invoke("run", "--stats", str(path), script)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--stats'" in result.output and message in result.output
    assert not marker.exists()                        # refused before the script, not after it
    assert (os.lstat(path).st_mode if os.path.lexists(path) else None) == before
    if kind == "symlink":
        assert (tmp_path / "target.json").read_text() == "keep"


def test_stats_path_refused_in_a_worker(tmp_path):
    # A torchrun worker checks its own FILE.rank{r} as it starts (the launcher sees only FILE).
    os.mkfifo(tmp_path / "stats.json.rank1")
    env = clean_env(LMSRT_STATS=str(tmp_path / "stats.json"), RANK="1")
    with pytest.raises(ValueError, match=r"--stats .*stats.json.rank1 is a FIFO"):
        lmsrt.launch.session.start(env)


# Trains 2 steps, then waits to be killed; says where it is on stdout.
WAIT_SCRIPT = MLP_SCRIPT + textwrap.dedent("""
    import time
    try:
        print("READY", flush=True)
        time.sleep(120)
    finally:
        print("FINALLY", flush=True)
""")


@pytest.mark.parametrize("how", ["lmsrt run", "torchrun worker"])
def test_sigterm_writes_the_stats_and_exits_143(tmp_path, how):
    script = write(tmp_path / "wait.py", WAIT_SCRIPT)
    stats = tmp_path / "stats.json"
    if how == "lmsrt run":
        argv = [sys.executable, "-m", "lmsrt", "run", "--lms", "1", "--lms-frac", "0", "--stats",
                str(stats), script, "2"]
        env = clean_env()
    else:   # what torchrun starts: python SCRIPT with the bootstrap first on PYTHONPATH
        argv = [sys.executable, script, "2"]
        env = clean_env(LMSRT_BOOTSTRAP="1", LMSRT_LMS="1", LMSRT_LMS_FRAC="0",
                        LMSRT_STATS=str(stats), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, env["PYTHONPATH"]])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        seen = [proc.stdout.readline()]
        assert seen[0].startswith("step 0"), proc.stderr.read()
        while not seen[-1].startswith("READY"):
            seen.append(proc.stdout.readline())
            # A script that ended before it was ready ends the test, not an endless wait.
            assert seen[-1], f"the script ended before READY: {seen}\n{proc.stderr.read()}"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr                     # what a shell shows for SIGTERM
    assert "FINALLY" in stdout                                 # the script's finally ran
    assert json.loads(stats.read_text())["total"]["steps"] == 2


# -- writing output files -------------------------------------------------------------------------

def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    path.chmod(0o640)

    def fails_midway(f):
        f.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(path), fails_midway)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    write_atomic(str(path), lambda f: f.write("new"))
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640


def test_write_atomic_leaves_what_appeared_at_the_path(tmp_path):
    path = tmp_path / "out.json"
    assert check_output_file(str(path)) == str(path)           # nothing there yet: fine

    def fifo_appears(f):
        os.mkfifo(path)                                         # during the run, say
        f.write("data")

    with pytest.raises(OSError, match="is a FIFO now"):
        write_atomic(str(path), fifo_appears)
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(tmp_path) == ["out.json"]


# -- lmsrt profile: a script that fails ends as under python --------------------------------------

PROFILED = textwrap.dedent("""
    import sys
    import torch

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("bad backward")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            WHERE_FORWARD
            return Fails.apply(y) if HOW == "backward" else y

    HOW = sys.argv[1]
    WHERE_START
    Net()(torch.randn(4, 8)).sum().backward()
""")


@pytest.mark.parametrize("how, status, says", [
    ("backward", 1, ["RuntimeError: bad backward", "partial: the script raised RuntimeError in "
                     "backward\n"]),
    ("exit_message", 1, ["stopped by the script\n", "ended before step 1 began"]),
    ("exit_3", 3, ["ended before step 1 began"]),
    ("exit_in_forward", 4, ["partial: the script exited with status 4 in forward of Net (Net)"]),
    ("ctrl_c", 130, ["KeyboardInterrupt", "interrupted in forward of Net (Net); no report"]),
])
def test_profile_reports_how_and_where_the_script_failed(tmp_path, how, status, says):
    body = {"exit_message": "sys.exit('stopped by the script')", "exit_3": "sys.exit(3)"}
    forward = {"exit_in_forward": "sys.exit(4)", "ctrl_c": "raise KeyboardInterrupt"}
    script = write(tmp_path / "net.py", PROFILED.replace("WHERE_START", body.get(how, "pass"))
                   .replace("WHERE_FORWARD", forward.get(how, "pass")))
    result = invoke("profile", script, how)
    assert result.exit_code == status, result.output
    for text in says:
        assert text in result.output
    assert "runpy" not in result.output and "lmsrt/_cli" not in result.output
    assert "no backward was seen" not in result.output or how != "backward"
    assert ("lmsrt memory report" in result.output) == (how in ("backward", "exit_in_forward"))


def test_profile_checks_its_output_paths_before_the_script(tmp_path):
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    os.mkfifo(tmp_path / "fifo")
    write(tmp_path / "file", "keep")
    for flag, path, message in (("--html", tmp_path / "file" / "r.html", "is a file, not a dir"),
                                ("--png", tmp_path / "fifo", "is a FIFO"),
                                ("--snapshot", tmp_path, "is a directory")):
        result = invoke("profile", flag, str(path), script)
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{flag}'" in result.output and message in result.output
        assert not marker.exists()


def test_script_traceback_is_the_scripts(tmp_path):
    script = write(tmp_path / "s.py", "def f():\n    raise ValueError('boom')\nf()\n")
    result = lmsrt_process("run", script)
    assert result.returncode == 1
    assert "ValueError: boom" in result.stderr and 's.py", line 2, in f' in result.stderr
    assert "runpy" not in result.stderr and "_cli" not in result.stderr


# -- torchrun and the worker bootstrap ------------------------------------------------------------

def test_torchrun_workers_enable_lms(tmp_path):
    script = write(tmp_path / "mlp.py", MLP_SCRIPT)
    stats = tmp_path / "stats.json"
    result = lmsrt_process("run", "--standalone", "--nproc_per_node", "2", "--lms", "1",
                           "--lms-frac", "0", "--stats", str(stats), script, "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("step 2 loss") == 2
    assert result.stderr.count("a step swapped") == 1                # rank 0's headline only
    for rank, path in ((0, stats), (1, tmp_path / "stats.json.rank1")):
        data = json.loads(path.read_text())
        assert data["rank"] == rank and data["world_size"] == 2
        assert data["total"]["steps"] == 3 and data["total"]["out_bytes"] > 0


CHILD_SCRIPT = MLP_SCRIPT + textwrap.dedent("""
    import json, os, sitecustomize
    print("SEEN=" + json.dumps({"user": os.environ.get("USER_SITECUSTOMIZE"),
                                "module": getattr(sitecustomize, "MARKER", None),
                                "lmsrt": "lmsrt.launch.session" in sys.modules}))
""")

# Makes LMSRT_LAUNCHER_PID this process's pid, then becomes the child script: what the launcher
# does before it becomes torchrun.
EXEC_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["LMSRT_LAUNCHER_PID"] = str(os.getpid())
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
""")


@pytest.mark.parametrize("role", ["worker", "launcher", "worker_subprocess"])
def test_bootstrap_enables_lms_in_workers_only_and_chains_sitecustomize(tmp_path, role):
    user_dir = tmp_path / "user"
    write(user_dir / "sitecustomize.py", "import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n"
                                         "MARKER = 'user'\n")
    child = write(tmp_path / "child.py", CHILD_SCRIPT)
    stats = tmp_path / "stats.json"
    env = clean_env(LMSRT_BOOTSTRAP="1", LMSRT_LMS="1", LMSRT_LMS_FRAC="0", LMSRT_STATS=str(stats),
                    RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, str(user_dir), env["PYTHONPATH"]])
    argv = [child, "3"]
    if role == "launcher":
        argv = [write(tmp_path / "exec.py", EXEC_SCRIPT), child, "3"]
    if role == "worker_subprocess":
        env["LMSRT_ACTIVE"] = "1"                 # inherited from the worker that started it
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    got = seen(result.stdout)
    assert got["user"] == "ran" and got["module"] == "user"     # the user's sitecustomize ran
    rank1 = tmp_path / "stats.json.rank1"
    if role == "worker":
        assert got["lmsrt"]
        data = json.loads(rank1.read_text())
        assert data["rank"] == 1 and data["total"]["steps"] == 3 and data["total"]["out_bytes"] > 0
        assert "a step swapped" not in result.stderr                 # rank 1 prints no summary
    else:
        assert not got["lmsrt"] and not rank1.exists()


# -- lmsrt info -----------------------------------------------------------------------------------

def test_info_says_what_is_there_and_what_is_missing():
    result = invoke("info", "--bandwidth")
    assert result.exit_code == 0, result.output
    out = result.output
    assert arena.native_status() in out and torch.__version__ in out
    for heading in ("NVIDIA driver", "GPUs", "host memory", "pinned budget", "bandwidth"):
        assert heading in out
    if not torch.cuda.is_available():
        assert "skipped: no CUDA GPU" in out
        assert ("CPU-only build" in out) == (torch.version.cuda is None)
    else:
        assert "GB/s" in out


def test_info_json():
    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["allocator"] == arena.native_status() and data["native_allocator"] == arena.NATIVE
    assert data["host"]["pinned_budget_bytes"] > 0
    assert data["settings"] == {"LMSRT_DEVICE": "sim", "LMSRT_PIN_AHEAD": "off"}
    assert (data["gpus"] == []) == (not torch.cuda.is_available())
