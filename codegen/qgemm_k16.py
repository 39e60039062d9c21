"""Quantized-weight GEMM for the K-quants with 16-weight sub-blocks: Q6_K, Q3_K, Q2_K weights x Q8 activations.

    llb_qgemm_<kind>_q8_<R>x8__avx2(wq, wsc, wd, aq, ad, asum, out, m, n, kb, ldo)
    llb_qgemm_<kind>_q8_16x16__avx512(...)       same arguments, same weight layout
    llb_qgemm_<kind>_q8_1x16__avx2(...)          the AVX2 decode kernel (see "AVX2 decode")

The weight arrays are runtime/layout_kquant16.py's (``QUANT_ARRAYS[kind]``:
quant planes and sub-block scales per 32-weight block, f16 scales per
256-weight super-block); the rest is codegen/qgemm.py's contract: Q8
activation blocks of 32 (``asum`` is not read), row groups of 8 columns,
``out`` at the first column, only ``n`` columns written. The driver, the row
tiles and the masked stores are qgemm.py's; this module adds the blocks.

Per block of 32 weights, row group and activation row, exactly in integers:

    X = sum over the block's two sub-blocks h of  s_h * sum_{j in h} (q_j - o) * a_j
    out += (d * d_a) * X                        [Q2_K: - (dmin * d_a) * sum_h m_h * sum_{j in h} a_j]

with o = 32 (Q6_K), 4 (Q3_K), 0 (Q2_K). The quants are unsigned, recovered
from the planes one chunk (4 weights x 8 rows, 32 bytes) at a time with
shifts and masks. |X| < 2^24 for every kind, so its conversion to f32 is
exact, and each block costs every row the same f32 operations in both
variants (a multiply for d * d_a, then an FMA; Q2_K a second pair for the
min): the sum over k runs in block order whatever the tile or ISA, and the
AVX2 and AVX-512 results are bit-identical.

AVX2. ``vpmaddubsw(q, a)`` gives int16 pair sums, summed over a sub-block's
four chunks in int16; o times the activations' pair sums, computed once per
block and row from its 32 bytes (``vpmaddubsw(o, a)`` and two shuffles, one
sub-block a lane), is subtracted there. The int16 sums may wrap on the way
(Q6_K: 4 * 2 * 63 * 127), but the result, sum (q - o) a, is at most
8 * 32 * 127 = 32512 a word, so it comes out exact. One ``vpmaddwd`` per
sub-block multiplies by the scales (int16 pairs (s, s) per row, unpacked from
the scale bytes once per block). A tile row needs its f32 total, the two
int16 sub-block sums and an int32 (Q2_K: two), next to five working
registers: tiles of 3 rows, the rest in smaller copies; constants
take the registers a tile leaves free, else they are memory operands.

AVX-512 VNNI: see the section below.
"""
from dataclasses import dataclass

from peachpy import Constant
from peachpy.x86_64 import (YMMRegister, ZMMRegister, Loop, Label, LABEL, LocalVariable, ADD, SUB, MOV, SHR, TEST,
                            JNZ, XOR, VMOVDQA, VMOVDQU, VPANDD, VPORD, VPSUBD, VPSRLD, VPMOVSXBD, VPMOVZXBD,
                            VPERMI2D, VPMOVZXWD, VINSERTI128, VPERM2I128, VPSHUFD, VPSUBB, VPXOR, VMOVUPS,
                            VPSRLW, VPAND, VPOR, VPBROADCASTD, VPMADDUBSW, VPADDW, VPSUBW, VPMADDWD,
                            VPADDD, VPMOVSXBW, VPMOVZXBW, VPSHUFB, VCVTDQ2PS, VCVTPH2PS, VBROADCASTSS,
                            VMULPS, VFMADD231PS, VFNMADD231PS, VXORPS)

from . import qgemm
from .peachpy_ext import VPDPBUSD, broadcast
from .contract import BLOCK, CHUNK, GROUP, SUPER_BLOCK, QGEMM_KIND_TILES

ISAS = ("avx2", "avx512")
YMM_COUNT = 16
WORKING = 5                 # chunk, temporary, broadcast, product, and the offset (or ones) constant
BLOCKS_PER_SUPER = SUPER_BLOCK // BLOCK


@dataclass(frozen=True)
class K16Kind:
    name: str
    quant_bytes: int        # quant planes per block of one group
    super_bytes: int        # f16 super-block scales per super-block of one group
    offset: int             # subtracted from every quant (o above)
    has_min: bool
    signed_scales: bool
    scale_bytes: int = GROUP * 2      # one scale byte per row and sub-block

    @property
    def max_rows(self):
        return int(QGEMM_KIND_TILES[self.name]["avx2"].split("x")[0])

    @property
    def row_registers(self):
        return 3          # f32 total and the two sub-blocks' int16 sums

    @property
    def weight_bytes(self):
        """Bytes per block of one group of each weight array (the super-block scales': a fraction)."""
        return self.quant_bytes, self.scale_bytes, self.super_bytes / BLOCKS_PER_SUPER


Q6_K = K16Kind("q6_k", quant_bytes=2 * 3 * GROUP * CHUNK, super_bytes=GROUP * 2, offset=32, has_min=False,
               signed_scales=True)
Q3_K = K16Kind("q3_k", quant_bytes=3 * GROUP * CHUNK, super_bytes=GROUP * 2, offset=4, has_min=False,
               signed_scales=True)
Q2_K = K16Kind("q2_k", quant_bytes=2 * GROUP * CHUNK, super_bytes=2 * GROUP * 2, offset=0, has_min=True,
               signed_scales=False)
KINDS = (Q6_K, Q3_K, Q2_K)

SIGNATURE = [("wq", "const uint8_t*"), ("wsc", "const uint8_t*"), ("wd", "const uint16_t*"),
             ("aq", "const int8_t*"), ("ad", "const float*"), ("asum", "const float*"), ("out", "float*"),
             ("m", "size_t"), ("n", "size_t"), ("kb", "size_t"), ("ldo", "size_t")]


def _bytes(*values):
    """Four bytes as one little-endian dword (for Constant.uint32x8)."""
    return sum(v << (8 * i) for i, v in enumerate(values))


# vpshufb patterns: from dwords (s_0, s_1) (int16 each) to (s_0, s_0) and (s_1, s_1)
FIRST_HALF = Constant.uint32x8(*[_bytes(4 * i, 4 * i + 1, 4 * i, 4 * i + 1) for i in range(4)] * 2)
SECOND_HALF = Constant.uint32x8(*[_bytes(4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3) for i in range(4)] * 2)


def _splat(byte):
    return Constant.uint32x8(byte * 0x01010101)


# --------------------------------------------------------------------------- driver hooks

def frame(r, kind, isa):
    """The stack slots the tiles share (qgemm.Family.frame)."""
    # the block's sub-block scales, s_0 and s_1 (Q2_K: then m_0 and m_1): vpmaddwd operands
    # (AVX2: int16 pairs, a ymm each), or f32 multipliers (AVX-512: a zmm each)
    vector_bytes = 32 if isa == "avx2" else 64
    r.scales = [LocalVariable(vector_bytes, alignment=16) for _ in range(4 if kind.has_min else 2)]
    r.dmin = LocalVariable(64, alignment=16)         # AVX-512 Q2_K: the block's dmin per column
    # AVX-512 Q6_K / Q3_K: an activation row's block biased by 128 (two, for alternate rows)
    r.biased = [LocalVariable(BLOCK, alignment=16) for _ in range(2)]


def advance_block(r, kind):
    """Step every pointer to the next block; the super-block scales every 8 blocks.
    (blocks_left counts down from kb, a multiple of 8.)"""
    same_super = Label()
    ADD(r.act, BLOCK)
    ADD(r.act_scale, 4)
    ADD(r.wq, kind.quant_bytes)
    ADD(r.wscale, kind.scale_bytes)
    SUB(r.blocks_left, 1)
    TEST(r.blocks_left, BLOCKS_PER_SUPER - 1)
    JNZ(same_super)
    ADD(r.wd, kind.super_bytes)
    LABEL(same_super)


# --------------------------------------------------------------------------- tile

class TileConstants:
    """The block's vector constants: in the registers the tile leaves free, most used first."""

    def __init__(self, kind, rows):
        spare = YMM_COUNT - WORKING - kind.row_registers * rows
        # vpmaddubsw takes its unsigned operand from a register: o (Q2_K: ones) always is one
        self.offset = YMMRegister()
        VMOVDQA(self.offset, _splat(kind.offset if kind.offset else 1))
        wanted = ({"q6_k": {"low6": _splat(0x3F), "top2": _splat(0xC0)},
                       "q3_k": {"low3": _splat(0x07), "bits37": _splat(0x88)},
                       "q2_k": {"low2": _splat(0x03), "nibble": Constant.uint16x16(0x0F)}}[kind.name])
        spare = qgemm.place_constants(self, wanted, spare)
        # the block's unpacked scales stay in registers if they fit (else in the stack frame)
        self.scales_in_registers = spare >= (4 if kind.has_min else 2)


def masked_load(target, mask, address):
    """target = [address] & mask (mask a register or a memory constant)."""
    if isinstance(mask, YMMRegister):
        VPAND(target, mask, [address])
    else:
        VMOVDQA(target, [address])
        VPAND(target, target, mask)


def masked(target, mask):
    VPAND(target, target, mask)


def emit_tile(r, kind, rows, ldo_bytes, name):
    """out[rows x 8] of the current group and row tile; leaves the pointers where it found them."""
    consts = TileConstants(kind, rows)
    totals = [YMMRegister() for _ in range(rows)]
    for total in totals:
        VXORPS(total, total, total)
    qgemm.count_blocks(r)
    with Loop() as blocks:
        if rows == 1:
            qgemm.prefetch_quants(r, kind)
        emit_block(r, kind, consts, totals)
        advance_block(r, kind)
        TEST(r.blocks_left, r.blocks_left)
        JNZ(blocks.begin)
    qgemm.rewind_blocks(r, kind)
    qgemm.store_tile_avx2(r, totals, ldo_bytes, name)


def unpack_scales(r, kind, consts):
    """The block's scale bytes (row-major: s_0, s_1 of row 0, ...) -> int16 pairs (s_h, s_h) per
    row for each sub-block h (Q2_K: the mins' too), in registers or stored in r.scales."""
    pairs = YMMRegister()
    if kind.signed_scales:
        VPMOVSXBW(pairs, [r.wscale])
        sources = [pairs]
    else:
        VPMOVZXBW(pairs, [r.wscale])
        mins = YMMRegister()
        VPSRLW(mins, pairs, 4)
        masked(pairs, consts.nibble)
        sources = [pairs, mins]
    slots = iter(r.scales)
    spread, unpacked = None, []
    for source in sources:
        for pattern in (FIRST_HALF, SECOND_HALF):
            if consts.scales_in_registers:
                spread = YMMRegister()
                VPSHUFB(spread, source, pattern)
                unpacked.append(spread)
            else:
                spread = spread or YMMRegister()
                VPSHUFB(spread, source, pattern)
                slot = next(slots)
                VMOVDQU(slot, spread)
                unpacked.append(slot)
    return unpacked


def gather_planes(wq, mask, base, shift):
    """The bits ``mask`` keeps of the three planes at ``base`` (bytes into the block at ``wq``),
    plane p shifted right by (3 - p) * ``shift``, OR-ed into one register: the chunk(s) whose
    bits the planes share."""
    gathered, part = YMMRegister(), YMMRegister()
    for p in range(3):
        masked_load(gathered if p == 0 else part, mask, wq + base + 32 * p)
        if p > 0:
            VPOR(gathered, gathered, part)
        VPSRLW(gathered, gathered, shift)
    return gathered


def chunks_q6_k(wq, consts, half):
    """Yield the 4 chunks of sub-block ``half`` of the block at ``wq`` (registers of 32 unsigned
    bytes), the last one first: its bits lie in the top 2 bits of the three planes."""
    base = 96 * half
    yield gather_planes(wq, consts.top2, base, 2)
    for p in range(3):
        chunk = YMMRegister()
        masked_load(chunk, consts.low6, wq + base + 32 * p)
        yield chunk


def chunks_q3_k(wq, consts, half):
    """Planes 0 and 1 hold chunks 0-3 (low and high nibble, 3 bits each); plane 2 chunks 4 and 5;
    bits 3 and 7 of the three planes, gathered, chunks 6 and 7."""
    if half == 0:
        planes = (0, 1)
    else:
        planes = (2,)
    for p in planes:
        chunk = YMMRegister()
        masked_load(chunk, consts.low3, wq + 32 * p)
        yield chunk
        chunk = YMMRegister()
        VMOVDQA(chunk, [wq + 32 * p])
        VPSRLW(chunk, chunk, 4)
        masked(chunk, consts.low3)
        yield chunk
    if half == 1:
        gathered = gather_planes(wq, consts.bits37, 0, 1)
        chunk = YMMRegister()
        VPAND(chunk, gathered, consts.low3)
        yield chunk
        VPSRLW(gathered, gathered, 4)
        masked(gathered, consts.low3)
        yield gathered


def chunks_q2_k(wq, consts, half):
    """Plane ``half`` holds its 4 chunks in bits 2j..2j+1."""
    for j in range(4):
        chunk = YMMRegister()
        if j == 0:
            masked_load(chunk, consts.low2, wq + 32 * half)
        else:
            VMOVDQA(chunk, [wq + 32 * half])
            VPSRLW(chunk, chunk, 2 * j)
            masked(chunk, consts.low2)
        yield chunk


CHUNKS = {"q6_k": chunks_q6_k, "q3_k": chunks_q3_k, "q2_k": chunks_q2_k}


def emit_block(r, kind, consts, totals):
    """totals[i] += the block's contribution for each activation row i of the tile."""
    rows = len(totals)
    scales = unpack_scales(r, kind, consts)
    row = qgemm.RowAddresses(r.act, r.row_stride, r.spare, rows)
    row.prepare()
    blocks = [None] * rows          # int32 sum of s_h * (sub-block sums) per row
    mins = [None] * rows            # Q2_K: int32 sum of m_h * (activation sub-block sums)
    sums = [[YMMRegister() for _ in range(rows)] for _ in range(2)]     # int16, per sub-block and row
    for half in range(2):
        for c, chunk in enumerate(CHUNKS[kind.name](r.wq, consts, half)):
            index = chunk_index(kind, half, c)
            for i in range(rows):
                bcast, product = YMMRegister(), YMMRegister()
                VPBROADCASTD(bcast, row(i, CHUNK * index))
                VPMADDUBSW(sums[half][i] if c == 0 else product, chunk, bcast)
                if c > 0:
                    VPADDW(sums[half][i], sums[half][i], product)
    for i in range(rows):
        both = activation_sums(row(i), consts.offset)
        for half in range(2):
            activation = YMMRegister()
            VPERM2I128(activation, both, both, 0x11 * half)      # sub-block half's, in both lanes
            if kind.offset:
                VPSUBW(sums[half][i], sums[half][i], activation)
            blocks[i] = accumulate_scaled(blocks[i], sums[half][i], scales[half])
            if kind.has_min:
                mins[i] = accumulate_scaled(mins[i], activation, scales[2 + half])
    emit_block_scale(r, kind, blocks, mins, totals)


def activation_sums(address, multiplier):
    """multiplier * each sub-block's 16 activations summed in int16, as the word pairs the
    sub-block sums have: (sum over its chunks c of o (a_4c + a_4c+1), ... (a_4c+2 + a_4c+3))
    in every dword of the lane of that sub-block (the block's 32 bytes: one sub-block a lane).
    (The sub-block sums may wrap in int16 on the way; their difference is sum (q - o) a, at
    most 8 * 32 * 127 = 32512 a word, so it comes out exact.)"""
    total, swapped = YMMRegister(), YMMRegister()
    VPMADDUBSW(total, multiplier, address)
    VPSHUFD(swapped, total, 0b01_00_11_10)
    VPADDW(total, total, swapped)
    VPSHUFD(swapped, total, 0b10_11_00_01)
    VPADDW(total, total, swapped)
    return total


def chunk_index(kind, half, c):
    """The chunk (weights 4 index .. 4 index + 3 of the block) that CHUNKS yields c-th in ``half``."""
    if kind is Q6_K:
        return 4 * half + (3 if c == 0 else c - 1)
    return 4 * half + c


def accumulate_scaled(total, sums, scales):
    """total (int32, or None) + vpmaddwd(sums, scales)."""
    if total is None:
        VPMADDWD(sums, sums, scales)
        return sums
    VPMADDWD(sums, sums, scales)
    VPADDD(total, total, sums)
    return total


def emit_block_scale(r, kind, blocks, mins, totals):
    """totals[i] += (d * d_a[i]) * blocks[i]  (- (dmin * d_a[i]) * mins[i])."""
    scales = qgemm.RowAddresses(r.act_scale, r.scale_stride, r.spare, len(totals))
    scales.prepare()
    d_w, factor = YMMRegister(), YMMRegister()
    VCVTPH2PS(d_w, [r.wd])
    for i, total in enumerate(totals):
        VCVTDQ2PS(blocks[i], blocks[i])
        VBROADCASTSS(factor, scales(i))
        VMULPS(factor, factor, d_w)
        VFMADD231PS(total, blocks[i], factor)
    if not kind.has_min:
        return
    VCVTPH2PS(d_w, [r.wd + GROUP * 2])
    for i, total in enumerate(totals):
        VCVTDQ2PS(mins[i], mins[i])
        VBROADCASTSS(factor, scales(i))
        VMULPS(factor, factor, d_w)
        VFNMADD231PS(total, mins[i], factor)


# --------------------------------------------------------------------------- AVX2 decode (1 x 16)
#
# A decode step (m = 1) reads every weight once, and a block of these kinds carries few quant
# bytes (64 to 192 for 8 rows), so the work a 3x8 tile does per block and activation row
# weighs: broadcasting the 8 activation chunks, the activation sums and their lane split, the
# activation scale. The decode kernel's tile takes one activation row over a group PAIR (16
# columns, the AVX-512 driver's pairing on ymm): that work is done once for both groups, the
# quant and scale work once per group. Each group's block gets the 3x8 tile's integer sums
# and f32 operations (d * d_a, then the FMA; Q2_K's min pair), so every output has the bits
# the 3x8 and AVX-512 tiles give it. A lone last group pairs with itself and stores 8 columns.

DECODE_TILING = qgemm.Tiling(full=(1,), groups=2, remainders=(), exact=True)


def emit_pair_tile(r, kind, rows, ldo_bytes, name):
    """out[1 x 16] of the current group pair and activation row; leaves the pointers where it found them."""
    assert rows == 1
    consts = TileConstants(kind, 2)           # register needs of two 8-column rows
    totals = [YMMRegister() for _ in range(2)]
    for total in totals:
        VXORPS(total, total, total)
    qgemm.count_blocks(r)
    with Loop() as blocks:
        qgemm.prefetch_quants(r, kind, pair=True)
        emit_pair_block(r, kind, consts, totals)
        advance_block(r, kind)
        TEST(r.blocks_left, r.blocks_left)
        JNZ(blocks.begin)
    qgemm.rewind_blocks(r, kind)
    qgemm.store_pair_avx2(r, totals, name)


def emit_pair_block(r, kind, consts, totals):
    """totals[g] += the block's contribution for group g of the pair (emit_block's, one row)."""
    quants = (r.wq, r.wq + r.pair_quants * 1)
    sums = [[YMMRegister() for _ in range(2)] for _ in range(2)]        # [group][half], int16
    for half in range(2):
        sources = [CHUNKS[kind.name](wq, consts, half) for wq in quants]
        for c, chunks in enumerate(zip(*sources)):
            index = chunk_index(kind, half, c)
            bcast = YMMRegister()
            VPBROADCASTD(bcast, [r.act + CHUNK * index])
            for g, chunk in enumerate(chunks):
                if c == 0:
                    VPMADDUBSW(sums[g][half], chunk, bcast)
                else:
                    VPMADDUBSW(chunk, chunk, bcast)
                    VPADDW(sums[g][half], sums[g][half], chunk)
    both = activation_sums([r.act], consts.offset)
    halves = [YMMRegister() for _ in range(2)]
    for half, activation in enumerate(halves):
        VPERM2I128(activation, both, both, 0x11 * half)      # sub-block half's, in both lanes
    blocks, mins = [None, None], [None, None]
    for g, wscale in enumerate((r.wscale, r.wscale + r.pair_scales * 1)):
        # unpack_scales' pairs, spread one sub-block at a time (into registers, not the frame)
        pairs = YMMRegister()
        if kind.signed_scales:
            VPMOVSXBW(pairs, [wscale])
        else:
            VPMOVZXBW(pairs, [wscale])
            minima = YMMRegister()
            VPSRLW(minima, pairs, 4)
            masked(pairs, consts.nibble)
        for half, (activation, pattern) in enumerate(zip(halves, (FIRST_HALF, SECOND_HALF))):
            spread = YMMRegister()
            VPSHUFB(spread, pairs, pattern)
            if kind.offset:
                VPSUBW(sums[g][half], sums[g][half], activation)
            blocks[g] = accumulate_scaled(blocks[g], sums[g][half], spread)
            if kind.has_min:
                product = YMMRegister()
                VPSHUFB(spread, minima, pattern)
                VPMADDWD(product, activation, spread)
                if mins[g] is None:
                    mins[g] = product
                else:
                    VPADDD(mins[g], mins[g], product)
    # the 3x8 tile's f32 operations per group (emit_block_scale), the activation scale broadcast once
    pair_super_offset(r, kind)
    d_a, factor, d_w = YMMRegister(), YMMRegister(), YMMRegister()
    VBROADCASTSS(d_a, [r.act_scale])
    supers = ([r.wd], [r.wd + r.spare * 1])
    for g, total in enumerate(totals):
        VCVTPH2PS(d_w, supers[g])
        VCVTDQ2PS(blocks[g], blocks[g])
        VMULPS(factor, d_a, d_w)
        VFMADD231PS(total, blocks[g], factor)
    if not kind.has_min:
        return
    for g, total in enumerate(totals):
        VCVTPH2PS(d_w, [supers[g][0] + GROUP * 2])
        VCVTDQ2PS(mins[g], mins[g])
        VMULPS(factor, d_a, d_w)
        VFNMADD231PS(total, mins[g], factor)


# --------------------------------------------------------------------------- AVX-512 (VNNI)
#
# As codegen/qgemm.py's AVX-512 kernel: one zmm holds a chunk of two row groups (g's 32
# bytes, then g + 1's), 16 columns; the block's 8 chunks stay in registers while the tile's
# activation rows pass one at a time, each chunk one ``vpdpbusd`` per row into its
# sub-block's int32 sum. Q6_K / Q3_K: the chunks become signed q - o once per block, and a
# row's activations, biased by 128 into unsigned bytes once per block (through the stack),
# are the unsigned operand; 128 * sum(q - o) per column, from one ``vpdpbusd`` per chunk
# and block shared by every row, is subtracted (as codegen/qgemm.py does for q8_0). Q2_K:
# unsigned q x the activations, and a second ``vpdpbusd`` of ones with the same bytes sums
# the activations for the min. Then X = s_0 U_0 + s_1 U_1 in f32 (scales as f32 per
# column): every product and the sum are integers below 2^24, so X is exact and equal to
# the AVX2 kernel's; the f32 operations after it are the AVX2 kernel's too, so both
# variants agree bit for bit.

AVX512_TILING = qgemm.Tiling(full=(16, 8), groups=2, remainders=(4, 2, 1), exact=False)
# vpermi2d indices (as words: PeachPy takes one constant size per function, and the tile
# stores use 32-byte ones): the even / odd dwords of two tables
EVEN_DWORDS = Constant.uint16x16(*range(0, 32, 2))
ODD_DWORDS = Constant.uint16x16(*range(1, 32, 2))


def pair_super_offset(r, kind):
    """r.spare = the offset from group g's super-block scales to group g + 1's."""
    ratio = kind.scale_bytes * BLOCKS_PER_SUPER // kind.super_bytes     # 8 or 4
    MOV(r.spare, r.pair_scales)
    SHR(r.spare, ratio.bit_length() - 1)


def unpack_scales_avx512(r, kind):
    """Sub-block scales (Q2_K: and mins) of both groups as f32 per column, into r.scales."""
    first, second = ZMMRegister(), ZMMRegister()
    load = VPMOVSXBD if kind.signed_scales else VPMOVZXBD
    load(first, [r.wscale])                       # 16 dwords: s_0, s_1 of row 0, ...
    load(second, [r.wscale + r.pair_scales * 1])
    sources = [(first, second)]
    if kind.has_min:
        nibble = broadcast_constant_zmm(r, 0x0F)
        mins = ZMMRegister(), ZMMRegister()
        for low, high in zip((first, second), mins):
            VPSRLD(high, low, 4)
            VPANDD(low, low, nibble)
        sources.append(mins)
    slots = iter(r.scales)
    for a, b in sources:
        for pattern in (EVEN_DWORDS, ODD_DWORDS):
            picked = ZMMRegister()
            VPMOVZXWD(picked, pattern)
            VPERMI2D(picked, a, b)
            VCVTDQ2PS(picked, picked)
            VMOVUPS(next(slots), picked)


def broadcast_constant_zmm(r, byte_or_dword, bytes_=False):
    register = ZMMRegister()
    MOV(r.spare.as_dword, byte_or_dword * 0x01010101 if bytes_ else byte_or_dword)
    VPBROADCASTD(register, r.spare.as_dword)
    return register


def super_scales_avx512(r, kind, field):
    """Group g's then g + 1's f16 super-block scales (``field`` 0: d, 1: dmin) as f32."""
    halves, values = YMMRegister(), ZMMRegister()
    pair_super_offset(r, kind)
    VMOVDQU(halves.as_xmm, [r.wd + GROUP * 2 * field])
    VINSERTI128(halves, halves, [r.wd + r.spare * 1 + GROUP * 2 * field], 1)
    VCVTPH2PS(values, halves)
    return values


def load_planes_avx512(r, base):
    """The three planes at ``base`` (bytes into the block) of both groups."""
    planes = [ZMMRegister() for _ in range(3)]
    for p, plane in enumerate(planes):
        qgemm.load_pair(r, plane, base + 32 * p)
    return planes


def gather_planes_avx512(planes, mask, shift):
    """gather_planes on planes in registers (which it leaves as they are)."""
    gathered, part = ZMMRegister(), ZMMRegister()
    for p, plane in enumerate(planes):
        VPANDD(gathered if p == 0 else part, plane, mask)
        if p > 0:
            VPORD(gathered, gathered, part)
        VPSRLW(gathered, gathered, shift)
    return gathered


def chunks_avx512(r, kind):
    """The block's 8 chunks of both groups (zmm), in chunk order."""
    if kind is Q6_K:
        top2, low6 = broadcast_constant_zmm(r, 0xC0, True), broadcast_constant_zmm(r, 0x3F, True)
        chunks = []
        for half in range(2):
            planes = load_planes_avx512(r, 96 * half)
            last = gather_planes_avx512(planes, top2, 2)
            for plane in planes:
                VPANDD(plane, plane, low6)
            chunks += planes + [last]
        return chunks
    if kind is Q3_K:
        bits37, low3 = broadcast_constant_zmm(r, 0x88, True), broadcast_constant_zmm(r, 0x07, True)
        planes = load_planes_avx512(r, 0)
        gathered = gather_planes_avx512(planes, bits37, 1)
        six = ZMMRegister()
        VPANDD(six, gathered, low3)
        VPSRLW(gathered, gathered, 4)
        VPANDD(gathered, gathered, low3)
        chunks = []
        for plane in planes:
            high = ZMMRegister()
            VPSRLW(high, plane, 4)
            VPANDD(high, high, low3)
            VPANDD(plane, plane, low3)
            chunks += [plane, high]
        return chunks + [six, gathered]
    low2 = broadcast_constant_zmm(r, 0x03, True)
    chunks = []
    for p in range(2):
        plane = ZMMRegister()
        qgemm.load_pair(r, plane, 32 * p)
        fields = [plane]
        for j in range(1, 4):
            field = ZMMRegister()
            VPSRLW(field, plane, 2 * j)
            VPANDD(field, field, low2)
            fields.append(field)
        VPANDD(plane, plane, low2)
        chunks += fields
    return chunks


def emit_row_avx512(r, kind, chunks, offset, d_w, total):
    """Q2_K: total += the block's contribution of the activation row at ``r.spare`` (counted
    in scale-row units: its bytes start at act + 8 * spare); ``offset`` is ones: the second
    sums are the activations' (for the min term)."""
    sums = [ZMMRegister() for _ in range(2)]
    offsets = [ZMMRegister() for _ in range(2)]
    for register in sums + offsets:
        qgemm.zero(register)
    for c, chunk in enumerate(chunks):
        a = broadcast([r.act + r.spare * 8 + CHUNK * c])
        VPDPBUSD(sums[c // 4], chunk, a)
        VPDPBUSD(offsets[c // 4], offset, a)
    scale = ZMMRegister()
    for h in range(2):
        VCVTDQ2PS(sums[h], sums[h])
    VMULPS(sums[0], sums[0], r.scales[0])
    VFMADD231PS(sums[0], sums[1], r.scales[1])          # exact: see above
    VMULPS(scale, d_w, broadcast([r.act_scale + r.spare * 1]))
    VFMADD231PS(total, sums[0], scale)
    for h in range(2):
        VCVTDQ2PS(offsets[h], offsets[h])
    VMULPS(offsets[0], offsets[0], r.scales[2])
    VFMADD231PS(offsets[0], offsets[1], r.scales[3])
    VMOVUPS(scale, r.dmin)
    VMULPS(scale, scale, broadcast([r.act_scale + r.spare * 1]))
    VFNMADD231PS(total, offsets[0], scale)


def signed_chunks_avx512(chunks, offset, bias):
    """Q6_K / Q3_K: the chunks as signed q - o (in place), and per sub-block 128 * sum(q - o)
    per column: what biasing the activations by 128 adds to their dot products."""
    corrections = [ZMMRegister() for _ in range(2)]
    for correction in corrections:
        qgemm.zero(correction)
    for c, chunk in enumerate(chunks):
        VPSUBB(chunk, chunk, offset)
        VPDPBUSD(corrections[c // 4], bias, chunk)
    return corrections


def emit_row_biased_avx512(r, chunks, corrections, bias, d_w, total, slot):
    """Q6_K / Q3_K: total += the block's contribution of the activation row at ``r.spare``.

    The row's 32 bytes biased by 128 (a xor 0x80: unsigned) go to the stack ``slot`` once, and
    each chunk takes one ``vpdpbusd`` of their broadcast with the signed q - o:
    sum (a + 128)(q - o) - 128 sum(q - o) = sum (q - o) a, exact."""
    biased = YMMRegister()
    VPXOR(biased, bias.as_ymm, [r.act + r.spare * 8])
    VMOVDQU(slot, biased)
    sums = [ZMMRegister() for _ in range(2)]
    for register in sums:
        qgemm.zero(register)
    for c, chunk in enumerate(chunks):
        a = ZMMRegister()
        VPBROADCASTD(a, dword_of(slot, c))
        VPDPBUSD(sums[c // 4], a, chunk)
    scale = ZMMRegister()
    for h in range(2):
        VPSUBD(sums[h], sums[h], corrections[h])
        VCVTDQ2PS(sums[h], sums[h])
    VMULPS(sums[0], sums[0], r.scales[0])
    VFMADD231PS(sums[0], sums[1], r.scales[1])          # exact: see above
    VMULPS(scale, d_w, broadcast([r.act_scale + r.spare * 1]))
    VFMADD231PS(total, sums[0], scale)


def dword_of(local, c):
    """Dword c of a 32-byte LocalVariable (PeachPy names its parts by halves)."""
    for bit in (4, 2, 1):
        local = local.hi if c & bit else local.lo
    return local


def emit_tile_avx512(r, kind, rows, ldo_bytes, name):
    """out[rows x 16] of the current group pair and row tile; leaves the pointers where it found them."""
    totals = qgemm.TOTALS[:rows]
    for total in totals:
        qgemm.zero(total)
    qgemm.count_blocks(r)
    with Loop() as blocks:
        unpack_scales_avx512(r, kind)
        d_w = super_scales_avx512(r, kind, 0)
        if kind.has_min:
            VMOVUPS(r.dmin, super_scales_avx512(r, kind, 1))
        chunks = chunks_avx512(r, kind)
        offset = broadcast_constant_zmm(r, kind.offset if kind.offset else 1, True)
        if kind.offset:
            bias = broadcast_constant_zmm(r, 0x80, True)
            corrections = signed_chunks_avx512(chunks, offset, bias)
        XOR(r.spare, r.spare)
        for i, total in enumerate(totals):
            if kind.offset:
                emit_row_biased_avx512(r, chunks, corrections, bias, d_w, total, r.biased[i % 2])
            else:
                emit_row_avx512(r, kind, chunks, offset, d_w, total)
            if i + 1 < rows:
                ADD(r.spare, r.scale_stride)
        advance_block(r, kind)
        TEST(r.blocks_left, r.blocks_left)
        JNZ(blocks.begin)
    qgemm.rewind_blocks(r, kind)
    qgemm.store_tile_avx512(r, totals, ldo_bytes, name)


def family(kind):
    """The qgemm driver's view of ``kind``'s kernels: this module's tiles, three weight arrays, no asum."""
    rows = kind.max_rows
    tilings = {"avx2": qgemm.Tiling(full=(rows,), groups=1, remainders=tuple(range(1, rows)), exact=True),
               "avx512": AVX512_TILING}
    return qgemm.Family(SIGNATURE, tiles={"avx2": emit_tile, "avx512": emit_tile_avx512}, tilings=tilings,
                        weights=("wq", "wscale", "wd"), reads_asum=False, frame=frame)


def emit(isa):
    kernels = [qgemm.emit_qgemm(kind, isa, family(kind)) for kind in KINDS]
    if isa == "avx2":
        kernels += [qgemm.emit_qgemm(kind, isa, family(kind), DECODE_TILING, emit_pair_tile) for kind in KINDS]
    return kernels
