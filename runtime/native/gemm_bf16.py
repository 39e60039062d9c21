"""Bindings: the BF16 linear layer on AVX512_BF16 (codegen/gemm_bf16.py).

``gemm_bf16_pairs(xb, w, out, rows=None)``: out[:, n0:n1] = xb . W[n0:n1]^T for a PackedWeight of
kind "bf16_pairs" (runtime/layout_bf16.py) and activations already in bf16 (``layout_bf16.to_bf16``:
uint16 [m, 2 ceil(k / 2)]). One kernel call per product (k is never blocked), so
``gemm_bf16_pairs_call`` is what a plan records; threads split the columns (rows=, n0 a panel start).
Only where the CPU has avx512_bf16 (``bf16_supported``); the kernel is the one variant, for
every m, so a row's bits never depend on m.
"""
import functools

import numpy as np

from .. import cpu, library
from .. import validate as v
from ..layout_bf16 import PAIR, k_pairs
from ..layout_float import PANEL_ROWS, n_panels
from ..layouts import PackedWeight
from ._lib import checked_address, index_range, kernel

__all__ = ["gemm_bf16_pairs"]

SYMBOL = "llb_gemm_bf16_bf16_8x48__avx512"
CPU_FLAG = "avx512_bf16"


@functools.lru_cache(maxsize=None)
def bf16_supported():
    """Whether this CPU and kernel library run the bf16 GEMM."""
    return (not cpu.missing_flags("avx512") and CPU_FLAG in cpu.cpu_flags()
            and SYMBOL in library.load("avx2").manifest)


def gemm_bf16_pairs(xb, w, out, rows=None):
    symbol, args = gemm_bf16_pairs_call(xb, w, out, rows)
    kernel(symbol)(*args)


def gemm_bf16_pairs_call(xb, w, out, rows=None):
    if not bf16_supported():
        raise ValueError(f"gemm_bf16: this CPU lacks {CPU_FLAG} (or the kernel library has no {SYMBOL})")
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
    n0, n1 = index_range("rows", rows, w.n, labels=("n0", "n1"), multiple=PANEL_ROWS, why=" (a panel start)")
    panel_stride = kp * PANEL_ROWS * PAIR
    return SYMBOL, [x_at, panels_at + (n0 // PANEL_ROWS) * panel_stride * 2, out_at + 4 * n0,
                    kp * PAIR, w.n, n1 - n0, m, kp, panel_stride, 0]
