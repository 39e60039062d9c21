"""The fast path end to end against the pure-numpy reference forward.

Tolerances. Float weights (F32, F16, BF16) go through FP32 kernels only, so
logits agree to float rounding: max |dlogit| <= 1e-3 * (1 + max |logit|).
"BF16-vdpbf16ps" is a BF16 model converted with LLAMBDA_BF16_MATH=bf16 (its activations
rounded to bf16 before each product, runtime/bf16_math.py), where the CPU has
AVX512_BF16: against the reference forward that rounds the same way, the same
tolerance, and against the plain one max |dlogit| <= 2e-2 * (1 + max |logit|).
Quantized weights multiply int8-quantized activations (Q8 blocks of 32, as
llama.cpp does), which the reference does not: there we require the same
top-1 token at (almost) every position, KL(ref || fast) <= 0.01 nats on
average, and max |dlogit| <= 5% of the logit spread.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import llambda
from synth import write_random_llama
from llambda.runtime.native.gemm_bf16 import bf16_supported
from helpers import mean_kl, random_prompt
from reference_forward import reference_logits

FLOAT_TYPES = ["F32", "F16", "BF16", "BF16-vdpbf16ps"]
# the LLAMBDA_BF16_MATH each model loads (and so converts) with
MATH = {"BF16": "f32", "BF16-vdpbf16ps": "bf16"}
QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]

# Float models use sizes that are not multiples of 8 (head_dim 18) to reach
# every masked tail; quantized ones need k % 32 == 0.
SHAPES = {
    "float": dict(n_layer=2, dim=72, n_head=4, n_kv_head=2, ffn_dim=100, vocab_size=300),
    "quant": dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300),
}


@pytest.fixture(scope="module", params=FLOAT_TYPES + QUANT_TYPES)
def tiny_model(request, tmp_path_factory):
    t = request.param
    if MATH.get(t) == "bf16" and not bf16_supported():
        pytest.skip("this CPU lacks avx512_bf16")
    shape = SHAPES["float" if t in FLOAT_TYPES else "quant"]
    path = tmp_path_factory.mktemp("models") / f"tiny-{t}.gguf"
    write_random_llama(path, tensor_type=t.split("-")[0], seed=7, n_ctx=256, **shape)
    return t, path


def _load(t, path, monkeypatch, **options):
    """The model, converted with the BF16 arithmetic its parameter names (the others: unset)."""
    if t in MATH:
        monkeypatch.setenv("LLAMBDA_BF16_MATH", MATH[t])
    else:
        monkeypatch.delenv("LLAMBDA_BF16_MATH", raising=False)
    return llambda.load(path, progress=False, **options)


def test_logits_match_reference(tiny_model, monkeypatch):
    t, path = tiny_model
    model = _load(t, path, monkeypatch, n_ctx=256)
    if t in MATH:                                    # the arithmetic asked for is the one packed
        kinds = {w.kind for w in vars(model.net.layers[0]).values() if hasattr(w, "kind")}
        assert kinds == {"f32": {"bf16"}, "bf16": {"bf16_pairs"}}[MATH[t]]
    for n, seed in ((1, 0), (13, 1), (150, 2)):      # 150 > one prefill chunk
        ids = random_prompt(model.config.vocab_size, n, seed)
        fast = model.logits(ids)
        rounds = MATH.get(t) == "bf16"
        ref = reference_logits(str(path), ids, bf16_activations=rounds)
        assert fast.shape == ref.shape
        assert np.isfinite(fast).all()
        if rounds:
            plain = reference_logits(str(path), ids)
            np.testing.assert_allclose(fast, plain, rtol=0, atol=2e-2 * (1 + np.abs(plain).max()))
            # and the rounding is seen: the plain reference is further away than the rounded one
            assert np.abs(fast - plain).max() > np.abs(fast - ref).max()
        if t in FLOAT_TYPES:
            np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-3 * (1 + np.abs(ref).max()))
        else:
            agree = (fast.argmax(-1) == ref.argmax(-1)).mean()
            assert agree >= 0.95, f"{t}: top-1 agreement {agree:.2%}"
            assert mean_kl(ref, fast) <= 0.01
            spread = ref.max() - ref.min()
            assert np.abs(fast - ref).max() <= 0.05 * spread


def test_decode_step_by_step_equals_prefill(tiny_model, monkeypatch):
    """The KV cache path (one token at a time) gives the prefill's logits: bit for bit with
    quantized weights (the qgemm kernels sum a row alike whatever m and ISA:
    tests/kernels/test_batch_invariance.py); float weights' GEMM still rounds by m (codegen/gemm.py)."""
    t, path = tiny_model
    model = _load(t, path, monkeypatch, n_ctx=64)
    ids = random_prompt(model.config.vocab_size, 20, 3)
    full = model.logits(ids)
    for i in range(1, len(ids) + 1):
        step = model.evaluate(ids[:i])
        if t in QUANT_TYPES:
            np.testing.assert_array_equal(step, full[i - 1], err_msg=f"{t}: position {i - 1}")
        else:
            np.testing.assert_allclose(step, full[i - 1], rtol=0, atol=1e-4 * (1 + np.abs(full).max()))


def test_llama3_rope_frequency_factors(tmp_path):
    """A GGUF with rope_freqs.weight (Llama 3): the divisors reach the RoPE tables."""
    path = tmp_path / "llama3-style.gguf"
    write_random_llama(path, tensor_type="F32", seed=3, n_ctx=256, rope_freqs=True, **SHAPES["float"])
    model = llambda.load(path, n_ctx=256, progress=False)
    ids = random_prompt(model.config.vocab_size, 40, 4)
    ref = reference_logits(str(path), ids)
    np.testing.assert_allclose(model.logits(ids), ref, rtol=0, atol=1e-3 * (1 + np.abs(ref).max()))


def test_evaluate_reuses_the_cached_prefix_and_owns_its_copy(tmp_path):
    """evaluate() runs only the tokens past the longest cached prefix, gives the logits of a
    fresh run whatever was cached before (bit for bit: quantized weights), and keeps its own
    record of the cached ids: a caller growing or rewriting one list in place between calls
    never makes it skip a token that changed."""
    path = tmp_path / "tiny-Q8_0.gguf"
    write_random_llama(path, tensor_type="Q8_0", seed=7, n_ctx=64, **SHAPES["quant"])
    model = llambda.load(path, n_ctx=64, progress=False)
    ids = random_prompt(model.config.vocab_size, 24, 4)
    full = model.logits(ids)
    stats = SimpleNamespace()
    grown = ids[:10]
    model.evaluate(grown, stats)
    for i in range(11, len(ids) + 1):
        grown.append(ids[i - 1])                     # the same list, one more token each call
        step = model.evaluate(grown, stats)
        assert stats.cached_tokens == i - 1 and model.position == i
        np.testing.assert_array_equal(step, full[i - 1])
    grown[5] = (grown[5] + 1) % model.config.vocab_size   # rewritten in place: diverges at 5
    step = model.evaluate(grown, stats)
    assert stats.cached_tokens == 5
    np.testing.assert_array_equal(step, model.logits(grown)[-1])
    step = model.evaluate(ids[:17], stats)           # a shorter prompt: the divergence cuts the reuse
    assert stats.cached_tokens == 5
    np.testing.assert_array_equal(step, full[16])
    np.testing.assert_array_equal(model.evaluate(ids[:17], stats), full[16])   # the same prompt again
    assert stats.cached_tokens == 16                 # always one token run, for its logits
