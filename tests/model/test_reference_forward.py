"""The reference forward (tests/reference_forward.py) and the synthetic-model writer
(tests/synth.py), checked against things they cannot fake: a real model's
knowledge, transformers' LlamaForCausalLM (when installed), causality, and the
GGUF reader."""
import importlib.util

import gguf
import numpy as np
import pytest

from synth import SUPPORTED_TYPES, minimal_vocab_size, write_random_llama
from reference_forward import (ReferenceModel, _attention, _rope, load_reference_weights,
                               reference_logits)
from repo_paths import TOOLS

# Float types take any width; block-quantized rows need multiples of 32, K-quant rows of 256.
TINY_SHAPES = {
    "float": dict(n_layer=2, dim=36, n_head=3, n_kv_head=1, ffn_dim=50, vocab_size=301),
    "quant": dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=320),
    # K-quant rows are whole super-blocks of 256
    "super": dict(n_layer=2, dim=256, n_head=4, n_kv_head=2, ffn_dim=512, vocab_size=320),
}
PROMPT = [5, 77, 300, 12, 12, 190, 3, 41]


def tiny_shape(tensor_type):
    if tensor_type in ("F32", "F16", "BF16"):
        return TINY_SHAPES["float"]
    block_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]][0]
    return TINY_SHAPES["super" if block_size == 256 else "quant"]


@pytest.fixture(scope="module", params=SUPPORTED_TYPES)
def tiny_model(request, tmp_path_factory):
    tensor_type = request.param
    path = tmp_path_factory.mktemp("synth") / f"tiny-{tensor_type}.gguf"
    write_random_llama(path, tensor_type=tensor_type, rope_base=5000.0, **tiny_shape(tensor_type))
    return path, tensor_type


def scale_of(logits):
    return float(np.abs(logits).max())


# ------------------------------------------------------------- the reference ---

def test_reference_is_causal(tiny_model):
    path, _ = tiny_model
    full = reference_logits(path, PROMPT)
    prefix = reference_logits(path, PROMPT[:3])
    # Float32 matmuls of 3 vs 8 rows may block differently in BLAS: a few ulps.
    np.testing.assert_allclose(prefix, full[:3], rtol=0, atol=1e-5 * scale_of(full))
    assert full.shape == (len(PROMPT), tiny_shape(tiny_model[1])["vocab_size"])
    assert full.dtype == np.float32 and np.all(np.isfinite(full))


def test_appended_token_changes_only_later_logits(tiny_model):
    path, _ = tiny_model
    a = reference_logits(path, PROMPT)
    b = reference_logits(path, PROMPT[:5] + [250] + PROMPT[6:])
    np.testing.assert_allclose(a[:5], b[:5], rtol=0, atol=1e-5 * scale_of(a))
    assert np.abs(a[5:] - b[5:]).max() > 1e-3 * scale_of(a)


def test_step_by_step_decode_equals_prefill(tiny_model):
    path, _ = tiny_model
    full = reference_logits(path, PROMPT)
    model = ReferenceModel(path)
    first = model.prefill(PROMPT[:2])
    stepped = np.vstack([first] + [model.step(token)[None] for token in PROMPT[2:]])
    assert model.position == len(PROMPT)
    # Same math, different row blocking in BLAS: a few ulps.
    np.testing.assert_allclose(stepped, full, rtol=0, atol=1e-5 * scale_of(full))
    model.reset()
    np.testing.assert_allclose(model.prefill(PROMPT), full, rtol=0, atol=1e-5 * scale_of(full))


def test_synthetic_logits_are_sane(tiny_model):
    """Neither exploded nor uniform: greedy decoding depends on the context."""
    path, _ = tiny_model
    logits = reference_logits(path, PROMPT)
    spread = logits.std(axis=-1)
    assert np.all(spread > 0.3) and np.all(spread < 30), spread
    assert len(set(logits.argmax(axis=-1).tolist())) > 1


def test_rope_rotates_adjacent_pairs():
    from reference_forward import ReferenceConfig
    config = ReferenceConfig(n_layer=1, dim=8, n_head=1, n_kv_head=1, head_dim=8, ffn_dim=8,
                             vocab_size=8, n_ctx=16, rms_eps=1e-5, rope_base=100.0, n_rot=8,
                             rope_freq_scale=1.0)
    x = np.zeros((1, 1, 8), dtype=np.float32)
    x[0, 0, 2] = 1.0   # first element of pair i=1, frequency 100^(-2/8)
    rotated = _rope(x, np.array([3]), config, None)[0, 0]
    angle = 3 * 100.0 ** (-2 / 8)
    expected = np.zeros(8)
    expected[2], expected[3] = np.cos(angle), np.sin(angle)
    np.testing.assert_allclose(rotated, expected, atol=1e-6)
    # The point of RoPE: q.k depends only on the distance between positions.
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    dot = lambda m, n: float(np.sum(_rope(q, np.array([m]), config, None)
                                    * _rope(k, np.array([n]), config, None)))
    assert dot(7, 4) == pytest.approx(dot(3, 0), abs=1e-5)


def test_gqa_query_head_reads_its_group_kv_head():
    from reference_forward import ReferenceConfig
    config = ReferenceConfig(n_layer=1, dim=8, n_head=4, n_kv_head=2, head_dim=2, ffn_dim=8,
                             vocab_size=8, n_ctx=16, rms_eps=1e-5, rope_base=1e4, n_rot=2,
                             rope_freq_scale=1.0)
    q = np.ones((1, 4, 2), dtype=np.float32)
    keys = np.zeros((1, 2, 2), dtype=np.float32)
    values = np.array([[[1, 2], [3, 4]]], dtype=np.float32)
    # A single key: softmax is 1, each head returns its kv head's value.
    out = _attention(q, keys, values, first_pos=0, config=config).reshape(4, 2)
    np.testing.assert_array_equal(out, [[1, 2], [1, 2], [3, 4], [3, 4]])


def token_ids_by_lookup(gguf_path, words):
    """Ids of whole-word tokens, looked up in the GGUF vocabulary (GPT-2 spells ' ' as 'Ġ')."""
    tokens = gguf.GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"].contents()
    index = {token: i for i, token in enumerate(tokens)}
    return [index[word.replace(" ", "Ġ")] for word in words], tokens


def test_default_model_knows_the_capital_of_france(default_gguf):
    ids, tokens = token_ids_by_lookup(default_gguf, ["The", " capital", " of", " France", " is"])
    model = ReferenceModel(default_gguf)
    next_id = int(model.prefill(ids)[-1].argmax())
    generated = []
    for _ in range(4):
        generated.append(next_id)
        next_id = int(model.step(next_id).argmax())
    text = "".join(tokens[i] for i in generated).replace("Ġ", " ")
    assert "Paris" in text, text


# ---------------------------------------------------- against transformers ---

HAVE_TRANSFORMERS = all(importlib.util.find_spec(name) for name in ("torch", "transformers"))
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs torch + transformers")


def unpermute_rows(weight, n_head):
    """GGUF Q/K rows back to HF order: converters interleave the two halves of each head."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_head
    return (weight.reshape(n_head, head_dim // 2, 2, in_dim)
            .swapaxes(1, 2).reshape(out_dim, in_dim))


def hf_llama_from_gguf(gguf_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    weights = load_reference_weights(gguf_path)
    c = weights.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                         num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                         num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
                         rms_norm_eps=c.rms_eps, rope_theta=c.rope_base,
                         max_position_embeddings=c.n_ctx, tie_word_embeddings=weights.tied)
    model = LlamaForCausalLM(config).eval().float()
    state = {"model.embed_tokens.weight": weights.token_embd, "model.norm.weight": weights.output_norm,
             "lm_head.weight": weights.output}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": layer.attn_norm,
            p + "self_attn.q_proj.weight": unpermute_rows(layer.wq, c.n_head),
            p + "self_attn.k_proj.weight": unpermute_rows(layer.wk, c.n_kv_head),
            p + "self_attn.v_proj.weight": layer.wv,
            p + "self_attn.o_proj.weight": layer.wo,
            p + "post_attention_layernorm.weight": layer.ffn_norm,
            p + "mlp.gate_proj.weight": layer.w_gate,
            p + "mlp.up_proj.weight": layer.w_up,
            p + "mlp.down_proj.weight": layer.w_down,
        })
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=True)
    return model


def hf_logits(gguf_path, ids):
    import torch
    with torch.no_grad():
        return hf_llama_from_gguf(gguf_path)(torch.tensor([ids])).logits[0].numpy()


@needs_transformers
@pytest.mark.parametrize("tied", [True, False])
def test_matches_transformers_on_synthetic_model(tmp_path, tied):
    path = write_random_llama(tmp_path / "m.gguf", tensor_type="F32", tied=tied, rope_base=5000.0,
                              **TINY_SHAPES["float"])
    ours = reference_logits(path, PROMPT)
    # Both float32 with different summation orders (measured: 6e-7 of the scale).
    np.testing.assert_allclose(ours, hf_logits(path, PROMPT), rtol=0, atol=1e-5 * scale_of(ours))


@needs_transformers
def test_matches_transformers_on_default_model(default_gguf):
    ids = [504, 3575, 282, 4649, 314, 7042, 30]
    ours = reference_logits(default_gguf, ids)
    # 30 float32 layers, different summation orders on each side (measured: 2e-6 of the
    # scale; a wrong RoPE pairing is off by a third of it).
    np.testing.assert_allclose(ours, hf_logits(default_gguf, ids), rtol=0, atol=2e-5 * scale_of(ours))


# ----------------------------------------------------------------- synth ---

def test_synth_tensors_read_back_with_requested_types_and_shapes(tiny_model):
    path, tensor_type = tiny_model
    shape = tiny_shape(tensor_type)
    dim, ffn, vocab = shape["dim"], shape["ffn_dim"], shape["vocab_size"]
    kv_dim = dim // shape["n_head"] * shape["n_kv_head"]
    reader = gguf.GGUFReader(path)
    found = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors}
    # GGUF lists dimensions fastest-first: [in, out].
    expected = {"token_embd.weight": (tensor_type, (dim, vocab)),
                "output_norm.weight": ("F32", (dim,))}
    for i in range(shape["n_layer"]):
        expected.update({
            f"blk.{i}.attn_norm.weight": ("F32", (dim,)),
            f"blk.{i}.ffn_norm.weight": ("F32", (dim,)),
            f"blk.{i}.attn_q.weight": (tensor_type, (dim, dim)),
            f"blk.{i}.attn_k.weight": (tensor_type, (dim, kv_dim)),
            f"blk.{i}.attn_v.weight": (tensor_type, (dim, kv_dim)),
            f"blk.{i}.attn_output.weight": (tensor_type, (dim, dim)),
            f"blk.{i}.ffn_gate.weight": (tensor_type, (dim, ffn)),
            f"blk.{i}.ffn_up.weight": (tensor_type, (dim, ffn)),
            f"blk.{i}.ffn_down.weight": (tensor_type, (ffn, dim)),
        })
    assert found == expected
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.embedding_length"].contents() == dim
    assert fields["llama.attention.head_count_kv"].contents() == shape["n_kv_head"]
    assert fields["llama.rope.freq_base"].contents() == 5000.0
    assert len(fields["tokenizer.ggml.tokens"].contents()) == vocab
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"


def test_synth_untied_with_own_embedding_type(tmp_path):
    path = write_random_llama(tmp_path / "m.gguf", tensor_type="Q4_0", embed_type="Q8_0",
                              tied=False, **TINY_SHAPES["quant"])
    found = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert found["token_embd.weight"] == "Q8_0"
    assert found["output.weight"] == "Q4_0"
    assert found["blk.1.ffn_down.weight"] == "Q4_0"
    assert np.all(np.isfinite(reference_logits(path, PROMPT)))


def test_synth_is_deterministic_per_seed(tmp_path):
    paths = [write_random_llama(tmp_path / f"{name}.gguf", seed=seed, **TINY_SHAPES["quant"])
             for name, seed in (("a", 1), ("b", 1), ("c", 2))]
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b and a != c


def test_synth_copies_tokenizer(tmp_path):
    source = write_random_llama(tmp_path / "source.gguf", tensor_type="F16",
                                **{**TINY_SHAPES["float"], "vocab_size": 400})
    copy = write_random_llama(tmp_path / "copy.gguf", tensor_type="F16", tokenizer_from=source,
                              **TINY_SHAPES["float"])
    read = lambda p: {k: f.contents() for k, f in gguf.GGUFReader(p).fields.items()
                      if k.startswith("tokenizer.")}
    assert read(copy) == read(source)
    assert reference_logits(copy, PROMPT).shape == (len(PROMPT), 400)


@pytest.mark.parametrize("overrides, message", [
    (dict(tensor_type="Q4_1", dim=36, n_head=3, n_kv_head=1), "multiple of 32"),
    (dict(tensor_type="F16", embed_type="Q8_0", dim=36, n_head=3, n_kv_head=1), "multiple of 32"),
    (dict(tensor_type="IQ4_NL"), "tensor_type"),
    (dict(tensor_type="Q4_K"), "dim \\(64\\) must be a multiple of 256"),
    (dict(vocab_size=10), "vocab_size"),
    (dict(n_head=5), "multiple of n_head"),
    (dict(n_kv_head=3), "multiple of n_kv_head"),
    (dict(n_layer=0), "n_layer"),
])
def test_synth_rejects_bad_shapes(tmp_path, overrides, message):
    args = {**TINY_SHAPES["quant"], "tensor_type": "Q8_0", **overrides}
    with pytest.raises(ValueError, match=message):
        write_random_llama(tmp_path / "bad.gguf", **args)
    assert list(tmp_path.iterdir()) == []   # no half file left behind


def test_minimal_tokenizer_fits_tiny_vocab():
    assert minimal_vocab_size() <= min(s["vocab_size"] for s in TINY_SHAPES.values())


def load_make_gguf_tool():
    from pathlib import Path
    tool = TOOLS / "make_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gguf", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_gguf_cli_overrides_preset(tmp_path, capsys):
    make_gguf = load_make_gguf_tool()
    out = tmp_path / "cli.gguf"
    assert make_gguf.main(["--preset", "tiny", "--type", "BF16", "--dim", "36", "--n-head", "3",
                           "--n-kv-head", "1", "--untied", "-o", str(out)]) == 0
    found = {t.name: (t.tensor_type.name, [int(n) for n in t.shape])
             for t in gguf.GGUFReader(out).tensors}
    assert found["output.weight"] == ("BF16", [36, 320])
    assert make_gguf.main(["--type", "Q4_0", "--dim", "36", "--n-head", "3", "--n-kv-head", "1",
                           "-o", str(tmp_path / "bad.gguf")]) == 2
    assert "multiple of 32" in capsys.readouterr().err


def test_synth_tokenizer_is_a_working_byte_level_bpe(tiny_model):
    """The built-in vocabulary, run by the `tokenizers` library: merges apply, bytes round-trip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    fields = gguf.GGUFReader(tiny_model[0]).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = "The cat is in the house, and of ünïcode 🦙\n"
    encoding = tokenizer.encode(text)
    assert "Ġthe" in encoding.tokens and "Ġand" in encoding.tokens
    assert tokenizer.decode(encoding.ids) == text
