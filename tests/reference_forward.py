"""A pure-numpy forward pass of every architecture llambda runs, written from the math.

Nothing here uses llambda: the GGUF is read with the `gguf` package's own
reader, every tensor is dequantized with `gguf.quants.dequantize`, and the
graph is the one each model's published description gives (and llama.cpp
runs for its GGUF architecture name):

    x = token_embd[ids] * embed_scale                  gemma3: sqrt(dim)
    per layer:
        h = RMSNorm(x) * attn_norm
        q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv    (W stored [out, in]; biases
                                                       where the file has them: qwen2;
                                                       phi3 stores [Wq; Wk; Wv] as one matrix)
        q, k = RMSNorm(q_head) * q_norm, ... k          per head, where the file has
                                                       attn_q_norm / attn_k_norm (qwen3, gemma3)
        q, k = RoPE(q), RoPE(k)                        llama: adjacent pairs; the others:
                                                       the two halves of a head (NeoX)
        a = softmax(scale q k^T + causal mask [+ window]) v      (GQA)
        o = a Wo^T
        x = x + o, or x + RMSNorm(o) * post_attention_norm     (gemma3)
        h = RMSNorm(x) * ffn_norm
        f = (act(h Wgate^T) * (h Wup^T)) Wdown^T       act: SiLU; gemma3: GELU (tanh form);
                                                       phi3 stores [Wgate; Wup] as one ffn_up
        x = x + f, or x + RMSNorm(f) * post_ffw_norm   (gemma3)
    logits = (RMSNorm(x) * output_norm) Wout^T     (Wout = token_embd when tied)
             then c tanh(logits / c) with a final_logit_softcapping c

Gemma 3 (Gemma 3 technical report; Hugging Face's Gemma3 modeling code):
RMSNorm multiplies by (1 + w), and GGUF stores 1 + w already, so the plain norm
above is right for the file's weights. Five of every six layers are local:
they attend only to the last sliding_window positions (keys p - W < j <= p)
and rotate with base 10000; every sixth layer (5, 11, ...) is global, with
rope.freq_base. Queries are scaled by query_pre_attn_scalar^-1/2, which the
published configs set to head_dim, except the 27B (62 layers): dim / n_head.

RoPE scaling as the metadata declares it: linear divides positions by the
factor; YaRN (Peng et al. 2023) interpolates only the low frequencies (a ramp
between the dimensions that turn fewer than beta_slow = 1 and more than
beta_fast = 32 times over the original context) and scales the rotation's
magnitude by 1 + 0.1 ln(factor). rope.scaling.attn_factor scales it too.
Llama 3's rope_freqs and Phi-3's rope_factors_short/long (long when the
context exceeds the original one) divide the frequencies.

Weights are float32; matmuls run in float32 (BLAS), reductions (RMS, softmax)
in float64. ``bf16_activations=True`` rounds the input of every product with a
BF16 matrix to bf16 (nearest even), as llama.cpp's bf16 dot product and llambda's
``vdpbf16ps`` path (LLAMBDA_BF16_MATH=bf16) do. Use:

    logits = reference_logits(path, ids)           # [len(ids), vocab], prefill from 0
    model = ReferenceModel(path)
    model.prefill(ids[:-1]); model.step(ids[-1])   # same last row, via the KV cache
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import gguf

__all__ = ["ReferenceConfig", "ReferenceWeights", "ReferenceModel", "reference_logits",
           "load_reference_weights"]


# ----------------------------------------------------------------- config ---

# What each architecture's published description fixes (the rest is in the file).
_ARCHITECTURES = {
    "llama": dict(rope_style="pairs", activation="silu"),
    "qwen2": dict(rope_style="halves", activation="silu"),
    "qwen3": dict(rope_style="halves", activation="silu"),
    "phi3": dict(rope_style="halves", activation="silu"),
    "gemma3": dict(rope_style="halves", activation="gelu", embed_sqrt_dim=True, local_every=6,
                   local_rope_base=10000.0),
}

YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


@dataclass(frozen=True)
class ReferenceConfig:
    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_ctx: int
    rms_eps: float
    rope_base: float
    n_rot: int               # leading dims of each head that RoPE rotates
    rope_freq_scale: float   # positions are multiplied by this (1 / linear factor)
    arch: str = "llama"
    rope_style: str = "pairs"        # "pairs": (x[2i], x[2i+1]); "halves": (x[i], x[i + n_rot/2])
    activation: str = "silu"         # "silu" or "gelu" (tanh approximation)
    embed_scale: float = 1.0
    attention_scale: float | None = None          # None: 1 / sqrt(head_dim)
    windows: tuple | None = None     # per layer: sliding window (0 = global); None: all global
    layer_rope_base: tuple | None = None          # per layer; None: rope_base everywhere
    layer_freq_scale: tuple | None = None         # per layer; None: rope_freq_scale everywhere
    yarn: bool = False
    rope_orig_ctx: int = 0           # the context YaRN (and Phi-3's long factors) stretch from
    rope_attn_factor: float = 1.0    # magnitude of the rotation (before YaRN's own)
    logit_softcap: float = 0.0

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_base(self, i):
        return self.layer_rope_base[i] if self.layer_rope_base else self.rope_base

    def layer_scale(self, i):
        return self.layer_freq_scale[i] if self.layer_freq_scale else self.rope_freq_scale

    def window(self, i):
        return self.windows[i] if self.windows else 0


def _read_config(reader: gguf.GGUFReader, vocab_size: int) -> ReferenceConfig:
    arch = reader.fields["general.architecture"].contents()
    if arch not in _ARCHITECTURES:
        raise ValueError(f"the reference runs {', '.join(_ARCHITECTURES)} models, this one is {arch!r}")
    spec = _ARCHITECTURES[arch]

    def value(key, default=None):
        field = reader.fields.get(f"{arch}.{key}")
        if field is None:
            if default is None:
                raise ValueError(f"GGUF has no {arch}.{key!r}")
            return default
        return field.contents()

    dim = int(value("embedding_length"))
    n_head = int(value("attention.head_count"))
    n_layer = int(value("block_count"))
    head_dim = int(value("attention.key_length", dim // n_head))
    n_ctx = int(value("context_length"))
    scaling = value("rope.scaling.type", "linear")
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise NotImplementedError(f"RoPE scaling {scaling!r} is not in the reference")
    factor = float(value("rope.scaling.factor", 0.0))
    freq_scale = 1.0 if scaling == "none" or factor == 0.0 else 1.0 / factor
    rope_base = float(value("rope.freq_base", 10000.0))

    windows, bases, scales = None, None, None
    window = int(value("attention.sliding_window", 0)) if "local_every" in spec else 0
    if window > 0:
        every = int(value("attention.sliding_window_pattern", spec["local_every"]))
        local = [layer % every != every - 1 for layer in range(n_layer)]
        windows = tuple(window if is_local else 0 for is_local in local)
        local_base = float(value("rope.freq_base_swa", spec["local_rope_base"]))
        bases = tuple(local_base if is_local else rope_base for is_local in local)
        scales = tuple(1.0 if is_local else freq_scale for is_local in local)
    attention_scale = None
    if arch == "gemma3":      # query_pre_attn_scalar ** -0.5, from the published configs
        attention_scale = (dim / n_head if n_layer == 62 else head_dim) ** -0.5
    softcap = reader.fields.get(f"{arch}.final_logit_softcapping")
    return ReferenceConfig(
        n_layer=n_layer, dim=dim, n_head=n_head,
        n_kv_head=int(value("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        ffn_dim=int(value("feed_forward_length")),
        vocab_size=vocab_size,
        n_ctx=n_ctx,
        rms_eps=float(value("attention.layer_norm_rms_epsilon")),
        rope_base=rope_base,
        n_rot=int(value("rope.dimension_count", head_dim)),
        rope_freq_scale=freq_scale,
        arch=arch, rope_style=spec["rope_style"], activation=spec["activation"],
        embed_scale=math.sqrt(dim) if spec.get("embed_sqrt_dim") else 1.0,
        attention_scale=attention_scale, windows=windows, layer_rope_base=bases, layer_freq_scale=scales,
        yarn=scaling == "yarn" and freq_scale != 1.0,
        rope_orig_ctx=int(value("rope.scaling.original_context_length", n_ctx)),
        rope_attn_factor=float(value("rope.scaling.attn_factor", 1.0)),
        logit_softcap=float(softcap.contents()) if softcap is not None else 0.0,
    )


# ---------------------------------------------------------------- weights ---

@dataclass
class LayerWeights:
    attn_norm: np.ndarray   # [dim]
    wq: np.ndarray          # [n_head * head_dim, dim]
    wk: np.ndarray          # [n_kv_head * head_dim, dim]
    wv: np.ndarray          # [n_kv_head * head_dim, dim]
    wo: np.ndarray          # [dim, n_head * head_dim]
    ffn_norm: np.ndarray    # [dim]
    w_gate: np.ndarray      # [ffn_dim, dim]
    w_up: np.ndarray        # [ffn_dim, dim]
    w_down: np.ndarray      # [dim, ffn_dim]
    biases: dict            # optional "attn_q" / "attn_k" / "attn_v" / "attn_output" biases
    norms: dict = None      # optional "attn_q_norm", "attn_k_norm" [head_dim],
                            # "post_attention_norm", "post_ffw_norm" [dim]


@dataclass
class ReferenceWeights:
    config: ReferenceConfig
    token_embd: np.ndarray          # [vocab, dim]
    layers: list[LayerWeights]
    output_norm: np.ndarray         # [dim]
    output: np.ndarray              # [vocab, dim]; the same array as token_embd when tied
    tied: bool
    rope_freq_factors: np.ndarray | None   # [n_rot / 2] divisors of RoPE frequencies (Llama 3)
    rope_factors_long: np.ndarray | None = None    # Phi-3: the divisors beyond the original context
    rope_factors_short: np.ndarray | None = None   # Phi-3: within it

    @property
    def nbytes(self) -> int:
        arrays = [self.token_embd, self.output_norm]
        if not self.tied:
            arrays.append(self.output)
        for layer in self.layers:
            arrays += [layer.attn_norm, layer.wq, layer.wk, layer.wv, layer.wo, layer.ffn_norm,
                       layer.w_gate, layer.w_up, layer.w_down, *layer.biases.values(),
                       *(layer.norms or {}).values()]
        return sum(array.nbytes for array in arrays)


class BF16Matrix(np.ndarray):
    """A matrix dequantized from a BF16 tensor: an ndarray that says where it came from."""


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in numpy order: a 2-D weight is [out, in].

    GGUF lists dimensions fastest-first (ne0 = in), so the numpy shape is the
    reverse of tensor.shape. A BF16 matrix comes back as a BF16Matrix.
    """
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a view of the file's memory map: own the data instead.
    values = np.array(values, dtype=np.float32, copy=True)
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{tensor.name}: dequantized {values.size} values for shape {shape}")
    values = values.reshape(shape)
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16 and len(shape) == 2:
        return values.view(BF16Matrix)
    return values


def _read_weights(gguf_path: str) -> ReferenceWeights:
    reader = gguf.GGUFReader(gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    def get(name):
        if name not in tensors:
            raise ValueError(f"{gguf_path}: missing tensor {name!r}")
        return _dequantized(tensors[name])

    def optional(name):
        return _dequantized(tensors[name]) if name in tensors else None

    token_embd = get("token_embd.weight")
    config = _read_config(reader, vocab_size=token_embd.shape[0])
    q_dim, kv_dim = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    layers = []
    for i in range(config.n_layer):
        blk = f"blk.{i}"
        biases = {part: _dequantized(tensors[f"{blk}.{part}.bias"])
                  for part in ("attn_q", "attn_k", "attn_v", "attn_output")
                  if f"{blk}.{part}.bias" in tensors}
        norms = {part: _dequantized(tensors[f"{blk}.{part}.weight"])
                 for part in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")
                 if f"{blk}.{part}.weight" in tensors}
        if f"{blk}.attn_qkv.weight" in tensors:     # Phi-3: rows [Wq; Wk; Wv]
            qkv = get(f"{blk}.attn_qkv.weight")
            wq, wk, wv = qkv[:q_dim], qkv[q_dim:q_dim + kv_dim], qkv[q_dim + kv_dim:]
        else:
            wq, wk, wv = get(f"{blk}.attn_q.weight"), get(f"{blk}.attn_k.weight"), get(f"{blk}.attn_v.weight")
        w_up = get(f"{blk}.ffn_up.weight")
        if f"{blk}.ffn_gate.weight" in tensors:
            w_gate = get(f"{blk}.ffn_gate.weight")
        else:                                        # Phi-3: ffn_up rows are [Wgate; Wup]
            w_gate, w_up = w_up[:config.ffn_dim], w_up[config.ffn_dim:]
        layers.append(LayerWeights(
            attn_norm=get(f"{blk}.attn_norm.weight"), wq=wq, wk=wk, wv=wv,
            wo=get(f"{blk}.attn_output.weight"), ffn_norm=get(f"{blk}.ffn_norm.weight"),
            w_gate=w_gate, w_up=w_up, w_down=get(f"{blk}.ffn_down.weight"), biases=biases, norms=norms))
    tied = "output.weight" not in tensors
    weights = ReferenceWeights(
        config=config, token_embd=token_embd, layers=layers,
        output_norm=get("output_norm.weight"),
        output=token_embd if tied else get("output.weight"), tied=tied,
        rope_freq_factors=optional("rope_freqs.weight"),
        rope_factors_long=optional("rope_factors_long.weight"),
        rope_factors_short=optional("rope_factors_short.weight"))
    _check_shapes(weights)
    return weights


def _check_shapes(weights: ReferenceWeights) -> None:
    c = weights.config
    q_dim, kv_dim = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    expected = {"wq": (q_dim, c.dim), "wk": (kv_dim, c.dim), "wv": (kv_dim, c.dim),
                "wo": (c.dim, q_dim), "w_gate": (c.ffn_dim, c.dim), "w_up": (c.ffn_dim, c.dim),
                "w_down": (c.dim, c.ffn_dim), "attn_norm": (c.dim,), "ffn_norm": (c.dim,)}
    for i, layer in enumerate(weights.layers):
        for name, shape in expected.items():
            if getattr(layer, name).shape != shape:
                raise ValueError(f"layer {i} {name}: shape {getattr(layer, name).shape}, "
                                 f"expected {shape}")
    if weights.output.shape != (c.vocab_size, c.dim):
        raise ValueError(f"LM head shape {weights.output.shape}, expected {(c.vocab_size, c.dim)}")
    if c.n_head % c.n_kv_head or c.n_rot % 2 or c.n_rot > c.head_dim:
        raise ValueError(f"unsupported head layout {c}")


# Dequantized weights cost 4 bytes per parameter; tests ask for the same file
# many times. Keep recently used models while they fit in this budget (the
# newest one is kept whatever its size).
_CACHE_BUDGET_BYTES = int(os.environ.get("LLAMBDA_REF_CACHE_BYTES", 3 << 30))
_cache: OrderedDict[tuple, ReferenceWeights] = OrderedDict()


def load_reference_weights(gguf_path) -> ReferenceWeights:
    """The dequantized model, cached by file identity (path, size, mtime):
    rewriting a file under the same name is seen."""
    path = os.path.realpath(os.fspath(gguf_path))
    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    weights = _read_weights(path)
    _cache[key] = weights
    while len(_cache) > 1 and sum(w.nbytes for w in _cache.values()) > _CACHE_BUDGET_BYTES:
        _cache.popitem(last=False)
    return weights


# ---------------------------------------------------------------- the math ---

def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    mean_square = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x / np.sqrt(mean_square + eps)).astype(np.float32) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), written with tanh so that no exp() can overflow.
    x64 = x.astype(np.float64)
    return (x64 * 0.5 * (1.0 + np.tanh(0.5 * x64))).astype(np.float32)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh approximation (Hendrycks & Gimpel), as Gemma uses it."""
    x64 = x.astype(np.float64)
    inner = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)
    return (0.5 * x64 * (1.0 + np.tanh(inner))).astype(np.float32)


_ACTIVATIONS = {"silu": _silu, "gelu": _gelu_tanh}


def _yarn_ramp(config: ReferenceConfig, base: float) -> np.ndarray:
    """Per rotation pair i, how much of it keeps its unscaled frequency (1) rather than
    being interpolated (0): 1 below the pair that turns beta_fast times over the original
    context, 0 above the one that turns beta_slow times, linear between."""
    def pair_turning(turns):     # the (fractional) pair index whose wavelength fits `turns` times
        return config.n_rot * math.log(config.rope_orig_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))
    low = max(0.0, math.floor(pair_turning(YARN_BETA_FAST)))
    high = min(config.n_rot - 1.0, math.ceil(pair_turning(YARN_BETA_SLOW)))
    i = np.arange(config.n_rot // 2, dtype=np.float64)
    return 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)


def _rope(x: np.ndarray, positions: np.ndarray, config: ReferenceConfig,
          freq_factors: np.ndarray | None, layer: int = 0) -> np.ndarray:
    """Rotate the first n_rot dims of every head by pos * base^(-2i/n_rot) (per pair i).

    llama: llama.cpp's "normal" RoPE, pairs (x[2i], x[2i+1]) -- the GGUF converter
    permutes the rows of Wq and Wk so that HF's rotate-half pairs land next to each
    other. The other architectures rotate (x[i], x[i + n_rot/2]) (NeoX style).
    x: [T, heads, head_dim].
    """
    half = config.n_rot // 2
    base, scale = config.layer_base(layer), config.layer_scale(layer)
    inv_freq = base ** (-2.0 * np.arange(half, dtype=np.float64) / config.n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    pos = positions.astype(np.float64)[:, None]
    angles = pos * scale * inv_freq[None, :]
    magnitude = config.rope_attn_factor
    if config.yarn:
        keep = _yarn_ramp(config, base)
        angles = angles * (1.0 - keep) + (pos * inv_freq[None, :]) * keep
        magnitude *= 1.0 + 0.1 * math.log(1.0 / scale)
    cos = np.cos(angles)[:, None, :] * magnitude   # [T, 1, half]: the same for every head
    sin = np.sin(angles)[:, None, :] * magnitude
    if config.rope_style == "pairs":
        first, second = slice(0, config.n_rot, 2), slice(1, config.n_rot, 2)
    else:
        first, second = slice(0, half), slice(half, config.n_rot)
    a, b = x[..., first].astype(np.float64), x[..., second].astype(np.float64)
    out = x.copy()
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """x (float32, finite) rounded to the nearest bf16, ties to even, as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
            bf16_activations: bool = False) -> np.ndarray:
    if bf16_activations and isinstance(weight, BF16Matrix):
        x = _round_bf16(x)
    y = x @ np.asarray(weight).T
    return y if bias is None else y + bias


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int,
               config: ReferenceConfig, window: int = 0) -> np.ndarray:
    """Causal grouped-query attention of T new queries over all S cached keys.

    q: [T, n_head, hd] at positions first_pos .. first_pos+T-1; keys, values:
    [S, n_kv_head, hd] at positions 0 .. S-1. Query head h reads kv head
    h // (n_head / n_kv_head). With a window W > 0 the query at p sees only keys
    p - W < j <= p. Returns [T, n_head * hd].
    """
    n_tokens, n_keys = q.shape[0], keys.shape[0]
    group = config.n_head // config.n_kv_head
    keys = np.repeat(keys, group, axis=1)        # [S, n_head, hd]
    values = np.repeat(values, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, keys, dtype=np.float64) * config.scale
    query_pos = first_pos + np.arange(n_tokens)
    key_pos = np.arange(n_keys)[None, :]
    hidden = key_pos > query_pos[:, None]                      # [T, S]: the future
    if window > 0:
        hidden |= key_pos <= query_pos[:, None] - window       # beyond the window
    scores[:, hidden] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, values.astype(np.float64))
    return out.reshape(n_tokens, config.n_head * config.head_dim).astype(np.float32)


class ReferenceModel:
    """The reference forward with a KV cache: prefill() and step() continue a sequence.

    ``n_ctx`` (default: the trained context) only chooses Phi-3's long or short RoPE
    factors, as llama.cpp does from its context size."""

    def __init__(self, gguf_path, n_ctx=None, bf16_activations=False):
        self.bf16_activations = bf16_activations
        self.weights = load_reference_weights(gguf_path)
        self.config = c = self.weights.config
        w = self.weights
        self.freq_factors = w.rope_freq_factors
        if self.freq_factors is None and w.rope_factors_short is not None:
            long = (n_ctx or c.n_ctx) > c.rope_orig_ctx
            self.freq_factors = w.rope_factors_long if long else w.rope_factors_short
        self.reset()

    def reset(self) -> None:
        """Forget the sequence: the next token is at position 0."""
        c = self.config
        empty = np.zeros((0, c.n_kv_head, c.head_dim), dtype=np.float32)
        self._keys = [empty] * c.n_layer
        self._values = [empty] * c.n_layer

    @property
    def position(self) -> int:
        """How many tokens the cache holds: the position of the next token."""
        return self._keys[0].shape[0]

    def prefill(self, ids) -> np.ndarray:
        """Append tokens to the sequence; returns their logits [len(ids), vocab] (float32)."""
        c = self.config
        logits = self._linear(self.hidden(ids), self.weights.output)
        if c.logit_softcap > 0:
            logits = (c.logit_softcap * np.tanh(logits.astype(np.float64) / c.logit_softcap)).astype(np.float32)
        return logits

    def hidden(self, ids) -> np.ndarray:
        """Append tokens to the sequence; returns their final-norm output [len(ids), dim]
        (float32): the rows the LM head multiplies, which llama.cpp's embeddings pool."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        c = self.config
        if ids.size == 0:
            return np.zeros((0, c.dim), dtype=np.float32)
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"token ids must be in [0, {c.vocab_size}), got {ids.min()}..{ids.max()}")
        first_pos = self.position
        positions = first_pos + np.arange(ids.size)
        x = np.asarray(self.weights.token_embd)[ids] * np.float32(c.embed_scale)
        for i, layer in enumerate(self.weights.layers):
            x = x + self._post_norm(layer, "post_attention_norm",
                                    self._attention_block(i, layer, x, positions, first_pos))
            x = x + self._post_norm(layer, "post_ffw_norm", self._ffn_block(layer, x))
        return _rms_norm(x, self.weights.output_norm, c.rms_eps)

    def step(self, token_id: int) -> np.ndarray:
        """One decode step: the logits [vocab] of `token_id` at the next position."""
        return self.prefill([token_id])[0]

    def _post_norm(self, layer, name, out):
        norms = layer.norms or {}
        return _rms_norm(out, norms[name], self.config.rms_eps) if name in norms else out

    def _head_norm(self, layer, name, heads):
        norms = layer.norms or {}
        return _rms_norm(heads, norms[name], self.config.rms_eps) if name in norms else heads

    def _attention_block(self, i, layer, x, positions, first_pos):
        c = self.config
        h = _rms_norm(x, layer.attn_norm, c.rms_eps)
        n_tokens = x.shape[0]
        q = self._linear(h, layer.wq, layer.biases.get("attn_q")).reshape(n_tokens, c.n_head, c.head_dim)
        k = self._linear(h, layer.wk, layer.biases.get("attn_k")).reshape(n_tokens, c.n_kv_head, c.head_dim)
        v = self._linear(h, layer.wv, layer.biases.get("attn_v")).reshape(n_tokens, c.n_kv_head, c.head_dim)
        q = _rope(self._head_norm(layer, "attn_q_norm", q), positions, c, self.freq_factors, i)
        k = _rope(self._head_norm(layer, "attn_k_norm", k), positions, c, self.freq_factors, i)
        self._keys[i] = np.concatenate([self._keys[i], k])
        self._values[i] = np.concatenate([self._values[i], v])
        attended = _attention(q, self._keys[i], self._values[i], first_pos, c, c.window(i))
        return self._linear(attended, layer.wo, layer.biases.get("attn_output"))

    def _ffn_block(self, layer, x):
        h = _rms_norm(x, layer.ffn_norm, self.config.rms_eps)
        act = _ACTIVATIONS[self.config.activation]
        return self._linear(act(self._linear(h, layer.w_gate)) * self._linear(h, layer.w_up), layer.w_down)

    def _linear(self, x, weight, bias=None):
        return _linear(x, weight, bias, bf16_activations=self.bf16_activations)


def reference_logits(gguf_path, ids, n_ctx=None, bf16_activations=False) -> np.ndarray:
    """Logits [len(ids), vocab] (float32) of a full causal prefill of `ids` from position 0."""
    return ReferenceModel(gguf_path, n_ctx=n_ctx, bf16_activations=bf16_activations).prefill(ids)
