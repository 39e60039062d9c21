"""Random-weight LLaMA models written as GGUF files.

Tests and benchmarks need models of exact shapes and tensor types without
downloading anything: a tiny one whose dimensions hit every kernel edge, or a
0.5B/1.1B one whose memory traffic looks like a real model's. The weights are
random but scaled so activations keep a sane magnitude through every layer, so
logits neither explode nor collapse to a uniform distribution. The file is
written as llambda/gguf/writer.py writes every GGUF: tensor by tensor, atomically.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QType

# (_Tokenizer, _minimal_tokenizer and minimal_vocab_size stay importable from here: tests patch and use them)
from llambda.gguf.writer import (FILE_TYPES as _FILE_TYPES, Tokenizer as _Tokenizer, add_hparams,
                         copied_tokenizer as _copied_tokenizer, minimal_tokenizer as _minimal_tokenizer,
                         minimal_vocab_size, tensor_info, write_gguf)

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
    def info(self):
        """Its entry in the GGUF tensor table."""
        return tensor_info(self.name, self.shape, self.type_name)


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
    writer = gguf.GGUFWriter(path=None, arch="llama")
    add_hparams(writer, name=f"llambda-synth-{n_layer}L-{dim}d-{tensor_type}", n_ctx=n_ctx, dim=dim,
                n_layer=n_layer, ffn_dim=ffn_dim, n_head=n_head, n_kv_head=n_kv_head,
                rope_dims=dim // n_head, rope_base=rope_base, rms_eps=rms_eps, vocab_size=vocab_size,
                file_type=_FILE_TYPES[tensor_type])
    tokenizer.add_to(writer)
    return write_gguf(path, writer, [plan.info for plan in plans],
                      (_draw_tensor(plan, seed, index) for index, plan in enumerate(plans)))


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
    out = np.empty(plan.info.shape, dtype=plan.info.dtype)
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
    from llambda.runtime.ref.kquants16 import BLOCK_BYTES, SUPER_BLOCK
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
    from llambda.runtime.ref import kquants
    blocks = rng.integers(0, 256, (rows * cols // 256, kquants.SUPER_BYTES[type_name]), dtype=np.uint8)
    levels = 16 if type_name == "Q4_K" else 32
    sc = rng.integers(32, 64, (blocks.shape[0], 8), dtype=np.uint8)
    d = std / (47.5 * levels / np.sqrt(12.0)) * rng.uniform(0.8, 1.25, blocks.shape[0])
    halves = np.stack([d, d * (levels - 1) / 2], axis=-1).astype(np.float16)
    blocks[:, :4] = halves.view(np.uint8)
    blocks[:, 4:4 + kquants.SCALE_BYTES] = kquants.pack_scale_min(sc, sc)
    return blocks.reshape(rows, -1)
