"""BF16 weight layout "bf16_pairs" (for the AVX512_BF16 kernel, codegen/gemm_bf16.py) and the
bf16 activations it multiplies.

    panels[p, kk, j, e] = W[16 p + j, 2 kk + e]      shape [ceil(n / 16), ceil(k / 2), 16, 2], uint16

Panels of 16 rows as the float kinds (runtime/layout_float.py), but one k step holds a
pair of k: each dword is the (even, odd) bf16 pair of one row, which ``vdpbf16ps``
multiplies by the broadcast activation pair. Rows past n and the k past an odd k are
zero. The bits are GGUF's, unchanged.

Activations are converted to bf16 as llama.cpp's GGML_FP32_TO_BF16 does for its bf16
vec_dot: round to nearest even, NaN kept quiet (``to_bf16``).

GGUF BF16 tensors pack into this kind only where runtime/bf16_math.py chooses it (the
machine runs ``vdpbf16ps`` faster than the float kernel); by default they are kind "bf16"
(runtime/layout_float.py, multiplied exactly in f32).
"""
import numpy as np

from . import buffers
from .layout_float import PANEL_ROWS, n_panels
from .layouts import Layout, PackedWeight, register

PAIR = 2


def k_pairs(k):
    return -(-k // PAIR)


def _as_matrix(raw, n, k):
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"BF16 tensor: expected uint8 data, got {raw.dtype}")
    if n < 1 or k < 1 or raw.size != n * k * 2:
        raise ValueError(f"BF16 tensor: {raw.size} bytes do not make a [{n}, {k}] bf16 matrix (shape {raw.shape})")
    return np.ascontiguousarray(raw).reshape(n, 2 * k).view("<u2")


def pack(gguf_type, raw, n, k):
    """GGUF BF16 (raw bytes [n, 2k], as gguf.GGUFReader gives them) -> kind "bf16_pairs" panels."""
    if gguf_type != "BF16":
        raise ValueError(f"layout_bf16: cannot pack GGUF type {gguf_type}")
    matrix = _as_matrix(raw, n, k)
    kp = k_pairs(k)
    padded = np.zeros((n_panels(n) * PANEL_ROWS, kp * PAIR), np.uint16)
    padded[:n, :k] = matrix
    panels = buffers.zeros((n_panels(n), kp, PANEL_ROWS, PAIR), np.uint16)
    panels[:] = padded.reshape(n_panels(n), PANEL_ROWS, kp, PAIR).transpose(0, 2, 1, 3)
    return PackedWeight("bf16_pairs", n, k, {"panels": panels}, {"panel_rows": PANEL_ROWS})


def dequantize(w):
    """W[n, k] as f32 (exact)."""
    panels = w.arrays["panels"]
    rows = panels.transpose(0, 2, 1, 3).reshape(-1, panels.shape[1] * PAIR)[:w.n, :w.k]
    return (rows.astype(np.uint32) << 16).view(np.float32)


def rows(w, ids):
    """Rows ``ids`` of W as f32 [len(ids), k] (exact): the embedding lookup of a tied table."""
    panels = w.arrays["panels"]
    ids = np.asarray(ids)
    picked = panels[ids // PANEL_ROWS, :, ids % PANEL_ROWS, :]          # [len(ids), k pairs, 2]
    bits = picked.reshape(len(ids), -1)[:, :w.k]
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bf16(x, out=None):
    """f32 [m, k] -> bf16 bits uint16 [m, 2 ceil(k / 2)] (the pad column zero), as
    llama.cpp rounds: nearest even; NaN -> its high half with the quiet bit set."""
    x = np.ascontiguousarray(x, np.float32)
    m, k = x.shape
    if out is None:
        out = buffers.zeros((m, k_pairs(k) * PAIR), np.uint16)
    bits = x.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded[nan] = ((bits[nan] >> 16) | 64).astype(np.uint16)
    out[:, :k] = rounded
    out[:, k:] = 0
    return out


def from_bf16(bits, k):
    """bf16 bits [m, >= k] -> f32 [m, k] (exact)."""
    return (np.asarray(bits)[:, :k].astype(np.uint32) << 16).view(np.float32)


register(Layout("bf16_pairs", ("BF16",), pack, dequantize, rows), default=False)
