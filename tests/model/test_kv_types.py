"""The KV cache's storage types (f32, f16 — the default — and q8_0) against the reference forward.

The reference keeps K and V in float64; llambda stores them rounded to the cache's type, so
on a long prompt every position's logits carry that rounding through every later position.
Float32 weights, so that the cache is the only difference beyond float32 rounding. Stated
tolerances, per position, max |dlogit| <= tol * (1 + max |reference logit|):

    f32   1e-4     (float32 rounding only)
    f16   4e-3     (a 2^-11 relative error per stored value)
    q8_0  4e-2     (half a quantization step, max|x|/254, per 32 values of K, V and q, which
                    q8_0 attention scores as a q8_0 row)

and each type is batch invariant on its own: decode steps equal the prefill, bit for bit.
"""
import numpy as np
import pytest

import llambda
from llambda.serving.kv_pool import check_kv_type
from llambda.errors import UserError
from synth import write_random_llama
from reference_forward import reference_logits

TOLERANCE = {"f32": 1e-4, "f16": 4e-3, "q8_0": 4e-2}
PROMPT = 700                  # 44 KV blocks; longer than one prefill chunk


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "tiny-F32.gguf"
    write_random_llama(path, tensor_type="F32", seed=5, n_ctx=1024, n_layer=2, dim=128, n_head=4, n_kv_head=2,
                       ffn_dim=192, vocab_size=300)
    return path


@pytest.fixture(scope="module")
def prompt_and_reference(model_path):
    ids = np.random.default_rng(1).integers(0, 300, PROMPT).tolist()
    return ids, reference_logits(str(model_path), ids)


@pytest.mark.parametrize("kv_type", list(TOLERANCE))
def test_long_prompt_logits_within_the_stated_tolerance(model_path, prompt_and_reference, kv_type):
    ids, ref = prompt_and_reference
    with llambda.load(model_path, n_ctx=1024, progress=False, kv_type=kv_type) as model:
        assert model.net.kv.kv_type == kv_type
        fast = model.logits(ids)
    err = np.abs(fast - ref).max(-1) / (1 + np.abs(ref).max(-1))
    assert err.max() <= TOLERANCE[kv_type], f"worst position {int(err.argmax())}: {err.max():.2e}"
    if kv_type != "f32":          # the bound is not slack by orders of magnitude: it would miss a broken cache
        assert err.max() >= TOLERANCE[kv_type] / 200


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_each_cache_type_is_batch_invariant(model_path, prompt_and_reference, kv_type):
    ids, _ = prompt_and_reference
    with llambda.load(model_path, n_ctx=1024, progress=False, kv_type=kv_type) as model:
        full = model.logits(ids[:200])
        for i in (150, 151, 199, 200):
            np.testing.assert_array_equal(model.evaluate(ids[:i]), full[i - 1])


def test_the_default_is_f16_unless_head_dim_rules_it_out():
    assert check_kv_type(None, 64) == "f16"
    assert check_kv_type(None, 18) == "f32"
    with pytest.raises(ValueError, match="q8_0 needs head_dim to be a multiple of 32"):
        check_kv_type("q8_0", 48)
    with pytest.raises(ValueError, match="kv_type: expected one of"):
        check_kv_type("int4", 64)


def test_a_bad_kv_type_is_one_clear_error(model_path):
    with pytest.raises(UserError, match="kv_type"):
        llambda.load(model_path, n_ctx=64, progress=False, kv_type="bf16")
