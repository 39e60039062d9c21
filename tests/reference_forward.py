"""A pure-numpy LLaMA forward pass, written from the math, to check llambda against.

Nothing here uses llambda: the GGUF is read with the `gguf` package's own
reader, every tensor is dequantized with `gguf.quants.dequantize`, and the
graph below is the one llama.cpp runs for GGUF "llama" models:

    x = token_embd[ids]
    per layer:
        h = RMSNorm(x) * attn_norm
        q, k, v = h Wq^T, h Wk^T, h Wv^T          (W stored [out, in])
        q, k = RoPE(q), RoPE(k)                    (adjacent pairs, see _rope)
        a = softmax(q k^T / sqrt(head_dim) + causal mask) v    (GQA)
        x = x + a Wo^T
        h = RMSNorm(x) * ffn_norm
        x = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
    logits = (RMSNorm(x) * output_norm) Wout^T     (Wout = token_embd when tied)

Weights are float32; matmuls run in float32 (BLAS), reductions (RMS, softmax)
in float64. Use:

    logits = reference_logits(path, ids)           # [len(ids), vocab], prefill from 0
    model = ReferenceModel(path)
    model.prefill(ids[:-1]); model.step(ids[-1])   # same last row, via the KV cache
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import gguf

__all__ = ["ReferenceConfig", "ReferenceWeights", "ReferenceModel", "reference_logits",
           "load_reference_weights"]


# ----------------------------------------------------------------- config ---

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
    rope_freq_scale: float   # linear RoPE scaling: positions are multiplied by this


def _read_config(reader: gguf.GGUFReader, vocab_size: int) -> ReferenceConfig:
    def value(key, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise ValueError(f"GGUF has no {key!r}")
            return default
        return field.contents()

    arch = value("general.architecture")
    if arch != "llama":
        raise ValueError(f"the reference runs LLaMA-architecture models, this one is {arch!r}")
    dim = int(value("llama.embedding_length"))
    n_head = int(value("llama.attention.head_count"))
    head_dim = int(value("llama.attention.key_length", dim // n_head))
    scaling = value("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise NotImplementedError(f"RoPE scaling {scaling!r} is not in the reference")
    freq_scale = 1.0
    if scaling == "linear":
        freq_scale = 1.0 / float(value("llama.rope.scaling.factor"))
    return ReferenceConfig(
        n_layer=int(value("llama.block_count")),
        dim=dim,
        n_head=n_head,
        n_kv_head=int(value("llama.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        ffn_dim=int(value("llama.feed_forward_length")),
        vocab_size=vocab_size,
        n_ctx=int(value("llama.context_length")),
        rms_eps=float(value("llama.attention.layer_norm_rms_epsilon")),
        rope_base=float(value("llama.rope.freq_base", 10000.0)),
        n_rot=int(value("llama.rope.dimension_count", head_dim)),
        rope_freq_scale=freq_scale,
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


@dataclass
class ReferenceWeights:
    config: ReferenceConfig
    token_embd: np.ndarray          # [vocab, dim]
    layers: list[LayerWeights]
    output_norm: np.ndarray         # [dim]
    output: np.ndarray              # [vocab, dim]; the same array as token_embd when tied
    tied: bool
    rope_freq_factors: np.ndarray | None   # [n_rot / 2] divisors of RoPE frequencies (Llama 3)

    @property
    def nbytes(self) -> int:
        arrays = [self.token_embd, self.output_norm]
        if not self.tied:
            arrays.append(self.output)
        for layer in self.layers:
            arrays += [layer.attn_norm, layer.wq, layer.wk, layer.wv, layer.wo, layer.ffn_norm,
                       layer.w_gate, layer.w_up, layer.w_down, *layer.biases.values()]
        return sum(array.nbytes for array in arrays)


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in numpy order: a 2-D weight is [out, in].

    GGUF lists dimensions fastest-first (ne0 = in), so the numpy shape is the
    reverse of tensor.shape.
    """
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a view of the file's memory map: own the data instead.
    values = np.array(values, dtype=np.float32, copy=True)
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{tensor.name}: dequantized {values.size} values for shape {shape}")
    return values.reshape(shape)


def _read_weights(gguf_path: str) -> ReferenceWeights:
    reader = gguf.GGUFReader(gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    def get(name):
        if name not in tensors:
            raise ValueError(f"{gguf_path}: missing tensor {name!r}")
        return _dequantized(tensors[name])

    token_embd = get("token_embd.weight")
    config = _read_config(reader, vocab_size=token_embd.shape[0])
    layers = []
    for i in range(config.n_layer):
        blk = f"blk.{i}"
        biases = {part: _dequantized(tensors[f"{blk}.{part}.bias"])
                  for part in ("attn_q", "attn_k", "attn_v", "attn_output")
                  if f"{blk}.{part}.bias" in tensors}
        layers.append(LayerWeights(
            attn_norm=get(f"{blk}.attn_norm.weight"),
            wq=get(f"{blk}.attn_q.weight"), wk=get(f"{blk}.attn_k.weight"),
            wv=get(f"{blk}.attn_v.weight"), wo=get(f"{blk}.attn_output.weight"),
            ffn_norm=get(f"{blk}.ffn_norm.weight"),
            w_gate=get(f"{blk}.ffn_gate.weight"), w_up=get(f"{blk}.ffn_up.weight"),
            w_down=get(f"{blk}.ffn_down.weight"), biases=biases))
    tied = "output.weight" not in tensors
    weights = ReferenceWeights(
        config=config, token_embd=token_embd, layers=layers,
        output_norm=get("output_norm.weight"),
        output=token_embd if tied else get("output.weight"), tied=tied,
        rope_freq_factors=get("rope_freqs.weight") if "rope_freqs.weight" in tensors else None)
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


def _rope(x: np.ndarray, positions: np.ndarray, config: ReferenceConfig,
          freq_factors: np.ndarray | None) -> np.ndarray:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of every head by pos * base^(-2i/n_rot).

    This is llama.cpp's "normal" RoPE, which GGUF llama models use: the
    converters permute the rows of Wq and Wk so that HF's rotate-half pairs
    (i, i + head_dim/2) land next to each other. Only the first n_rot dims of a
    head rotate. x: [T, heads, head_dim].
    """
    half = config.n_rot // 2
    inv_freq = config.rope_base ** (-2.0 * np.arange(half, dtype=np.float64) / config.n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = (positions.astype(np.float64) * config.rope_freq_scale)[:, None] * inv_freq[None, :]
    cos = np.cos(angles)[:, None, :]   # [T, 1, half]: the same for every head
    sin = np.sin(angles)[:, None, :]
    even = x[..., 0:config.n_rot:2].astype(np.float64)
    odd = x[..., 1:config.n_rot:2].astype(np.float64)
    out = x.copy()
    out[..., 0:config.n_rot:2] = even * cos - odd * sin
    out[..., 1:config.n_rot:2] = even * sin + odd * cos
    return out


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = x @ weight.T
    return y if bias is None else y + bias


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int,
               config: ReferenceConfig) -> np.ndarray:
    """Causal grouped-query attention of T new queries over all S cached keys.

    q: [T, n_head, hd] at positions first_pos .. first_pos+T-1; keys, values:
    [S, n_kv_head, hd] at positions 0 .. S-1. Query head h reads kv head
    h // (n_head / n_kv_head). Returns [T, n_head * hd].
    """
    n_tokens, n_keys = q.shape[0], keys.shape[0]
    group = config.n_head // config.n_kv_head
    keys = np.repeat(keys, group, axis=1)        # [S, n_head, hd]
    values = np.repeat(values, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, keys, dtype=np.float64) / np.sqrt(config.head_dim)
    query_pos = first_pos + np.arange(n_tokens)
    future = np.arange(n_keys)[None, :] > query_pos[:, None]   # [T, S]
    scores[:, future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, values.astype(np.float64))
    return out.reshape(n_tokens, config.n_head * config.head_dim).astype(np.float32)


class ReferenceModel:
    """The reference forward with a KV cache: prefill() and step() continue a sequence."""

    def __init__(self, gguf_path):
        self.weights = load_reference_weights(gguf_path)
        self.config = self.weights.config
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
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        c = self.config
        if ids.size == 0:
            return np.zeros((0, c.vocab_size), dtype=np.float32)
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"token ids must be in [0, {c.vocab_size}), got {ids.min()}..{ids.max()}")
        first_pos = self.position
        positions = first_pos + np.arange(ids.size)
        x = self.weights.token_embd[ids]
        for i, layer in enumerate(self.weights.layers):
            x = x + self._attention_block(i, layer, x, positions, first_pos)
            x = x + self._ffn_block(layer, x)
        x = _rms_norm(x, self.weights.output_norm, c.rms_eps)
        return _linear(x, self.weights.output)

    def step(self, token_id: int) -> np.ndarray:
        """One decode step: the logits [vocab] of `token_id` at the next position."""
        return self.prefill([token_id])[0]

    def _attention_block(self, i, layer, x, positions, first_pos):
        c = self.config
        h = _rms_norm(x, layer.attn_norm, c.rms_eps)
        n_tokens = x.shape[0]
        q = _linear(h, layer.wq, layer.biases.get("attn_q")).reshape(n_tokens, c.n_head, c.head_dim)
        k = _linear(h, layer.wk, layer.biases.get("attn_k")).reshape(n_tokens, c.n_kv_head, c.head_dim)
        v = _linear(h, layer.wv, layer.biases.get("attn_v")).reshape(n_tokens, c.n_kv_head, c.head_dim)
        q = _rope(q, positions, c, self.weights.rope_freq_factors)
        k = _rope(k, positions, c, self.weights.rope_freq_factors)
        self._keys[i] = np.concatenate([self._keys[i], k])
        self._values[i] = np.concatenate([self._values[i], v])
        attended = _attention(q, self._keys[i], self._values[i], first_pos, c)
        return _linear(attended, layer.wo, layer.biases.get("attn_output"))

    def _ffn_block(self, layer, x):
        h = _rms_norm(x, layer.ffn_norm, self.config.rms_eps)
        return _linear(_silu(_linear(h, layer.w_gate)) * _linear(h, layer.w_up), layer.w_down)


def reference_logits(gguf_path, ids) -> np.ndarray:
    """Logits [len(ids), vocab] (float32) of a full causal prefill of `ids` from position 0."""
    return ReferenceModel(gguf_path).prefill(ids)
