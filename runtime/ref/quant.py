"""numpy references: int8 activation quantization and quantized-weight GEMM, from the math.

``quantize_gguf`` (not a backend op) quantizes f32 rows to GGUF Q4_0 / Q4_1 /
Q8_0 bytes exactly as ggml's reference quantizers do; tests and synthetic
models use it to make GGUF-compatible weights without llama.cpp.
"""
import numpy as np

from .. import layouts

__all__ = ["quantize_q8", "qgemm"]

from ...codegen.contract import BLOCK


def _round_half_even(v):
    return np.rint(v)


def quantize_q8(x, qs, d, s):
    """Per 32-block: d = amax/127, q = round(x * (1/d)) in [-127, 127], s = d * sum(q).

    Rounds ties to even, like the kernel (GGUF rounds them away from zero)."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // BLOCK, BLOCK)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inverse = np.minimum(np.float32(1) / scale, np.finfo(np.float32).max)
        q = np.clip(_round_half_even(blocks * inverse[..., None]), -127, 127)
    qs[...] = q.astype(np.int8).reshape(m, k)
    d[...] = scale
    s[...] = scale * q.sum(axis=-1, dtype=np.float32)


def qgemm(qs, d, s, w, out, rows=None):
    """out[:, n0:n1] = dequant(act) @ dequant(w)[n0:n1].T in float64; ``s`` is implied by qs and d."""
    n0, n1 = rows if rows is not None else (0, w.n)
    m, k = qs.shape
    act = qs.reshape(m, k // BLOCK, BLOCK).astype(np.float64) * d.astype(np.float64)[..., None]
    weights = layouts.rows(w, np.arange(n0, n1)).astype(np.float64)
    out[:, n0:n1] = act.reshape(m, k) @ weights.T


# --------------------------------------------------------------------------- GGUF quantizers

def _f16_bytes(values):
    return values.astype(np.float16).view(np.uint8)


def _inverse(scale):
    with np.errstate(divide="ignore"):
        return np.where(scale == 0, np.float32(0), np.float32(1) / scale).astype(np.float32)


def _round_half_away(v):
    # floor(|v| + 0.5) would round 0.49999997 up (the sum rounds to 1.0 in float32)
    magnitude = np.abs(v)
    whole = np.floor(magnitude)
    return np.sign(v) * (whole + (magnitude - whole >= np.float32(0.5)))


def _nibble_bytes(q):
    """q uint8 [blocks, 32] -> 16 bytes: weight j in the low nibble, weight j + 16 in the high."""
    return q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << 4)


def _q4_0(blocks):
    # the signed value of largest magnitude (first one on ties) maps to -8
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[:, None], axis=-1)
    scale = extreme / np.float32(-8)
    q = np.trunc(blocks * _inverse(scale) + np.float32(8.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(scale), _nibble_bytes(q)], axis=-1)


def _q4_1(blocks):
    low = blocks.min(axis=-1, keepdims=True)
    scale = (blocks.max(axis=-1, keepdims=True) - low) / np.float32(15)
    q = np.trunc((blocks - low) * _inverse(scale) + np.float32(0.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(scale), _f16_bytes(low), _nibble_bytes(q)], axis=-1)


def _q8_0(blocks):
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    q = _round_half_away(blocks * _inverse(scale)).astype(np.int8)
    return np.concatenate([_f16_bytes(scale), q.view(np.uint8)], axis=-1)


GGUF_QUANTIZERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}


def quantize_gguf(x, type_name):
    """f32 [n, k] (k % 32 == 0) -> GGUF bytes uint8 [n, row bytes], as gguf.GGUFReader returns them."""
    if type_name not in GGUF_QUANTIZERS:
        raise ValueError(f"quantize_gguf: type must be one of {', '.join(GGUF_QUANTIZERS)}, got {type_name!r}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % BLOCK or x.shape[1] == 0:
        raise ValueError(f"quantize_gguf: expected [n, k] with k a positive multiple of {BLOCK}, got {x.shape}")
    n, k = x.shape
    blocks = GGUF_QUANTIZERS[type_name](x.reshape(-1, BLOCK))
    return np.ascontiguousarray(blocks).reshape(n, -1)
