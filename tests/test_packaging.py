"""What an installed lmsrt carries and how fast its command answers: a wheel holds the C++ copy
path's source, and `lmsrt --version` / `--help` import no torch."""
import shutil
import subprocess
import sys

import pytest
from processes import ROOT

from lmsrt._cli import COMMANDS, main


def test_a_built_package_carries_the_copy_paths_source(tmp_path):
    # build_py is the step of a wheel build that lays out the package: what it writes, the
    # wheel holds. (A whole wheel would also compile the native allocator.)
    tree = tmp_path / "tree"          # a copy: the build leaves nothing in the checkout
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(ROOT / name, tree / name)
    for folder in ("lmsrt", "csrc"):
        shutil.copytree(ROOT / folder, tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", "out"],
                   cwd=tree, check=True, capture_output=True, timeout=120)
    shipped = tree / "out" / "lmsrt" / "_csrc" / "copy_path.cpp"
    assert shipped.read_bytes() == (ROOT / "csrc" / "copy_path.cpp").read_bytes()
    assert "include csrc/*.cpp" in (ROOT / "MANIFEST.in").read_text().splitlines()   # the sdist


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_import_no_torch(flag):
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmsrt", flag], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and ("version" in result.stdout or "Usage" in result.stdout)
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]
    assert "lmsrt" in imported and "torch" not in imported and "click" in imported


def test_every_subcommand_is_listed_and_loads_under_its_name():
    modules = {p.stem for p in (ROOT / "lmsrt" / "_cli").glob("*.py") if not p.stem.startswith("_")}
    assert {module for module, _ in COMMANDS.values()} == modules
    for name in COMMANDS:
        assert main.get_command(None, name).name == name
