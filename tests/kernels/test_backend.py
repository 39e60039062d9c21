"""Backend selection, the CPU gate, and what the built library contains."""
import shutil
import subprocess

import numpy as np
import pytest

import llambda
from llambda.runtime import backend, cpu, library
from synth import write_random_llama


@pytest.fixture
def cpu_without_avx2(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2", "sse4_2", "avx"}))
    library.load.cache_clear()
    backend.get_backend.cache_clear()
    yield
    library.load.cache_clear()
    backend.get_backend.cache_clear()


def test_cpu_without_avx2_gets_a_clear_error_and_the_numpy_backend(cpu_without_avx2, monkeypatch):
    with pytest.raises(library.KernelLibraryError, match="lacks avx2, fma, f16c.*LLAMBDA_BACKEND=numpy"):
        library.load("avx2")
    with pytest.raises(backend.BackendError, match="LLAMBDA_BACKEND=avx2 but this CPU lacks avx2"):
        backend.get_backend("avx2")
    monkeypatch.delenv("LLAMBDA_BACKEND", raising=False)
    assert backend.get_backend().name == "numpy"      # the default falls back


def test_unknown_backend_name(monkeypatch):
    backend.get_backend.cache_clear()
    monkeypatch.setenv("LLAMBDA_BACKEND", "cuda")
    with pytest.raises(backend.BackendError, match="LLAMBDA_BACKEND must be 'avx2' or 'numpy', got 'cuda'"):
        backend.get_backend()
    backend.get_backend.cache_clear()


def test_both_backends_offer_the_same_ops(native, ref):
    ops = lambda ns: sorted(k for k in vars(ns) if k != "name")
    assert ops(native) == ops(ref)


@pytest.mark.parametrize("tensor_type", ["F16", "Q4_1"])
def test_numpy_backend_runs_a_model_like_the_kernels(tmp_path, tensor_type):
    path = tmp_path / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type=tensor_type, n_ctx=128, seed=5)
    ids = np.random.default_rng(1).integers(0, 300, 40).tolist()
    with llambda.load(path, n_ctx=128, backend="numpy", progress=False) as slow:
        reference = slow.logits(ids)
    with llambda.load(path, n_ctx=128, backend="avx2", progress=False) as fast:
        got = fast.logits(ids)
    if tensor_type == "F16":
        # the same float math up to rounding (FMA, summation order)
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4 * (1 + np.abs(reference).max()))
    else:
        # int8 activations: a rounding difference can flip one activation's int8 value,
        # and later layers amplify that; the bound of tests/model/test_model.py applies
        assert np.abs(got - reference).max() <= 0.05 * (reference.max() - reference.min())


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_library_uses_the_instructions_it_is_built_around():
    lib = library.load("avx2")
    text = subprocess.run(["objdump", "-d", str(lib.path)], capture_output=True, text=True, check=True).stdout
    for mnemonic in ("vpmaddubsw", "vpmaddwd", "vfmadd231ps", "vcvtph2ps"):
        assert mnemonic in text, mnemonic
    for symbol in lib.manifest:
        assert f"<{symbol}>:" in text
