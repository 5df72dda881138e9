"""The optional C++ copy path: found or not, said so, turned off, built.

On a GPU, tests/test_cuda.py runs its race and leak checks through both copy paths."""
import shutil

import pytest
import torch
from click.testing import CliRunner

import lmsrt.copy_path as copy_path
from lmsrt._cli import main


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(copy_path, "_loaded", None)
    yield
    copy_path._loaded = None


def test_not_built_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSRT_CACHE", str(tmp_path))
    monkeypatch.delenv("LMSRT_COPY_PATH", raising=False)
    assert copy_path.load() is None
    assert "lmsrt build" in copy_path.status() and copy_path.status().startswith("Python")


@pytest.mark.parametrize("value", ["python", "off", "0"])
def test_env_turns_it_off(monkeypatch, value):
    monkeypatch.setenv("LMSRT_COPY_PATH", value)
    assert copy_path.load() is None
    assert f"LMSRT_COPY_PATH={value}" in copy_path.status()


def test_set_enabled_false_wins_until_enabled_again(monkeypatch):
    monkeypatch.delenv("LMSRT_COPY_PATH", raising=False)
    copy_path.set_enabled(False)
    assert copy_path.load() is None and "set_enabled(False)" in copy_path.status()
    copy_path.set_enabled(True)
    assert copy_path._loaded is None          # looked up again on the next load()


def test_broken_build_falls_back_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSRT_CACHE", str(tmp_path))
    monkeypatch.delenv("LMSRT_COPY_PATH", raising=False)
    folder = tmp_path / copy_path._module_name()
    folder.mkdir()
    (folder / (copy_path._module_name() + ".so")).write_bytes(b"not a shared object")
    assert copy_path.load() is None
    assert "did not load" in copy_path.status() and "lmsrt build" in copy_path.status()


def test_build_without_source_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(copy_path, "source_path", lambda: str(tmp_path / "missing.cpp"))
    result = CliRunner().invoke(main, ["build"])
    assert result.exit_code == 1
    assert "source checkout" in result.output and "optional" in result.output


def test_info_names_the_copy_path(monkeypatch):
    monkeypatch.setenv("LMSRT_COPY_PATH", "python")
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "copy path" in result.output and "LMSRT_COPY_PATH=python" in result.output


@pytest.mark.skipif(shutil.which("ninja") is None and not shutil.which("c++"),
                    reason="needs ninja and a C++ compiler")
def test_built_module_views_bytes_like_torch(tmp_path, monkeypatch):
    """Builds csrc/copy_path.cpp against this torch (CPU or CUDA build alike) and checks the one
    call that needs no GPU: a dtype/shape/stride/offset view of a byte block."""
    pytest.importorskip("ninja")
    monkeypatch.setenv("LMSRT_CACHE", str(tmp_path))
    monkeypatch.delenv("LMSRT_COPY_PATH", raising=False)
    copy_path.build()
    native = copy_path.load()
    assert native is not None and copy_path.status().startswith("native")
    block = torch.arange(64, dtype=torch.uint8)
    got = native.view(block, torch.int16, (3, 4), (1, 3), 8)
    want = torch.empty(0, dtype=torch.int16).set_(block.untyped_storage(), 8, (3, 4), (1, 3))
    assert torch.equal(got, want) and got.stride() == (1, 3) and got.storage_offset() == 8
    assert got.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
