"""llama.cpp's tokenizer test vectors: ``ggml-vocab-<name>.gguf`` with ``.inp`` / ``.out``.

They ship in the sdist of llama-cpp-python 0.3.36 (vendor/llama.cpp/models/).
tests/fixtures/vocab/ keeps every ``.inp`` / ``.out`` and the small vocabularies
(xz-compressed); the large ones are taken out of the sdist, which pip downloads
once into the user cache (``<cache>/vocab/``). ``vocabularies.json`` pins each
GGUF's sha256.

LLAMBDA_VOCAB_SDIST may name a copy of that sdist (.tar.gz) already on disk.
Only llama-cpp-python itself is taken as source (``--no-binary llama-cpp-python``):
with ``:all:`` pip would also build every build dependency from source just to
read the sdist's metadata, which takes many minutes.
"""
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llambda.runtime import paths

HERE = Path(__file__).parent / "fixtures" / "vocab"
REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
SEPARATOR = "\n__ggml_vocab_test__\n"

MANIFEST = json.loads((HERE / "vocabularies.json").read_text())["vocabularies"]
NAMES = sorted(MANIFEST)


class Unavailable(Exception):
    """The vocabulary cannot be had here (no network, no pip): the test skips with this reason."""


def cases(name):
    """[(text, expected ids)] of one vocabulary, in file order."""
    texts = (HERE / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    lines = (HERE / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    if texts and texts[-1] == "":      # the .inp file ends with a separator
        texts.pop()
    if lines and lines[-1] == "":      # the .out file with a newline
        lines.pop()
    assert len(lines) == len(texts), f"{name}: {len(texts)} inputs, {len(lines)} outputs"
    expected = [[int(i) for i in line.split()] for line in lines]
    return list(zip(texts, expected))


def vocab_path(name):
    """The GGUF of vocabulary ``name``, checked against its pinned sha256."""
    entry = MANIFEST[name]
    target = _cache() / f"ggml-vocab-{name}.gguf"
    if not _verified(target, entry):
        if entry["committed"]:
            _write_checked(target, entry, lambda out: _unxz(HERE / f"ggml-vocab-{name}.gguf.xz", out))
        else:
            _extract_from_sdist(name, target, entry)
    return target


def _cache():
    directory = paths.cache_dir() / "vocab" / REQUIREMENT.replace("==", "-")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path, entry):
    return path.exists() and path.stat().st_size == entry["bytes"] and _sha256(path) == entry["sha256"]


def _write_checked(target, entry, write):
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            write(out)
        if _sha256(tmp) != entry["sha256"]:
            raise AssertionError(f"{target.name}: sha256 differs from vocabularies.json")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _unxz(source, out):
    with lzma.open(source) as src:
        shutil.copyfileobj(src, out, 1 << 20)


def _extract_from_sdist(name, target, entry):
    sdist = _sdist()
    member = f"{SDIST_PREFIX}ggml-vocab-{name}.gguf"
    with tarfile.open(sdist) as archive:
        try:
            src = archive.extractfile(member)
        except KeyError:
            raise Unavailable(f"{sdist.name} has no {member}") from None
        _write_checked(target, entry, lambda out: shutil.copyfileobj(src, out, 1 << 20))
    # Every large vocabulary taken, the sdist itself is no longer needed.
    if all(_verified(_cache() / f"ggml-vocab-{n}.gguf", e) for n, e in MANIFEST.items()
           if not e["committed"]) and sdist.parent == _cache():
        sdist.unlink(missing_ok=True)


def _sdist():
    given = os.environ.get("LLAMBDA_VOCAB_SDIST")
    if given:
        return Path(given)
    found = sorted(_cache().glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=_cache(), prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                   "--disable-pip-version-check", "--quiet", REQUIREMENT, "-d", tmp]
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as e:
            raise Unavailable(f"cannot run pip to fetch the {REQUIREMENT} sdist ({e})") from None
        downloaded = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or not downloaded:
            tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
            raise Unavailable(f"pip could not download the {REQUIREMENT} sdist "
                              f"(network down?): {tail}")
        kept = _cache() / downloaded[0].name
        os.replace(downloaded[0], kept)
    return kept
