"""Bindings: the float linear layer C[m, n] = A[m, k] . W[n, k]^T (codegen/gemm.py).

``gemm_f32_calls`` / ``gemm_f16_calls`` / ``gemm_bf16_calls`` (weight kinds "f32", "f16",
"bf16") validate like the ops and return the kernel calls the op makes,
``[(symbol, args), ...]`` in order, args in the kernel's C argument order; ``rows=(n0, n1)``
restricts them to one thread's output columns (``*_calls_ranges``: for many ranges, the
arrays validated once, as a plan's chunks want). Large products are cache-blocked into several calls (row
blocks, and k blocks that add into out: a thread must run its calls in order).
``gemm_f32_call`` / ``gemm_f16_call`` give the one call of a product that needs
only one (decode always does) and refuse the others. ``matmul_nt`` packs its
weight on every call, so it has no plan form: a plan packs once and uses
``gemm_f32_call``.

There is an AVX2 kernel (the baseline) and an AVX-512 one (zmm FMAs) on the same
weight layout; both sum every output in the same order, so they agree bit for bit
and the choice (``gemm_isa``: the widest the CPU runs, capped by ``LLAMBDA_ISA``;
``isa=`` asks for one, as the tests do) never changes a result.
"""
import functools
import os

import numpy as np

from .. import cpu, library
from .. import validate as v
from ...codegen.contract import PANEL
from ..layout_float import PANEL_ROWS, n_panels, pack
from ..layouts import PackedWeight
from ._lib import checked_address, index_range, kernel

__all__ = ["gemm_f32", "gemm_f16", "gemm_bf16", "matmul_nt"]
KINDS = ("f32", "f16", "bf16")

ROW_TILE = 6            # rows of the AVX2 kernel's main tile (codegen/gemm.py TILINGS)
# Cache blocking. Every output is one FMA chain over k in order whatever the blocking
# (a k block after the first continues the chains from out), so it is a speed choice
# only. A whole block of panels (k x 16 weights each) read from L2 by each row tile
# keeps the FMA pipes fed; k is blocked only when a block's panels would crowd L2, and
# m only in big steps (A is read from L3 once per column block).
K_BLOCK = 4096
M_BLOCK = 512

# The kernel variants, baseline first: the tile in the symbol (codegen/gemm.py kernel_tile).
GEMM_TILES = {"avx2": "6x32", "avx512": "8x48"}
ISA_CAP = "LLAMBDA_ISA"
# Below this many rows the AVX2 kernel is used where both run. The two compute every
# output in the same order (bit-identical, tests/kernels/test_gemm.py), so the switch is a
# speed choice that no result can see.
AVX512_MIN_ROWS = 1
# Threads split the columns in multiples of this (runtime/recorder.py): whole column
# blocks of both kernels (2 and 3 panels), so no thread ends in a narrow edge tile.
SPLIT_COLUMNS = 6 * PANEL
# A product too narrow for two of those splits in blocks of the AVX-512 kernel (3 panels),
# when it has two: a 192-column K or V projection in 16-column chunks ran every chunk on
# the edge tiles (ymm, one panel wide), at half the zmm rate.
SPLIT_COLUMNS_NARROW = 3 * PANEL

F32 = np.dtype(np.float32)


def gemm_symbol(kind, isa):
    return f"llb_gemm_{kind}_f32_{GEMM_TILES[isa]}__{isa}"


@functools.lru_cache(maxsize=None)
def gemm_isas():
    """The float GEMM variants this CPU runs and the kernel library has, baseline first."""
    manifest = library.load("avx2").manifest
    return tuple(isa for isa in GEMM_TILES if not cpu.missing_flags(isa)
                 and all(gemm_symbol(kind, isa) in manifest for kind in KINDS))


@functools.lru_cache(maxsize=None)
def widest_gemm_isa():
    """The widest of gemm_isas(), or of those up to LLAMBDA_ISA when set (read once)."""
    names = list(GEMM_TILES)
    cap = os.environ.get(ISA_CAP) or names[-1]
    if cap not in names:
        raise ValueError(f"{ISA_CAP}: expected one of {', '.join(names)}, got {cap!r}")
    return [isa for isa in gemm_isas() if names.index(isa) <= names.index(cap)][-1]


def gemm_isa(m, isa=None):
    """The variant that computes a product of m rows: ``isa`` if given (checked), else the
    widest from AVX512_MIN_ROWS rows on."""
    if isa is None:
        widest = widest_gemm_isa()
        return "avx2" if m < AVX512_MIN_ROWS else widest
    if isa not in gemm_isas():
        raise ValueError(f"isa: expected one of {', '.join(gemm_isas())} (the float GEMM variants this CPU "
                         f"and kernel library run), got {isa!r}")
    return isa


def gemm_f32(x, w, out, rows=None, *, isa=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "f32" (rows=(n0, n1), default all).
    ``isa`` (one of gemm_isas()) picks a kernel variant; by default the fastest for m."""
    for symbol, args in gemm_f32_calls(x, w, out, rows, isa=isa):
        kernel(symbol)(*args)


def gemm_f16(x, w, out, rows=None, *, isa=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "f16" (rows=(n0, n1), default all)."""
    for symbol, args in gemm_f16_calls(x, w, out, rows, isa=isa):
        kernel(symbol)(*args)


def gemm_bf16(x, w, out, rows=None, *, isa=None):
    """out[:, n0:n1] = x . W[n0:n1]^T for a PackedWeight of kind "bf16" (widened exactly to f32)."""
    for symbol, args in gemm_bf16_calls(x, w, out, rows, isa=isa):
        kernel(symbol)(*args)


def gemm_bf16_calls(x, w, out, rows=None, *, isa=None):
    return _gemm_calls("bf16", x, w, out, rows, isa)


def gemm_bf16_call(x, w, out, rows=None, *, isa=None):
    return _single_call("gemm_bf16", _gemm_calls("bf16", x, w, out, rows, isa))


def gemm_f32_calls(x, w, out, rows=None, *, isa=None):
    return _gemm_calls("f32", x, w, out, rows, isa)


def gemm_f16_calls(x, w, out, rows=None, *, isa=None):
    return _gemm_calls("f16", x, w, out, rows, isa)


def gemm_f32_call(x, w, out, rows=None, *, isa=None):
    return _single_call("gemm_f32", _gemm_calls("f32", x, w, out, rows, isa))


def gemm_f16_call(x, w, out, rows=None, *, isa=None):
    return _single_call("gemm_f16", _gemm_calls("f16", x, w, out, rows, isa))


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
    dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[kind]
    return checked_address("w.panels", w.arrays.get("panels"), dtype, (n_panels(w.n), w.k, PANEL_ROWS))


def _gemm_calls(kind, x, w, out, rows, isa=None):
    return _gemm_calls_ranges(kind, x, w, out, [rows], isa)[0]


def gemm_f32_calls_ranges(x, w, out, ranges, *, isa=None):
    """``gemm_f32_calls`` for each ``rows`` range in ``ranges``, the arrays validated once
    (a plan's chunks of one product differ only in their columns)."""
    return _gemm_calls_ranges("f32", x, w, out, ranges, isa)


def gemm_f16_calls_ranges(x, w, out, ranges, *, isa=None):
    return _gemm_calls_ranges("f16", x, w, out, ranges, isa)


def gemm_bf16_calls_ranges(x, w, out, ranges, *, isa=None):
    return _gemm_calls_ranges("bf16", x, w, out, ranges, isa)


def _gemm_calls_ranges(kind, x, w, out, ranges, isa=None):
    panels_at = _check_weight(kind, w)
    n, k = w.n, w.k
    x_at = checked_address("x", x, F32, (None, k))
    m = x.shape[0]
    out_at = checked_address("out", out, F32, (m, n), writable=True)
    # A single row tile reads each weight once whatever the blocking: keep the stream whole.
    k_block = k if m <= ROW_TILE else K_BLOCK
    weight_bytes = 4 if kind == "f32" else 2
    panel_stride = k * PANEL_ROWS
    symbol = gemm_symbol(kind, gemm_isa(m, isa))
    per_range = []
    for rows in ranges:
        n0, n1 = index_range("rows", rows, n, labels=("n0", "n1"), multiple=PANEL_ROWS, why=" (a panel start)")
        w_start = panels_at + (n0 // PANEL_ROWS) * panel_stride * weight_bytes
        per_range.append([(symbol, [x_at + (m0 * k + k0) * 4,
                                    w_start + k0 * PANEL_ROWS * weight_bytes,
                                    out_at + (m0 * n + n0) * 4,
                                    k, n, n1 - n0, min(M_BLOCK, m - m0), min(k_block, k - k0), panel_stride,
                                    int(k0 > 0)])
                          for m0 in range(0, m, M_BLOCK) for k0 in range(0, k, k_block)])
    return per_range


def _single_call(op, calls):
    if len(calls) != 1:
        raise ValueError(f"x: this product is cache-blocked into {len(calls)} kernel calls "
                         f"(m > {M_BLOCK}, or k > {K_BLOCK} with m > {ROW_TILE}); use {op}_calls")
    return calls[0]
