"""Bindings: the BF16 linear layer on AVX512_BF16 (codegen/gemm_bf16.py).

``gemm_bf16_pairs(xb, w, out, rows=None)``: out[:, n0:n1] = xb . W[n0:n1]^T for a PackedWeight of
kind "bf16_pairs" (runtime/layout_bf16.py) and activations already in bf16 (``layout_bf16.to_bf16``:
uint16 [m, 2 ceil(k / 2)]). One kernel call per product (k is never blocked), so
``gemm_bf16_pairs_call`` is what a plan records; threads split the columns (rows=, n0 a panel start).
Only where the CPU has avx512_bf16 (``bf16_supported``); the kernel is the one variant, for
every m, so a row's bits never depend on m.

``round_bf16(x, xb, rows=None)``: xb[r0:r1] = layout_bf16.to_bf16(x[r0:r1]) bit for bit (the
activations' rounding, pad column included). ``round_bf16_calls`` / ``gemm_bf16_pairs_calls_ranges``
give a plan one call per range, the arrays validated once.
"""
import functools

import numpy as np

from .. import cpu, library
from .. import validate as v
from ..layout_bf16 import PAIR, k_pairs
from ..layout_float import PANEL_ROWS, n_panels
from ..layouts import PackedWeight
from ._lib import checked_address, index_range, kernel

__all__ = ["gemm_bf16_pairs", "round_bf16"]

SYMBOL = "llb_gemm_bf16_bf16_8x48__avx512"
ROUND_SYMBOL = "llb_round_bf16_f32_16__avx512"
CPU_FLAG = "avx512_bf16"


def cpu_runs_bf16():
    """Whether this CPU has what the bf16 kernels need (AVX-512 and AVX512_BF16), without
    loading the kernel library."""
    return cpu.supports("avx512") and CPU_FLAG in cpu.cpu_flags()


@functools.lru_cache(maxsize=None)
def bf16_supported():
    """Whether this CPU and kernel library run the bf16 GEMM and the rounding it needs."""
    if not cpu_runs_bf16():
        return False
    manifest = library.load("avx2").manifest
    return SYMBOL in manifest and ROUND_SYMBOL in manifest


def _check_supported(op):
    if not bf16_supported():
        raise ValueError(f"{op}: this CPU lacks {CPU_FLAG} (or the kernel library has no {SYMBOL} "
                         f"and {ROUND_SYMBOL})")


def gemm_bf16_pairs(xb, w, out, rows=None):
    symbol, args = gemm_bf16_pairs_call(xb, w, out, rows)
    kernel(symbol)(*args)


def gemm_bf16_pairs_call(xb, w, out, rows=None):
    return gemm_bf16_pairs_calls_ranges(xb, w, out, [rows])[0]


def gemm_bf16_pairs_calls_ranges(xb, w, out, ranges):
    """One ``gemm_bf16_pairs_call`` per column range (``rows``) in ``ranges``, the arrays validated
    once: what the plan recorder gives its threads. Each call's columns are one chain of vdpbf16ps
    per output as in a whole call, so a split changes no bit."""
    _check_supported("gemm_bf16")
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w: expected a PackedWeight, got {type(w).__name__}")
    if w.kind != "bf16_pairs":
        raise ValueError(f"w: expected a PackedWeight of kind 'bf16_pairs', got {w.kind!r}")
    v.positive_int("w.n", w.n)
    v.positive_int("w.k", w.k)
    kp = k_pairs(w.k)
    panels_at = checked_address("w.panels", w.arrays.get("panels"), np.uint16,
                                (n_panels(w.n), kp, PANEL_ROWS, PAIR))
    x_at = checked_address("xb", xb, np.uint16, (None, kp * PAIR))
    m = xb.shape[0]
    out_at = checked_address("out", out, np.float32, (m, w.n), writable=True)
    panel_stride = kp * PANEL_ROWS * PAIR
    calls = []
    for rows in ranges:
        n0, n1 = index_range("rows", rows, w.n, labels=("n0", "n1"), multiple=PANEL_ROWS, why=" (a panel start)")
        calls.append((SYMBOL, [x_at, panels_at + (n0 // PANEL_ROWS) * panel_stride * 2, out_at + 4 * n0,
                               kp * PAIR, w.n, n1 - n0, m, kp, panel_stride, 0]))
    return calls


def round_bf16(x, xb, rows=None):
    """xb[r0:r1] = bf16 bits of x[r0:r1] (``rows=(r0, r1)``), as layout_bf16.to_bf16."""
    symbol, args = round_bf16_calls(x, xb, [rows])[0]
    kernel(symbol)(*args)


def round_bf16_calls(x, xb, ranges):
    """One call per ``rows`` range in ``ranges``, the arrays validated once. Rows are rounded
    each on its own, so a row's bits do not depend on the split."""
    _check_supported("round_bf16")
    # The kernel loads and stores unaligned (element alignment is enough), so row slices work.
    x_at = checked_address("x", x, np.float32, ndim=2, align=4)
    m, k = x.shape
    xb_at = checked_address("xb", xb, np.uint16, (m, k_pairs(k) * PAIR), writable=True, align=2)
    ldb = k_pairs(k) * PAIR
    calls = []
    for rows in ranges:
        r0, r1 = index_range("rows", rows, m, labels=("r0", "r1"))
        calls.append((ROUND_SYMBOL, [x_at + 4 * r0 * k, xb_at + 2 * r0 * ldb, k, k, ldb, r1 - r0]))
    return calls
