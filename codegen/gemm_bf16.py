"""BF16 linear layer on AVX512_BF16: C[m, n] = A[m, k] . W[n, k]^T with bf16 A and W,
and the rounding of f32 activations to the bf16 A it multiplies.

    llb_gemm_bf16_bf16_8x48__avx512(a, w, out, lda, ldo, ncols, m, kc, panel_stride, accumulate)

    a             &A[0, 0]          bf16 pairs (as uint16), row stride lda elements (even)
    w             &panel[n0 / 16]   bf16 pair panels (runtime/layout_bf16.py), panel stride in elements
    out           &C[0, n0]         f32, row stride ldo elements
    kc            k pairs (k rounded up to even, the padding zero in both A and W)
    accumulate    must be 0 (the binding never blocks k)

The weights are packed in panels of 16 rows as the float kinds, but k-pair-major:
one k-pair step of a panel is 16 dwords, each the pair (W[j, 2kk], W[j, 2kk + 1]),
one zmm. ``vdpbf16ps`` adds to each f32 lane the two products of its dword's bf16
pair and the broadcast activation pair (what llama.cpp's bf16 vec_dot does, with
activations converted to bf16 first). Each output is one chain of vdpbf16ps over
the k pairs in order, in every tile shape: a row's bits do not depend on m, on its
position, or on the column split (tests/test_gemm_bf16.py).

Tiles as the AVX-512 float kernel (codegen/gemm.py): blocks of 3 panels, 8 rows x 3
panels = 24 accumulators (zmm16-31 and 8 more), 3 weight vectors, 2 broadcasts; rows
left over run 1..7-row tiles of the same width. Panels after the last whole block
run 1-panel zmm tiles (the padding rows of a partial panel are zero in the layout, so
every load stays inside it) whose store keeps columns < ncols through two ymm masks.

    llb_round_bf16_f32_16__avx512(x, xb, k, ldx, ldb, m)

    x             &X[0, 0]          f32 [m, k], row stride ldx elements
    xb            &A[0, 0]          bf16 bits (uint16) [m, 2 ceil(k / 2)], row stride ldb elements

A = runtime/layout_bf16.to_bf16(X) bit for bit: round to nearest even in integer arithmetic,
(bits + 0x7FFF + bit 16) >> 16, so subnormals round like any other value (``vcvtneps2bf16``
flushes them to zero) and the largest finite values round to infinity; a NaN keeps its high
half with the quiet bit (0x40) set. 16 floats a step (zmm, vpmovdw keeps each dword's low
word); a row's last k % 16 through ymm masks (VMASKMOVPS / VPMASKMOVD: nothing past the row
is read or written). For an odd k that masked store also writes column k, the pair's
padding, as 0 (its lane loads as 0.0), so a buffer needs no clearing first.
"""
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, ZMMRegister, LOAD, Loop, Block, RETURN,
                            VXORPS, VMOVUPS, VMOVAPS, VMASKMOVPS, VPBROADCASTD, VEXTRACTF64X4, VZEROUPPER,
                            VMOVDQU32, VINSERTI64X4, VPSRLD, VPSRAD, VPANDD, VPADDD, VPSUBD, VPORD, VPTERNLOGD,
                            VPMOVDW, VPMASKMOVD, PREFETCHT0, LEA, MOV, ADD, SUB, SHL, SHR, AND, IMUL, CMP, TEST,
                            JB, JAE, JNE, JZ, JNZ, yword)

from .common import Kernel, function, symbol, tail_mask
from .contract import PANEL as NR
from .gemm import (PREFETCH_DISTANCE, SIGNATURE_TAIL, TILINGS, Globals, PanelPointers,
                   RowPointers, _unique, emit_k_loops, emit_rows)
from .peachpy_ext import UPPER_ZMM, VDPBF16PS, upper_zmm_function

ISAS = ("avx512",)
TILING = TILINGS["avx512"]
STEP_BYTES = NR * 4          # one k-pair step of a panel: 16 dwords


def emit_k_loop(acc, a_rows, panels, count, prefetch=True):
    rows, n_panels = len(acc), len(acc[0])
    w_regs = [ZMMRegister() for _ in range(n_panels)]
    bcasts = [ZMMRegister(), ZMMRegister()]

    def k_step(u):
        for p in range(n_panels):
            if prefetch:
                PREFETCHT0(panels.address(p, PREFETCH_DISTANCE + u * STEP_BYTES))
            VMOVUPS(w_regs[p], panels.address(p, u * STEP_BYTES))
        for row in range(rows):
            bcast = bcasts[row % 2]
            VPBROADCASTD(bcast, a_rows.address(row, 4 * u))
            for p in range(n_panels):
                VDPBF16PS(acc[row][p], w_regs[p], bcast)

    def advance(steps):
        a_rows.advance(4 * steps)
        panels.advance(STEP_BYTES * steps)

    emit_k_loops(count, k_step, advance, "bf16_k")


def emit_tile(rows, n_panels, a_row, w_panel, out_row, g, args, column_bytes=0, owns_w_panel=False, edge=False):
    upper = iter(UPPER_ZMM)
    acc = [[next(upper, None) or ZMMRegister() for _ in range(n_panels)] for _ in range(rows)]
    for reg in (r for per_row in acc for r in per_row):
        VXORPS(reg, reg, reg)
    a_rows = RowPointers(a_row, g.lda, rows)
    stride = None
    if n_panels > 1:
        stride = GeneralPurposeRegister64()
        LOAD.ARGUMENT(stride, args["panel_stride"])
        SHL(stride, 1)                                  # uint16 elements -> bytes
    panels = PanelPointers(w_panel, stride, n_panels, owned=owns_w_panel)
    count = GeneralPurposeRegister64()
    LOAD.ARGUMENT(count, args["kc"])
    emit_k_loop(acc, a_rows, panels, count)
    outs = RowPointers(out_row, g.ldo, rows)
    if not edge:
        for row, per_row in enumerate(acc):
            for p, reg in enumerate(per_row):
                VMOVUPS(outs.address(row, column_bytes + p * NR * 4), reg)
        return
    low, high, half = YMMRegister(), YMMRegister(), YMMRegister()
    tail_mask(low, g.ncols_left)
    cols_in_high_half = GeneralPurposeRegister64()
    LEA(cols_in_high_half, [g.ncols_left - 8])          # <= 0 leaves the high mask empty
    tail_mask(high, cols_in_high_half)
    for row, (reg,) in enumerate(acc):
        VMOVAPS(half, reg.as_ymm)
        VMASKMOVPS(outs.address(row), low, half)
        VEXTRACTF64X4(half, reg, 1)
        VMASKMOVPS(outs.address(row, 32), high, half)


def emit_gemm():
    t = TILING
    sig = [("a", "const uint16_t*"), ("w", "const uint16_t*")] + SIGNATURE_TAIL
    fn, arguments = upper_zmm_function(symbol("gemm", "bf16_bf16", t.name, "avx512"), sig, "avx512")
    args = dict(zip((name for name, _ in sig), arguments))
    with fn:
        g = Globals()
        g.load(args)
        # Globals scales the strides for f32 (x4); A is uint16 (x2)
        SHR(g.lda, 1)

        def block_tile(rows, a_row, out_row):
            emit_tile(rows, t.block_panels, a_row, g.w, out_row, g, args)

        def edge_tile(rows, a_row, out_row):
            emit_tile(rows, 1, a_row, g.w, out_row, g, args, edge=True)

        def advance(panels):
            stride = GeneralPurposeRegister64()
            LOAD.ARGUMENT(stride, args["panel_stride"])
            IMUL(stride, stride, panels * 2)
            ADD(g.w, stride)
            ADD(g.out, panels * NR * 4)
            SUB(g.ncols_left, panels * NR)

        block_columns = t.block_panels * NR
        blocks = Loop(_unique("bf16_blocks"))
        CMP(g.ncols_left, block_columns)
        JB(blocks.end)
        with blocks:
            emit_rows(g, args, t.full_rows, block_tile)
            advance(t.block_panels)
            CMP(g.ncols_left, block_columns)
            JAE(blocks.begin)

        edge = Loop(_unique("bf16_edge"))
        TEST(g.ncols_left, g.ncols_left)
        JZ(edge.end)
        with edge:
            emit_rows(g, args, t.full_rows, edge_tile)
            CMP(g.ncols_left, NR)
            JB(edge.end)
            advance(1)
            TEST(g.ncols_left, g.ncols_left)
            JNE(edge.begin)
        VZEROUPPER()
        RETURN()
    return Kernel(fn, "gemm", "avx512", tile=t.name, args=sig)


ROUND_LANES = 16
ROUND_TILE = str(ROUND_LANES)
ROUND_BIAS, QUIET_BIT = 0x7FFF, 0x40
ABS_MASK, INFINITY_BITS = 0x7FFFFFFF, 0x7F800000     # an |x| above +inf's bits is a NaN
NAN_SELECT = 0xB8                                    # vpternlogd a, b, c: b ? c : a, bit by bit


def dword_constant(value, scratch):
    """A zmm with the dword ``value`` in every lane (through the GP register ``scratch``):
    five splats made once per call need no RIP-relative table."""
    register = ZMMRegister()
    MOV(scratch.as_dword, value)
    VPBROADCASTD(register, scratch.as_dword)
    return register


class RoundConstants:
    def __init__(self, scratch):
        self.one = dword_constant(1, scratch)
        self.bias = dword_constant(ROUND_BIAS, scratch)
        self.abs_mask = dword_constant(ABS_MASK, scratch)
        self.infinity = dword_constant(INFINITY_BITS, scratch)
        self.quiet = dword_constant(QUIET_BIT, scratch)


def emit_round_lanes(c, bits):
    """``bits`` (16 f32 as dwords) -> their bf16 bits in each dword's low word (consumed).
    The integer arithmetic of layout_bf16.to_bf16, so the bits match it exactly.

    No k-mask: the 2021 PeachPy cannot allocate mask registers (its SysV table lists none,
    and its liveness analysis rejects a physical k1), so a NaN's lanes are selected by a
    sign-spread vector and vpternlogd."""
    high, rounded = ZMMRegister(), ZMMRegister()
    VPSRLD(high, bits, 16)
    VPANDD(rounded, high, c.one)                     # ties go to the even high half
    VPADDD(rounded, rounded, c.bias)
    VPADDD(rounded, rounded, bits)                   # a carry out of the mantissa bumps the exponent:
    VPSRLD(rounded, rounded, 16)                     # FLT_MAX rounds to inf, as in to_bf16
    # Rounding would turn a NaN with a low payload into inf: keep its high half, made quiet.
    # inf's bits - |x|'s bits < 0 exactly for a NaN (both < 2^31: no overflow).
    VPANDD(bits, bits, c.abs_mask)
    VPSUBD(bits, c.infinity, bits)
    VPSRAD(bits, bits, 31)                           # all ones in a NaN's lane
    VPORD(high, high, c.quiet)
    VPTERNLOGD(rounded, bits, high, NAN_SELECT)
    return rounded


class RoundTail:
    """The masks of a row's last k % 16 floats, the same for every row (ymm: VEX masked moves).

    ``load_low`` / ``load_high``: lanes 0..count-1 of the two 8-float halves (masked-off lanes
    read as 0.0 and nothing past the row is read); ``store``: the (count + 1) / 2 dwords of
    word pairs to write. For an odd k that includes column k, the pair's padding, whose
    lane was loaded as 0.0 and rounds to 0: the pad column needs no store of its own."""

    def __init__(self, count):
        self.count = count
        self.load_low, self.load_high, self.store = YMMRegister(), YMMRegister(), YMMRegister()
        tail_mask(self.load_low, count)
        signed = GeneralPurposeRegister64()
        LEA(signed, [count - 8])                     # <= 0 leaves the high mask empty
        tail_mask(self.load_high, signed)
        LEA(signed, [count + 1])
        SHR(signed, 1)
        tail_mask(self.store, signed)


def emit_round_tail(c, tail, x_at, xb_at):
    low, high = YMMRegister(), YMMRegister()
    VMASKMOVPS(low, tail.load_low, [x_at])
    VMASKMOVPS(high, tail.load_high, [x_at + 32])
    bits = ZMMRegister()
    VINSERTI64X4(bits, low.as_zmm, high, 1)
    words = YMMRegister()
    VPMOVDW(words, emit_round_lanes(c, bits))
    VPMASKMOVD([xb_at], tail.store, words)


def emit_round_row(c, x_row, xb_row, chunks, tail):
    """One row: ``chunks`` whole steps of 16 floats, then the masked tail when k % 16 > 0."""
    x_at, xb_at, left = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
    MOV(x_at, x_row)
    MOV(xb_at, xb_row)
    MOV(left, chunks)
    steps = Loop()
    TEST(left, left)
    JZ(steps.end)
    with steps:
        bits = ZMMRegister()
        VMOVDQU32(bits, [x_at])
        VPMOVDW(yword[xb_at], emit_round_lanes(c, bits))
        ADD(x_at, ROUND_LANES * 4)
        ADD(xb_at, ROUND_LANES * 2)
        SUB(left, 1)
        JNZ(steps.begin)
    last = Block()
    with last:
        TEST(tail.count, tail.count)
        JZ(last.end)
        emit_round_tail(c, tail, x_at, xb_at)


def emit_round():
    sig = [("x", "const float*"), ("xb", "uint16_t*"), ("k", "size_t"), ("ldx", "size_t"),
           ("ldb", "size_t"), ("m", "size_t")]
    fn, arguments = function(symbol("round", "bf16_f32", ROUND_TILE, "avx512"), sig, "avx512")
    args = dict(zip((name for name, _ in sig), arguments))
    with fn:
        x, xb, chunks, x_stride, xb_stride, rows = (GeneralPurposeRegister64() for _ in range(6))
        for reg, name in zip((x, xb, chunks, x_stride, xb_stride, rows), ("x", "xb", "k", "ldx", "ldb", "m")):
            LOAD.ARGUMENT(reg, args[name])
        SHL(x_stride, 2)                                # elements -> bytes
        SHL(xb_stride, 1)
        count = GeneralPurposeRegister64()
        MOV(count, chunks)
        AND(count, ROUND_LANES - 1)
        SHR(chunks, 4)                                  # k -> whole steps
        tail = RoundTail(count)
        c = RoundConstants(GeneralPurposeRegister64())
        row_loop = Loop()
        TEST(rows, rows)
        JZ(row_loop.end)
        with row_loop:
            emit_round_row(c, x, xb, chunks, tail)
            ADD(x, x_stride)
            ADD(xb, xb_stride)
            SUB(rows, 1)
            JNZ(row_loop.begin)
        VZEROUPPER()
        RETURN()
    return Kernel(fn, "gemm", "avx512", tile=ROUND_TILE, args=sig)


def emit(isa):
    return [emit_gemm(), emit_round()] if isa == "avx512" else []
