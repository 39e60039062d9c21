"""Q4_K / Q5_K models end to end: the fast path against the numpy reference forward
(tests/reference_forward.py dequantizes with gguf), with test_model.py's tolerances for
quantized weights, except that top-1 must agree wherever the reference's top-2 margin is clear
(at these shapes Q8_0, too, flips a few near-ties of margin ~0.02). K-quant rows are multiples
of 256, hence the wider shapes."""
import numpy as np
import pytest

import llambda
from llambda.bench.llamacpp_compare import kl_divergence
from synth import write_random_llama
from llamacpp_fixtures import synth_recording
from reference_forward import reference_logits
from helpers import mean_kl, random_prompt

SHAPE = dict(n_layer=2, dim=256, n_head=4, n_kv_head=2, ffn_dim=512, vocab_size=300)
# (linear weights, token embedding, tied LM head): the embedding is looked up through the
# layout (no embed kernel reads K-quants); the LM head is a K-quant GEMM either way
CLEAR_MARGIN = 0.1
MODELS = [("Q4_K", "Q4_K", True), ("Q5_K", "Q4_K", False)]


@pytest.fixture(scope="module", params=MODELS, ids=lambda p: "-".join(map(str, p)))
def kquant_model(request, tmp_path_factory):
    tensor_type, embed_type, tied = request.param
    path = tmp_path_factory.mktemp("models") / f"tiny-{tensor_type}-{embed_type}.gguf"
    write_random_llama(path, tensor_type=tensor_type, embed_type=embed_type, tied=tied, seed=11,
                       n_ctx=256, **SHAPE)
    return path


def test_logits_match_reference(kquant_model):
    # the weights' path against the reference: an f32 KV cache, as the reference keeps
    # (tests/model/test_kv_types.py bounds what the f16 and q8_0 caches add)
    model = llambda.load(kquant_model, n_ctx=256, progress=False, kv_type="f32")
    checked = []
    for n, seed in ((1, 0), (13, 1), (150, 2)):
        ids = random_prompt(model.config.vocab_size, n, seed)
        fast = model.logits(ids)
        ref = reference_logits(str(kquant_model), ids)
        assert fast.shape == ref.shape and np.isfinite(fast).all()
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > CLEAR_MARGIN
        np.testing.assert_array_equal(fast.argmax(-1)[clear], ref.argmax(-1)[clear])
        checked += clear.tolist()
        assert mean_kl(ref, fast) <= 0.01
        assert np.abs(fast - ref).max() <= 0.05 * (ref.max() - ref.min())
    assert np.mean(checked) >= 0.8       # most positions are clear: the check has teeth


def test_decode_step_by_step_equals_prefill(kquant_model):
    model = llambda.load(kquant_model, n_ctx=64, progress=False)
    ids = random_prompt(model.config.vocab_size, 20, 3)
    full = model.logits(ids)
    for i in range(1, len(ids) + 1):
        # bit for bit: every qgemm tile sums a row alike (tests/kernels/test_batch_invariance.py)
        np.testing.assert_array_equal(model.evaluate(ids[:i]), full[i - 1], err_msg=f"position {i - 1}")


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_tiny_models_match_recorded_llama_cpp_logits(tmp_path, name):
    """llama.cpp's logits on the same random-weight files, recorded once
    (tools/record_llamacpp_logits.py --set kquant: 3 heads of 256, GQA 3:1, k = 768 and 512).
    Both the fast path and the reference forward must match them: KL(llama.cpp || ours) <= 0.03
    at every position and <= 0.01 on average, and the same top-1 wherever llama.cpp's top-2
    margin is clear. (llama.cpp multiplies K-quants by Q8_K activations, int8 with one scale
    per 256: even the f32 reference forward is ~0.01 from it at worst, the fast path ~0.003
    from the reference.)"""
    recording, path = synth_recording("kquant", name, tmp_path)
    ids, expected = recording.ids, recording.logits
    top2 = np.sort(expected, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR_MARGIN
    assert clear.mean() >= 0.8
    model = llambda.load(path, n_ctx=256, progress=False)
    for got in (model.logits(ids), reference_logits(str(path), ids)):
        got = got[recording.positions]
        kl = kl_divergence(expected, got)
        assert kl.max() <= 0.03 and kl.mean() <= 0.01, f"KL per position up to {kl.max():.4f}"
        np.testing.assert_array_equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
