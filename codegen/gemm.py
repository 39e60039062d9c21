"""Floating-point linear layer: C[m, n] = A[m, k] . W[n, k]^T on packed weight panels.

The weights come packed by runtime/layout_float.py: panels of NR = 16 weight
rows, k-major inside a panel, so one k step of a panel is 16 contiguous
weights (two ymm loads, f32; or two VCVTPH2PS loads, f16). The activations A
stay as they are (row-major, any row stride): each k step broadcasts one
element of each of MR = 6 rows.

Register tile (BLIS-style, Haswell sgemm shape): 6 rows x 16 columns = 12 ymm
accumulators + 2 weight registers + 1 broadcast = 15 of the 16 ymm. Twelve
independent FMA chains cover the FMA latency (4 cycles) x 2 FMA pipes = 8 in
flight with room to spare; each k step issues 12 FMAs for 8 loads.

Tiles with fewer rows (the m remainder, and m == 1 decode) have fewer chains,
so they split the k loop over 2 or 4 accumulator sets (k step u feeds set
u % sets) that are summed at the end: a 1-row tile would otherwise run at one
FMA per 2 cycles, bound by the FMA latency rather than by the weight stream.

One call computes the columns [0, ncols) of ``out`` over rows [0, m) for one
block of k (``kc`` steps): for every panel, for every 6-row tile of A. The
first tile streams the panel in from memory (software-prefetched), the
others read it from L2; the binding chooses kc (k blocking) and splits large
m (see runtime/native/gemm.py for the measurements). ``accumulate`` = 0 overwrites
``out``, 1 adds to it (the k blocks after the first). Columns beyond ncols
of the last panel are computed on zero padding and never stored (masked
stores), rows beyond m are never computed.

    llb_gemm_<wtype>_f32_6x16__avx2(a, w, out, lda, ldo, ncols, m, kc, panel_stride, accumulate)

    a             &A[0, k0]                  f32, row stride lda elements
    w             &panel[n0 / 16][k0][0]     f32 or f16 (as uint16), panel stride panel_stride elements
    out           &C[0, n0]                  f32, row stride ldo elements
"""
import itertools

from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LOAD, Loop, Label, LABEL, RETURN,
                            VXORPS, VADDPS, VMOVUPS, VMASKMOVPS, VBROADCASTSS, VFMADD231PS, VCVTPH2PS,
                            VZEROUPPER, PREFETCHT0, MOV, LEA, ADD, SUB, SHL, CMP, TEST, JB, JAE, JBE, JNE, JZ, JNZ, JMP)

from .common import Kernel, function, symbol, tail_mask

MR = 6                # rows of A per register tile
NR = 16               # weight rows per panel = columns of C per tile (two ymm)
K_UNROLL = 4          # k steps per main-loop iteration
LANES = 8
# Software prefetch of the weight stream, this many bytes ahead (one PREFETCHT0
# per 64-byte line). The hardware prefetcher alone left a single weight stream
# from DRAM at 44 GB/s; 16 KiB ahead gave 53 (f32) / 65 (f16) GB/s for m == 1
# and took 4096x4096 at m = 16 from 76 to 124 GFLOP/s (Zen 5). 8 KiB was
# half-way; 32 KiB cost 25 % on weights already in L2/L3.
PREFETCH_DISTANCE = 16384

# Bytes of one element of the weight panel, by weight type.
WEIGHT_BYTES = {"f32": 4, "f16": 2}
WEIGHT_C_TYPE = {"f32": "const float*", "f16": "const uint16_t*"}

_label_ids = itertools.count()


def _unique(what):
    """A unique label name: PeachPy infers names from the source line, which
    collides when the same line emits many labels in a Python loop."""
    return f"{what}_{next(_label_ids)}"


def _label(what):
    return Label(_unique(what))


def accumulator_sets(rows):
    """Independent accumulator sets for a tile of ``rows`` rows: enough FMA chains
    to hide the FMA latency, within 15 ymm (sets * 2 * rows + 3)."""
    if rows == 1:
        return 4
    if rows <= 3:
        return 2
    return 1


class TileRegisters:
    """The GP registers a tile reads: row pointers of A and the weight pointer."""

    def __init__(self, a_row0, a_row3, lda, w_ptr):
        self.a_row0, self.a_row3, self.lda, self.w_ptr = a_row0, a_row3, lda, w_ptr

    def a_element(self, row, k_offset_bytes):
        """Address of A[row, kk + k_offset]: rows 0..2 from a_row0, 3..5 from a_row3 (lda scaled 1, 2)."""
        base = self.a_row0 if row < 3 else self.a_row3
        step = row % 3
        if step == 0:
            return [base + k_offset_bytes]
        return [base + self.lda * step + k_offset_bytes]


def load_weights(w_regs, w_ptr, weight_type, k_step):
    """Load the 16 weights of one k step of the panel into two ymm (as f32)."""
    esize = WEIGHT_BYTES[weight_type]
    offset = k_step * NR * esize
    for half, reg in enumerate(w_regs):
        address = [w_ptr + offset + half * LANES * esize]
        if weight_type == "f32":
            VMOVUPS(reg, address)
        else:
            VCVTPH2PS(reg, address)


def emit_k_loop(rows, regs, count, weight_type):
    """Accumulate the tile over ``count`` k steps; returns the accumulators [row][half]."""
    sets = accumulator_sets(rows)
    acc = [[[YMMRegister() for _ in range(2)] for _ in range(rows)] for _ in range(sets)]
    for reg in (r for s in acc for row in s for r in row):
        VXORPS(reg, reg, reg)
    w_regs = [YMMRegister(), YMMRegister()]
    a_bcast = YMMRegister()
    esize = WEIGHT_BYTES[weight_type]

    def k_step(u, accs):
        if (u * NR * esize) % 64 == 0:
            PREFETCHT0([regs.w_ptr + PREFETCH_DISTANCE + u * NR * esize])
        load_weights(w_regs, regs.w_ptr, weight_type, u)
        for row in range(rows):
            VBROADCASTSS(a_bcast, regs.a_element(row, 4 * u))
            VFMADD231PS(accs[row][0], w_regs[0], a_bcast)
            VFMADD231PS(accs[row][1], w_regs[1], a_bcast)

    def advance(steps):
        ADD(regs.a_row0, 4 * steps)
        if rows > 3:
            ADD(regs.a_row3, 4 * steps)
        ADD(regs.w_ptr, NR * esize * steps)

    unrolled = Loop(_unique("k_unrolled"))
    CMP(count, K_UNROLL)
    JB(unrolled.end)
    with unrolled:
        for u in range(K_UNROLL):
            k_step(u, acc[u % sets])
        advance(K_UNROLL)
        SUB(count, K_UNROLL)
        CMP(count, K_UNROLL)
        JAE(unrolled.begin)

    single = Loop(_unique("k_single"))
    TEST(count, count)
    JZ(single.end)
    with single:
        k_step(0, acc[0])
        advance(1)
        SUB(count, 1)
        JNZ(single.begin)

    for s in range(1, sets):
        for row in range(rows):
            for half in range(2):
                VADDPS(acc[0][row][half], acc[0][row][half], acc[s][row][half])
    return acc[0]


def emit_store(acc, out_row0, ldo, ncols_left, accumulate_arg):
    """Store (or add into) the tile at out_row0; lanes at columns >= ncols_left are not touched."""
    rows = len(acc)
    out_row3 = GeneralPurposeRegister64()
    if rows > 3:
        LEA(out_row3, [ldo + ldo * 2])
        ADD(out_row3, out_row0)

    def out_address(row, half):
        base = out_row0 if row < 3 else out_row3
        step = row % 3
        offset = half * LANES * 4
        return [base + offset] if step == 0 else [base + ldo * step + offset]

    tiles = [(row, half) for row in range(rows) for half in range(2)]
    accumulate = GeneralPurposeRegister64()
    LOAD.ARGUMENT(accumulate, accumulate_arg)
    masked, done = _label("store_masked"), _label("store_done")
    full_overwrite, masked_overwrite = _label("store_full_overwrite"), _label("store_masked_overwrite")

    CMP(ncols_left, NR)
    JB(masked)
    TEST(accumulate, accumulate)
    JZ(full_overwrite)
    for row, half in tiles:
        VADDPS(acc[row][half], acc[row][half], out_address(row, half))
    LABEL(full_overwrite)
    for row, half in tiles:
        VMOVUPS(out_address(row, half), acc[row][half])
    JMP(done)

    LABEL(masked)
    masks = [YMMRegister(), YMMRegister()]
    tail_mask(masks[0], ncols_left)
    cols_in_high_half = GeneralPurposeRegister64()
    LEA(cols_in_high_half, [ncols_left - LANES])    # <= 0 leaves the high mask empty
    tail_mask(masks[1], cols_in_high_half)
    TEST(accumulate, accumulate)
    JZ(masked_overwrite)
    previous = YMMRegister()
    for row, half in tiles:
        VMASKMOVPS(previous, masks[half], out_address(row, half))
        VADDPS(acc[row][half], acc[row][half], previous)
    LABEL(masked_overwrite)
    for row, half in tiles:
        VMASKMOVPS(out_address(row, half), masks[half], acc[row][half])
    LABEL(done)


def emit_tile(rows, a_row, w_panel, lda, out_row, ldo, ncols_left, args, weight_type):
    """One rows x 16 tile over the call's k block: k loop, then store."""
    a_row0, w_ptr, count = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
    MOV(a_row0, a_row)
    MOV(w_ptr, w_panel)
    LOAD.ARGUMENT(count, args["kc"])
    a_row3 = GeneralPurposeRegister64()
    if rows > 3:
        LEA(a_row3, [lda + lda * 2])
        ADD(a_row3, a_row0)
    acc = emit_k_loop(rows, TileRegisters(a_row0, a_row3, lda, w_ptr), count, weight_type)
    emit_store(acc, out_row, ldo, ncols_left, args["accumulate"])


def advance_rows(pointer, stride, rows):
    """pointer += rows * stride, for rows a multiple of 3 (LEA scales by 2, then one ADD)."""
    for _ in range(rows // 3):
        LEA(pointer, [pointer + stride * 2])
        ADD(pointer, stride)


def emit_column_of_tiles(a, w_panel, lda, out_panel, ldo, ncols_left, args, weight_type):
    """All rows of A against one panel: full 6-row tiles, then the 1..5-row remainder."""
    a_row, out_row, m_left = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
    MOV(a_row, a)
    MOV(out_row, out_panel)
    LOAD.ARGUMENT(m_left, args["m"])
    column_done = _label("column_done")

    full_tiles = Loop(_unique("full_tiles"))
    CMP(m_left, MR)
    JB(full_tiles.end)
    with full_tiles:
        emit_tile(MR, a_row, w_panel, lda, out_row, ldo, ncols_left, args, weight_type)
        advance_rows(a_row, lda, MR)
        advance_rows(out_row, ldo, MR)
        SUB(m_left, MR)
        CMP(m_left, MR)
        JAE(full_tiles.begin)

    for rows in range(MR - 1, 0, -1):
        not_this = _label(f"not_{rows}_rows")
        CMP(m_left, rows)
        JNE(not_this)
        emit_tile(rows, a_row, w_panel, lda, out_row, ldo, ncols_left, args, weight_type)
        JMP(column_done)
        LABEL(not_this)
    LABEL(column_done)


SIGNATURE_TAIL = [("out", "float*"), ("lda", "size_t"), ("ldo", "size_t"), ("ncols", "size_t"),
                  ("m", "size_t"), ("kc", "size_t"), ("panel_stride", "size_t"), ("accumulate", "size_t")]


def emit_gemm(isa, weight_type):
    sig = [("a", "const float*"), ("w", WEIGHT_C_TYPE[weight_type])] + SIGNATURE_TAIL
    fn, arguments = function(symbol("gemm", f"{weight_type}_f32", f"{MR}x{NR}", isa), sig, isa)
    args = dict(zip((name for name, _ in sig), arguments))
    esize = WEIGHT_BYTES[weight_type]
    with fn:
        # The first six arguments live in registers for the whole call; the
        # rest are re-read from the stack where needed (GP registers are short).
        a, w_panel, out_panel = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
        lda, ldo, ncols_left = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
        for reg, name in ((a, "a"), (w_panel, "w"), (out_panel, "out"), (lda, "lda"), (ldo, "ldo"),
                          (ncols_left, "ncols")):
            LOAD.ARGUMENT(reg, args[name])
        SHL(lda, 2)
        SHL(ldo, 2)

        panels = Loop(_unique("panels"))
        with panels:
            emit_column_of_tiles(a, w_panel, lda, out_panel, ldo, ncols_left, args, weight_type)
            CMP(ncols_left, NR)
            JBE(panels.end)
            SUB(ncols_left, NR)
            panel_stride = GeneralPurposeRegister64()
            LOAD.ARGUMENT(panel_stride, args["panel_stride"])
            SHL(panel_stride, esize.bit_length() - 1)      # elements -> bytes
            ADD(w_panel, panel_stride)
            ADD(out_panel, NR * 4)
            JMP(panels.begin)
        VZEROUPPER()    # PeachPy does not add it; SSE code after us must not pay for dirty upper halves
        RETURN()
    return Kernel(fn, "gemm", isa, tile=f"{MR}x{NR}", args=sig)


def emit(isa):
    return [emit_gemm(isa, weight_type) for weight_type in ("f32", "f16")]
