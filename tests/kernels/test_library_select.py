"""Which kernel library the runtime takes (runtime/library.py): the one a wheel ships when
its source key is the key of the installed generators, otherwise the cache's, built with
PeachPy when missing, and a clear error when neither can serve. No network, no real build:
the libraries here are stand-in files, and the build is a fake that records its call."""
import json
import subprocess
import sys
import types

import pytest

from llambda import cli
from llambda.codegen import build
from llambda.runtime import library


@pytest.fixture
def where(tmp_path, monkeypatch):
    """A packaged-library directory and an empty cache, both under tmp_path; no override."""
    monkeypatch.setattr(library, "PACKAGED_DIR", tmp_path / "site" / "kernels")
    monkeypatch.setattr(library, "checkout_dir", lambda: None)     # as installed: builds go to the cache
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LLAMBDA_KERNEL_DIR", raising=False)
    monkeypatch.delenv("LLAMBDA_FAMILIES", raising=False)
    return tmp_path


def ship(directory, key, peachpy="9.9"):
    """Stand in for what codegen/wheel_hook.py puts into a wheel."""
    directory.mkdir(parents=True)
    (directory / build.LIBRARY_NAME).write_bytes(b"\x7fELF stand-in")
    (directory / build.MANIFEST_NAME).write_text("[]")
    (directory / build.KEY_NAME).write_text(json.dumps({"key": key, "peachpy": peachpy}))


@pytest.fixture
def no_peachpy(monkeypatch):
    """``import peachpy`` fails, as in a bare venv; a build would be a bug."""
    monkeypatch.setitem(sys.modules, "peachpy", None)

    def refuse(directory, *args, **kwargs):
        raise AssertionError(f"built into {directory} although no build was expected")
    monkeypatch.setattr(build, "build", refuse)


@pytest.fixture
def fake_build(monkeypatch):
    """PeachPy 'importable' and a build that writes a stand-in library; returns the calls."""
    monkeypatch.setitem(sys.modules, "peachpy", types.ModuleType("peachpy"))
    calls = []

    def fake(directory, *args, **kwargs):
        calls.append(directory)
        directory.mkdir(parents=True)
        (directory / build.LIBRARY_NAME).write_bytes(b"\x7fELF stand-in")
    monkeypatch.setattr(build, "build", fake)
    return calls


def test_packaged_library_serves_when_its_key_matches(where, no_peachpy):
    # Recorded with a PeachPy version this runtime does not have: the key is recomputed with
    # the recorded version, so a runtime without PeachPy still recognises its library.
    key = build.source_key(peachpy="9.9")
    ship(library.PACKAGED_DIR, key)
    assert library.packaged_key() == key
    assert library.locate() == (library.PACKAGED_DIR, "packaged", key)
    assert library.ensure_built() == library.PACKAGED_DIR
    assert not (where / "cache").exists()


def test_changed_generators_rebuild_into_the_cache(where, fake_build):
    ship(library.PACKAGED_DIR, "0123456789abcdef")      # built from other generators
    assert library.packaged_key() is None
    expected = where / "cache" / "kernels" / build.source_key()
    assert library.locate() == (expected, "unbuilt", build.source_key())
    assert library.ensure_built() == expected
    assert fake_build == [expected]
    assert library.locate().origin == "built"
    assert library.ensure_built() == expected and len(fake_build) == 1     # built once


def test_packaged_library_without_its_key_file_or_library_is_not_used(where, fake_build):
    ship(library.PACKAGED_DIR, build.source_key(peachpy="9.9"))
    (library.PACKAGED_DIR / build.LIBRARY_NAME).unlink()
    assert library.packaged_key() is None
    (library.PACKAGED_DIR / build.LIBRARY_NAME).write_bytes(b"")
    (library.PACKAGED_DIR / build.KEY_NAME).write_text("not json")
    assert library.packaged_key() is None
    assert library.ensure_built() == where / "cache" / "kernels" / build.source_key()


def test_neither_packaged_library_nor_peachpy_is_a_clear_error(where, no_peachpy):
    ship(library.PACKAGED_DIR, "0123456789abcdef")
    with pytest.raises(library.KernelLibraryError, match="built from other generators") as e:
        library.ensure_built()
    for needle in ("is not built", "PeachPy is not importable", "python3-peachpy", "make wheel",
                   str(where / "cache" / "kernels")):
        assert needle in str(e.value)


def test_no_packaged_library_and_no_peachpy(where, no_peachpy):
    with pytest.raises(library.KernelLibraryError, match="PeachPy is not importable") as e:
        library.ensure_built()
    assert "other generators" not in str(e.value)


def test_kernel_dir_override_wins_over_the_packaged_library(where, monkeypatch, fake_build):
    ship(library.PACKAGED_DIR, build.source_key(peachpy="9.9"))
    monkeypatch.setenv("LLAMBDA_KERNEL_DIR", str(where / "mine"))
    assert library.ensure_built() == where / "mine"
    assert fake_build == [where / "mine"]


def test_the_packaging_hook_is_not_part_of_the_key(where, monkeypatch, tmp_path):
    # codegen/wheel_hook.py emits no kernel: editing it must not invalidate every cache.
    generators = tmp_path / "codegen"
    generators.mkdir()
    (generators / "gemm.py").write_text("def emit(isa): return []\n")
    monkeypatch.setattr(build, "HERE", generators)
    before = build.source_key(peachpy="9.9")
    (generators / "wheel_hook.py").write_text("# setuptools commands\n")
    assert build.source_key(peachpy="9.9") == before
    assert build.family_names() == ["gemm"]
    (generators / "gemm.py").write_text("def emit(isa): return [1]\n")
    assert build.source_key(peachpy="9.9") != before


def test_version_names_the_packaged_key(where, monkeypatch, no_peachpy):
    import llambda
    key = build.source_key(peachpy="9.9")
    ship(library.PACKAGED_DIR, key)
    monkeypatch.setenv("LLAMBDA_BACKEND", "numpy")      # the stand-in library cannot be loaded
    text = cli.version_text()
    assert text.splitlines()[0] == f"llambda {llambda.__version__}"
    assert f"source key {key}, packaged" in text
    assert "isa: none, the numpy reference backend (LLAMBDA_BACKEND=numpy)" in text


def test_python_dash_m_llambda_is_the_command(tmp_path):
    import llambda
    proc = subprocess.run([sys.executable, "-m", "llambda", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"llambda {llambda.__version__}"
    assert lines[1].startswith("kernel library: source key ") and lines[2].startswith("isa: ")
