"""Bindings: the float linear layer C[m, n] = A[m, k] . W[n, k]^T (codegen/gemm.py)."""
import numpy as np

from .. import validate as v
from ..layout_float import PANEL_ROWS, n_panels, pack
from ..layouts import PackedWeight
from ._lib import kernel

__all__ = ["gemm_f32", "gemm_f16", "matmul_nt"]

ROW_TILE = 6            # codegen/gemm.py MR
# Cache blocking, measured on Zen 5 (48 KiB L1d, 1 MiB L2 per core) at n = k = 4096:
# a whole panel (k x 16 weights) read from L2 by each 6-row tile keeps the FMA
# pipes fed (64 bytes per 6 cycles); blocking k to keep it in L1 instead was
# 8-25 % slower (the extra load-add-store of C per block and the broken
# weight stream cost more than L2 latency). So k is blocked only when a panel
# would crowd L2 (K_BLOCK x 16 f32 = 256 KiB), and m only in big steps (A is
# read from L3 per panel: 512 rows gave 125 GFLOP/s, 64 rows 113).
K_BLOCK = 4096
M_BLOCK = 512

_SYMBOL = {"f32": "llb_gemm_f32_f32_6x16__avx2", "f16": "llb_gemm_f16_f32_6x16__avx2"}


def gemm_f32(x, w, out, rows=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "f32" (rows=(n0, n1), default all)."""
    _gemm("f32", x, w, out, rows)


def gemm_f16(x, w, out, rows=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "f16" (rows=(n0, n1), default all)."""
    _gemm("f16", x, w, out, rows)


def matmul_nt(a, b, out):
    """out = a . b^T for plain row-major f32 a [m, k], b [n, k] (b is packed on every call)."""
    v.array("b", b, np.float32, ndim=2, align=0)
    n, k = b.shape
    v.array("a", a, np.float32, (None, k))
    _gemm("f32", a, pack("F32", b, n, k), out, None)


def _check_weight(kind, w):
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w: expected a PackedWeight, got {type(w).__name__}")
    if w.kind != kind:
        raise ValueError(f"w: expected a PackedWeight of kind {kind!r}, got {w.kind!r}")
    v.positive_int("w.n", w.n)
    v.positive_int("w.k", w.k)
    dtype = np.float32 if kind == "f32" else np.float16
    return v.array("w.panels", w.arrays.get("panels"), dtype, (n_panels(w.n), w.k, PANEL_ROWS))


def _check_columns(rows, n):
    """(n0, n1) from ``rows``: a non-empty column range whose start begins a panel."""
    if rows is None:
        return 0, n
    try:
        n0, n1 = rows
    except (TypeError, ValueError):
        raise ValueError(f"rows: expected a pair (n0, n1), got {rows!r}") from None
    for name, value in (("rows[0]", n0), ("rows[1]", n1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
    if not 0 <= n0 < n1 <= n:
        raise ValueError(f"rows: expected 0 <= n0 < n1 <= {n}, got {rows!r}")
    if n0 % PANEL_ROWS:
        raise ValueError(f"rows: n0 must be a multiple of {PANEL_ROWS} (a panel start), got {n0}")
    return int(n0), int(n1)


def _gemm(kind, x, w, out, rows):
    panels = _check_weight(kind, w)
    n, k = w.n, w.k
    v.array("x", x, np.float32, (None, k))
    m = x.shape[0]
    v.array("out", out, np.float32, (m, n), writable=True)
    n0, n1 = _check_columns(rows, n)

    # A single row tile reads each weight once whatever the blocking: keep the stream whole.
    k_block = k if m <= ROW_TILE else K_BLOCK
    run = kernel(_SYMBOL[kind])
    panel_stride = k * PANEL_ROWS
    w_start = panels.ctypes.data + (n0 // PANEL_ROWS) * panel_stride * panels.itemsize
    for m0 in range(0, m, M_BLOCK):
        for k0 in range(0, k, k_block):
            run(x.ctypes.data + (m0 * k + k0) * 4,
                w_start + k0 * PANEL_ROWS * panels.itemsize,
                out.ctypes.data + (m0 * n + n0) * 4,
                k, n, n1 - n0, min(M_BLOCK, m - m0), min(k_block, k - k0), panel_stride, int(k0 > 0))
