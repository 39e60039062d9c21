"""Bindings: int8 activation quantization and quantized-weight GEMM (codegen/quant.py, codegen/qgemm.py).

``quantize_q8_call`` / ``qgemm_call`` validate like the bindings and return
``(kernel symbol, integer arguments)`` instead of calling: what a plan
(runtime/plan.py) records for a worker thread, e.g. one ``rows`` range each.

qgemm has an AVX2 kernel (the baseline) and an AVX-512 one (AVX512BW +
AVX512_VNNI) on the same weight layout. The widest one the CPU runs is used
(for m >= AVX512_MIN_ROWS activation rows; decode stays on AVX2, except for the
AVX512_DECODE_KINDS, and for q4_1 / q8_0 on AVX512_SINGLE_ROW_VENDORS' CPUs);
``LLAMBDA_ISA=avx2`` caps it at the baseline (for ISA-fair comparisons), and
``isa=`` asks for one variant explicitly (tests compare them).
"""
import functools
import os

import numpy as np

from .. import cpu, library
from .. import validate as v
from ...codegen.contract import (BLOCK, GROUP, QGEMM_AVX2_DECODE_KINDS, QGEMM_AVX2_DECODE_TILE, QGEMM_KIND_TILES,
                                 QUANT_ARRAYS, block_multiple, qgemm_symbol)
from ..kinds import quantized_kinds
from ..layouts import PackedWeight
from ._lib import index_range, kernel

__all__ = ["quantize_q8", "qgemm"]

# per ISA, widest last: the register tile in the kernel's name, and a CPU flag beyond
# cpu.REQUIRED (as Linux or py-cpuinfo spell it)
QGEMM_TILES = {"avx2": "6x8", "avx512": "16x16"}
QGEMM_EXTRA_FLAG = {"avx512": ("avx512_vnni", "avx512vnni")}
ISA_CAP = "LLAMBDA_ISA"
# The AVX-512 kernel reads two row groups at once: four weight streams instead of two.
# With few activation rows it is memory-bound and streams slower (cold GEMV, m = 1: ~25
# vs ~33 GB/s; m = 2 ~18 vs ~24); from m = 4 on it is as fast or faster (m = 8: ~2x).
AVX512_MIN_ROWS = 4
# ... or fewer for kinds whose AVX-512 tiles prefetch both groups and have a tile for every
# row count (codegen/qgemm.py KIND_TILINGS): from m = 3 on they stream as fast or faster
# (one pass of 3 rows where AVX2 runs a 3-row tile too); at m = 2 AVX2 stays ahead.
AVX512_MIN_ROWS_BY_KIND = {"q4_1": 3, "q8_0": 3}
# ... and from one row (decode) on CPUs of these vendors, which run 512-bit operations at full
# width. In the model, at 2 threads on the Intel Xeon host (docs/perf-journal/2026-12-01-1729-decode-row-on-avx512-tiles.md), the AVX-512
# tiles decode SmolLM2's Q4_1 GEMMs about 9% and its Q8_0 LM head about 27% faster than
# AVX2. On the AMD Zen 4 host, which splits 512-bit operations in two, AVX2 was ahead at
# m = 1 (the measurement above).
AVX512_SINGLE_ROW_VENDORS = ("GenuineIntel",)
# ... except for kinds whose AVX2 GEMV is bound by its unpacking work rather than by memory:
# their AVX-512 tiles (half the instructions per byte, ternary logic to merge the fifth bit,
# each block's scales formed once for 16 columns) prefetch all their streams and are not.
# Every kind's tiles, on both ISAs, sum a row with the same f32 operations in the same order
# (codegen/qgemm.py "Summation order"), so neither switch changes a bit of any row.
AVX512_DECODE_KINDS = ("q5_0", "q5_1", "q4_k", "q5_k")
ELEMENT_ALIGN = 4


def _block_count(name, k):
    if k % BLOCK:
        raise ValueError(f"{name}: k = {k} must be a multiple of {BLOCK} (quantization blocks)")
    return k // BLOCK


def quantize_q8(x, qs, d, s):
    """x f32 [m, k] -> qs int8 [m, k], d and s f32 [m, k/32] (GGUF Q8_0 blocks, s = d * sum(q))."""
    symbol, args = quantize_q8_call(x, qs, d, s)
    kernel(symbol)(*args)


def quantize_q8_call(x, qs, d, s, rows=None):
    """``rows=(r0, r1)``: quantize only those rows (each block is quantized on its own,
    so a row's result does not depend on the split)."""
    return quantize_q8_calls(x, qs, d, s, [rows])[0]


def quantize_q8_calls(x, qs, d, s, ranges):
    """One ``quantize_q8_call`` per ``rows`` range in ``ranges``, the arrays validated once."""
    v.array("x", x, np.float32, ndim=2)
    m, k = x.shape
    kb = _block_count("x", k)
    v.array("qs", qs, np.int8, (m, k), writable=True)
    v.array("d", d, np.float32, (m, kb), writable=True)
    v.array("s", s, np.float32, (m, kb), writable=True)
    x_at, qs_at, d_at, s_at = x.ctypes.data, qs.ctypes.data, d.ctypes.data, s.ctypes.data
    calls = []
    for rows in ranges:
        r0, r1 = index_range("rows", rows, m, labels=("r0", "r1"))
        calls.append(("llb_quantize_q8_f32_32__avx2", [x_at + 4 * r0 * k, qs_at + r0 * k, d_at + 4 * r0 * kb,
                                                       s_at + 4 * r0 * kb, (r1 - r0) * kb]))
    return calls


def _check_weight(w, k):
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w: expected a PackedWeight, got {type(w).__name__}")
    if w.kind not in quantized_kinds():
        raise ValueError(f"w: qgemm needs a weight of kind {', '.join(quantized_kinds())}, got kind {w.kind!r}")
    if w.k != k:
        raise ValueError(f"w: has k = {w.k} but the activations have k = {k}")
    if k % block_multiple(w.kind):
        raise ValueError(f"w: kind {w.kind} needs k to be a multiple of {block_multiple(w.kind)}, got k = {k}")
    if w.meta.get("group", GROUP) != GROUP:
        raise ValueError(f"w: packed with row groups of {w.meta.get('group')}, the kernels need {GROUP}")
    groups, blocks = -(-w.n // GROUP), k // BLOCK
    return [v.array(f"w.{spec.name}", w.arrays.get(spec.name), spec.dtype, spec.shape(groups, blocks))
            for spec in QUANT_ARRAYS[w.kind]]


def qgemm(qs, d, s, w, out, rows=None, *, isa=None):
    """out[m, n0:n1] = dequant(qs, d) [m, k] . dequant(w)[n0:n1, k]^T; ``rows=(n0, n1)`` (n0 % 8 == 0).

    qs, d, s are quantize_q8's output (qs in [-127, 127]), or row slices of it; w a quantized
    PackedWeight (kinds.quantized_kinds()); out f32 [m, n]. Columns outside n0..n1 are not touched.
    ``isa`` (one of qgemm_isas()) picks a kernel variant; by default the fastest for m."""
    symbol, args = qgemm_call(qs, d, s, w, out, rows, isa=isa)
    kernel(symbol)(*args)


def qgemm_tile(kind, isa):
    """The register tile in ``kind``'s qgemm kernel name for ``isa`` (None: it has no such kernel)."""
    if kind in QGEMM_KIND_TILES:
        return QGEMM_KIND_TILES[kind].get(isa)
    return QGEMM_TILES[isa]


@functools.lru_cache(maxsize=None)
def qgemm_isas(kind=None):
    """The qgemm variants this CPU runs and the kernel library has, baseline first: for ``kind``,
    or (None) those that every kind emitted for that ISA has (contract.QGEMM_KIND_TILES lists
    the kinds with fewer ISAs)."""
    flags = cpu.cpu_flags()
    manifest = library.load("avx2").manifest
    kinds = [kind] if kind is not None else quantized_kinds()
    return tuple(isa for isa in QGEMM_TILES
                 if not cpu.missing_flags(isa)
                 and (isa not in QGEMM_EXTRA_FLAG or flags & set(QGEMM_EXTRA_FLAG[isa]))
                 and (kind is None or qgemm_tile(kind, isa) is not None)
                 and all(qgemm_symbol(k, qgemm_tile(k, isa), isa) in manifest
                         for k in kinds if qgemm_tile(k, isa) is not None))


@functools.lru_cache(maxsize=None)
def widest_qgemm_isa(kind=None):
    """The widest of qgemm_isas(kind), or of those up to LLAMBDA_ISA when set (read once)."""
    names = list(QGEMM_TILES)
    cap = os.environ.get(ISA_CAP) or names[-1]
    if cap not in names:
        raise ValueError(f"{ISA_CAP}: expected one of {', '.join(names)}, got {cap!r}")
    return [isa for isa in qgemm_isas(kind) if names.index(isa) <= names.index(cap)][-1]


def _qgemm_isa(isa, m, kind=None):
    if isa is None:
        widest = widest_qgemm_isa(kind)
        few_rows = m < AVX512_MIN_ROWS_BY_KIND.get(kind, AVX512_MIN_ROWS) and kind not in AVX512_DECODE_KINDS
        if m == 1 and kind in AVX512_MIN_ROWS_BY_KIND and cpu.vendor() in AVX512_SINGLE_ROW_VENDORS:
            few_rows = False
        return "avx2" if widest == "avx512" and few_rows else widest
    if isa not in qgemm_isas(kind):
        raise ValueError(f"isa: expected one of {', '.join(qgemm_isas(kind))} (the qgemm variants this CPU "
                         f"and kernel library run for kind {kind}), got {isa!r}")
    return isa


def qgemm_call(qs, d, s, w, out, rows=None, *, isa=None):
    return qgemm_calls(qs, d, s, w, out, [rows], isa=isa)[0]


def qgemm_calls(qs, d, s, w, out, ranges, *, isa=None):
    """One ``qgemm_call`` per ``rows`` range in ``ranges``, the arrays validated once
    (a plan's chunks of one product differ only in their ranges)."""
    # The kernel broadcasts activations and stores outputs unaligned, so row slices of
    # them (e.g. the last token's row for the LM head) work; the weights need 32 bytes.
    v.array("qs", qs, np.int8, ndim=2, align=ELEMENT_ALIGN)
    m, k = qs.shape
    kb = _block_count("qs", k)
    v.array("d", d, np.float32, (m, kb), align=ELEMENT_ALIGN)
    v.array("s", s, np.float32, (m, kb), align=ELEMENT_ALIGN)
    weight_arrays = _check_weight(w, k)
    v.array("out", out, np.float32, (m, w.n), writable=True, align=ELEMENT_ALIGN)
    isa = _qgemm_isa(isa, m, w.kind)
    tile = qgemm_tile(w.kind, isa)
    if isa == "avx2" and m == 1 and w.kind in QGEMM_AVX2_DECODE_KINDS:
        tile = QGEMM_AVX2_DECODE_TILE       # the decode kernel: the same bits, a group pair a pass
    symbol = qgemm_symbol(w.kind, tile, isa)
    weights = [(a.ctypes.data, a.strides[0]) for a in weight_arrays]
    qs_at, d_at, s_at, out_at = qs.ctypes.data, d.ctypes.data, s.ctypes.data, out.ctypes.data
    calls = []
    for rows in ranges:
        n0, n1 = index_range("rows", rows, w.n, labels=("n0", "n1"), multiple=GROUP, why=" (the row group)")
        group0 = n0 // GROUP
        calls.append((symbol, [*(at + group0 * stride for at, stride in weights), qs_at, d_at, s_at,
                               out_at + 4 * n0, m, n1 - n0, kb, w.n]))
    return calls

