"""BF16 linear layer on AVX512_BF16: C[m, n] = A[m, k] . W[n, k]^T with bf16 A and W.

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
"""
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, ZMMRegister, LOAD, Loop, RETURN,
                            VXORPS, VMOVUPS, VMOVAPS, VMASKMOVPS, VPBROADCASTD, VEXTRACTF64X4, VZEROUPPER,
                            PREFETCHT0, LEA, ADD, SUB, SHL, IMUL, CMP, TEST, JB, JAE, JNE, JZ)

from .common import Kernel, symbol, tail_mask
from .contract import PANEL as NR
from .gemm import (PREFETCH_DISTANCE, SIGNATURE_TAIL, TILINGS, UPPER_ZMM, Globals, PanelPointers,
                   RowPointers, _unique, emit_k_loops, emit_rows)
from .peachpy_ext import VDPBF16PS, upper_zmm_function

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
        from peachpy.x86_64 import SHR
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


def emit(isa):
    return [emit_gemm()] if isa == "avx512" else []
