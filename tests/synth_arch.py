"""Random-weight GGUFs of every architecture llambda runs, from a seed.

    write_random_model("g.gguf", arch="gemma3", seed=1, n_layer=7, dim=96, n_head=3,
                       n_kv_head=1, head_dim=256, ffn_dim=160, vocab_size=320,
                       sliding_window=4, tensor_type="F32")

The files carry the tensor names and metadata keys llama.cpp's loader expects
for the architecture (llama, qwen2, qwen3, phi3, gemma3), so llama.cpp can run
them as the referee; the names are written out here from llama.cpp's
src/models/<arch>.cpp, not taken from llambda/model/arch.py, so a wrong name in
llambda shows up as a failed conversion instead of being copied. Weights are
drawn as in tests/synth.py (one reproducible stream per tensor, scales that
keep activations near unit RMS); norm weights are drawn near 1 (Gemma's GGUF
norms hold 1 + w, so near 1 is what a real file looks like too).

Embedding rows beyond the tokenizer's vocabulary (``padding_tokens``) are
written as a converter from Hugging Face writes them: ``[PAD<id>]`` tokens.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from llambda.gguf.writer import (FILE_TYPES, TOKEN_USER_DEFINED, Tokenizer, add_hparams, copied_tokenizer,
                         minimal_tokenizer, write_gguf)
from synth import _draw_tensor, _TensorPlan

__all__ = ["write_random_model", "ARCHS"]

# What each architecture's llama.cpp loader asks for beyond a llama block.
_FEATURES = {
    "llama": set(),
    "qwen2": {"qkv_bias"},
    "qwen3": {"qk_norm"},
    "phi3": {"fused_qkv", "fused_gate_up", "rope_factors"},
    "gemma3": {"qk_norm", "post_norms"},
}
ARCHS = tuple(_FEATURES)


def write_random_model(path, *, arch: str = "llama", seed: int = 0, n_layer: int = 2, dim: int = 64,
                       n_head: int = 4, n_kv_head: int = 2, head_dim: int | None = None,
                       ffn_dim: int = 96, vocab_size: int = 320, tensor_type: str = "F32",
                       embed_type: str | None = None, tied: bool = True, n_ctx: int = 2048,
                       rope_base: float | None = None, rms_eps: float = 1e-5,
                       sliding_window: int | None = None, sliding_window_pattern: int | None = None,
                       rope_base_swa: float | None = None, logit_softcap: float | None = None,
                       rope_scaling: dict | None = None, rope_freqs: bool = False,
                       padding_tokens: int = 0, unlisted_rows: int = 0, tokenizer_from=None,
                       pooling_type: int | None = None) -> Path:
    """Write a random-weight GGUF of architecture ``arch`` to ``path`` and return the path.

    Matrices use ``tensor_type`` (any type gguf-py can quantize to: F32, F16, BF16,
    Q8_0, Q5_0, Q5_1, Q4_0, Q4_1), the token embedding ``embed_type`` (default the same);
    norms and biases are F32. ``head_dim`` defaults to dim / n_head (256 for gemma3).

    arch-specific: qwen2 writes Q/K/V biases; qwen3 and gemma3 per-head Q/K norms;
    phi3 writes fused ``attn_qkv`` and ``ffn_up`` (gate rows first) and needs
    head_dim = dim / n_head; gemma3 writes the post-attention/post-FFN norms, and with
    ``sliding_window`` its local layers (every layer but each 6th, or
    ``sliding_window_pattern``-th) attend that many positions back.
    ``rope_scaling``: {"type": "linear"|"yarn", "factor": f, "original_context": n,
    "attn_factor": a} (keys optional but type). ``rope_freqs``: llama's rope_freqs.weight,
    or phi3's rope_factors_long/short (random divisors in about [1, 4]).
    ``padding_tokens``: the last rows of the vocabulary are ``[PAD<id>]`` tokens;
    ``unlisted_rows``: the embedding has that many rows more than the tokenizer has tokens
    (llama.cpp refuses such a file; llambda runs it and never produces those ids).
    ``pooling_type``: ``<arch>.pooling_type`` (llama.h's enum: 0 none, 1 mean, 2 cls, 3 last,
    4 rank), as embedding models' files carry it.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    embed_type = embed_type or tensor_type
    if head_dim is None:
        head_dim = 256 if arch == "gemma3" else dim // max(n_head, 1)
    if rope_base is None:
        rope_base = 1_000_000.0 if arch in ("gemma3", "qwen2", "qwen3") else 10000.0
    tokenizer = copied_tokenizer(tokenizer_from) if tokenizer_from else None
    if tokenizer is not None:
        if padding_tokens:
            raise ValueError("padding_tokens: not with tokenizer_from (its vocabulary is copied as is)")
        vocab_size = tokenizer.vocab_size + unlisted_rows
    sizes = dict(n_layer=n_layer, dim=dim, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
                 ffn_dim=ffn_dim, vocab_size=vocab_size)
    _check(arch, sizes, tensor_type, embed_type, padding_tokens + unlisted_rows, rope_scaling)
    if tokenizer is None:
        listed = vocab_size - unlisted_rows
        tokenizer = _padded(minimal_tokenizer(listed - padding_tokens), padding_tokens)

    plans = _tensor_plans(arch, sizes, tensor_type, embed_type, tied)
    if rope_freqs:
        plans += _rope_factor_plans(arch, head_dim)
    writer = gguf.GGUFWriter(path=None, arch=arch)
    _add_hparams(writer, arch, sizes, tensor_type=tensor_type, n_ctx=n_ctx, rope_base=rope_base,
                 rms_eps=rms_eps, sliding_window=sliding_window, pattern=sliding_window_pattern,
                 rope_base_swa=rope_base_swa, logit_softcap=logit_softcap, rope_scaling=rope_scaling)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    tokenizer.add_to(writer)
    return write_gguf(path, writer, [plan.info for plan in plans],
                      (_draw_tensor(plan, seed, index) for index, plan in enumerate(plans)))


# ---------------------------------------------------------------- checks ---

def _check(arch, sizes, tensor_type, embed_type, padding_tokens, rope_scaling):
    for type_name, role in ((tensor_type, "tensor_type"), (embed_type, "embed_type")):
        if type_name not in QType.__members__:
            raise ValueError(f"{role}: {type_name!r} is not a GGML type")
        try:
            gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[QType[type_name]][0]), np.float32),
                                 QType[type_name])
        except NotImplementedError:
            raise ValueError(f"{role}: gguf-py cannot quantize to {type_name}") from None
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if sizes["head_dim"] % 2:
        raise ValueError(f"head_dim ({sizes['head_dim']}) must be even for RoPE")
    if sizes["n_head"] % sizes["n_kv_head"]:
        raise ValueError(f"n_head ({sizes['n_head']}) must be a multiple of n_kv_head ({sizes['n_kv_head']})")
    if arch in ("llama", "qwen2", "phi3") and sizes["head_dim"] * sizes["n_head"] != sizes["dim"]:
        raise ValueError(f"{arch}: head_dim * n_head must equal dim ({sizes['dim']})")
    if not 0 <= padding_tokens < sizes["vocab_size"]:
        raise ValueError(f"padding_tokens + unlisted_rows must be in [0, vocab_size), got {padding_tokens}")
    if rope_scaling is not None and rope_scaling.get("type") not in ("linear", "yarn"):
        raise ValueError(f"rope_scaling type must be 'linear' or 'yarn', got {rope_scaling.get('type')!r}")
    # A quantized row holds whole blocks: every dot-product length must divide.
    q_dim = sizes["n_head"] * sizes["head_dim"]
    lengths = {tensor_type: {"dim": sizes["dim"], "ffn_dim": sizes["ffn_dim"], "n_head * head_dim": q_dim},
               embed_type: {"dim": sizes["dim"]}}
    for type_name, row_lengths in lengths.items():
        block_size = gguf.GGML_QUANT_SIZES[QType[type_name]][0]
        for name, length in row_lengths.items():
            if length % block_size:
                raise ValueError(f"{type_name} packs rows in blocks of {block_size}: "
                                 f"{name} ({length}) must be a multiple of {block_size}")


# ---------------------------------------------------------------- tensors ---

def _tensor_plans(arch, s, tensor_type, embed_type, tied):
    """Every tensor the architecture's llama.cpp loader asks for, in its order, scaled as
    tests/synth.py explains (unit-RMS activations, residual writes by 1/sqrt(2 n_layer))."""
    has = _FEATURES[arch]
    dim, ffn, n_layer = s["dim"], s["ffn_dim"], s["n_layer"]
    q_dim, kv_dim = s["n_head"] * s["head_dim"], s["n_kv_head"] * s["head_dim"]
    gain = 1.0 / np.sqrt(2.0 * n_layer)
    head_std = 3.0 / np.sqrt(dim)
    # Gemma scales the embedding by sqrt(dim): draw it 1/sqrt(dim) smaller so the
    # residual stream starts near unit RMS as the others do.
    embed_std = head_std if tied else 1.0
    plans = [_TensorPlan("token_embd.weight", (s["vocab_size"], dim), embed_type, std=embed_std)]

    def norm(name, n):
        return _TensorPlan(name, (n,), "F32", std=0.1, mean=1.0)

    def matrix(name, rows, cols, std):
        return _TensorPlan(name, (rows, cols), tensor_type, std=std)

    for layer in range(n_layer):
        b = f"blk.{layer}"
        plans.append(norm(f"{b}.attn_norm.weight", dim))
        if "fused_qkv" in has:
            plans.append(matrix(f"{b}.attn_qkv.weight", q_dim + 2 * kv_dim, dim, dim ** -0.5))
        else:
            plans += [matrix(f"{b}.attn_q.weight", q_dim, dim, dim ** -0.5),
                      matrix(f"{b}.attn_k.weight", kv_dim, dim, dim ** -0.5),
                      matrix(f"{b}.attn_v.weight", kv_dim, dim, dim ** -0.5)]
        if "qkv_bias" in has:
            plans += [_TensorPlan(f"{b}.attn_q.bias", (q_dim,), "F32", std=0.5),
                      _TensorPlan(f"{b}.attn_k.bias", (kv_dim,), "F32", std=0.5),
                      _TensorPlan(f"{b}.attn_v.bias", (kv_dim,), "F32", std=0.5)]
        if "qk_norm" in has:
            plans += [norm(f"{b}.attn_q_norm.weight", s["head_dim"]),
                      norm(f"{b}.attn_k_norm.weight", s["head_dim"])]
        plans.append(matrix(f"{b}.attn_output.weight", dim, q_dim, q_dim ** -0.5 * gain))
        if "post_norms" in has:
            plans.append(norm(f"{b}.post_attention_norm.weight", dim))
        plans.append(norm(f"{b}.ffn_norm.weight", dim))
        if "fused_gate_up" in has:
            plans.append(matrix(f"{b}.ffn_up.weight", 2 * ffn, dim, dim ** -0.5))
        else:
            plans += [matrix(f"{b}.ffn_gate.weight", ffn, dim, dim ** -0.5),
                      matrix(f"{b}.ffn_up.weight", ffn, dim, dim ** -0.5)]
        plans.append(matrix(f"{b}.ffn_down.weight", dim, ffn, ffn ** -0.5 * gain * 2.0))
        if "post_norms" in has:
            plans.append(norm(f"{b}.post_ffw_norm.weight", dim))
    plans.append(norm("output_norm.weight", dim))
    if not tied:
        plans.append(matrix("output.weight", s["vocab_size"], dim, head_std))
    return plans


def _rope_factor_plans(arch, head_dim):
    half = head_dim // 2
    if arch == "llama":
        return [_TensorPlan("rope_freqs.weight", (half,), "F32", std=0.5, mean=3.0)]
    if "rope_factors" in _FEATURES[arch]:
        return [_TensorPlan("rope_factors_long.weight", (half,), "F32", std=0.5, mean=3.0),
                _TensorPlan("rope_factors_short.weight", (half,), "F32", std=0.2, mean=1.5)]
    raise ValueError(f"rope_freqs: {arch} files carry no RoPE factor tensors")


# ---------------------------------------------------------------- metadata ---

def _add_hparams(writer, arch, s, *, tensor_type, n_ctx, rope_base, rms_eps, sliding_window, pattern,
                 rope_base_swa, logit_softcap, rope_scaling):
    # Not the architecture's name: llama.cpp keys vocabulary fix-ups on general.name
    # (a "phi3" in it makes it look for </s>, which the built-in vocabulary lacks).
    add_hparams(writer, name=f"llambda-synth-{s['n_layer']}L-{s['dim']}d-{tensor_type}", n_ctx=n_ctx,
                dim=s["dim"], n_layer=s["n_layer"], ffn_dim=s["ffn_dim"], n_head=s["n_head"],
                n_kv_head=s["n_kv_head"], head_dim=s["head_dim"], rope_dims=s["head_dim"],
                rope_base=rope_base, rms_eps=rms_eps, vocab_size=s["vocab_size"],
                sliding_window=sliding_window,
                file_type=FILE_TYPES.get(tensor_type, gguf.LlamaFileType.GUESSED))
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    if rope_base_swa is not None:
        writer.add_rope_freq_base_swa(rope_base_swa)
    if logit_softcap:
        writer.add_final_logit_softcapping(logit_softcap)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["type"]))
        if "factor" in rope_scaling:
            writer.add_rope_scaling_factor(rope_scaling["factor"])
        if "original_context" in rope_scaling:
            writer.add_rope_scaling_orig_ctx_len(rope_scaling["original_context"])
        if "attn_factor" in rope_scaling:
            writer.add_rope_scaling_attn_factors(rope_scaling["attn_factor"])


def _padded(tokenizer, count):
    """The tokenizer with ``count`` more tokens, ``[PAD<id>]`` user-defined ones, at the end."""
    if not count:
        return tokenizer
    entries = []
    for key, value, vtype, sub_type in tokenizer.entries:
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [f"[PAD{i}]" for i in range(len(value), len(value) + count)]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [TOKEN_USER_DEFINED] * count
        entries.append((key, value, vtype, sub_type))
    return Tokenizer(entries, vocab_size=tokenizer.vocab_size + count)
