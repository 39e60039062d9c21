"""Float weight layouts "f32", "f16" and "bf16": W[n, k] packed into panels of 16 rows.

    panels[p, kk, j] = W[16 p + j, kk]        shape [ceil(n / 16), k, 16]

Rows n..16*ceil(n/16)-1 are zero. The GEMM microkernel (codegen/gemm.py) keeps
a 6 x 16 tile of C in registers; one k step of a panel is the 16 weights it
multiplies by one broadcast activation, stored contiguously (64 bytes f32 =
one cache line, 32 bytes f16), so the kernel reads each panel as one
sequential stream and never gathers. Why panels of 16 and not GGUF's rows:

- row-major W[n, k] would need 16 row streams (or a transpose in registers)
  per tile; a panel is one stream, which the hardware prefetcher follows and
  which splits at any k (k blocking is a pointer offset, k0 * 16 elements);
- 16 = two ymm: a 6 x 16 tile is 12 accumulators + 2 weights + 1 broadcast =
  15 of 16 ymm registers; 24 columns (4 x 24) would use all 16 and leave no
  register for the masked edge stores;
- padding costs < 16 rows per matrix (0 for the usual n, multiples of 64).

"f32" holds F32 weights. "f16" keeps F16 weights as f16: half the bytes of f32,
which is what a memory-bound decode step pays for; the kernel widens them with
F16C (VCVTPH2PS) as it loads them, also exact. "bf16" keeps BF16 weights' 16 bits
(uint16) the same way; the kernel widens them exactly (a bf16 is the high half of
its f32), so a BF16 model computes what its weights widened to f32 would.
"""
import numpy as np

from . import buffers
from .layouts import Layout, PackedWeight, register

PANEL_ROWS = 16        # codegen/gemm.py NR

_PANEL_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
_KIND = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def n_panels(n):
    return -(-n // PANEL_ROWS)


def _as_matrix(gguf_type, raw, n, k):
    """Check ``raw`` (as gguf.GGUFReader gives it) and return W[n, k] in its stored precision."""
    raw = np.asarray(raw)
    if gguf_type == "F32":
        want_dtype, per_element = np.float32, 1
    elif gguf_type == "F16":
        want_dtype, per_element = np.float16, 1
    elif gguf_type == "BF16":
        want_dtype, per_element = np.uint8, 2     # the reader gives BF16 as raw bytes [n, 2k]
    else:
        raise ValueError(f"layout_float: cannot pack GGUF type {gguf_type}")
    if raw.dtype != want_dtype:
        raise ValueError(f"{gguf_type} tensor: expected {np.dtype(want_dtype)} data, got {raw.dtype}")
    if n < 1 or k < 1 or raw.size != n * k * per_element:
        raise ValueError(f"{gguf_type} tensor: {raw.size} elements do not make a [{n}, {k}] matrix "
                         f"(shape {raw.shape})")
    matrix = np.ascontiguousarray(raw).reshape(n, k * per_element)
    if gguf_type == "BF16":
        return matrix.view("<u2")
    return matrix


def pack(gguf_type, raw, n, k):
    """GGUF F32 -> kind "f32", F16 -> "f16", BF16 -> "bf16": W[n, k] as panels (see module doc)."""
    kind = _KIND.get(gguf_type, "f32")     # an unknown type is refused by _as_matrix
    matrix = _as_matrix(gguf_type, raw, n, k)
    panels = buffers.zeros((n_panels(n), k, PANEL_ROWS), _PANEL_DTYPE[kind])
    full = n // PANEL_ROWS
    panels[:full] = matrix[:full * PANEL_ROWS].reshape(full, PANEL_ROWS, k).transpose(0, 2, 1)
    if n > full * PANEL_ROWS:
        panels[full, :, :n - full * PANEL_ROWS] = matrix[full * PANEL_ROWS:].T
    return PackedWeight(kind, n, k, {"panels": panels}, {"panel_rows": PANEL_ROWS})


def dequantize(w):
    """W[n, k] as f32 (exact for every source type)."""
    return _as_f32(w.arrays["panels"].transpose(0, 2, 1).reshape(-1, w.k)[:w.n])


def rows(w, ids):
    """W[ids] as f32 [len(ids), k] (e.g. an embedding lookup)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids: expected a 1-D integer array, got {ids.dtype} shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= w.n):
        raise ValueError(f"ids: out of range [0, {w.n})")
    panels = w.arrays["panels"]
    return _as_f32(panels[ids // PANEL_ROWS, :, ids % PANEL_ROWS])


def _as_f32(values):
    """Panel values as f32: bf16 bits (uint16) are the high half of theirs."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


register(Layout("f32", ("F32",), pack, dequantize, rows))
register(Layout("f16", ("F16",), pack, dequantize, rows))
register(Layout("bf16", ("BF16",), pack, dequantize, rows))
