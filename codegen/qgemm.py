"""Quantized-weight GEMM: out[m, n] = act[m, k] . W[n, k]^T with int8 dot products.

    llb_qgemm_<kind>_q8_<MR>x8__avx2(wq, wscale, aq, ad, asum, out, m, n, kb, ldo)

W is a packed ``q4_1`` or ``q8_0`` weight (runtime/layout_quant.py: groups of
8 rows, quant bytes interleaved 4 at a time, f16 scales); the activations are
Q8 blocks from quantize_q8: ``aq`` int8 [m, 32 kb], ``ad`` and ``asum`` f32
[m, kb] (scale, and scale * sum of the block's quants). ``wq`` / ``wscale``
point at the first row group to compute, ``out`` at the output element of that
group's first row, ``ldo`` is the output row stride in elements; only the
``n`` columns asked for are written (the last group's store is masked), so
threads can split a weight by row groups.

One 32-byte weight load holds 4 quant bytes of each of 8 rows. A broadcast of
the matching 4 activation bytes and ``vpmaddubsw`` (unsigned weight x signed
activation) leave, per row, two int16 pair sums; ``vpmaddwd`` with ones adds
those into one int32 lane per row. Then per block

    out += (d_w * d_a) * sum(q_w * q_a)   [+ m_w * s_a for q4_1]

q4_1 nibbles are 0..15, so a pair sum is at most 2*15*127 = 3810 and the 8
``vpmaddubsw`` of a block are summed in int16 (at most 30480) before a single
``vpmaddwd``. q8_0 weights are signed: |w| goes into the unsigned operand and
w's sign onto the activation (``vpsignb``; activations lie in [-127, 127]),
and each pair sum (up to 2*128*127) needs its own ``vpmaddwd``.

Loop order: row groups outside, activation row tiles inside. One group's
weights (k/32 blocks of 160 bytes for q4_1: 20 KB at k = 4096) stay in L1
while every tile of MR activation rows streams past, so a prefill reads the
weights from memory once; decode (m = 1) streams them straight through, with
a software prefetch well ahead of the hardware prefetchers.
A tile holds MR rows x 8 outputs of f32 accumulators and MR int16/int32 block
accumulators: 2 * MR + 4 ymm registers, so MR = 6. Rows left over at the end
(m % MR) run a copy of the tile code specialised for that many rows, which
keeps its constants in the registers the smaller tile leaves free.
"""
from dataclasses import dataclass

from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LOAD, Loop, Label, LABEL, RETURN,
                            LocalVariable, ADD, SUB, MOV, SHL, SHR, IMUL, LEA, CMP, JB, JNE, JAE, JG, JMP, JNZ,
                            VMOVDQA, VPSRLW, VPAND, VPBROADCASTD, VPMADDUBSW, VPADDW, VPMADDWD, VPADDD,
                            VPABSB, VPSIGNB, VCVTDQ2PS, VCVTPH2PS, VBROADCASTSS, VMULPS, VADDPS,
                            VFMADD231PS, VXORPS, VMOVUPS, VMASKMOVPS, PREFETCHT0)

from .common import Kernel, function, symbol, tail_mask

BLOCK = 32           # weights per block (GGUF)
GROUP = 8            # weight rows per group = f32 lanes of one output vector
CHUNK = 4            # quant bytes of one row per 32-byte load
MR = 6               # activation rows per tile (register budget, see the module docstring)
YMM_COUNT = 16
# Decode streams the weights once: prefetching 16 KiB ahead lifts a cold single-thread
# GEMV from ~32 to ~43 GB/s, the machine's read-probe bandwidth (measured 4-64 KiB).
PREFETCH_BYTES = 16384


@dataclass(frozen=True)
class QuantKind:
    name: str
    quant_bytes: int      # per block of one group (8 rows)
    scale_bytes: int      # f16 scales (and mins) per block of one group
    has_min: bool


Q4_1 = QuantKind("q4_1", quant_bytes=GROUP * BLOCK // 2, scale_bytes=2 * GROUP * 2, has_min=True)
Q8_0 = QuantKind("q8_0", quant_bytes=GROUP * BLOCK, scale_bytes=GROUP * 2, has_min=False)
KINDS = (Q4_1, Q8_0)

SIGNATURE = [("wq", "const uint8_t*"), ("wscale", "const uint16_t*"), ("aq", "const int8_t*"),
             ("ad", "const float*"), ("asum", "const float*"), ("out", "float*"),
             ("m", "size_t"), ("n", "size_t"), ("kb", "size_t"), ("ldo", "size_t")]


def kernel_symbol(kind_name, isa="avx2"):
    return symbol("qgemm", f"{kind_name}_q8", f"{MR}x{GROUP}", isa)


class RowAddresses:
    """Addresses of MR rows that are ``stride`` bytes apart, from one base register.

    x86 addressing reaches base + {0, 1, 2} * stride; rows 3..5 go through
    ``spare`` = base + 3 * stride, set up by ``prepare``."""

    def __init__(self, base, stride, spare, rows):
        self.base, self.stride, self.spare, self.rows = base, stride, spare, rows

    def prepare(self):
        if self.rows > 3:
            LEA(self.spare, [self.base + self.stride * 2])
            ADD(self.spare, self.stride)

    def __call__(self, i, offset=0):
        base = self.base if i < 3 else self.spare
        scaled = (None, self.stride * 1, self.stride * 2)[i % 3]
        return [base + offset] if i % 3 == 0 else [base + scaled + offset]


class Registers:
    """The GP registers every part of the kernel shares."""

    def __init__(self):
        names = ("wq", "wscale", "act", "act_scale", "act_sum", "out_row", "groups_left_cols",
                 "rows_left", "blocks_left", "row_stride", "scale_stride", "spare")
        for name in names:
            setattr(self, name, GeneralPurposeRegister64())


def emit_block_q4_1(r, consts, acc, facc):
    """One 32-weight block of one group for ``len(acc)`` activation rows."""
    lo, hi, bcast, prod = (YMMRegister() for _ in range(4))
    row = RowAddresses(r.act, r.row_stride, r.spare, len(acc))
    row.prepare()
    for c in range(BLOCK // 2 // CHUNK):
        VMOVDQA(lo, [r.wq + 32 * c])
        VPSRLW(hi, lo, 4)
        VPAND(lo, lo, consts.nibble)
        VPAND(hi, hi, consts.nibble)
        for i in range(len(acc)):
            # low nibbles are weights 4c..4c+3 of the block, high nibbles 16+4c..16+4c+3
            VPBROADCASTD(bcast, row(i, CHUNK * c))
            if c == 0:
                VPMADDUBSW(acc[i], lo, bcast)
            else:
                VPMADDUBSW(prod, lo, bcast)
                VPADDW(acc[i], acc[i], prod)
            VPBROADCASTD(bcast, row(i, BLOCK // 2 + CHUNK * c))
            VPMADDUBSW(prod, hi, bcast)
            VPADDW(acc[i], acc[i], prod)
    for a in acc:
        VPMADDWD(a, a, consts.ones)
    d_w, m_w = lo, hi
    VCVTPH2PS(d_w, [r.wscale])
    VCVTPH2PS(m_w, [r.wscale + GROUP * 2])
    emit_block_scale(r, acc, facc, d_w, m_w, bcast, prod)


def emit_block_q8_0(r, consts, acc, facc):
    w, w_abs, bcast = (YMMRegister() for _ in range(3))
    row = RowAddresses(r.act, r.row_stride, r.spare, len(acc))
    row.prepare()
    for c in range(BLOCK // CHUNK):
        VMOVDQA(w, [r.wq + 32 * c])
        VPABSB(w_abs, w)
        for i in range(len(acc)):
            target = acc[i] if c == 0 else bcast
            VPBROADCASTD(target, row(i, CHUNK * c))
            VPSIGNB(target, target, w)
            VPMADDUBSW(target, w_abs, target)
            VPMADDWD(target, target, consts.ones)
            if c > 0:
                VPADDD(acc[i], acc[i], bcast)
    d_w = w
    VCVTPH2PS(d_w, [r.wscale])
    emit_block_scale(r, acc, facc, d_w, None, bcast, w_abs)


def emit_block_scale(r, acc, facc, d_w, m_w, bcast, prod):
    """facc[i] += (d_w * d_a[i]) * acc[i]  (+ m_w * s_a[i]); acc holds int32 block sums."""
    scales = RowAddresses(r.act_scale, r.scale_stride, r.spare, len(acc))
    scales.prepare()
    for i in range(len(acc)):
        VCVTDQ2PS(acc[i], acc[i])
        VBROADCASTSS(bcast, scales(i))
        VMULPS(bcast, bcast, d_w)
        VFMADD231PS(facc[i][0], acc[i], bcast)
    if m_w is None:
        return
    sums = RowAddresses(r.act_sum, r.scale_stride, r.spare, len(acc))
    sums.prepare()
    for i in range(len(acc)):
        VBROADCASTSS(prod, sums(i))
        # a second accumulator (when registers allow) halves the FMA latency chain
        VFMADD231PS(facc[i][-1], m_w, prod)


class TileConstants:
    """The vector constants of the block loop: in registers when the tile leaves some free
    (a memory operand costs a load per use: 10 -> 12.7 cycles a block in the decode GEMV),
    else RIP-relative memory operands. Spare registers after that give each row a second
    accumulator for the min term."""

    def __init__(self, kind, rows):
        working = 4 if kind is Q4_1 else 3       # weight, unpacked / |w|, broadcast, product
        spare = YMM_COUNT - working - 2 * rows  # block sums and f32 accumulators
        wanted = {"nibble": Constant.uint32x8(0x0F0F0F0F), "ones": Constant.uint16x16(1)}
        if kind is not Q4_1:
            del wanted["nibble"]
        for name, constant in wanted.items():
            if spare > 0:
                register = YMMRegister()
                VMOVDQA(register, constant)
                constant, spare = register, spare - 1
            setattr(self, name, constant)
        self.accumulators_per_row = 2 if kind.has_min and spare >= rows else 1


def emit_tile(r, kind, rows, ldo_bytes, name):
    """out[rows x 8] of the current group and row tile; leaves the pointers where it found them."""
    consts = TileConstants(kind, rows)
    facc = [[YMMRegister() for _ in range(consts.accumulators_per_row)] for _ in range(rows)]
    for pair in facc:
        for f in pair:
            VXORPS(f, f, f)
    MOV(r.blocks_left, r.scale_stride)
    SHR(r.blocks_left, 2)
    with Loop() as blocks:
        if rows == 1:
            # only the decode path streams; bigger tiles re-read the group from L1
            for line in range(0, kind.quant_bytes, 64):
                PREFETCHT0([r.wq + PREFETCH_BYTES + line])
        acc = [YMMRegister() for _ in range(rows)]
        if kind is Q4_1:
            emit_block_q4_1(r, consts, acc, facc)
        else:
            emit_block_q8_0(r, consts, acc, facc)
        ADD(r.act, BLOCK)
        ADD(r.act_scale, 4)
        ADD(r.act_sum, 4)
        ADD(r.wq, kind.quant_bytes)
        ADD(r.wscale, kind.scale_bytes)
        SUB(r.blocks_left, 1)
        JNZ(blocks.begin)
    rewind_blocks(r, kind)
    for pair in facc:
        if len(pair) > 1:
            VADDPS(pair[0], pair[0], pair[1])
    store_tile(r, [pair[0] for pair in facc], ldo_bytes, name)


def rewind_blocks(r, kind):
    """Undo the block loop's pointer walk (k bytes of activations, kb blocks of weights)."""
    SUB(r.act, r.row_stride)
    SUB(r.act_scale, r.scale_stride)
    SUB(r.act_sum, r.scale_stride)
    MOV(r.spare, r.scale_stride)
    IMUL(r.spare, r.spare, kind.quant_bytes // 4)
    SUB(r.wq, r.spare)
    MOV(r.spare, r.scale_stride)
    IMUL(r.spare, r.spare, kind.scale_bytes // 4)
    SUB(r.wscale, r.spare)


def store_tile(r, totals, ldo_bytes, name):
    """Rows of 8 outputs; the group at the right edge (fewer than 8 columns left) is masked."""
    partial, done = Label(f"{name}_partial"), Label(f"{name}_stored")
    MOV(r.spare, r.out_row)
    CMP(r.groups_left_cols, GROUP)
    JB(partial)
    for i, total in enumerate(totals):
        VMOVUPS([r.spare], total)
        if i + 1 < len(totals):
            ADD(r.spare, ldo_bytes)
    JMP(done)
    LABEL(partial)
    mask = YMMRegister()
    tail_mask(mask, r.groups_left_cols)
    for i, total in enumerate(totals):
        VMASKMOVPS([r.spare], mask, total)
        if i + 1 < len(totals):
            ADD(r.spare, ldo_bytes)
    LABEL(done)


def emit_qgemm(kind, isa):
    fn, args = function(kernel_symbol(kind.name, isa), SIGNATURE, isa)
    a_wq, a_wscale, a_aq, a_ad, a_asum, a_out, a_m, a_n, a_kb, a_ldo = args
    with fn:
        r = Registers()
        # loaded once per row group; kept in the stack frame to spare registers
        act_base, scale_base, sum_base, m_rows, ldo_bytes, out_group = (LocalVariable(8) for _ in range(6))
        LOAD.ARGUMENT(r.wq, a_wq)
        LOAD.ARGUMENT(r.wscale, a_wscale)
        for local, arg in ((act_base, a_aq), (scale_base, a_ad), (sum_base, a_asum), (m_rows, a_m),
                           (out_group, a_out)):
            LOAD.ARGUMENT(r.spare, arg)
            MOV(local, r.spare)
        LOAD.ARGUMENT(r.spare, a_ldo)
        SHL(r.spare, 2)
        MOV(ldo_bytes, r.spare)
        LOAD.ARGUMENT(r.groups_left_cols, a_n)
        LOAD.ARGUMENT(r.scale_stride, a_kb)
        MOV(r.row_stride, r.scale_stride)
        SHL(r.row_stride, 5)           # k bytes per activation row
        SHL(r.scale_stride, 2)         # kb floats per activation scale row

        with Loop() as groups:
            MOV(r.act, act_base)
            MOV(r.act_scale, scale_base)
            MOV(r.act_sum, sum_base)
            MOV(r.out_row, out_group)
            MOV(r.rows_left, m_rows)
            group_done = Label("group_done")

            full_tiles = Loop()
            CMP(r.rows_left, MR)
            JB(full_tiles.end)
            with full_tiles:
                emit_tile(r, kind, MR, ldo_bytes, f"tile{MR}")
                advance_rows(r, MR, ldo_bytes)
                SUB(r.rows_left, MR)
                CMP(r.rows_left, MR)
                JAE(full_tiles.begin)
            for rows in range(1, MR):
                other = Label(f"not{rows}")
                CMP(r.rows_left, rows)
                JNE(other)
                emit_tile(r, kind, rows, ldo_bytes, f"tile{rows}")
                JMP(group_done)
                LABEL(other)
            LABEL(group_done)

            MOV(r.spare, r.scale_stride)
            IMUL(r.spare, r.spare, kind.quant_bytes // 4)
            ADD(r.wq, r.spare)
            MOV(r.spare, r.scale_stride)
            IMUL(r.spare, r.spare, kind.scale_bytes // 4)
            ADD(r.wscale, r.spare)
            ADD(out_group, GROUP * 4)
            SUB(r.groups_left_cols, GROUP)
            JG(groups.begin)
        RETURN()
    return Kernel(fn, "qgemm", isa, tile=f"{MR}x{GROUP}", args=SIGNATURE)


def advance_rows(r, rows, ldo_bytes):
    for reg, stride in ((r.act, r.row_stride), (r.act_scale, r.scale_stride), (r.act_sum, r.scale_stride)):
        MOV(r.spare, stride)
        IMUL(r.spare, r.spare, rows)
        ADD(reg, r.spare)
    MOV(r.spare, ldo_bytes)
    IMUL(r.spare, r.spare, rows)
    ADD(r.out_row, r.spare)


def emit(isa):
    return [emit_qgemm(kind, isa) for kind in KINDS]
