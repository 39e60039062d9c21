"""K-quant weight GEMM: Q4_K / Q5_K weights x Q8 activations on the qgemm driver.

    llb_qgemm_q4_k_q8_6x8__avx2(wq, wscale, aq, ad, asum, out, m, n, kb, ldo)
    llb_qgemm_q5_k_q8_16x16__avx512(...)         (and the other two)
    llb_qgemm_q4_k_q8_1x16__avx2(...)            the AVX2 decode kernel (see "AVX2 decode")

The arguments, tiles, loops and stores are codegen/qgemm.py's; only the tiles'
block loop differs. ``wq`` points at a ``q4_k`` / ``q5_k`` weight's ``qs`` and
``wscale`` at its ``scales`` (runtime/layout_kquant.py): per super-block of a
row group one 160-byte record with the 8 rows' f16 ``d`` and ``-dmin`` and, per
32-weight block, their uint8 sub-block scales ``sc`` and mins ``m``.

A K-quant block is a q4_1 block whose scale and min are ``d * sc`` and
``-dmin * m``, so per block

    out += (d * sc * d_a) * sum(q_w * q_a) + (-dmin * m) * s_a

with the integer dot product exact in int32 and the two products of scale
fields exact in f32 (11 x 6 mantissa bits). The tile walks super-blocks, their
8 blocks unrolled: each block widens its 8 (AVX-512: 16) sub-scales and mins
(``vpmovzxbd``, ``vcvtdq2ps``) and multiplies them by the record's ``d`` and
``-dmin``, converted once per super-block when registers allow; that is a few
instructions per block shared by every activation row of the tile. The AVX2
tile's pointers stay at the super-block (displacements reach its blocks); the
AVX-512 one walks block by block (PeachPy misencodes broadcast displacements
that are multiples of 64, see peachpy_ext.broadcast).

Decode (m < 4) runs on AVX-512 too when the CPU has it (runtime/native/quant.py
AVX512_DECODE_KINDS): the AVX2 GEMV is bound by its unpacking instructions, not by
memory, and the AVX-512 one-row tile does half of them per byte and prefetches
all four of its streams (two groups' quants and scale records).

Q5_K's fifth quant bit. The fifth chunk of a block holds each row's 32 high
bits, arranged so that for chunk c one word shift brings the bits of the low
nibbles (bit 2c of each byte) and of the high nibbles (bit 2c + 1) to bit 4,
where a mask 0x10 and an OR (AVX-512: one ``vpternlogd``) put them over the
nibbles: q in 0..31. A ``vpmaddubsw`` pair sum is then up to 2 * 31 * 127 =
7874, so at most four of them are summed in int16: on AVX2 chunks 0 and 1
accumulate in int16 and go to int32 with one ``vpmaddwd``; chunks 2 and 3 do
the same in a second int16 sum where the tile has a register for it, else each
widens its two products on its own. (``vpdpbusd`` sums into int32: no limit.)

Summation order: every tile, AVX2 or AVX-512, any row count, adds each block
to one f32 accumulator per row with the same three operations (a multiply
for the scale product, then an FMA for the dot product and one for the min
term), so results are bit-identical across tiles and ISAs: a row's result does
not depend on the other rows of its batch.
"""
from dataclasses import dataclass

from peachpy import Constant
from peachpy.x86_64 import (YMMRegister, XMMRegister, ZMMRegister, Loop, ADD, SUB, XOR, JNZ,
                            VMOVDQA, VMOVDQU, VMOVQ, VPINSRQ, VPSRLW, VPSLLW, VPAND, VPOR, VPANDD, VPTERNLOGD,
                            VPBROADCASTD, VPMADDUBSW, VPADDW, VPMADDWD, VPADDD, VPMOVZXBD, VCVTDQ2PS,
                            VCVTPH2PS, VBROADCASTSS, VMULPS, VFMADD231PS, VXORPS, VINSERTI128, PREFETCHT0)

from .peachpy_ext import VPDPBUSD, broadcast
from .contract import (BLOCK, CHUNK, GROUP, KQ_SUB_BLOCKS, KQ_MINS_OFFSET, KQ_BLOCK_SCALES_OFFSET,
                       KQ_BLOCK_SCALES_BYTES, KQ_SCALE_RECORD, QGEMM_AVX2_DECODE_KINDS)
from .qgemm import (PREFETCH_BYTES, YMM_COUNT, SIGNATURE, TILINGS, Family, QuantsAndScales, RowAddresses, TOTALS,
                    NIBBLE_BYTES, Tiling, emit_qgemm, place_constants, count_blocks, emit_block_scale,
                    store_tile_avx2, store_pair_avx2, store_tile_avx512, rewind_blocks, broadcast_constant,
                    load_pair, zero, emit_row_q4_1)

ISAS = ("avx2", "avx512")
NIBBLE_CHUNKS = BLOCK // 2 // CHUNK          # 4 chunks of nibbles per block
HIGH_BIT = 0x10                              # the fifth bit, over a nibble
# vpternlogd truth table of a | (b & c) (bit 4a + 2b + c of the immediate is the result)
OR_MASKED = sum(1 << (4 * a + 2 * b + c) for a in (0, 1) for b in (0, 1) for c in (0, 1) if a | (b & c))
LINE = 64


@dataclass(frozen=True)
class KQuantKind(QuantsAndScales):
    name: str
    quant_bytes: int      # per block of one group (8 rows): nibbles (+ high bits)
    five_bit: bool
    # the driver's pointer arithmetic counts per block: a record per 8 blocks
    scale_bytes: int = KQ_SCALE_RECORD // KQ_SUB_BLOCKS
    has_min: bool = True

    @property
    def high_bits_offset(self):
        return NIBBLE_CHUNKS * GROUP * CHUNK


Q4_K = KQuantKind("q4_k", quant_bytes=GROUP * BLOCK // 2, five_bit=False)
Q5_K = KQuantKind("q5_k", quant_bytes=GROUP * BLOCK // 2 + GROUP * BLOCK // 8, five_bit=True)
KINDS = (Q4_K, Q5_K)


def high_bit_shifts(c):
    """Word shifts (left if positive) that bring chunk c's high bits to bit 4: (low nibbles, high)."""
    return 4 - 2 * c, 3 - 2 * c


def shift_words(target, source, count):
    if count > 0:
        VPSLLW(target, source, count)
    elif count < 0:
        VPSRLW(target, source, -count)
    return count != 0


def advance_block(r, kind, blocks=1):
    """Activations and quants ``blocks`` blocks on; the scale record moves once per super-block."""
    ADD(r.act, BLOCK * blocks)
    ADD(r.act_scale, 4 * blocks)
    ADD(r.act_sum, 4 * blocks)
    ADD(r.wq, kind.quant_bytes * blocks)


# --------------------------------------------------------------------------- AVX2 tile

class Registers:
    """What the tile keeps in the registers its rows leave free, most useful first (else memory
    operands and reloads): the vector constants; the super-block's d and -dmin as f32 (each a
    2-uop vcvtph2ps per block otherwise); Q5_K's high-bit chunk (loaded once per block, not per
    use); a second int16 block sum per row (Q5_K: chunks 2 and 3 then need no widening of their
    own). Only integer work and loads move: the f32 operations, and so the results, are the same
    for every tile."""

    def __init__(self, kind, rows):
        spare = YMM_COUNT - 4 - 2 * rows        # lo, hi, two temporaries; block sums, accumulators
        wanted = {"nibble": Constant.uint32x8(0x0F0F0F0F), "ones": Constant.uint16x16(1)}
        if kind.five_bit:
            wanted["high"] = Constant.uint32x8(HIGH_BIT * 0x01010101)
        spare = place_constants(self, wanted, spare)
        self.super_scales = spare >= 2
        spare -= 2 * self.super_scales
        self.high_bits = kind.five_bit and spare >= 1
        spare -= self.high_bits
        self.second_sums = kind.five_bit and spare >= rows

    def load_super_scales(self, r):
        """f32 d and -dmin of the super-block's 8 rows, or their addresses."""
        if not self.super_scales:
            self.d, self.neg_dmin = [r.wscale], [r.wscale + KQ_MINS_OFFSET]
            return
        self.d, self.neg_dmin = YMMRegister(), YMMRegister()
        VCVTPH2PS(self.d, [r.wscale])
        VCVTPH2PS(self.neg_dmin, [r.wscale + KQ_MINS_OFFSET])


def prefetch_block(r, kind, b):
    """The decode GEMV streams the weights once: prefetch the cache lines that start inside
    block b (at the same distance as codegen/qgemm.py), and the scale records as far ahead."""
    start = kind.quant_bytes * b               # wq points at the super-block
    for line in range(-(-start // LINE) * LINE, start + kind.quant_bytes, LINE):
        PREFETCHT0([r.wq + PREFETCH_BYTES + line])
    ahead = PREFETCH_BYTES * KQ_SCALE_RECORD // (KQ_SUB_BLOCKS * kind.quant_bytes) // LINE * LINE
    if b * LINE < KQ_SCALE_RECORD:
        PREFETCHT0([r.wscale + ahead + b * LINE])


def emit_block_avx2(r, kind, regs, acc, facc, b):
    """Block b of the super-block for ``len(acc)`` activation rows: facc += its products.
    The pointers stay at the super-block (displacements reach its blocks)."""
    quants, act = kind.quant_bytes * b, BLOCK * b
    lo, hi, t, prod = (YMMRegister() for _ in range(4))
    row = RowAddresses(r.act, r.row_stride, r.spare, len(acc))
    row.prepare()
    high_bits = [r.wq + quants + kind.high_bits_offset]
    if kind.five_bit and regs.high_bits:
        high_bits = YMMRegister()
        VMOVDQA(high_bits, [r.wq + quants + kind.high_bits_offset])
    late = [YMMRegister() for _ in acc] if regs.second_sums else None   # chunks 2, 3 (Q5_K)
    for c in range(NIBBLE_CHUNKS):
        VMOVDQA(lo, [r.wq + quants + 32 * c])
        VPSRLW(hi, lo, 4)
        VPAND(lo, lo, regs.nibble)
        VPAND(hi, hi, regs.nibble)
        if kind.five_bit:
            for nibbles, count in zip((lo, hi), high_bit_shifts(c)):
                if isinstance(high_bits, YMMRegister):
                    if not shift_words(t, high_bits, count):
                        VPAND(t, high_bits, regs.high)
                    else:
                        VPAND(t, t, regs.high)
                else:
                    VMOVDQA(t, high_bits)
                    shift_words(t, t, count)
                    VPAND(t, t, regs.high)
                VPOR(nibbles, nibbles, t)
        for i in range(len(acc)):
            # low nibbles are weights 4c..4c+3 of the block, high nibbles 16+4c..16+4c+3;
            # at most four pair sums of 5-bit quants fit an int16 lane
            if kind.five_bit and c >= 2 and late is None:
                VPBROADCASTD(t, row(i, act + CHUNK * c))
                VPMADDUBSW(t, lo, t)
                VPBROADCASTD(prod, row(i, act + BLOCK // 2 + CHUNK * c))
                VPMADDUBSW(prod, hi, prod)
                VPADDW(t, t, prod)
                VPMADDWD(t, t, regs.ones)
                VPADDD(acc[i], acc[i], t)
                continue
            target = late[i] if kind.five_bit and c >= 2 else acc[i]
            VPBROADCASTD(t, row(i, act + CHUNK * c))
            if c in (0, 2) and target is not acc[i] or c == 0:
                VPMADDUBSW(target, lo, t)
            else:
                VPMADDUBSW(t, lo, t)
                VPADDW(target, target, t)
            VPBROADCASTD(t, row(i, act + BLOCK // 2 + CHUNK * c))
            VPMADDUBSW(t, hi, t)
            VPADDW(target, target, t)
        if c == (1 if kind.five_bit else NIBBLE_CHUNKS - 1):
            for a in acc:
                VPMADDWD(a, a, regs.ones)
    if late is not None:
        for a, extra in zip(acc, late):
            VPMADDWD(extra, extra, regs.ones)
            VPADDD(a, a, extra)
    d_w, m_w = lo, hi
    scales = KQ_BLOCK_SCALES_OFFSET + KQ_BLOCK_SCALES_BYTES * b
    for target, sub_offset, factor in ((d_w, 0, regs.d), (m_w, GROUP, regs.neg_dmin)):
        VPMOVZXBD(target, [r.wscale + scales + sub_offset])
        VCVTDQ2PS(target, target)
        if not isinstance(factor, YMMRegister):
            VCVTPH2PS(prod, factor)
            factor = prod
        VMULPS(target, target, factor)
    emit_block_scale(r, acc, facc, d_w, m_w, t, prod, offset=4 * b)


def emit_tile_avx2(r, kind, rows, ldo_bytes, name):
    """out[rows x 8] of the current group and row tile; leaves the pointers where it found them."""
    regs = Registers(kind, rows)
    facc = [YMMRegister() for _ in range(rows)]
    for f in facc:
        VXORPS(f, f, f)
    count_blocks(r, KQ_SUB_BLOCKS)
    with Loop() as supers:
        regs.load_super_scales(r)
        for b in range(KQ_SUB_BLOCKS):
            if rows == 1:
                prefetch_block(r, kind, b)
            acc = [YMMRegister() for _ in range(rows)]
            emit_block_avx2(r, kind, regs, acc, facc, b)
        advance_block(r, kind, KQ_SUB_BLOCKS)
        ADD(r.wscale, KQ_SCALE_RECORD)
        SUB(r.blocks_left, 1)
        JNZ(supers.begin)
    rewind_blocks(r, kind)
    store_tile_avx2(r, facc, ldo_bytes, name)


# --------------------------------------------------------------------------- AVX2 decode (1 x 16)
#
# Q4_K, as codegen/qgemm_k16.py's: for one activation row (decode) the tile takes a group PAIR
# (16 columns), so each activation broadcast feeds both groups' vpmaddubsw, and the block's
# activation scale and sum are broadcast once for both. Each group's block gets the 6x8
# tile's integer sums and f32 operations (emit_block_scale's multiply and two FMAs), so the
# bits are the same; both groups' super-block d and -dmin stay in registers. (A Q5_K pair
# tile, its high bits and masks read from memory for want of registers and chunks 2-3 widened
# on their own, ran 0.77-0.82x the 6x8 tile's one-row rate on the Zen 3 host: Q5_K has none.)

DECODE_TILING = Tiling(full=(1,), groups=2, remainders=(), exact=True)


def prefetch_pair_block(r, kind, b):
    """prefetch_block for both groups of the pair."""
    start = kind.quant_bytes * b
    for line in range(-(-start // LINE) * LINE, start + kind.quant_bytes, LINE):
        PREFETCHT0([r.wq + PREFETCH_BYTES + line])
        PREFETCHT0([r.wq + r.pair_quants * 1 + PREFETCH_BYTES + line])
    ahead = PREFETCH_BYTES * KQ_SCALE_RECORD // (KQ_SUB_BLOCKS * kind.quant_bytes) // LINE * LINE
    if b * LINE < KQ_SCALE_RECORD:
        PREFETCHT0([r.wscale + ahead + b * LINE])
        PREFETCHT0([r.wscale + r.pair_scales * 1 + ahead + b * LINE])


def emit_pair_tile(r, kind, rows, ldo_bytes, name):
    """out[1 x 16] of the current group pair and activation row; leaves the pointers where it found them."""
    assert rows == 1 and not kind.five_bit
    nibble, ones = YMMRegister(), YMMRegister()
    VMOVDQA(nibble, Constant.uint32x8(0x0F0F0F0F))
    VMOVDQA(ones, Constant.uint16x16(1))
    records = (r.wscale, r.wscale + r.pair_scales * 1)
    facc = [YMMRegister() for _ in range(2)]
    for f in facc:
        VXORPS(f, f, f)
    count_blocks(r, KQ_SUB_BLOCKS)
    with Loop() as supers:
        super_scales = []
        for record in records:
            d, neg_dmin = YMMRegister(), YMMRegister()
            VCVTPH2PS(d, [record])
            VCVTPH2PS(neg_dmin, [record + KQ_MINS_OFFSET])
            super_scales.append((d, neg_dmin))
        for b in range(KQ_SUB_BLOCKS):
            prefetch_pair_block(r, kind, b)
            emit_pair_block(r, kind, (nibble, ones), records, super_scales, facc, b)
        advance_block(r, kind, KQ_SUB_BLOCKS)
        ADD(r.wscale, KQ_SCALE_RECORD)
        SUB(r.blocks_left, 1)
        JNZ(supers.begin)
    rewind_blocks(r, kind)
    store_pair_avx2(r, facc, name)


def emit_pair_block(r, kind, consts, records, super_scales, facc, b):
    """Block b of the super-block for both groups of the pair: facc[g] += its products."""
    nibble, ones = consts
    quants, act = kind.quant_bytes * b, BLOCK * b
    wq = (r.wq, r.wq + r.pair_quants * 1)
    acc = [YMMRegister() for _ in range(2)]
    for c in range(NIBBLE_CHUNKS):
        nibbles = []
        for g in range(2):
            lo, hi = YMMRegister(), YMMRegister()
            VMOVDQA(lo, [wq[g] + quants + 32 * c])
            VPSRLW(hi, lo, 4)
            VPAND(lo, lo, nibble)
            VPAND(hi, hi, nibble)
            nibbles.append((lo, hi))
        for part, offset in ((0, CHUNK * c), (1, BLOCK // 2 + CHUNK * c)):
            # low nibbles are weights 4c..4c+3 of the block, high nibbles 16+4c..16+4c+3
            bcast = YMMRegister()
            VPBROADCASTD(bcast, [r.act + act + offset])
            for g in range(2):
                weights = nibbles[g][part]
                if c == 0 and part == 0:
                    VPMADDUBSW(acc[g], weights, bcast)          # the block's int16 sum starts
                    continue
                VPMADDUBSW(weights, weights, bcast)
                VPADDW(acc[g], acc[g], weights)
    for a in acc:
        VPMADDWD(a, a, ones)
    # emit_block_scale's operations per group, the activation scale and sum broadcast once
    scales = KQ_BLOCK_SCALES_OFFSET + KQ_BLOCK_SCALES_BYTES * b
    d_a, s_a = YMMRegister(), YMMRegister()
    VBROADCASTSS(d_a, [r.act_scale + 4 * b])
    VBROADCASTSS(s_a, [r.act_sum + 4 * b])
    for g, record in enumerate(records):
        d_w, m_w, factor = YMMRegister(), YMMRegister(), YMMRegister()
        for target, sub_offset, super_scale in ((d_w, 0, super_scales[g][0]), (m_w, GROUP, super_scales[g][1])):
            VPMOVZXBD(target, [record + scales + sub_offset])
            VCVTDQ2PS(target, target)
            VMULPS(target, target, super_scale)
        VCVTDQ2PS(acc[g], acc[g])
        VMULPS(factor, d_a, d_w)
        VFMADD231PS(facc[g], acc[g], factor)
        VFMADD231PS(facc[g], m_w, s_a)


# --------------------------------------------------------------------------- AVX-512 tile

def load_super_scales_avx512(r):
    """f32 d and -dmin of the super-block's 16 rows (group g's 8, then group g + 1's)."""
    for offset in (0, KQ_MINS_OFFSET):
        halves, value = YMMRegister(), ZMMRegister()
        VMOVDQU(halves.as_xmm, [r.wscale + offset])
        VINSERTI128(halves, halves, [r.wscale + r.pair_scales * 1 + offset], 1)
        VCVTPH2PS(value, halves)
        yield value


def prefetch_block_avx512(r, kind, b):
    """As prefetch_block, for both groups of the pair (the decode GEMV streams four arrays)."""
    start = kind.quant_bytes * b
    ahead = PREFETCH_BYTES * KQ_SCALE_RECORD // (KQ_SUB_BLOCKS * kind.quant_bytes) // LINE * LINE
    for line in range(-(-start // LINE) * LINE, start + kind.quant_bytes, LINE):
        PREFETCHT0([r.wq + PREFETCH_BYTES + line - start])
        PREFETCHT0([r.wq + r.pair_quants * 1 + PREFETCH_BYTES + line - start])
    if b * LINE < KQ_SCALE_RECORD:
        PREFETCHT0([r.wscale + ahead + b * LINE])
        PREFETCHT0([r.wscale + r.pair_scales * 1 + ahead + b * LINE])


def load_block_avx512(r, kind, nibbles, high, super_scales, b):
    """Block b's quants of both groups, (low, high) per chunk, and its d * sc and -dmin * m."""
    if kind.five_bit:
        bits = ZMMRegister()
        load_pair(r, bits, kind.high_bits_offset)
    weights = []
    for c in range(NIBBLE_CHUNKS):
        low, upper = ZMMRegister(), ZMMRegister()
        load_pair(r, low, 32 * c)
        VPSRLW(upper, low, 4)
        VPANDD(low, low, nibbles)
        VPANDD(upper, upper, nibbles)
        if kind.five_bit:
            for quants, count in zip((low, upper), high_bit_shifts(c)):
                t = ZMMRegister()
                if not shift_words(t, bits, count):
                    t = bits
                VPTERNLOGD(quants, t, high, OR_MASKED)       # quants |= t & high
        weights.append((low, upper))
    return (weights,) + tuple(block_scales_avx512(r, super_scales, b))


def block_scales_avx512(r, super_scales, b):
    """Group g's 8 and group g + 1's 8 block scales times their rows' d (then mins, -dmin)."""
    scales = KQ_BLOCK_SCALES_OFFSET + KQ_BLOCK_SCALES_BYTES * b
    for sub_offset, factor in zip((0, GROUP), super_scales):
        packed, value = XMMRegister(), ZMMRegister()
        VMOVQ(packed, [r.wscale + scales + sub_offset])
        VPINSRQ(packed, packed, [r.wscale + r.pair_scales * 1 + scales + sub_offset], 1)
        VPMOVZXBD(value, packed)
        VCVTDQ2PS(value, value)
        VMULPS(value, value, factor)
        yield value


def emit_tile_avx512(r, kind, rows, ldo_bytes, name):
    """out[rows x 16] of the current group pair and row tile; leaves the pointers where it found them."""
    totals = TOTALS[:rows]
    for total in totals:
        zero(total)
    nibbles = broadcast_constant(r, NIBBLE_BYTES)
    high = broadcast_constant(r, HIGH_BIT * 0x01010101) if kind.five_bit else None
    count_blocks(r, KQ_SUB_BLOCKS)
    with Loop() as supers:
        super_scales = tuple(load_super_scales_avx512(r))
        for b in range(KQ_SUB_BLOCKS):
            if rows == 1:
                prefetch_block_avx512(r, kind, b)
            weights, d_w, m_w = load_block_avx512(r, kind, nibbles, high, super_scales, b)
            # the row walker counts scale-row bytes: activation bytes are 8x that (k = 32 kb)
            XOR(r.spare, r.spare)
            for i, total in enumerate(totals):
                (emit_only_row if rows == 1 else emit_row_q4_1)(r, weights, d_w, m_w, total)
                if i + 1 < rows:
                    ADD(r.spare, r.scale_stride)
            advance_block(r, kind)
        ADD(r.wscale, KQ_SCALE_RECORD)
        SUB(r.blocks_left, 1)
        JNZ(supers.begin)
    rewind_blocks(r, kind)
    store_tile_avx512(r, totals, ldo_bytes, name)


def emit_only_row(r, weights, d_w, m_w, total):
    """emit_row_q4_1 for a tile of one row (the decode GEMV): the low and high nibbles' dot
    products in two int32 chains of four ``vpdpbusd`` rather than one of eight (their latency
    bounds a block otherwise), and d_w scaled in place, which no other row needs. The f32
    operations are emit_row_q4_1's."""
    acc, second = ZMMRegister(), ZMMRegister()
    zero(acc)
    zero(second)
    for c, (low, high) in enumerate(weights):
        VPDPBUSD(acc, low, broadcast([r.act + r.spare * 8 + CHUNK * c]))
        VPDPBUSD(second, high, broadcast([r.act + r.spare * 8 + BLOCK // 2 + CHUNK * c]))
    VPADDD(acc, acc, second)
    VCVTDQ2PS(acc, acc)
    VMULPS(d_w, d_w, broadcast([r.act_scale + r.spare * 1]))
    VFMADD231PS(total, acc, d_w)
    VFMADD231PS(total, m_w, broadcast([r.act_sum + r.spare * 1]))


FAMILY = Family(SIGNATURE, tiles={"avx2": emit_tile_avx2, "avx512": emit_tile_avx512}, tilings=TILINGS)


def emit(isa):
    kernels = [emit_qgemm(kind, isa, FAMILY) for kind in KINDS]
    if isa == "avx2":
        kernels += [emit_qgemm(kind, isa, FAMILY, DECODE_TILING, emit_pair_tile) for kind in KINDS
                    if kind.name in QGEMM_AVX2_DECODE_KINDS]
    return kernels
