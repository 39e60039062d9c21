"""Every architecture llambda runs (llama, qwen2, qwen3, phi3, gemma3): the fast path
against the pure-numpy reference forward on random-weight models with awkward sizes
(odd head counts, GQA ratios, head_dim 256 for gemma3, q width != dim for qwen3),
against llama.cpp where llama-cpp-python is installed, and the metadata and tensor
checks of conversion.

Tolerances. Float weights: max |dlogit| <= 1e-3 * (1 + max |logit|), as
tests/model/test_model.py states for FP32 kernels. Quantized weights multiply int8
activations (the reference does not; measured max |dlogit| 0.5-1.2% of the
spread): max |dlogit| <= 5% of the spread, and the same top-1 wherever the
reference's top-2 margin exceeds 2% of the spread. llama.cpp keeps K/V in f16 and evaluates GELU
from an f16 table: its logits agree with the reference to about 1e-3 of the largest
logit (measured 2e-4..1.2e-3 on these models); we allow 4e-3.
"""
import importlib.util

import gguf
import numpy as np
import pytest

import llambda
from llambda.model import convert
from llambda.model.config import ModelConfig
from llambda.errors import UserError
from llambda.model.forward import TransformerModel
from llambda.runtime import cpu, get_backend, layouts
from synth_arch import ARCHS, write_random_model
from reference_forward import reference_logits

# Float sizes: nothing a multiple of 8 where it can be avoided.
FLOAT_MODELS = {
    "llama": dict(n_layer=2, dim=72, n_head=3, n_kv_head=1, ffn_dim=100),
    "qwen2": dict(n_layer=2, dim=60, n_head=5, n_kv_head=1, ffn_dim=84),
    "qwen3": dict(n_layer=2, dim=64, n_head=6, n_kv_head=2, head_dim=20, ffn_dim=90),
    "phi3": dict(n_layer=2, dim=80, n_head=5, n_kv_head=5, ffn_dim=72),
    "gemma3": dict(n_layer=7, dim=48, n_head=3, n_kv_head=1, head_dim=256, ffn_dim=80, sliding_window=5),
}
# Quantized rows hold whole blocks of 32.
QUANT_MODELS = {
    "llama": dict(n_layer=2, dim=96, n_head=3, n_kv_head=1, ffn_dim=128),
    "qwen2": dict(n_layer=2, dim=64, n_head=2, n_kv_head=1, ffn_dim=96),
    "qwen3": dict(n_layer=2, dim=64, n_head=6, n_kv_head=2, head_dim=32, ffn_dim=96),
    "phi3": dict(n_layer=2, dim=96, n_head=3, n_kv_head=1, ffn_dim=64),
    "gemma3": dict(n_layer=7, dim=64, n_head=3, n_kv_head=1, head_dim=256, ffn_dim=96, sliding_window=4),
}
VOCAB = 300
BACKENDS = ["numpy", pytest.param("avx2", marks=pytest.mark.skipif(not cpu.supports("avx2"),
                                                                   reason="needs AVX2+FMA+F16C"))]


def _prompt(n, seed, vocab=VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _float_close(fast, ref):
    np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-3 * (1 + np.abs(ref).max()))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(arch, tensor type) -> GGUF path, written once per module."""
    root = tmp_path_factory.mktemp("arch-models")
    cache = {}

    def get(arch, tensor_type="F32"):
        if (arch, tensor_type) not in cache:
            sizes = FLOAT_MODELS[arch] if tensor_type in ("F32", "F16", "BF16") else QUANT_MODELS[arch]
            path = root / f"{arch}-{tensor_type}.gguf"
            cache[arch, tensor_type] = write_random_model(path, arch=arch, seed=11, vocab_size=VOCAB,
                                                          tensor_type=tensor_type, n_ctx=256, **sizes)
        return cache[arch, tensor_type]
    return get


# ------------------------------------------------------- fast path vs reference ---

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_float_model_matches_reference(models, arch, backend):
    path = models(arch, "F32")
    ids = _prompt(23, 1)
    with llambda.load(path, n_ctx=64, backend=backend, progress=False) as model:
        fast = model.logits(ids)
    _float_close(fast, reference_logits(path, ids))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0", "Q4_0"])
def test_typed_model_matches_reference(models, arch, tensor_type):
    path = models(arch, tensor_type)
    ids = _prompt(19, 2)
    with llambda.load(path, n_ctx=64, progress=False) as model:
        fast = model.logits(ids)
    ref = reference_logits(path, ids)
    if tensor_type == "F16":
        _float_close(fast, ref)
    else:
        spread = ref.max() - ref.min()
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.02 * spread        # near-ties may flip
        assert (fast.argmax(-1) == ref.argmax(-1))[clear].all()
        assert np.abs(fast - ref).max() <= 0.05 * spread


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_decode_and_small_chunks_equal_prefill(models, arch, backend):
    """Decoding one token at a time past the sliding window, and prefilling in chunks of 3
    (windows that start inside an earlier chunk), give the one-chunk prefill's logits."""
    path = models(arch, "F32")
    ids = _prompt(17, 3)
    with llambda.load(path, n_ctx=32, backend=backend, progress=False) as model:
        full = model.logits(ids)
        for i in range(1, len(ids) + 1):
            _float_close(model.evaluate(ids[:i]), full[i - 1])
    config, _, weights = convert.load_model_file(convert.ensure_converted(path, progress=False))
    net = TransformerModel(config, weights, get_backend(backend), n_ctx=32, max_batch=3)
    try:
        _float_close(net.forward(ids, 0, all_logits=True), full)
    finally:
        net.close()


@pytest.mark.parametrize("arch, options", [
    ("llama", dict(rope_scaling=dict(type="yarn", factor=4.0, original_context=16), rope_base=100.0)),
    ("llama", dict(rope_scaling=dict(type="linear", factor=2.5, attn_factor=0.8), rope_freqs=True)),
    ("qwen2", dict(rope_scaling=dict(type="yarn", factor=3.0, original_context=8, attn_factor=1.1))),
    ("phi3", dict(rope_freqs=True, rope_scaling=dict(type="linear", factor=1.0, original_context=16))),
    ("phi3", dict(rope_freqs=True, rope_scaling=dict(type="linear", factor=1.0, original_context=1024))),
    ("gemma3", dict(sliding_window_pattern=2, rope_base_swa=50.0, logit_softcap=3.0,
                    rope_scaling=dict(type="linear", factor=8.0))),
])
def test_rope_scaling_and_variants_match_reference(tmp_path, arch, options):
    """YaRN, linear scaling with an attention factor, Llama 3's rope_freqs, Phi-3's short
    and long factors, Gemma's window pattern / local base / soft-cap."""
    sizes = {k: v for k, v in FLOAT_MODELS[arch].items() if k != "sliding_window"}
    if arch == "gemma3":
        sizes["sliding_window"] = 3
    path = write_random_model(tmp_path / "m.gguf", arch=arch, seed=5, vocab_size=VOCAB, n_ctx=256,
                              **sizes, **options)
    ids = _prompt(30, 4)
    with llambda.load(path, n_ctx=64, progress=False) as model:
        fast = model.logits(ids)
    _float_close(fast, reference_logits(path, ids, n_ctx=64))


# ------------------------------------------------------------- llama.cpp referee ---

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="needs llama-cpp-python (optional referee)")


@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
def test_reference_and_fast_path_match_llama_cpp(models, arch):
    import llama_cpp
    path = models(arch, "F32")
    ids = _prompt(20, 6)
    cpp = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, flash_attn=True, verbose=False)
    cpp.eval(ids)
    theirs = np.array(cpp.scores[:len(ids)], dtype=np.float32)
    cpp.close()
    with llambda.load(path, n_ctx=256, progress=False) as model:
        ours = model.logits(ids)
    ref = reference_logits(path, ids, n_ctx=256)
    for logits in (ref, ours):
        assert np.abs(logits - theirs).max() <= 4e-3 * np.abs(theirs).max()
        assert (logits.argmax(-1) == theirs.argmax(-1)).all()


# ------------------------------------------------------------------ metadata ---

def _metadata(arch, **keys):
    base = {"general.architecture": arch, f"{arch}.block_count": 7, f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 4, f"{arch}.feed_forward_length": 96,
            f"{arch}.context_length": 512, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.vocab_size": 320}
    base.update({f"{arch}.{k}": v for k, v in keys.items()})
    return base


def test_gemma3_config_follows_llama_cpp():
    c = ModelConfig.from_gguf_metadata(_metadata("gemma3", **{"attention.key_length": 256,
                                                             "attention.sliding_window": 512,
                                                             "rope.freq_base": 1e6}))
    assert c.layer_window == (512, 512, 512, 512, 512, 0, 512)        # every 6th layer is global
    assert c.layer_rope_base == (1e4,) * 5 + (1e6,) + (1e4,)
    assert c.embed_scale == pytest.approx(8.0) and c.att_scale == pytest.approx(1 / 16)
    assert c.rope_style == "halves" and c.architecture.glu_op == "gelu_mul"
    assert c.logit_softcap == 0.0
    big = ModelConfig.from_gguf_metadata({**_metadata("gemma3", **{"attention.key_length": 128}),
                                          "gemma3.block_count": 62, "gemma3.embedding_length": 5376,
                                          "gemma3.attention.head_count": 32})
    assert big.att_scale == pytest.approx(168 ** -0.5)                 # 27B: dim / n_head


def test_window_pattern_local_base_and_scaling_per_layer():
    c = ModelConfig.from_gguf_metadata(_metadata("gemma3", **{
        "attention.sliding_window": 4, "attention.sliding_window_pattern": 3,
        "rope.freq_base_swa": 500.0, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert c.layer_window == (4, 4, 0, 4, 4, 0, 4)
    assert c.layer_rope_base == (500.0, 500.0, 10000.0, 500.0, 500.0, 10000.0, 500.0)
    assert c.layer_rope_scale == (1.0, 1.0, 0.125, 1.0, 1.0, 0.125, 1.0)   # local layers: unscaled
    listed = ModelConfig.from_gguf_metadata(_metadata("gemma3", **{
        "attention.sliding_window": 4, "attention.sliding_window_pattern": [1, 0, 0, 1, 1, 1, 0]}))
    assert listed.layer_window == (4, 0, 0, 4, 4, 4, 0)
    # qwen2 files may carry a window; llama.cpp ignores it for qwen2, and so do we
    assert ModelConfig.from_gguf_metadata(_metadata("qwen2", **{"attention.sliding_window": 4})
                                          ).layer_window == (0,) * 7


@pytest.mark.parametrize("keys, scaling, scale", [
    ({}, "none", 1.0),
    ({"rope.scaling.factor": 4.0}, "linear", 0.25),                  # llama.cpp's default type
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "yarn", 0.25),
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, "none", 1.0),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 1.0}, "none", 1.0),
])
def test_rope_scaling_metadata(keys, scaling, scale):
    c = ModelConfig.from_gguf_metadata(_metadata("llama", **keys))
    assert (c.rope_scaling, c.layer_rope_scale) == (scaling, (scale,) * 7)
    assert c.rope_orig_ctx == 512 and c.rope_style == "pairs"


@pytest.mark.parametrize("arch, keys, message", [
    ("mamba", {}, "architecture 'mamba' is not supported.*gemma3"),
    ("llama", {"rope.scaling.type": "dynamic"}, "rope.scaling.type"),
    ("qwen3", {"attention.key_length": 32, "attention.value_length": 16}, "value_length"),
    ("gemma3", {"attention.sliding_window": 4, "attention.sliding_window_pattern": [1, 0]}, "lists 2 layers"),
])
def test_bad_metadata_is_refused(arch, keys, message):
    with pytest.raises(UserError, match=message):
        ModelConfig.from_gguf_metadata(_metadata(arch, **keys))


def test_config_round_trips_through_the_file(models):
    path = convert.ensure_converted(models("gemma3"), progress=False)
    config, _, _ = convert.load_model_file(path)
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.layer_window == (5, 5, 5, 5, 5, 0, 5) and config.head_dim == 256


# ------------------------------------------------------------------ conversion ---

def test_phi3_fused_tensors_split_exactly(models):
    """attn_qkv rows become attn_q, attn_k, attn_v and ffn_up rows ffn_gate, ffn_up, bit for bit."""
    path = models("phi3", "Q8_0")
    _, _, weights = convert.load_model_file(convert.ensure_converted(path, progress=False))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    sizes = QUANT_MODELS["phi3"]
    head_dim = sizes["dim"] // sizes["n_head"]
    q, kv, ffn = sizes["n_head"] * head_dim, sizes["n_kv_head"] * head_dim, sizes["ffn_dim"]

    def original(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, sizes["dim"])

    qkv, gate_up = original("blk.1.attn_qkv.weight"), original("blk.1.ffn_up.weight")
    for part, rows in (("attn_q", qkv[:q]), ("attn_k", qkv[q:q + kv]), ("attn_v", qkv[q + kv:]),
                       ("ffn_gate", gate_up[:ffn]), ("ffn_up", gate_up[ffn:])):
        np.testing.assert_array_equal(layouts.dequantize(weights[f"blk.1.{part}.weight"]), rows)
    assert "blk.1.attn_qkv.weight" not in weights


def _relabelled(path, old, new, out):
    """The GGUF with architecture `old` renamed `new` (same length: every offset stays)."""
    assert len(old) == len(new)
    out.write_bytes(path.read_bytes().replace(old.encode(), new.encode()))
    return out


def test_tensors_outside_the_architecture_are_refused(models, tmp_path):
    qwen3_as_llama = _relabelled(models("qwen3"), "qwen3", "llama", tmp_path / "a.gguf")
    with pytest.raises(UserError, match="llama architecture does not use: blk.0.attn_k_norm.weight, blk.0.attn_q_norm"):
        convert.convert(qwen3_as_llama, tmp_path / "a.llb", progress=False)


def test_tensors_the_architecture_needs_are_required(models, tmp_path):
    qwen2_as_qwen3 = _relabelled(models("qwen2"), "qwen2", "qwen3", tmp_path / "b.gguf")
    with pytest.raises(UserError, match="qwen3 architecture needs: blk.0.attn_q_norm.weight"):
        convert.convert(qwen2_as_qwen3, tmp_path / "b.llb", progress=False)


# ------------------------------------------------------------------ synth ---

def test_synth_writes_each_architectures_tensor_names(models):
    names = {arch: {t.name for t in gguf.GGUFReader(models(arch)).tensors} for arch in ARCHS}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names["qwen2"]
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= names["qwen3"]
    assert "blk.0.attn_qkv.weight" in names["phi3"] and "blk.0.ffn_gate.weight" not in names["phi3"]
    assert {"blk.6.post_attention_norm.weight", "blk.6.post_ffw_norm.weight",
            "blk.6.attn_q_norm.weight"} <= names["gemma3"]
    llama_block = {name.split(".", 2)[2] for name in names["llama"] if name.startswith("blk.0.")}
    assert llama_block == {f"{part}.weight" for part in ("attn_norm", "attn_q", "attn_k", "attn_v",
                                                         "attn_output", "ffn_norm", "ffn_gate",
                                                         "ffn_up", "ffn_down")}


def test_synth_is_deterministic_per_seed(tmp_path):
    kw = dict(arch="gemma3", n_layer=2, dim=32, n_head=1, n_kv_head=1, ffn_dim=32, vocab_size=300)
    a, b, c = (write_random_model(tmp_path / f"{n}.gguf", seed=s, **kw).read_bytes()
               for n, s in (("a", 1), ("b", 1), ("c", 2)))
    assert a == b and a != c


@pytest.mark.parametrize("overrides, message", [
    (dict(arch="mamba"), "arch"),
    (dict(arch="qwen2", head_dim=32), "head_dim \\* n_head"),
    (dict(tensor_type="Q4_K"), "cannot quantize"),
    (dict(tensor_type="Q8_0", dim=48, n_head=3, n_kv_head=1), "multiple of 32"),
    (dict(arch="qwen3", rope_freqs=True), "no RoPE factor"),
])
def test_synth_rejects_bad_requests(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        write_random_model(tmp_path / "bad.gguf", **{"vocab_size": 300, **overrides})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ RoPE tables ---

def test_rope_tables_magnitude_and_yarn_ramp(ref):
    n_ctx, head_dim, base = 64, 16, 10000.0
    plain_cos, plain_sin = ref.rope_tables(n_ctx, head_dim, base, "halves")
    cos, sin = ref.rope_tables(n_ctx, head_dim, base, "halves", magnitude=1.5)
    np.testing.assert_allclose(cos, 1.5 * plain_cos, rtol=1e-6)
    np.testing.assert_allclose(sin, 1.5 * plain_sin, rtol=1e-6)
    # YaRN over an original context of 4096: the fastest pairs (more than 32 turns) keep
    # the unscaled angle (pairs 0-2 here), the slowest (under one turn: 6, 7) are
    # interpolated like linear scaling, the ones between blend the two
    scaled_cos, _ = ref.rope_tables(n_ctx, head_dim, base, "halves", freq_scale=0.25)
    yarn_cos, _ = ref.rope_tables(n_ctx, head_dim, base, "halves", freq_scale=0.25, yarn_orig_ctx=4096)
    half = head_dim // 2
    np.testing.assert_allclose(yarn_cos[:, 0], plain_cos[:, 0], atol=1e-6)
    np.testing.assert_allclose(yarn_cos[:, half - 1], scaled_cos[:, half - 1], atol=1e-6)
    assert not np.allclose(yarn_cos[:, 4], plain_cos[:, 4]) and not np.allclose(yarn_cos[:, 4], scaled_cos[:, 4])
    # pass-through lanes of a partial rotation keep cos 1, sin 0 whatever the magnitude
    cos, sin = ref.rope_tables(n_ctx, head_dim, base, "pairs", n_rot=8, magnitude=2.0)
    assert (cos[:, 8:] == 1).all() and (sin[:, 8:] == 0).all()


# ------------------------------------------------------------- the reference itself ---

def test_reference_window_hides_keys_at_or_beyond_w_back():
    from reference_forward import ReferenceConfig, _attention
    config = ReferenceConfig(n_layer=1, dim=2, n_head=1, n_kv_head=1, head_dim=2, ffn_dim=2,
                             vocab_size=2, n_ctx=16, rms_eps=1e-5, rope_base=1e4, n_rot=2,
                             rope_freq_scale=1.0)
    q = np.zeros((1, 1, 2), np.float32)                      # equal scores: a mean of the visible values
    keys = np.zeros((6, 1, 2), np.float32)
    values = np.arange(12, dtype=np.float32).reshape(6, 1, 2)
    out = _attention(q, keys, values, first_pos=5, config=config, window=3)   # sees keys 3, 4, 5
    np.testing.assert_allclose(out[0], values[3:6, 0].mean(axis=0), rtol=1e-6)


def test_reference_neox_rope_rotates_the_two_halves():
    from reference_forward import ReferenceConfig, _rope
    config = ReferenceConfig(n_layer=1, dim=8, n_head=1, n_kv_head=1, head_dim=8, ffn_dim=8,
                             vocab_size=8, n_ctx=16, rms_eps=1e-5, rope_base=100.0, n_rot=8,
                             rope_freq_scale=1.0, rope_style="halves")
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 1] = 1.0                                       # pair i=1 is (x[1], x[5])
    rotated = _rope(x, np.array([3]), config, None)[0, 0]
    angle = 3 * 100.0 ** (-2 / 8)
    expected = np.zeros(8)
    expected[1], expected[5] = np.cos(angle), np.sin(angle)
    np.testing.assert_allclose(rotated, expected, atol=1e-6)
