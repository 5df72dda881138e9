"""What a new user of `lmsrt run` meets first: the summary, warnings, directory scripts, `__file__`,
and the version fields of what lmsrt writes. LMS runs on the simulated device (LMSRT_DEVICE=sim).
"""
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from processes import clean_env, write
from test_cli import MLP_SCRIPT, invoke, lmsrt_process

from lmsrt import __version__
from lmsrt.summary import format_summary
from lmsrt.units import GiB, MiB

BOOM = MLP_SCRIPT + "raise ValueError('boom')\n"


# -- the summary: when, and how bytes read ------------------------------------------------------

@pytest.mark.parametrize("flags, script, table, line", [
    ([], MLP_SCRIPT, False, True),                           # the headline only
    (["--lms", "100000"], MLP_SCRIPT, False, True),         # nothing moved: the headline
    ([], BOOM, False, True),                                 # after a traceback: the headline
    (["--summary", "full"], MLP_SCRIPT, True, True),         # asked for: headline and table
    (["--summary", "full"], BOOM, False, True),              # the traceback stays last but one
    (["--quiet"], MLP_SCRIPT, False, False),                 # nothing at all
    (["-q"], BOOM, False, False),
], ids=["moved", "nothing-moved", "traceback", "full", "full-traceback", "quiet", "q-traceback"])
def test_summary_headline_and_table(tmp_path, flags, script, table, line):
    path = write(tmp_path / "s.py", script)
    result = lmsrt_process("run", "--lms-frac", "0", "--lms", "1", *flags, path, "3")
    assert result.returncode == (1 if "boom" in script else 0), result.stderr
    err = result.stderr
    assert ("\nsettings: lms=1 KiB" in err) == table
    assert ("  fetched ahead" in err) == table             # under "swapped in", not "rebuilt"
    brief = [ln for ln in err.splitlines() if ln.startswith("lmsrt: ") and " step" in ln]
    assert len(brief) == (1 if line else 0), err
    if line:
        assert brief[0].startswith("lmsrt: 3 steps (3 optimizer steps), ") and "GPU peak" in \
            brief[0] and " of 1.00 GiB (" in brief[0]
    if "boom" in script and not table:
        # The traceback is the last thing but at most one line.
        assert err.rstrip().splitlines()[-1 - line].startswith("ValueError: boom")


def test_quiet_and_summary_together_exit_2(tmp_path):
    result = invoke("run", "-q", "--summary", "full", write(tmp_path / "s.py", ""))
    assert result.exit_code == 2 and "give one" in result.output


def test_bad_summary_variable_exits_2_before_the_script(tmp_path):
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w')\n")
    result = lmsrt_process("run", script, env=clean_env(LMSRT_SUMMARY="loud"))
    assert result.returncode == 2 and "LMSRT_SUMMARY='loud'" in result.stderr
    assert not marker.exists()


def test_summary_bytes_use_the_byte_formatter():
    stats = {"config": {"lms": 1000, "lms_frac": 0.5, "recompute": False}, "device": "simulated",
             "mark_bytes": GiB, "allocator": "native", "copy_path": "python",
             "limit_bytes": 2 * GiB}
    step = dict.fromkeys(("out_bytes", "out_tensors", "beyond_plan_bytes", "in_bytes",
                          "recipe_bytes", "recomputed_regions", "recomputed_bytes",
                          "prefetch_hits", "prefetch_misses", "prefetch_dropped",
                          "backward_retries", "kept_bytes",
                          "live_bytes", "skipped_tensors", "swapout_waits", "host_refused",
                          "alloc_retries", "alloc_failures", "gpu_peak_bytes", "host_lagged",
                          "host_peak_bytes", "host_pinned_bytes", "optimizer_host_bytes",
                          "optimizer_in_bytes", "optimizer_out_bytes"), 0)
    step.update(swapin_wait_ms=0.0, swapout_wait_ms=0.0, host_pin_s=0.0, host_pin_wait_s=0.0,
                cpu_s=0.0,
                mode="plan",
                host_pinned_bytes=64 * MiB, out_bytes=1536)
    stats.update(last_step=step, total=dict(step, steps=3))
    text = format_summary(stats)
    assert "0.00 GiB" not in text and "swap above: 1.00 GiB" in text
    assert "64.0 MiB" in text and "1.50 KiB" in text and " 0 B" in text


# -- steps -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", ["print('no forward')",
                                  "import torch\nwith torch.no_grad():\n"
                                  "    torch.nn.Linear(8, 8)(torch.randn(2, 8))"])
def test_a_script_without_a_forward_ran_no_step(tmp_path, body):
    stats = tmp_path / "stats.json"
    result = invoke("run", "--stats", str(stats), write(tmp_path / "s.py", body + "\n"))
    assert result.exit_code == 0, result.output
    data = json.loads(stats.read_text())
    assert data["total"]["steps"] == 0 and data["history"] == []
    assert "lmsrt: 0 steps" in result.stderr


# -- the warning without a GPU -----------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the warning without a GPU")
def test_no_gpu_warning_is_one_line_with_the_launchers_way(tmp_path):
    env = clean_env()
    del env["LMSRT_DEVICE"]
    result = lmsrt_process("run", write(tmp_path / "s.py", "print('ran')\n"), env=env)
    assert result.returncode == 0 and "ran" in result.stdout
    lines = result.stderr.splitlines()
    said = [ln for ln in lines if "no CUDA device" in ln]
    assert len(said) == 1 and said[0].startswith("lmsrt: ") and "LMSRT_DEVICE=sim" in said[0]
    assert not any("lms.py" in ln or "warnings.warn" in ln for ln in lines), result.stderr


def test_the_scripts_own_warnings_print_as_python_prints_them(tmp_path):
    script = write(tmp_path / "s.py", "import warnings\nwarnings.warn('mine')\n")
    result = lmsrt_process("run", script)
    assert f"{script}:2: UserWarning: mine" in result.stderr


# -- what python runs, lmsrt runs ----------------------------------------------------------------

SEEN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    here = os.path.dirname(__file__)
    os.chdir("/")                                  # a script that moves, then uses __file__
    print("SEEN=" + json.dumps({"file": __file__, "path0": sys.path[0], "name": __name__,
                                "found": os.path.exists(os.path.join(here, "data.txt"))}))
""")


def _seen(stdout: str) -> dict:
    return json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("SEEN="))[5:])


@pytest.mark.parametrize("kind", ["file", "directory", "zip"])
def test_what_python_runs_lmsrt_runs_with_the_same_file_and_path(tmp_path, kind):
    write(tmp_path / "app" / "data.txt", "")
    if kind == "file":
        target = os.path.join("app", "train.py")
        write(tmp_path / target, SEEN_SCRIPT)
    elif kind == "directory":
        target = "app"
        write(tmp_path / "app" / "__main__.py", SEEN_SCRIPT)
    else:
        target = "app.zip"
        with zipfile.ZipFile(tmp_path / target, "w") as z:
            z.writestr("__main__.py", SEEN_SCRIPT)
    python = subprocess.run([sys.executable, target], cwd=tmp_path, capture_output=True,
                            text=True, env=clean_env())
    result = lmsrt_process("run", target, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _seen(result.stdout) == _seen(python.stdout)
    assert os.path.isabs(_seen(result.stdout)["file"])
    assert _seen(result.stdout)["found"] == (kind != "zip")


@pytest.mark.parametrize("command", ["run", "tune", "profile"])
def test_a_directory_without_main_is_refused_and_one_with_it_is_taken(tmp_path, command):
    (tmp_path / "empty").mkdir()
    result = invoke(command, str(tmp_path / "empty"))
    assert result.exit_code == 2 and "without a __main__.py" in result.output
    app = tmp_path / "app"
    write(app / "__main__.py", "import sys; sys.exit(3)\n")
    out = tmp_path / "tune-out"
    extra = ["--steps", "1", "--lms", "1000", "--lms-frac", "auto", "--out", str(out)] \
        if command == "tune" else []
    result = invoke(command, *extra, str(app))
    assert "does not exist" not in result.output and result.exit_code != 2, result.output


# -- versions in what lmsrt writes -------------------------------------------------------------

def test_stats_json_carries_version_and_schema(tmp_path):
    stats = tmp_path / "stats.json"
    assert invoke("run", "-q", "--stats", str(stats), write(tmp_path / "s.py", "")).exit_code == 0
    data = json.loads(stats.read_text())
    assert data["lmsrt_version"] == __version__ and isinstance(data["schema"], int)


def test_info_json_carries_version_and_schema():
    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["lmsrt_version"] == __version__ and isinstance(data["schema"], int)


def test_info_says_whether_the_compiler_and_ninja_are_there(monkeypatch):
    from lmsrt._cli import info

    found = info.collect()["build_tools"]
    assert set(found) == {"cxx_name", "cxx", "ninja"}
    monkeypatch.setenv("CXX", "no-such-compiler")
    real_which = info.shutil.which
    monkeypatch.setattr(info.shutil, "which",
                        lambda name, path=None: None if name == "ninja" else real_which(name))
    data = info.collect()
    assert data["build_tools"] == {"cxx_name": "no-such-compiler", "cxx": None, "ninja": None}
    text = info.format_info(data)
    assert "none: no-such-compiler is not on PATH" in text and "pip install ninja" in text


# -- README, docs/ and --help say the same ------------------------------------------------------

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")


def _flat(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_readme_and_help_agree():
    from lmsrt._cli import main

    readme = _flat(open(README, encoding="utf-8").read())
    docs = {name: _flat(open(os.path.join(DOCS, name), encoding="utf-8").read())
            for name in ("native.md", "tune.md")}
    build = _flat(main.get_command(None, "build").help)
    took = build[build.index("(") + 1:build.index(";")]
    assert took == "14-16 s on an H200 host, 18 s on a CPU host" and took in docs["native.md"]
    [fracs] = [p for p in main.get_command(None, "tune").params if p.name == "fracs"]
    help_text = _flat(fracs.help)
    order = help_text[help_text.index("Order of trials:"):help_text.index("lowest first.") + 13]
    assert order in docs["tune.md"]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "pip install -e . compiles one thing" in readme
