"""Which arithmetic BF16 matrices get (runtime/bf16_math.py), on every CPU.

The choice is made at conversion: LLAMBDA_BF16_MATH=f32 packs kind "bf16" (the exact float
GEMM), =bf16 packs kind "bf16_pairs" (vdpbf16ps on activations rounded to bf16), =auto
(the default) times both once per machine and keeps the answer. Where the CPU lacks
AVX512_BF16 the bf16_pairs model still runs on the numpy backend: with the CPU check
patched, these tests convert such a file and check its logits against the reference
forward that rounds its activations the same way (max |dlogit| <= 1e-3 * (1 + max |logit|),
as for every float model), so the packing, the traits and the layer's rounding are
tested here too; tests/model/test_model.py runs the same model on the kernels where it can.
"""
import json

import numpy as np
import pytest

import llambda
from llambda.model import convert
from llambda.errors import UserError
from llambda.runtime import bf16_math, layouts, library
from llambda.runtime.native import gemm_bf16
from synth import write_random_llama
from reference_forward import reference_logits

TINY = dict(n_layer=2, dim=72, n_head=4, n_kv_head=2, ffn_dim=100, vocab_size=300)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """A cache of the test's own (conversions and the machine memo), the choice unset; the
    kernel library where it is (a private cache would build it again)."""
    monkeypatch.setenv("LLAMBDA_KERNEL_DIR", str(library.locate().directory))
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(bf16_math.ENV, raising=False)
    measured = bf16_math.measured_choice            # a test may patch the name over
    measured.cache_clear()
    yield tmp_path / "cache"
    measured.cache_clear()                          # no timing a test faked outlives it


@pytest.fixture
def bf16_gguf(tmp_path):
    return write_random_llama(tmp_path / "tiny-BF16.gguf", tensor_type="BF16", seed=3, n_ctx=128, **TINY)


@pytest.fixture
def able(monkeypatch):
    """Pretend the CPU has AVX512_BF16 for the choice (the kernels are not called)."""
    monkeypatch.setattr(gemm_bf16, "bf16_supported", lambda: True)


def kinds_of(model):
    return {w.kind for w in vars(model.net.layers[0]).values() if hasattr(w, "kind")}


@pytest.mark.parametrize("value, want", [(None, "auto"), ("", "auto"), ("F32", "f32"), (" bf16 ", "bf16"),
                                         ("auto", "auto")])
def test_setting_reads_the_variable(monkeypatch, value, want):
    if value is not None:
        monkeypatch.setenv(bf16_math.ENV, value)
    assert bf16_math.setting() == want


def test_a_bad_setting_is_refused_by_name(monkeypatch, bf16_gguf):
    monkeypatch.setenv(bf16_math.ENV, "fast")
    with pytest.raises(ValueError, match="LLAMBDA_BF16_MATH: expected one of auto, f32, bf16, got 'fast'"):
        bf16_math.setting()
    with pytest.raises(UserError, match="LLAMBDA_BF16_MATH"):
        llambda.load(bf16_gguf, progress=False, backend="numpy")
    assert not list((bf16_gguf.parent / "cache").rglob("*.llb")), "a refused load converted"


def test_a_cpu_without_bf16_gets_the_exact_kind(monkeypatch):
    monkeypatch.setattr(gemm_bf16, "bf16_supported", lambda: False)
    monkeypatch.setattr(bf16_math, "measured_choice", lambda: pytest.fail("timed on a CPU that cannot"))
    assert bf16_math.bf16_kind() == "bf16"
    monkeypatch.setenv(bf16_math.ENV, "bf16")
    with pytest.raises(ValueError, match="LLAMBDA_BF16_MATH=bf16: this CPU lacks avx512_bf16"):
        bf16_math.choice()


def test_the_setting_is_part_of_the_conversion_key(monkeypatch, bf16_gguf):
    keys = set()
    for value in ("auto", "f32", "bf16"):
        monkeypatch.setenv(bf16_math.ENV, value)
        keys.add(convert._cache_key(bf16_gguf))
    assert len(keys) == 3


def test_auto_times_once_per_machine_and_keeps_the_answer(monkeypatch, able, private_cache):
    probes = []

    def probe():
        probes.append(1)
        return {"f32": 100.0, "bf16": 115.0}                # bf16 ahead, but inside the margin

    monkeypatch.setattr(bf16_math, "probe", probe)
    assert bf16_math.choice() == "f32"
    memo = private_cache / "machine" / "bf16-math.json"
    kept = json.loads(memo.read_text())
    assert kept["choice"] == "f32" and kept["gflops"] == {"f32": 100.0, "bf16": 115.0}
    bf16_math.measured_choice.cache_clear()                 # a new process reads the memo
    assert bf16_math.choice() == "f32" and len(probes) == 1
    # another library (or CPU) is another key: timed again
    memo.write_text(json.dumps({**kept, "key": "another machine"}))
    bf16_math.measured_choice.cache_clear()
    monkeypatch.setattr(bf16_math, "probe", lambda: {"f32": 100.0, "bf16": 200.0})
    assert bf16_math.bf16_kind() == "bf16_pairs"
    assert json.loads(memo.read_text())["choice"] == "bf16"


def test_a_broken_memo_is_timed_again(monkeypatch, able, private_cache):
    memo = private_cache / "machine" / "bf16-math.json"
    memo.parent.mkdir(parents=True)
    memo.write_text("{not json")
    monkeypatch.setattr(bf16_math, "probe", lambda: {"f32": 100.0, "bf16": 300.0})
    assert bf16_math.choice() == "bf16"


@pytest.mark.skipif(not gemm_bf16.bf16_supported(), reason="this CPU lacks avx512_bf16")
def test_probe_times_both_products():
    rates = bf16_math.probe()
    assert set(rates) == {"f32", "bf16"} and min(rates.values()) > 0


def test_pack_refuses_a_kind_the_type_does_not_pack_into():
    raw = np.zeros((16, 64), np.uint8)
    with pytest.raises(ValueError, match=r"tensor type BF16 does not pack into kind 'q4_0' \(it packs into bf16, bf16_pairs\)"):
        layouts.pack("BF16", raw, 16, 32, kind="q4_0")
    assert layouts.pack("BF16", raw, 16, 32).kind == "bf16"
    assert layouts.pack("BF16", raw, 16, 32, kind="bf16_pairs").kind == "bf16_pairs"


@pytest.mark.parametrize("math, kind", [("f32", "bf16"), ("bf16", "bf16_pairs")])
def test_the_choice_is_the_packed_kind_and_the_logits_follow_it(monkeypatch, able, bf16_gguf, math, kind):
    """On the numpy backend: the kind asked for is packed, and the logits are the reference's
    that rounds (or does not round) the activations to bf16 like it."""
    monkeypatch.setenv(bf16_math.ENV, math)
    model = llambda.load(bf16_gguf, progress=False, backend="numpy", n_ctx=128)
    assert kinds_of(model) == {kind}
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], 9).tolist()
    fast = model.logits(ids)
    ref = reference_logits(str(bf16_gguf), ids, bf16_activations=(math == "bf16"))
    np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-3 * (1 + np.abs(ref).max()))
    other = reference_logits(str(bf16_gguf), ids, bf16_activations=(math != "bf16"))
    assert np.abs(fast - other).max() > np.abs(fast - ref).max()   # the rounding is seen


@pytest.mark.skipif(gemm_bf16.bf16_supported(), reason="this CPU has avx512_bf16")
def test_a_file_packed_for_vdpbf16ps_is_refused_where_it_cannot_run(monkeypatch, bf16_gguf):
    """A conversion carried to a CPU without AVX512_BF16 fails the load naming the file and the
    fix, before any step runs."""
    with monkeypatch.context() as patched:
        patched.setattr(gemm_bf16, "bf16_supported", lambda: True)
        patched.setenv(bf16_math.ENV, "bf16")
        converted = convert.ensure_converted(bf16_gguf, progress=False)
    with pytest.raises(UserError, match=rf"{converted.name}: [\w.]+\.weight \(and \d+ more\) hold BF16 weights "
                                        r"packed for vdpbf16ps .* LLAMBDA_BF16_MATH=f32"):
        llambda.load(converted, progress=False)
    assert kinds_of(llambda.load(converted, progress=False, backend="numpy")) == {"bf16_pairs"}
