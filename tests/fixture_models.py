"""Tiny random-weight GGUFs of every architecture and tensor type, from a seed.

These are the models llama.cpp judges llambda on (tests/bench/test_llamacpp_referee.py):
tools/record_llamacpp_logits.py ran llama.cpp on each once and stored its logits
with the sha256 of the file it ran and of its content (content_sha256); the test
regenerates the file from the same seed, checks the content sha256 (so a change
here is caught, not silently compared against logits of another model) and
compares llambda's logits to the stored ones.

Shapes are awkward on purpose but every dot-product length (dim, ffn_dim,
n_head * head_dim) is a multiple of 256, so the same model exists in every type,
K-quants included: odd head counts (gemma3: 3 heads of 256), GQA ratios 1, 3, 4,
a query width unlike dim (qwen3, gemma3), untied LM head with Llama 3
rope_freqs (llama), Q/K/V biases (qwen2), per-head Q/K norms (qwen3, gemma3),
fused QKV and gate/up (phi3), six layers so that gemma3's default pattern of five
sliding-window layers and one global layer appears, with a window (4) shorter
than the recorded prompt.

Float and legacy-quant tensors are drawn from a normal distribution and
quantized by `gguf.quants.quantize`. gguf cannot quantize K-quants, so those are
random but valid raw super-blocks (random quant bytes and sub-block scales,
positive f16 super-block scales at the offsets ggml-common.h gives), rescaled
so each tensor has the standard deviation the plan asks for.

Everything is a pure function of (arch, type, seed): same inputs, same bytes.
The tensor names and weights are drawn here rather than through tests/synth.py
so that a change to the benchmark generator does not invalidate the recorded
fixtures; the keys, the tokenizer and the file itself are written by
llambda/gguf/writer.py, whose key order the content sha256 pins (a change there
fails tests/bench/test_llamacpp_referee.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QType

from llambda.gguf.writer import FILE_TYPES, add_hparams, minimal_tokenizer, tensor_info, write_gguf

__all__ = ["ARCHS", "TYPES", "FixtureSpec", "fixture_spec", "write_fixture_model", "sha256_of",
           "content_sha256", "random_kquant_blocks"]

TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")

# One shape per architecture. head_dim is explicit (key_length) where the real
# family decouples it from dim / n_head.
ARCHS = {
    "llama": dict(n_layer=2, dim=256, n_head=8, n_kv_head=2, head_dim=32, ffn_dim=768,
                  rope_base=500000.0, rms_eps=1e-5, tied=False, rope_freqs=True),
    "qwen2": dict(n_layer=2, dim=256, n_head=4, n_kv_head=1, head_dim=64, ffn_dim=512,
                  rope_base=1000000.0, rms_eps=1e-6, tied=True, qkv_bias=True),
    "qwen3": dict(n_layer=2, dim=256, n_head=6, n_kv_head=2, head_dim=128, ffn_dim=512,
                  rope_base=1000000.0, rms_eps=1e-6, tied=True, qk_norm=True),
    "phi3": dict(n_layer=2, dim=256, n_head=4, n_kv_head=4, head_dim=64, ffn_dim=512,
                 rope_base=10000.0, rms_eps=1e-5, tied=False, fused=True),
    # Gemma multiplies the embedding by sqrt(dim) on the way in but not on the way
    # out (tied): a small embedding (std 1/32) keeps the input token's own logit
    # from dominating, a larger final norm gives the logits a spread of a few units.
    "gemma3": dict(n_layer=6, dim=256, n_head=3, n_kv_head=1, head_dim=256, ffn_dim=256,
                   rope_base=1000000.0, rms_eps=1e-6, tied=True, qk_norm=True,
                   post_norms=True, sliding_window=4, embed_std=1 / 32, output_norm_mean=3.0),
}

VOCAB_SIZE = 293        # the built-in tokenizer exactly: 3 specials + 256 bytes + 34 merges
N_CTX_TRAIN = 128
DEFAULT_SEED = 7


@dataclass(frozen=True)
class FixtureSpec:
    """Everything the file is a function of."""
    arch: str
    type_name: str
    seed: int
    hparams: dict = field(hash=False)

    def as_dict(self) -> dict:
        return {"arch": self.arch, "type": self.type_name, "seed": self.seed,
                "vocab_size": VOCAB_SIZE, "n_ctx_train": N_CTX_TRAIN, **self.hparams}


def fixture_spec(arch: str, type_name: str, seed: int = DEFAULT_SEED) -> FixtureSpec:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if type_name not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, got {type_name!r}")
    return FixtureSpec(arch, type_name, int(seed), dict(ARCHS[arch]))


def content_sha256(path) -> str:
    """sha256 of what the model is, not of how the file lays it out: every metadata
    key, type and value (in file order) and every tensor's name, type, shape and
    bytes. A new gguf writer that pads or orders differently keeps it; a changed
    value, tensor or quantizer does not."""
    reader = gguf.GGUFReader(path)
    digest = hashlib.sha256()
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):          # version and counts: the container's
            continue
        digest.update(repr((key, [int(t) for t in fld.types], fld.contents())).encode())
    for tensor in reader.tensors:
        digest.update(repr((tensor.name, int(tensor.tensor_type), [int(n) for n in tensor.shape])).encode())
        digest.update(np.ascontiguousarray(tensor.data).tobytes())
    return digest.hexdigest()


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- tensors ---

@dataclass(frozen=True)
class _Plan:
    name: str
    shape: tuple[int, ...]      # numpy order: [rows, cols] = [out, in]
    type_name: str
    std: float
    mean: float = 0.0


def _plans(spec: FixtureSpec) -> list[_Plan]:
    """Every tensor, with a scale that keeps activations near unit RMS (see tests/synth.py)."""
    h = spec.hparams
    t = spec.type_name
    dim, ffn, hd = h["dim"], h["ffn_dim"], h["head_dim"]
    q_dim, kv_dim = h["n_head"] * hd, h["n_kv_head"] * hd
    gain = 1.0 / np.sqrt(2.0 * h["n_layer"])
    head_std = 3.0 / np.sqrt(dim)
    embd_std = h.get("embed_std", head_std if h["tied"] else 1.0)
    plans = [_Plan("token_embd.weight", (VOCAB_SIZE, dim), t, std=embd_std)]
    if h.get("rope_freqs"):
        plans.append(_Plan("rope_freqs.weight", (hd // 2,), "F32", std=0.5, mean=3.0))
    for i in range(h["n_layer"]):
        b = f"blk.{i}"
        plans.append(_Plan(f"{b}.attn_norm.weight", (dim,), "F32", std=0.1, mean=1.0))
        if h.get("fused"):
            plans.append(_Plan(f"{b}.attn_qkv.weight", (q_dim + 2 * kv_dim, dim), t, std=dim ** -0.5))
        else:
            plans += [_Plan(f"{b}.attn_q.weight", (q_dim, dim), t, std=dim ** -0.5),
                      _Plan(f"{b}.attn_k.weight", (kv_dim, dim), t, std=dim ** -0.5),
                      _Plan(f"{b}.attn_v.weight", (kv_dim, dim), t, std=dim ** -0.5)]
        if h.get("qkv_bias"):
            plans += [_Plan(f"{b}.attn_q.bias", (q_dim,), "F32", std=0.5),
                      _Plan(f"{b}.attn_k.bias", (kv_dim,), "F32", std=0.5),
                      _Plan(f"{b}.attn_v.bias", (kv_dim,), "F32", std=0.5)]
        if h.get("qk_norm"):
            plans += [_Plan(f"{b}.attn_q_norm.weight", (hd,), "F32", std=0.1, mean=1.0),
                      _Plan(f"{b}.attn_k_norm.weight", (hd,), "F32", std=0.1, mean=1.0)]
        plans.append(_Plan(f"{b}.attn_output.weight", (dim, q_dim), t, std=q_dim ** -0.5 * gain))
        if h.get("post_norms"):
            plans.append(_Plan(f"{b}.post_attention_norm.weight", (dim,), "F32", std=0.1, mean=1.0))
        plans.append(_Plan(f"{b}.ffn_norm.weight", (dim,), "F32", std=0.1, mean=1.0))
        if h.get("fused"):
            plans.append(_Plan(f"{b}.ffn_up.weight", (2 * ffn, dim), t, std=dim ** -0.5))
        else:
            plans += [_Plan(f"{b}.ffn_gate.weight", (ffn, dim), t, std=dim ** -0.5),
                      _Plan(f"{b}.ffn_up.weight", (ffn, dim), t, std=dim ** -0.5)]
        plans.append(_Plan(f"{b}.ffn_down.weight", (dim, ffn), t, std=ffn ** -0.5 * gain * 2.0))
        if h.get("post_norms"):
            plans.append(_Plan(f"{b}.post_ffw_norm.weight", (dim,), "F32", std=0.1, mean=1.0))
    plans.append(_Plan("output_norm.weight", (dim,), "F32", std=0.1, mean=h.get("output_norm_mean", 1.0)))
    if not h["tied"]:
        plans.append(_Plan("output.weight", (VOCAB_SIZE, dim), t, std=head_std))
    return plans


def _draw(plan: _Plan, seed: int, index: int) -> np.ndarray:
    """The tensor in its GGUF storage form, from its own random stream (seed, index)."""
    rng = np.random.default_rng([seed, index])
    if plan.type_name in K_QUANTS:
        return random_kquant_blocks(plan.type_name, plan.shape[0], plan.shape[1], plan.std, rng)
    values = rng.standard_normal(plan.shape, dtype=np.float32) * np.float32(plan.std)
    values += np.float32(plan.mean)
    if plan.type_name == "F32":
        return values
    if plan.type_name == "F16":
        return values.astype(np.float16)
    return gguf.quants.quantize(values, QType[plan.type_name])


# -------------------------------------------------------------- K-quants ---

# Byte offsets of the f16 super-block scales (d, then dmin where the type has
# one) and the size of each 256-value super-block, from ggml-common.h.
_KQ_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# For the types with mins (x = d * sc * q - dmin * m): the mean of q over its
# range. dmin = mean_q * d and m = sc make every sub-block zero-mean.
_KQ_MEAN_Q = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


def random_kquant_blocks(type_name: str, rows: int, cols: int, std: float,
                         rng: np.random.Generator) -> np.ndarray:
    """Random valid K-quant super-blocks [rows, cols / 256 * block bytes] (uint8) whose
    dequantized values have standard deviation `std` (about zero mean).

    Quant bits and sub-block scales are random bytes (every bit pattern is a valid
    block); per-block d varies over [0.5, 1.5) of the tensor's scale. For the types
    with mins, the min of each sub-block equals its scale, so with dmin = mean(q) * d
    each sub-block is centred instead of carrying a random offset.
    """
    qtype = QType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{type_name} rows hold super-blocks of {block_size}: cols ({cols}) "
                         f"must be a multiple of {block_size}")
    n_blocks = rows * (cols // block_size)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    if type_name in ("Q4_K", "Q5_K"):
        # 12 scale bytes at 4..16: bytes 0-3 hold sc0-3 (+ high bits of sc4-7), bytes 4-7
        # the same for the mins, bytes 8-11 the low nibbles of sc4-7 | m4-7 << 4.
        scales = blocks[:, 4:16]
        scales[:, 4:8] = scales[:, 0:4]
        scales[:, 8:12] = (scales[:, 8:12] & 0x0F) * 0x11
    elif type_name == "Q2_K":
        # 16 scale bytes at 0..16: scale in the low nibble, min in the high one.
        blocks[:, 0:16] = (blocks[:, 0:16] & 0x0F) * 0x11
    d = rng.uniform(0.5, 1.5, n_blocks).astype(np.float32)
    _set_superblock_scales(blocks, type_name, d)
    # The values are linear in (d, dmin) together: measure, then rescale to std.
    measured = gguf.quants.dequantize(blocks, qtype).reshape(-1).astype(np.float64).std()
    _set_superblock_scales(blocks, type_name, d * np.float32(std / measured))
    return blocks.reshape(rows, (cols // block_size) * type_size)


def _set_superblock_scales(blocks: np.ndarray, type_name: str, d: np.ndarray) -> None:
    offsets = _KQ_SCALE_OFFSETS[type_name]
    d16 = d.astype(np.float16)
    blocks[:, offsets[0]:offsets[0] + 2] = d16.view(np.uint8).reshape(-1, 2)
    if len(offsets) == 2:
        dmin16 = (d16.astype(np.float32) * np.float32(_KQ_MEAN_Q[type_name])).astype(np.float16)
        blocks[:, offsets[1]:offsets[1] + 2] = dmin16.view(np.uint8).reshape(-1, 2)


# -------------------------------------------------------------- metadata ---

# K-quant files name the small mix (llama.cpp's _S file types).
_FILE_TYPES = dict(FILE_TYPES, Q4_K=gguf.LlamaFileType.MOSTLY_Q4_K_S, Q5_K=gguf.LlamaFileType.MOSTLY_Q5_K_S,
                   Q3_K=gguf.LlamaFileType.MOSTLY_Q3_K_S)


def _add_hparams(writer: gguf.GGUFWriter, spec: FixtureSpec) -> None:
    h = spec.hparams
    # No architecture in the name: llama.cpp keys vocabulary fix-ups on names
    # like "phi3" (and expects that family's special tokens then). No
    # sliding_window_pattern key, as in real Gemma 3 files: llama.cpp's default
    # (5 local layers, then 1 global) applies, and the local layers' RoPE base is
    # its default 10000.
    add_hparams(writer, name=f"llambda-fixture-{spec.type_name}-seed{spec.seed}", n_ctx=N_CTX_TRAIN,
                dim=h["dim"], n_layer=h["n_layer"], ffn_dim=h["ffn_dim"], n_head=h["n_head"],
                n_kv_head=h["n_kv_head"], head_dim=h["head_dim"], rope_dims=h["head_dim"],
                rope_base=h["rope_base"], rms_eps=h["rms_eps"], sliding_window=h.get("sliding_window"),
                vocab_size=VOCAB_SIZE, file_type=_FILE_TYPES[spec.type_name])


# ------------------------------------------------------------------ write ---

def write_fixture_model(path, arch: str, type_name: str, seed: int = DEFAULT_SEED) -> Path:
    """Write the (arch, type, seed) fixture GGUF to `path` (atomically) and return the path."""
    spec = fixture_spec(arch, type_name, seed)
    writer = gguf.GGUFWriter(path=None, arch=arch)
    _add_hparams(writer, spec)
    # A byte-level BPE vocabulary of exactly VOCAB_SIZE tokens: enough for llama.cpp
    # and llambda to load the file; the tests feed token ids directly.
    minimal_tokenizer(VOCAB_SIZE, bare=True).add_to(writer)
    plans = _plans(spec)
    arrays = [_draw(plan, spec.seed, index) for index, plan in enumerate(plans)]
    return write_gguf(path, writer, [tensor_info(p.name, p.shape, p.type_name) for p in plans], arrays)
