"""Bindings: the float linear layer C[m, n] = A[m, k] . W[n, k]^T (codegen/gemm.py).

``gemm_f32_calls`` / ``gemm_f16_calls`` validate like the ops and return the
kernel calls the op makes, ``[(symbol, args), ...]`` in order, args in the
kernel's C argument order; ``rows=(n0, n1)`` restricts them to one thread's
output columns. Large products are cache-blocked into several calls (row
blocks, and k blocks that add into out: a thread must run its calls in order).
``gemm_f32_call`` / ``gemm_f16_call`` give the one call of a product that needs
only one (decode always does) and refuse the others. ``matmul_nt`` packs its
weight on every call, so it has no plan form: a plan packs once and uses
``gemm_f32_call``.
"""
import numpy as np

from .. import validate as v
from ..layout_float import PANEL_ROWS, n_panels, pack
from ..layouts import PackedWeight
from ._lib import checked_address, index_range, kernel

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

F32 = np.dtype(np.float32)
_SYMBOL = {"f32": "llb_gemm_f32_f32_6x16__avx2", "f16": "llb_gemm_f16_f32_6x16__avx2"}


def gemm_f32(x, w, out, rows=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "f32" (rows=(n0, n1), default all)."""
    for symbol, args in gemm_f32_calls(x, w, out, rows):
        kernel(symbol)(*args)


def gemm_f16(x, w, out, rows=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "f16" (rows=(n0, n1), default all)."""
    for symbol, args in gemm_f16_calls(x, w, out, rows):
        kernel(symbol)(*args)


def gemm_f32_calls(x, w, out, rows=None):
    return _gemm_calls("f32", x, w, out, rows)


def gemm_f16_calls(x, w, out, rows=None):
    return _gemm_calls("f16", x, w, out, rows)


def gemm_f32_call(x, w, out, rows=None):
    return _single_call("gemm_f32", _gemm_calls("f32", x, w, out, rows))


def gemm_f16_call(x, w, out, rows=None):
    return _single_call("gemm_f16", _gemm_calls("f16", x, w, out, rows))


def matmul_nt(a, b, out):
    """out = a . b^T for plain row-major f32 a [m, k], b [n, k] (b is packed on every call)."""
    v.array("b", b, np.float32, ndim=2, align=0)
    n, k = b.shape
    v.array("a", a, np.float32, (None, k))
    gemm_f32(a, pack("F32", b, n, k), out)


def _check_weight(kind, w):
    """Address of the weight's panels (validated)."""
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w: expected a PackedWeight, got {type(w).__name__}")
    if w.kind != kind:
        raise ValueError(f"w: expected a PackedWeight of kind {kind!r}, got {w.kind!r}")
    v.positive_int("w.n", w.n)
    v.positive_int("w.k", w.k)
    dtype = np.float32 if kind == "f32" else np.float16
    return checked_address("w.panels", w.arrays.get("panels"), dtype, (n_panels(w.n), w.k, PANEL_ROWS))


def _gemm_calls(kind, x, w, out, rows):
    panels_at = _check_weight(kind, w)
    n, k = w.n, w.k
    x_at = checked_address("x", x, F32, (None, k))
    m = x.shape[0]
    out_at = checked_address("out", out, F32, (m, n), writable=True)
    n0, n1 = index_range("rows", rows, n, labels=("n0", "n1"), multiple=PANEL_ROWS, why=" (a panel start)")

    # A single row tile reads each weight once whatever the blocking: keep the stream whole.
    k_block = k if m <= ROW_TILE else K_BLOCK
    weight_bytes = 2 if kind == "f16" else 4
    panel_stride = k * PANEL_ROWS
    w_start = panels_at + (n0 // PANEL_ROWS) * panel_stride * weight_bytes
    symbol = _SYMBOL[kind]
    return [(symbol, [x_at + (m0 * k + k0) * 4,
                      w_start + k0 * PANEL_ROWS * weight_bytes,
                      out_at + (m0 * n + n0) * 4,
                      k, n, n1 - n0, min(M_BLOCK, m - m0), min(k_block, k - k0), panel_stride, int(k0 > 0)])
            for m0 in range(0, m, M_BLOCK) for k0 in range(0, k, k_block)]


def _single_call(op, calls):
    if len(calls) != 1:
        raise ValueError(f"x: this product is cache-blocked into {len(calls)} kernel calls "
                         f"(m > {M_BLOCK}, or k > {K_BLOCK} with m > {ROW_TILE}); use {op}_calls")
    return calls[0]
