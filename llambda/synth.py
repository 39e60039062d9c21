"""Random-weight LLaMA models written as GGUF files.

Tests and benchmarks need models of exact shapes and tensor types without
downloading anything: a tiny one whose dimensions hit every kernel edge, or a
0.5B/1.1B one whose memory traffic looks like a real model's. The weights are
random but scaled so activations keep a sane magnitude through every layer, so
logits neither explode nor collapse to a uniform distribution.

The file is written tensor by tensor (header first, then one tensor at a time),
so a 1.1B-parameter model never sits in memory as a whole, and atomically
(a temp file renamed into place) so an interrupted run leaves no half file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QType

from .tokenizer import byte_level_alphabet

__all__ = ["write_random_llama", "SUPPORTED_TYPES", "PRESETS"]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
# gguf has no quantizer for the K-quants: their tensors are random valid super-blocks
_KQUANT32_TYPES = ("Q4_K", "Q5_K")            # random_kquant_rows
_KQUANT16_TYPES = ("Q6_K", "Q3_K", "Q2_K")    # _random_kquant16_rows

# Llama-like shapes. 1.1b is TinyLlama's; 0.5b is a Llama-shaped model of 0.52
# billion parameters (64-wide heads, 4:1 grouped-query attention).
PRESETS = {
    "tiny": dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=320),
    "0.5b": dict(n_layer=32, dim=1024, n_head=16, n_kv_head=4, ffn_dim=4096, vocab_size=32000),
    "1.1b": dict(n_layer=22, dim=2048, n_head=32, n_kv_head=4, ffn_dim=5632, vocab_size=32000),
}

_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
}

# Rows per quantization call: bounds the float32 staging memory of one big
# tensor (a 32000 x 2048 embedding would otherwise need a 256 MB float copy
# plus the quantizer's temporaries).
_ROWS_PER_CHUNK = 1024


@dataclass(frozen=True)
class _TensorPlan:
    """One tensor to write: its name, numpy shape [rows, cols], type and how to draw it."""
    name: str
    shape: tuple[int, ...]
    type_name: str
    std: float
    mean: float = 0.0

    @property
    def qtype(self) -> QType:
        return QType[self.type_name]

    @property
    def nbytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        n_elements = int(np.prod(self.shape))
        return n_elements // block_size * type_size

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype GGUFWriter infers the GGML type from (uint8 = raw blocks)."""
        if self.type_name == "F32":
            return np.dtype(np.float32)
        if self.type_name == "F16":
            return np.dtype(np.float16)
        return np.dtype(np.uint8)


def write_random_llama(path, *, n_layer: int, dim: int, n_head: int, n_kv_head: int,
                       ffn_dim: int, vocab_size: int, tensor_type: str = "Q4_1",
                       tied: bool = True, n_ctx: int = 2048, seed: int = 0,
                       rope_base: float = 10000.0, tokenizer_from=None,
                       embed_type: str | None = None, rms_eps: float = 1e-5,
                       rope_freqs: bool = False) -> Path:
    """Write a random-weight LLaMA GGUF to `path` and return the path.

    Linear weights use `tensor_type`, the token embedding `embed_type` (default:
    `tensor_type`), norms are always F32. With `tokenizer_from` (a GGUF path)
    every tokenizer.* key is copied from that file and vocab_size becomes its
    vocabulary size; otherwise a small self-contained byte-level BPE vocabulary
    is written and padded with unused tokens up to `vocab_size`. `rope_freqs` adds
    Llama 3's `rope_freqs.weight` (per-frequency divisors of the RoPE angles, here
    random in about [2, 4]).
    """
    embed_type = embed_type or tensor_type
    tokenizer = _copied_tokenizer(tokenizer_from) if tokenizer_from else None
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    _check_shapes(n_layer=n_layer, dim=dim, n_head=n_head, n_kv_head=n_kv_head, ffn_dim=ffn_dim,
                  vocab_size=vocab_size, tensor_type=tensor_type, embed_type=embed_type)
    if tokenizer is None:
        tokenizer = _minimal_tokenizer(vocab_size)

    plans = _tensor_plans(n_layer=n_layer, dim=dim, n_head=n_head, n_kv_head=n_kv_head,
                          ffn_dim=ffn_dim, vocab_size=vocab_size, tensor_type=tensor_type,
                          embed_type=embed_type, tied=tied)
    if rope_freqs:
        plans.append(_TensorPlan("rope_freqs.weight", (dim // n_head // 2,), "F32", std=0.5, mean=3.0))
    path = Path(path)
    writer = gguf.GGUFWriter(path=None, arch="llama")
    _add_hparams(writer, n_layer=n_layer, dim=dim, n_head=n_head, n_kv_head=n_kv_head,
                 ffn_dim=ffn_dim, vocab_size=vocab_size, n_ctx=n_ctx, rope_base=rope_base,
                 rms_eps=rms_eps, tensor_type=tensor_type)
    tokenizer.add_to(writer)
    for plan in plans:
        writer.add_tensor_info(plan.name, plan.shape if plan.type_name in ("F32", "F16") else
                               gguf.quant_shape_to_byte_shape(plan.shape, plan.qtype),
                               plan.storage_dtype, plan.nbytes,
                               raw_dtype=None if plan.type_name in ("F32", "F16") else plan.qtype)

    tmp_name = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer.write_header_to_file(tmp_name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for index, plan in enumerate(plans):
            writer.write_tensor_data(_draw_tensor(plan, seed, index))
        writer.close()
        os.replace(tmp_name, path)
    except BaseException:
        writer.close()
        tmp_name.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------- shapes ---

def _check_shapes(*, n_layer, dim, n_head, n_kv_head, ffn_dim, vocab_size, tensor_type, embed_type):
    for type_name, role in ((tensor_type, "tensor_type"), (embed_type, "embed_type")):
        if type_name not in SUPPORTED_TYPES:
            raise ValueError(f"{role} must be one of {', '.join(SUPPORTED_TYPES)}, got {type_name!r}")
    for name, value in (("n_layer", n_layer), ("dim", dim), ("n_head", n_head),
                        ("n_kv_head", n_kv_head), ("ffn_dim", ffn_dim), ("vocab_size", vocab_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if dim % n_head:
        raise ValueError(f"dim ({dim}) must be a multiple of n_head ({n_head})")
    if (dim // n_head) % 2:
        raise ValueError(f"head_dim (dim / n_head = {dim // n_head}) must be even for RoPE")
    if n_head % n_kv_head:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
    # A quantized row holds whole blocks: every dot-product length must divide.
    for type_name, row_lengths in ((tensor_type, {"dim": dim, "ffn_dim": ffn_dim}),
                                   (embed_type, {"dim": dim})):
        block_size = gguf.GGML_QUANT_SIZES[QType[type_name]][0]
        for name, length in row_lengths.items():
            if length % block_size:
                raise ValueError(f"{type_name} packs rows in blocks of {block_size}: "
                                 f"{name} ({length}) must be a multiple of {block_size}")


def _tensor_plans(*, n_layer, dim, n_head, n_kv_head, ffn_dim, vocab_size, tensor_type,
                  embed_type, tied) -> list[_TensorPlan]:
    """Every tensor in llama.cpp's order, with a scale that keeps activations near unit RMS.

    Each projection reads an RMS-normalised input, so std 1/sqrt(fan_in) keeps its
    output near unit scale. The two projections that write into the residual
    stream are further scaled by 1/sqrt(2 n_layer) so the stream stays O(1)
    after all layers. The LM head (tied or not) gets std 3/sqrt(dim): logits
    with a spread of a few units, peaked enough for greedy decoding to differ
    from a uniform draw.
    """
    head_dim = dim // n_head
    kv_dim = head_dim * n_kv_head
    residual_gain = 1.0 / np.sqrt(2.0 * n_layer)
    head_std = 3.0 / np.sqrt(dim)
    plans = [_TensorPlan("token_embd.weight", (vocab_size, dim), embed_type,
                         std=head_std if tied else 1.0)]
    for layer in range(n_layer):
        blk = f"blk.{layer}"
        plans += [
            _TensorPlan(f"{blk}.attn_norm.weight", (dim,), "F32", std=0.1, mean=1.0),
            _TensorPlan(f"{blk}.attn_q.weight", (dim, dim), tensor_type, std=dim ** -0.5),
            _TensorPlan(f"{blk}.attn_k.weight", (kv_dim, dim), tensor_type, std=dim ** -0.5),
            _TensorPlan(f"{blk}.attn_v.weight", (kv_dim, dim), tensor_type, std=dim ** -0.5),
            _TensorPlan(f"{blk}.attn_output.weight", (dim, dim), tensor_type,
                        std=dim ** -0.5 * residual_gain),
            _TensorPlan(f"{blk}.ffn_norm.weight", (dim,), "F32", std=0.1, mean=1.0),
            _TensorPlan(f"{blk}.ffn_gate.weight", (ffn_dim, dim), tensor_type, std=dim ** -0.5),
            _TensorPlan(f"{blk}.ffn_up.weight", (ffn_dim, dim), tensor_type, std=dim ** -0.5),
            _TensorPlan(f"{blk}.ffn_down.weight", (dim, ffn_dim), tensor_type,
                        std=ffn_dim ** -0.5 * residual_gain * 2.0),
        ]
    plans.append(_TensorPlan("output_norm.weight", (dim,), "F32", std=0.1, mean=1.0))
    if not tied:
        plans.append(_TensorPlan("output.weight", (vocab_size, dim), tensor_type, std=head_std))
    return plans


def _draw_tensor(plan: _TensorPlan, seed: int, index: int) -> np.ndarray:
    """The tensor's bytes in its GGUF type, drawn chunk by chunk from its own random stream.

    Seeding by (seed, index) makes every tensor reproducible on its own,
    whatever else the model contains.
    """
    rng = np.random.default_rng([seed, index])
    if len(plan.shape) == 1:
        values = rng.standard_normal(plan.shape, dtype=np.float32) * np.float32(plan.std)
        return (values + np.float32(plan.mean)).astype(np.float32)
    rows, cols = plan.shape
    out = np.empty(gguf.quant_shape_to_byte_shape(plan.shape, plan.qtype)
                   if plan.storage_dtype == np.uint8 else plan.shape, dtype=plan.storage_dtype)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        stop = min(rows, start + _ROWS_PER_CHUNK)
        if plan.type_name in _KQUANT32_TYPES:
            out[start:stop] = random_kquant_rows(plan.type_name, stop - start, cols, rng, plan.std)
            continue
        values = rng.standard_normal((stop - start, cols), dtype=np.float32)
        values *= np.float32(plan.std)
        if plan.mean:
            values += np.float32(plan.mean)
        if plan.type_name in _KQUANT16_TYPES:
            out[start:stop] = _random_kquant16_rows(plan.type_name, stop - start, cols, plan.std, rng)
        else:
            out[start:stop] = gguf.quants.quantize(values, plan.qtype)
    return out


# (rms of the quant's offset value, rms of the sub-block scale) as drawn below
_KQUANT16_SPREAD = {"Q6_K": (18.5, 37.0), "Q3_K": (2.29, 18.5), "Q2_K": (1.118, 8.8)}


def _random_kquant16_rows(type_name, rows, cols, std, rng):
    """Raw GGUF rows of a K-quant with 16-weight sub-blocks: random quants and sub-block
    scales, super-block scales chosen so the weights have about ``std`` and mean 0 (the
    Q2_K min term cancels its quants' mean: m = sc, dmin = 1.5 d)."""
    from .runtime.ref.kquants16 import BLOCK_BYTES, SUPER_BLOCK
    blocks = rng.integers(0, 256, (rows, cols // SUPER_BLOCK, BLOCK_BYTES[type_name]), dtype=np.uint8)
    offset_rms, scale_rms = _KQUANT16_SPREAD[type_name]
    d = np.full(blocks.shape[:-1] + (1,), std / (offset_rms * scale_rms), np.float16)
    if type_name == "Q6_K":
        blocks[..., 192:208] = rng.integers(-64, 65, blocks.shape[:-1] + (16,)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = d.view(np.uint8)
    elif type_name == "Q3_K":
        blocks[..., 108:110] = d.view(np.uint8)
    else:
        sc = rng.integers(1, 16, blocks.shape[:-1] + (16,), dtype=np.uint8)
        blocks[..., :16] = sc | (sc << 4)
        blocks[..., 80:82] = d.view(np.uint8)
        blocks[..., 82:84] = (d * np.float16(1.5)).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_kquant_rows(type_name: str, rows: int, cols: int, rng, std: float) -> np.ndarray:
    """Random valid Q4_K / Q5_K bytes uint8 [rows, row bytes] whose weights have about ``std``
    spread and mean zero: random quants, 6-bit sub-block scales in 32..63 with each min equal
    to its scale, and per super-block f16 d = std / (mean scale * quant std), dmin = d * mean
    quant (so that each block's min cancels its mean)."""
    from .runtime.ref import kquants
    blocks = rng.integers(0, 256, (rows * cols // 256, kquants.SUPER_BYTES[type_name]), dtype=np.uint8)
    levels = 16 if type_name == "Q4_K" else 32
    sc = rng.integers(32, 64, (blocks.shape[0], 8), dtype=np.uint8)
    d = std / (47.5 * levels / np.sqrt(12.0)) * rng.uniform(0.8, 1.25, blocks.shape[0])
    halves = np.stack([d, d * (levels - 1) / 2], axis=-1).astype(np.float16)
    blocks[:, :4] = halves.view(np.uint8)
    blocks[:, 4:4 + kquants.SCALE_BYTES] = kquants.pack_scale_min(sc, sc)
    return blocks.reshape(rows, -1)


def _add_hparams(writer, *, n_layer, dim, n_head, n_kv_head, ffn_dim, vocab_size, n_ctx,
                 rope_base, rms_eps, tensor_type):
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"llambda-synth-{n_layer}L-{dim}d-{tensor_type}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(ffn_dim)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_rope_dimension_count(dim // n_head)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(_FILE_TYPES[tensor_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ------------------------------------------------------------- tokenizer ---

@dataclass
class _Tokenizer:
    """tokenizer.* key/values ready for a GGUFWriter: (key, value, type, array item type)."""
    entries: list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]
    vocab_size: int

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        for key, value, vtype, sub_type in self.entries:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)


def _copied_tokenizer(gguf_path) -> _Tokenizer:
    reader = gguf.GGUFReader(gguf_path)
    entries = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        entries.append((key, field.contents(), field.types[0], sub_type))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{gguf_path} has no tokenizer.ggml.tokens to copy")
    return _Tokenizer(entries, vocab_size=len(tokens.data))


_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Enough merges that ordinary English words become multi-byte tokens, so BPE
# merging is exercised; each merge's parts are bytes or earlier merge results.
_MERGES = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"),
    ("r", "e"), ("a", "n"), ("Ġ", "s"), ("Ġ", "o"), ("e", "n"), ("a", "t"), ("o", "r"),
    ("Ġ", "w"), ("Ġ", "c"), ("i", "s"), ("Ġ", "i"), ("Ġ", "f"), ("Ġo", "f"), ("in", "g"),
    ("Ġ", "b"), ("Ġ", "p"), ("Ġa", "n"), ("Ġan", "d"), ("Ġ", "is"), ("Ġ", "h"), ("l", "l"),
    ("Ġ", "T"), ("ĠT", "he"), ("e", "s"), ("Ġ", "m"), ("o", "u"), ("Ġt", "o"),
)

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_UNUSED = 1, 3, 5


def minimal_vocab_size() -> int:
    """The smallest vocab_size the built-in tokenizer fits in."""
    return len(_SPECIAL_TOKENS) + 256 + len(_MERGES)


def _minimal_tokenizer(vocab_size: int) -> _Tokenizer:
    if vocab_size < minimal_vocab_size():
        raise ValueError(f"vocab_size ({vocab_size}) must be >= {minimal_vocab_size()} for the "
                         "built-in byte-level tokenizer (or pass tokenizer_from)")
    byte_tokens = [byte_level_alphabet()[byte] for byte in range(256)]
    merged_tokens = [left + right for left, right in _MERGES]
    tokens = list(_SPECIAL_TOKENS) + byte_tokens + merged_tokens
    token_types = [_TOKEN_CONTROL] * len(_SPECIAL_TOKENS) + [_TOKEN_NORMAL] * (256 + len(_MERGES))
    # Padding rows of the embedding: real tokens no text can produce.
    n_padding = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_padding)]
    token_types += [_TOKEN_UNUSED] * n_padding
    assert len(set(tokens)) == len(tokens), "duplicate token in the built-in vocabulary"

    V = gguf.GGUFValueType
    entries = [
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.pre", "smollm", V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", token_types, V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", [f"{left} {right}" for left, right in _MERGES], V.ARRAY, V.STRING),
        ("tokenizer.ggml.bos_token_id", tokens.index("<|im_start|>"), V.UINT32, None),
        ("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"), V.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", tokens.index("<|endoftext|>"), V.UINT32, None),
        ("tokenizer.ggml.padding_token_id", tokens.index("<|im_end|>"), V.UINT32, None),
        ("tokenizer.ggml.add_bos_token", False, V.BOOL, None),
        ("tokenizer.ggml.add_space_prefix", False, V.BOOL, None),
        ("tokenizer.chat_template", _CHATML_TEMPLATE, V.STRING, None),
    ]
    return _Tokenizer(entries, vocab_size=vocab_size)
