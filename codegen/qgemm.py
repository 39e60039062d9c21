"""Quantized-weight GEMM: out[m, n] = act[m, k] . W[n, k]^T with int8 dot products.

    llb_qgemm_<kind>_q8_6x8__avx2(wq, wscale, aq, ad, asum, out, m, n, kb, ldo)
    llb_qgemm_<kind>_q8_16x16__avx512(...)      same arguments, same weight layout

W is a packed ``q4_1``, ``q8_0``, ``q5_0`` or ``q5_1`` weight (runtime/layout_quant.py,
runtime/layout_q5.py: groups of 8 rows, quant bytes interleaved 4 at a time, f16
scales; the five-bit kinds are unpacked as described in their section below); the activations are
Q8 blocks from quantize_q8: ``aq`` int8 [m, 32 kb], ``ad`` and ``asum`` f32
[m, kb] (scale, and scale * sum of the block's quants). ``wq`` / ``wscale``
point at the first row group to compute, ``out`` at the output element of that
group's first row, ``ldo`` is the output row stride in elements; only the
``n`` columns asked for are written (the last group's store is masked), so
threads can split a weight by row groups.

Per block both variants compute sum(q_w * q_a) exactly in int32, then

    out += (d_w * d_a) * sum(q_w * q_a)   [+ m_w * s_a for q4_1]

AVX2 (the baseline). One 32-byte weight load holds 4 quant bytes of each of 8
rows. A broadcast of the matching 4 activation bytes and ``vpmaddubsw``
(unsigned weight x signed activation) leave, per row, two int16 pair sums;
``vpmaddwd`` with ones adds those into one int32 lane per row. q4_1 nibbles
are 0..15, so a pair sum is at most 2*15*127 = 3810 and the 8 ``vpmaddubsw``
of a block are summed in int16 (at most 30480) before a single ``vpmaddwd``.
q8_0 weights are signed: |w| goes into the unsigned operand and w's sign onto
the activation (``vpsignb``; activations lie in [-127, 127]), and each pair
sum (up to 2*128*127) needs its own ``vpmaddwd``.
A tile holds MR rows x 8 outputs of f32 accumulators and MR int16/int32 block
accumulators: 2 * MR + 4 ymm registers, so MR = 6. Rows left over at the end
(m % MR) run a copy of the tile code specialised for that many rows, which
keeps its constants in the registers the smaller tile leaves free.

AVX-512 (AVX512BW + AVX512_VNNI). One zmm holds the same 4-byte chunk of two
row groups (group g's 32 bytes, then group g + 1's), so a vector is 16 output
columns on the AVX2 layout. ``vpdpbusd`` (unsigned x signed bytes, four
products summed into each int32 lane) takes the activation's 4 bytes as an
embedded broadcast from memory: one instruction per 4 weights x 16 columns.
q4_1: nibbles are the unsigned operand, activations the signed one. q8_0: the
activation biased by 128 (``a xor 0x80`` = a + 128, 0..255) is the unsigned
operand, the signed weight the other, and 128 * sum(w), computed once per
block of the group pair, is subtracted: exact. (``vpmaddubsw`` zmm would do
the same products in two or three instructions where ``vpdpbusd`` takes one,
on the same two multiply ports: both run 2 a cycle here, like the FMAs; and
(a + 128) * w overflows its int16 pair sums.) 32 zmm registers: 16 f32
accumulators (zmm16-31, named directly: see UpperZmmFunction) for a 16-row
tile, and one block's weights (8 zmm) stay in registers while the rows pass
one at a time. Rows left over (m % 16) run tiles of 8, 4, 2 and 1 rows. A
lone last row group (an odd group count) pairs with itself and stores only its
8 columns. Decode (m < 4) stays on AVX2: the two groups are two weight streams
each, and a cold GEMV streams slower than AVX2's (runtime/native/quant.py) --
except for the five-bit kinds, whose AVX2 unpacking is ALU-bound: their 1-row
tile prefetches both streams and decodes.

q4_1 and q8_0 (KIND_TILINGS, emit_rows_interleaved), the kinds of a serving
step of a few rows: their tiles pass the rows four at a time, chunk by chunk,
so that four vpdpbusd chains are in flight rather than one row's chain of
eight; the rows left after the 16-row tiles (1..15) take one tile of exactly
that many rows, one pass over the group pair's weights (unpacked once) where
tiles of 8, 4, 2 and 1 took up to four; tiles of up to 8 rows prefetch both
groups' quants, since a step of few rows streams its weights. They take the
AVX-512 tiles from m = 3 on.

Loop order: row groups outside, activation row tiles inside. One group's
weights (k/32 blocks of 160 bytes for q4_1: 20 KB at k = 4096) stay in L1
while every tile of MR activation rows streams past, so a prefill reads the
weights from memory once; decode (m = 1) streams them straight through, with
a software prefetch well ahead of the hardware prefetchers.

Summation order (batch invariance, DESIGN.md "Many sequences"): every tile of
either ISA, full or remainder, gives each row one f32 accumulator and adds its
blocks in k order with the same f32 operations per block: a multiply for
d_w * d_a, an FMA of the exact int32 dot product with it, and (kinds with a
min) an FMA of m_w * s_a into the same accumulator. So a row's output is
bit-identical whatever m, its place in a tile, or the ISA picked for that m:
decode (m = 1, AVX2) and prefill (AVX-512) give the same logits for the same
position. (A second accumulator for the min term would shorten the decode
GEMV's FMA chain, but it measured no faster, and the 6-row and 16-row tiles
have no registers for it.)
"""
from dataclasses import dataclass

from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, ZMMRegister, LOAD, Loop, Label, LABEL,
                            RETURN, LocalVariable, ADD, SUB, MOV, SHL, SHR, IMUL, LEA, XOR, CMP, TEST, JB, JBE,
                            JA, JNE, JAE, JG, JMP, JNZ, JZ, VMOVDQA, VMOVDQU, VPSRLW, VPAND, VPANDD, VPBROADCASTD,
                            VPMADDUBSW, VPADDW, VPOR, VPTERNLOGD, VPMADDWD, VPADDD, VPSUBD, VPXORD, VPABSB, VPSIGNB,
                            VCVTDQ2PS, VCVTPH2PS, VBROADCASTSS, VMULPS, VFMADD231PS, VXORPS, VMOVUPS,
                            VMOVAPS, VMASKMOVPS, VINSERTI64X4, VINSERTI128, VSHUFF64X2, VBROADCASTI64X4, VEXTRACTF64X4,
                            PREFETCHT0)

from .common import Kernel, function, tail_mask
from .contract import BLOCK, CHUNK, GROUP, QUANT_ARRAYS, qgemm_symbol
from .peachpy_ext import VPDPBUSD, broadcast, upper_zmm_function

ISAS = ("avx2", "avx512")
YMM_COUNT = 16
# Decode streams the weights once: a software prefetch this far ahead of the hardware
# prefetchers lifted a cold single-thread GEMV to the read probe's bandwidth on the AMD
# host it was tuned on (4-64 KiB measured alike).
PREFETCH_BYTES = 16384


class QuantsAndScales:
    """A kind whose weight is two arrays, quants and scales (the driver's default ``weights``)."""

    @property
    def weight_bytes(self):
        """Bytes per block of one group of each weight array (the driver's strides)."""
        return self.quant_bytes, self.scale_bytes


@dataclass(frozen=True)
class QuantKind(QuantsAndScales):
    name: str
    quant_bytes: int      # per block of one group (8 rows)
    scale_bytes: int      # f16 scales (and mins) per block of one group
    has_min: bool
    min_per_scale: float = 0.0   # m = this * d, formed in the kernel (0: m is stored after d)


Q4_1 = QuantKind("q4_1", quant_bytes=GROUP * BLOCK // 2, scale_bytes=2 * GROUP * 2, has_min=True)
Q8_0 = QuantKind("q8_0", quant_bytes=GROUP * BLOCK, scale_bytes=GROUP * 2, has_min=False)
# five-bit quants (runtime/layout_q5.py): 20 bytes a block per row; Q5_0's m = -16 d is not stored
Q5_0 = QuantKind("q5_0", quant_bytes=QUANT_ARRAYS["q5_0"][0].bytes_per_entry,
                 scale_bytes=QUANT_ARRAYS["q5_0"][1].bytes_per_entry, has_min=True, min_per_scale=-16.0)
Q5_1 = QuantKind("q5_1", quant_bytes=QUANT_ARRAYS["q5_1"][0].bytes_per_entry,
                 scale_bytes=QUANT_ARRAYS["q5_1"][1].bytes_per_entry, has_min=True)
FIVE_BIT = (Q5_0, Q5_1)
KINDS = (Q4_1, Q8_0) + FIVE_BIT

SIGNATURE = [("wq", "const uint8_t*"), ("wscale", "const uint16_t*"), ("aq", "const int8_t*"),
             ("ad", "const float*"), ("asum", "const float*"), ("out", "float*"),
             ("m", "size_t"), ("n", "size_t"), ("kb", "size_t"), ("ldo", "size_t")]


@dataclass(frozen=True)
class Tiling:
    """How one ISA's kernel covers the output with register tiles of some activation rows x
    ``groups`` row groups: as many tiles of ``full[0]`` rows as fit, then of ``full[1]``...;
    the rows left then run the tiles in ``remainders``, either the one matching their count
    (``exact``) or every one whose bit is set in it. ``aliasing_kinds`` skip the first full
    size when activation rows lie a multiple of ALIASING_BYTES apart."""
    full: tuple
    groups: int
    remainders: tuple
    exact: bool
    aliasing_kinds: tuple = ()
    # the full sizes after the first run only where activation rows alias (else the rows
    # left go straight to the remainders)
    later_full_only_aliasing: bool = False

    @property
    def rows(self):
        return self.full[0]

    @property
    def columns(self):
        return GROUP * self.groups

    @property
    def name(self):
        return f"{self.rows}x{self.columns}"


# 16 activation rows k = 4096 bytes apart share one L1 set (64 sets of 64-byte lines, 12
# ways): q4_1 at k = 4096 runs at ~530 GOP/s in 16-row tiles, ~620 in 8-row ones, like
# any other k in 16-row tiles. q8_0 amortises more per-block work over a tile's rows and
# stays faster with 16.
ALIASING_BYTES = 4096
TILINGS = {"avx2": Tiling(full=(6,), groups=1, remainders=(1, 2, 3, 4, 5), exact=True),
           "avx512": Tiling(full=(16, 8), groups=2, remainders=(4, 2, 1), exact=False,
                            aliasing_kinds=("q4_1",))}
# q4_1 and q8_0 (whose AVX-512 tiles interleave rows, emit_rows_interleaved) have a tile for
# every row count below 16, so that the rows a group pair has left (a serving step of 2..15
# rows, or the end of a prefill) take one pass over its weights, which they unpack once,
# rather than up to four passes of 8, 4, 2 and 1 rows.
EXACT_REMAINDERS = tuple(range(15, 0, -1))
KIND_TILINGS = {("q4_1", "avx512"): Tiling(full=(16, 8), groups=2, remainders=EXACT_REMAINDERS, exact=True,
                                           aliasing_kinds=("q4_1",), later_full_only_aliasing=True),
                ("q8_0", "avx512"): Tiling(full=(16,), groups=2, remainders=EXACT_REMAINDERS, exact=True)}


class Registers:
    """The GP registers every part of the kernel shares (the AVX-512 kernel adds two): one
    pointer per weight array (``weights``: the family's), the activation pointers and the
    loop state. Where the tiles do not read asum, ``act_sum`` is a dummy stack slot, which
    the shared row walk (advance_rows) may step."""

    def __init__(self, paired, weights=("wq", "wscale"), reads_asum=True):
        self.weights, self.reads_asum = weights, reads_asum
        if not reads_asum:
            self.act_sum = LocalVariable(8)
        names = list(weights) + ["act", "act_scale"] + (["act_sum"] if reads_asum else []) + [
            "out_row", "groups_left_cols", "rows_left", "blocks_left", "row_stride", "scale_stride", "spare"]
        if paired:
            # offsets from group g's quants / scales to group g + 1's (0 for a lone last group)
            names += ["pair_quants", "pair_scales"]
        for name in names:
            setattr(self, name, GeneralPurposeRegister64())

    def weight_strides(self, kind):
        """(pointer, bytes per block of one group) of each weight array, in argument order."""
        return tuple(zip((getattr(self, name) for name in self.weights), kind.weight_bytes))


@dataclass(frozen=True)
class Family:
    """What a family of quant kinds brings to the one driver: its C signature (a pointer per
    weight array, then aq, ad, asum, out, m, n, kb, ldo), the registers that hold those
    pointers (``weights``), its tile emitters and Tilings by ISA, whether its tiles read
    ``asum``, and ``frame(r, kind, isa)``, which gives the tiles stack slots they share (or None).
    Its kinds give ``weight_bytes``: each weight array's bytes per block of one group."""
    signature: list
    tiles: dict
    tilings: dict
    weights: tuple = ("wq", "wscale")
    reads_asum: bool = True
    frame: object = None
    kind_tilings: dict = None     # (kind name, isa) -> a Tiling other than the ISA's


# --------------------------------------------------------------------------- driver (both ISAs)

def emit_qgemm(kind, isa, family=None, tiling=None, emit_tile=None):
    """The kernel of ``kind`` for ``isa`` on the tiles of ``family`` (default: this module's;
    codegen/qgemm_kquant.py's walk super-blocks, codegen/qgemm_k16.py's add a third weight array),
    or on ``tiling`` with the tile emitter ``emit_tile`` (a family's second kernel, as the
    AVX2 decode kernels of codegen/qgemm_k16.py)."""
    family = family or FAMILY
    tiling = tiling or (family.kind_tilings or {}).get((kind.name, isa)) or family.tilings[isa]
    open_function = function if isa == "avx2" else upper_zmm_function
    emit_tile = emit_tile or family.tiles[isa]
    fn, args = open_function(qgemm_symbol(kind.name, tiling.name, isa), family.signature, isa)
    weight_args, (a_aq, a_ad, a_asum, a_out, a_m, a_n, a_kb, a_ldo) = (args[:len(family.weights)],
                                                                       args[len(family.weights):])
    with fn:
        r = Registers(paired=tiling.groups > 1, weights=family.weights, reads_asum=family.reads_asum)
        # loaded once per row group; kept in the stack frame to spare registers
        act_base, scale_base = LocalVariable(8), LocalVariable(8)
        sum_base = LocalVariable(8) if family.reads_asum else None
        m_rows, ldo_bytes, out_group = (LocalVariable(8) for _ in range(3))
        if family.frame is not None:
            family.frame(r, kind, isa)
        for name, arg in zip(family.weights, weight_args):
            LOAD.ARGUMENT(getattr(r, name), arg)
        for local, arg in ((act_base, a_aq), (scale_base, a_ad), (sum_base, a_asum), (m_rows, a_m),
                           (out_group, a_out)):
            if local is not None:
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
            if family.reads_asum:
                MOV(r.act_sum, sum_base)
            MOV(r.out_row, out_group)
            MOV(r.rows_left, m_rows)
            if tiling.groups > 1:
                set_pair_offsets(r, kind)

            smaller_tiles = Label("smaller_tiles")
            if kind.name in tiling.aliasing_kinds:
                TEST(r.row_stride, ALIASING_BYTES - 1)
                JZ(smaller_tiles)
            remainders = Label("remainders")
            for i, rows in enumerate(tiling.full):
                emit_full_tiles(r, kind, rows, emit_tile, ldo_bytes)
                if i == 0:
                    if tiling.later_full_only_aliasing:
                        JMP(remainders)
                    LABEL(smaller_tiles)
            LABEL(remainders)
            emit_remainder_tiles(r, kind, tiling, emit_tile, ldo_bytes)

            for pointer, per_block in r.weight_strides(kind):
                per_block_bytes(r.spare, r.scale_stride, per_block * tiling.groups)
                ADD(pointer, r.spare)
            ADD(out_group, tiling.columns * 4)
            SUB(r.groups_left_cols, tiling.columns)
            JG(groups.begin)
        RETURN()
    return Kernel(fn, "qgemm", isa, tile=tiling.name, args=family.signature)


def emit_full_tiles(r, kind, rows, emit_tile, ldo_bytes):
    """Tiles of ``rows`` rows while that many are left."""
    tiles = Loop()
    CMP(r.rows_left, rows)
    JB(tiles.end)
    with tiles:
        emit_tile(r, kind, rows, ldo_bytes, f"tile{rows}")
        advance_rows(r, rows, ldo_bytes)
        SUB(r.rows_left, rows)
        CMP(r.rows_left, rows)
        JAE(tiles.begin)


def emit_remainder_tiles(r, kind, tiling, emit_tile, ldo_bytes):
    """The rows left after the full tiles (fewer than the last full size)."""
    group_done = Label("group_done")
    for rows in tiling.remainders:
        skip = Label(f"not{rows}")
        if tiling.exact:
            CMP(r.rows_left, rows)
            JNE(skip)
        else:
            TEST(r.rows_left, rows)
            JZ(skip)
        emit_tile(r, kind, rows, ldo_bytes, f"rest{rows}" if rows in tiling.full else f"tile{rows}")
        if tiling.exact:
            JMP(group_done)
        else:
            advance_rows(r, rows, ldo_bytes)
        LABEL(skip)
    LABEL(group_done)


def advance_rows(r, rows, ldo_bytes):
    for reg, stride in ((r.act, r.row_stride), (r.act_scale, r.scale_stride), (r.act_sum, r.scale_stride)):
        multiply(r.spare, stride, rows)
        ADD(reg, r.spare)
    multiply(r.spare, ldo_bytes, rows)
    ADD(r.out_row, r.spare)


def multiply(target, source, factor):
    """target = source * factor (a small positive constant).

    PeachPy (2021) encodes IMUL's immediate 128 as the 8-bit -128, so factors of 128 and
    more must be powers of two, which are shifts anyway."""
    MOV(target, source)
    if factor & (factor - 1) == 0:
        if factor > 1:
            SHL(target, factor.bit_length() - 1)
    elif factor < 128:
        IMUL(target, target, factor)
    else:
        raise ValueError(f"multiply: {factor} is neither a power of two nor below 128")


def per_block_bytes(target, scale_stride, per_block):
    """target = kb * per_block from scale_stride = 4 kb (per_block: an integer, or a power-of-two
    fraction: a value per super-block spread over its blocks)."""
    if per_block == int(per_block) and int(per_block) % 4 == 0:
        multiply(target, scale_stride, int(per_block) // 4)
    else:
        MOV(target, scale_stride)
        SHR(target, 2)                  # kb
        factor = int(per_block * 8)     # per_block = factor / 8 (super-block values)
        assert factor * 8 == per_block * 64 and factor & (factor - 1) == 0, per_block
        shift = factor.bit_length() - 1 - 3
        if shift > 0:
            SHL(target, shift)
        elif shift < 0:
            SHR(target, -shift)


def advance_blocks(r, kind):
    ADD(r.act, BLOCK)
    ADD(r.act_scale, 4)
    ADD(r.act_sum, 4)
    ADD(r.wq, kind.quant_bytes)
    ADD(r.wscale, kind.scale_bytes)


def count_blocks(r, per_step=1):
    """blocks_left = the block loop's steps: kb / ``per_step`` (a power of two; scale_stride is 4 kb)."""
    MOV(r.blocks_left, r.scale_stride)
    SHR(r.blocks_left, 2 + per_step.bit_length() - 1)


def prefetch_quants(r, kind, pair=False):
    """Only the decode path streams (bigger tiles re-read the group from L1): the block's
    quants PREFETCH_BYTES ahead, of group g + 1 too with ``pair``."""
    for line in range(0, kind.quant_bytes, 64):
        PREFETCHT0([r.wq + PREFETCH_BYTES + line])
        if pair:
            PREFETCHT0([r.wq + r.pair_quants * 1 + PREFETCH_BYTES + line])


def rewind_blocks(r, kind):
    """Undo the block loop's pointer walk (k bytes of activations, kb blocks of weights)."""
    SUB(r.act, r.row_stride)
    SUB(r.act_scale, r.scale_stride)
    if r.reads_asum:
        SUB(r.act_sum, r.scale_stride)
    for pointer, per_block in r.weight_strides(kind):
        per_block_bytes(r.spare, r.scale_stride, per_block)
        SUB(pointer, r.spare)


# --------------------------------------------------------------------------- AVX2 tile

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


def emit_block_scale(r, acc, facc, d_w, m_w, bcast, prod, offset=0):
    """facc[i] += (d_w * d_a[i]) * acc[i], then facc[i] += m_w * s_a[i]: acc holds int32 block
    sums, facc one f32 accumulator per row. Every tile of this module's kinds and the K-quants'
    ends its block with these operations in this order (the AVX-512 tiles: emit_row_scale,
    then the min FMA), so a row's result does not depend on its tile, m or ISA.
    ``offset``: bytes from the activation scale and sum pointers to the block's."""
    scales = RowAddresses(r.act_scale, r.scale_stride, r.spare, len(acc))
    scales.prepare()
    for i in range(len(acc)):
        VCVTDQ2PS(acc[i], acc[i])
        VBROADCASTSS(bcast, scales(i, offset))
        VMULPS(bcast, bcast, d_w)
        VFMADD231PS(facc[i], acc[i], bcast)
    if m_w is None:
        return
    sums = RowAddresses(r.act_sum, r.scale_stride, r.spare, len(acc))
    sums.prepare()
    for i in range(len(acc)):
        VBROADCASTSS(prod, sums(i, offset))
        VFMADD231PS(facc[i], m_w, prod)


def place_constants(target, wanted, spare, floats=()):
    """Each vector constant of ``wanted`` (name -> Constant, most used first) as an attribute of
    ``target``: in a fresh ymm while ``spare`` registers are left, else the RIP-relative memory
    operand. ``floats`` name the f32 ones (loaded with vmovaps, the rest with vmovdqa).
    Returns the registers still spare."""
    for name, constant in wanted.items():
        if spare > 0:
            register = YMMRegister()
            (VMOVAPS if name in floats else VMOVDQA)(register, constant)
            constant, spare = register, spare - 1
        setattr(target, name, constant)
    return spare


class TileConstants:
    """The vector constants of the block loop: in registers when the tile leaves some free
    (a memory operand costs a load per use: 10 -> 12.7 cycles a block in the decode GEMV),
    else RIP-relative memory operands. Spare registers stay unused: a second f32
    accumulator per row for the min term (which the decode tiles once had) would sum the
    row in another order than the 6-row tiles and the AVX-512 kernel (batch invariance,
    see the module docstring), and measured no faster in the decode GEMV (m = 1)."""

    def __init__(self, kind, rows):
        working = 4 if kind is Q4_1 else 3       # weight, unpacked / |w|, broadcast, product
        spare = YMM_COUNT - working - 2 * rows  # block sums and f32 accumulators
        wanted = {"nibble": Constant.uint32x8(0x0F0F0F0F), "ones": Constant.uint16x16(1)}
        if kind is not Q4_1:
            del wanted["nibble"]
        place_constants(self, wanted, spare)


def emit_tile_avx2(r, kind, rows, ldo_bytes, name):
    """out[rows x 8] of the current group and row tile; leaves the pointers where it found them."""
    consts = (Q5TileConstants if kind in FIVE_BIT else TileConstants)(kind, rows)
    facc = [YMMRegister() for _ in range(rows)]
    for f in facc:
        VXORPS(f, f, f)
    count_blocks(r)
    with Loop() as blocks:
        if rows == 1:
            prefetch_quants(r, kind)
        acc = [YMMRegister() for _ in range(rows)]
        if kind in FIVE_BIT:
            emit_block_q5(r, kind, consts, acc, facc)
        elif kind is Q4_1:
            emit_block_q4_1(r, consts, acc, facc)
        else:
            emit_block_q8_0(r, consts, acc, facc)
        advance_blocks(r, kind)
        SUB(r.blocks_left, 1)
        JNZ(blocks.begin)
    rewind_blocks(r, kind)
    store_tile_avx2(r, facc, ldo_bytes, name)


def store_tile_avx2(r, totals, ldo_bytes, name):
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


def store_pair_avx2(r, totals, name):
    """One row of 16 outputs from two ymm (group g's 8, then group g + 1's) on AVX2 tiles of a
    group pair: at the right edge the first keeps min(columns, 8) of them, the second the rest,
    masked (a lone last group's second, a copy of the first, is not stored)."""
    first, second = totals
    partial, low_only, done = Label(f"{name}_partial"), Label(f"{name}_low"), Label(f"{name}_stored")
    CMP(r.groups_left_cols, 2 * GROUP)
    JB(partial)
    VMOVUPS([r.out_row], first)
    VMOVUPS([r.out_row + 32], second)
    JMP(done)

    LABEL(partial)
    mask = YMMRegister()
    CMP(r.groups_left_cols, GROUP)
    JBE(low_only)
    MOV(r.spare, r.groups_left_cols)
    SUB(r.spare, GROUP)
    tail_mask(mask, r.spare)
    VMOVUPS([r.out_row], first)
    VMASKMOVPS([r.out_row + 32], mask, second)
    JMP(done)

    LABEL(low_only)
    tail_mask(mask, r.groups_left_cols)
    VMASKMOVPS([r.out_row], mask, first)
    LABEL(done)


# --------------------------------------------------------------------------- AVX-512 tile

# The f32 accumulators of an AVX-512 tile, one row each.
TOTALS = tuple(ZMMRegister(physical_id=i) for i in range(16, 32))
NIBBLE_BYTES = 0x0F0F0F0F
BIAS_BYTES = 0x80808080          # q8_0: a xor 0x80 = a + 128 (unsigned), and 128 as a multiplier


def set_pair_offsets(r, kind):
    """Group g + 1 is kb blocks after group g; a lone last group (8 or fewer columns left)
    pairs with itself, so every load stays inside the weight."""
    paired = Label("paired")
    multiply(r.pair_quants, r.scale_stride, kind.quant_bytes // 4)
    multiply(r.pair_scales, r.scale_stride, kind.scale_bytes // 4)
    CMP(r.groups_left_cols, GROUP)
    JA(paired)
    XOR(r.pair_quants, r.pair_quants)
    XOR(r.pair_scales, r.pair_scales)
    LABEL(paired)


def broadcast_constant(r, value):
    """A zmm with the dword ``value`` in every lane (through ``r.spare``)."""
    register = ZMMRegister()
    MOV(r.spare.as_dword, value)
    VPBROADCASTD(register, r.spare.as_dword)
    return register


def load_pair(r, register, offset):
    """``register`` = 32 bytes of group g at ``offset`` into the block, then group g + 1's.

    A broadcast rather than a ymm load writes all of the zmm, as PeachPy's liveness
    analysis needs to see (it does not know that a VEX ymm write clears the upper half)."""
    VBROADCASTI64X4(register, [r.wq + offset])
    VINSERTI64X4(register, register, [r.wq + r.pair_quants * 1 + offset], 1)


def zero(register):
    """vpxord x, x, x, marked as the zeroing idiom it is: PeachPy knows vpxor's, not vpxord's,
    and would otherwise take x as live from the start of the function."""
    VPXORD(register, register, register)._cancelling_inputs = True


def load_block_q4_1(r, nibbles):
    """The block's nibbles of both groups: (low, high) per 4-byte chunk, and d_w, m_w."""
    weights = []
    for c in range(BLOCK // 2 // CHUNK):
        low, high = ZMMRegister(), ZMMRegister()
        load_pair(r, low, 32 * c)
        VPSRLW(high, low, 4)
        VPANDD(low, low, nibbles)
        VPANDD(high, high, nibbles)
        weights.append((low, high))
    # each group's block scales are 8 d then 8 m: one f16 -> f32 conversion per group
    first, second, d_w, m_w = (ZMMRegister() for _ in range(4))
    VCVTPH2PS(first, [r.wscale])
    VCVTPH2PS(second, [r.wscale + r.pair_scales * 1])
    VSHUFF64X2(d_w, first, second, 0b01_00_01_00)
    VSHUFF64X2(m_w, first, second, 0b11_10_11_10)
    return weights, d_w, m_w


def load_block_q8_0(r, bias):
    """The block's signed quants of both groups per chunk, d_w, and 128 * sum(w) per column."""
    weights = [ZMMRegister() for _ in range(BLOCK // CHUNK)]
    correction = ZMMRegister()
    zero(correction)
    for c, w in enumerate(weights):
        load_pair(r, w, 32 * c)
        VPDPBUSD(correction, bias, w)
    halves, d_w = YMMRegister(), ZMMRegister()
    VMOVDQU(halves.as_xmm, [r.wscale])
    VINSERTI128(halves, halves, [r.wscale + r.pair_scales * 1], 1)
    VCVTPH2PS(d_w, halves)
    return weights, d_w, correction


def emit_row_q4_1(r, weights, d_w, m_w, total):
    """total += (d_w * d_a) * sum(q_w * q_a) + m_w * s_a for the activation row at ``r.spare``
    (counted in scale-row units: its bytes start at act + 8 * spare)."""
    acc = ZMMRegister()
    zero(acc)
    for c, (low, high) in enumerate(weights):
        # low nibbles are weights 4c..4c+3 of the block, high nibbles 16+4c..16+4c+3
        VPDPBUSD(acc, low, broadcast([r.act + r.spare * 8 + CHUNK * c]))
        VPDPBUSD(acc, high, broadcast([r.act + r.spare * 8 + BLOCK // 2 + CHUNK * c]))
    emit_row_scale(r, acc, d_w, total)
    VFMADD231PS(total, m_w, broadcast([r.act_sum + r.spare * 1]))


def emit_row_q8_0(r, weights, d_w, correction, bias, total):
    """sum((q_a + 128) * q_w) - 128 * sum(q_w): the correction comes last, so that a row's
    chain does not wait for the block's (measured: up to 6% faster than starting from it)."""
    acc = ZMMRegister()
    zero(acc)
    for c, w in enumerate(weights):
        biased = ZMMRegister()
        VPXORD(biased, bias, broadcast([r.act + r.spare * 8 + CHUNK * c]))
        VPDPBUSD(acc, biased, w)
    VPSUBD(acc, acc, correction)
    emit_row_scale(r, acc, d_w, total)


# Kinds whose AVX-512 tiles run their rows INTERLEAVED_ROWS at a time (emit_rows_interleaved).
INTERLEAVED_KINDS = (Q4_1, Q8_0)
INTERLEAVED_ROWS = 4
# Their tiles of at most this many rows stream the weights (a step of few rows is bound by
# reading them): they prefetch both groups' quants as the decode GEMV does.
STREAMING_ROWS = 8


def emit_rows_interleaved(r, kind, weights, d_w, extra, constant, totals):
    """The block's rows as emit_row_q4_1 / emit_row_q8_0 compute them, INTERLEAVED_ROWS rows at
    a time: their int32 dot products chunk by chunk (one vpdpbusd of each row in turn, so
    that four independent chains hide vpdpbusd's latency, where a row's eight form one
    chain), then each row's f32 operations, unchanged and in the same order. The int32 sums
    are exact whatever the order, so every row's result keeps its bits.

    Activation rows of a sub-tile at [row + 0|stride], [row2 + 0|stride] (row2 = row + 2
    strides): ``r.spare`` serves as row2 and, for the f32 part, as the scale-row offset, and
    ``r.rows_left`` (which the tile saves: every GP register is taken) as row."""
    row = r.rows_left
    MOV(row, r.act)
    for start in range(0, len(totals), INTERLEAVED_ROWS):
        sub = totals[start:start + INTERLEAVED_ROWS]
        accs = [ZMMRegister() for _ in sub]
        for acc in accs:
            zero(acc)
        if len(sub) > 2:
            LEA(r.spare, [row + r.row_stride * 2])
        addresses = [[row], [row + r.row_stride * 1], [r.spare], [r.spare + r.row_stride * 1]][:len(sub)]

        def at(i, offset):
            return broadcast([addresses[i][0] + offset])

        if kind is Q4_1:
            for c, (low, high) in enumerate(weights):
                for i, acc in enumerate(accs):
                    VPDPBUSD(acc, low, at(i, CHUNK * c))
                for i, acc in enumerate(accs):
                    VPDPBUSD(acc, high, at(i, BLOCK // 2 + CHUNK * c))
        else:
            for c, w in enumerate(weights):
                for i, acc in enumerate(accs):
                    biased = ZMMRegister()
                    VPXORD(biased, constant, at(i, CHUNK * c))
                    VPDPBUSD(acc, biased, w)
        if start + INTERLEAVED_ROWS < len(totals):
            LEA(row, [row + r.row_stride * 4])
        # the f32 part: scale-row offsets of this sub-tile's rows
        if start:
            multiply(r.spare, r.scale_stride, start)
        else:
            XOR(r.spare, r.spare)
        for i, (acc, total) in enumerate(zip(accs, sub)):
            if kind is Q4_1:
                emit_row_scale(r, acc, d_w, total)
                VFMADD231PS(total, extra, broadcast([r.act_sum + r.spare * 1]))
            else:
                VPSUBD(acc, acc, extra)
                emit_row_scale(r, acc, d_w, total)
            if i + 1 < len(sub):
                ADD(r.spare, r.scale_stride)


def emit_row_scale(r, acc, d_w, total):
    scale = ZMMRegister()
    VCVTDQ2PS(acc, acc)
    VMULPS(scale, d_w, broadcast([r.act_scale + r.spare * 1]))
    VFMADD231PS(total, acc, scale)


def emit_tile_avx512(r, kind, rows, ldo_bytes, name):
    """out[rows x 16] of the current group pair and row tile; leaves the pointers where it found them."""
    totals = TOTALS[:rows]
    for total in totals:
        zero(total)
    if kind in FIVE_BIT:
        masks = Q5Masks(r, kind)
    else:
        constant = broadcast_constant(r, NIBBLE_BYTES if kind is Q4_1 else BIAS_BYTES)
    rows_left = None
    if kind in INTERLEAVED_KINDS:
        rows_left = LocalVariable(8)
        MOV(rows_left, r.rows_left)
    count_blocks(r)
    with Loop() as blocks:
        if rows <= 2 and kind in FIVE_BIT:
            # five-bit kinds decode (m < 4) on these tiles too (runtime/native/quant.py): stream
            # both groups (m = 3 prefetches twice, the 1-row tile's lines already cached)
            prefetch_quants(r, kind, pair=True)
        elif rows <= STREAMING_ROWS and kind in INTERLEAVED_KINDS:
            prefetch_quants(r, kind, pair=True)
        if kind in FIVE_BIT:
            weights, d_w, m_w = load_block_q5(r, kind, masks)
        elif kind is Q4_1:
            weights, d_w, m_w = load_block_q4_1(r, constant)
        else:
            weights, d_w, correction = load_block_q8_0(r, constant)
        if kind in INTERLEAVED_KINDS:
            extra = m_w if kind is Q4_1 else correction
            emit_rows_interleaved(r, kind, weights, d_w, extra, constant, totals)
        else:
            # the row walker counts scale-row bytes: activation bytes are 8x that (k = 32 kb)
            XOR(r.spare, r.spare)
            for i, total in enumerate(totals):
                if kind is Q4_1 or kind in FIVE_BIT:
                    emit_row_q4_1(r, weights, d_w, m_w, total)
                else:
                    emit_row_q8_0(r, weights, d_w, correction, constant, total)
                if i + 1 < rows:
                    ADD(r.spare, r.scale_stride)
        advance_blocks(r, kind)
        SUB(r.blocks_left, 1)
        JNZ(blocks.begin)
    if rows_left is not None:
        MOV(r.rows_left, rows_left)
    rewind_blocks(r, kind)
    store_tile_avx512(r, totals, ldo_bytes, name)


def store_tile_avx512(r, totals, ldo_bytes, name):
    """Rows of 16 outputs. At the right edge the low half (group g) keeps min(columns, 8) of
    them and the high half the rest, stored through a ymm mask (the 2021 PeachPy allocates
    no mask registers)."""
    partial, low_only, done = Label(f"{name}_partial"), Label(f"{name}_low"), Label(f"{name}_stored")
    MOV(r.spare, r.out_row)
    CMP(r.groups_left_cols, 2 * GROUP)
    JB(partial)
    for total in totals:
        VMOVUPS([r.spare], total)
        ADD(r.spare, ldo_bytes)
    JMP(done)

    LABEL(partial)
    mask, half = YMMRegister(), YMMRegister()
    CMP(r.groups_left_cols, GROUP)
    JBE(low_only)
    MOV(r.blocks_left, r.groups_left_cols)      # free until the next tile
    SUB(r.blocks_left, GROUP)
    tail_mask(mask, r.blocks_left)
    for total in totals:
        VMOVUPS([r.spare], total.as_ymm)
        VEXTRACTF64X4(half, total, 1)
        VMASKMOVPS([r.spare + 32], mask, half)
        ADD(r.spare, ldo_bytes)
    JMP(done)

    LABEL(low_only)
    tail_mask(mask, r.groups_left_cols)
    for total in totals:
        VMOVAPS(half, total.as_ymm)
        VMASKMOVPS([r.spare], mask, half)
        ADD(r.spare, ldo_bytes)
    LABEL(done)


# --------------------------------------------------------------------------- five-bit kinds (q5_0, q5_1)
#
# A block of one group is 5 chunks of 32 bytes (runtime/layout_q5.py): chunk c < 4 holds
# q[4c + i] in bits 0-4 and q[16 + 4c + i] >> 2 in bits 5-7 of each row's byte i, chunk 4
# the low two bits of q[16 + 4c + i] at bit 2c. Unpacked, chunk c gives the same two
# vectors as a q4_1 chunk (weights 4c..4c+3 and 16+4c..16+4c+3 of 8 rows, now 0..31):
#     low  = B_c & 31
#     high = ((B_c >> 3) & 28) | ((B_4 >> 2c) & 3)
# (16-bit shifts: the masks drop what the next byte shifts in). Q5_0's d (q - 16) is
# d q + m with m = -16 d, formed in f32 in the kernel (exact, a power of two), so both
# kinds share the q4_1 arithmetic per block: out += (d_w d_a) sum(q_w q_a) + m_w s_a.
#
# AVX2: a vpmaddubsw pair sum is up to 2 * 31 * 127 = 7874, so at most four of them add
# up in int16: the products of chunks 0 and 1 sum in the row's block register, which a
# vpmaddwd then widens in place; chunks 2 and 3 each widen their two products and add
# them in int32 (with registers to spare, chunks 2-3 keep a second int16 sum instead).

LOW5, HIGH3, LOW2 = 0x1F1F1F1F, 0x1C1C1C1C, 0x03030303
Q5_CHUNKS = BLOCK // 2 // CHUNK             # chunks 0..3 hold q[4c..] and the top of q[16+4c..]
Q5_LOW_BITS = Q5_CHUNKS                     # chunk 4 holds the low bits of q[16..31]


class Q5TileConstants:
    """TileConstants for five-bit kinds: the masks, vpmaddwd's ones, the low-bits chunk of
    the block and (q5_0) -16.0 in registers while the tile leaves some free, else memory
    operands (the low-bits chunk is then reloaded per chunk); then, with registers to
    spare, a second int16 block sum per row. The min term shares the row's f32
    accumulator in every tile (a second one measured no faster in the decode GEMV), so
    every row sums exactly as the AVX-512 tile does: the ISAs agree bit for bit."""

    def __init__(self, kind, rows):
        spare = YMM_COUNT - 4 - 2 * rows       # low/high weights, broadcast, product; sums
        wanted = {"ones": Constant.uint16x16(1), "low5": Constant.uint32x8(LOW5),
                  "high3": Constant.uint32x8(HIGH3), "low2": Constant.uint32x8(LOW2)}
        if kind.min_per_scale:
            wanted["min_per_scale"] = Constant.float32x8(kind.min_per_scale)
        spare = place_constants(self, wanted, spare, floats=("min_per_scale",))
        self.low_bits = None
        if spare > 0:
            self.low_bits, spare = YMMRegister(), spare - 1       # loaded per block
        self.split_sums = spare >= rows


def emit_unpack_q5_avx2(r, consts, c, low, high, tmp):
    """low, high = the two weight vectors of chunk c (tmp is clobbered)."""
    VMOVDQA(low, [r.wq + 32 * c])
    VPSRLW(high, low, 3)
    VPAND(high, high, consts.high3)
    if consts.low_bits is not None:
        source = consts.low_bits
    else:
        VMOVDQA(tmp, [r.wq + 32 * Q5_LOW_BITS])
        source = tmp
    if c:
        VPSRLW(tmp, source, 2 * c)
        source = tmp
    VPAND(tmp, source, consts.low2)
    VPOR(high, high, tmp)
    VPAND(low, low, consts.low5)


def emit_block_q5(r, kind, consts, acc, facc):
    """One 32-weight block of one group for ``len(acc)`` activation rows."""
    lo, hi, bcast, prod = (YMMRegister() for _ in range(4))
    second = [YMMRegister() for _ in acc] if consts.split_sums else None
    row = RowAddresses(r.act, r.row_stride, r.spare, len(acc))
    row.prepare()
    if consts.low_bits is not None:
        VMOVDQA(consts.low_bits, [r.wq + 32 * Q5_LOW_BITS])
    for c in range(Q5_CHUNKS):
        emit_unpack_q5_avx2(r, consts, c, lo, hi, prod)
        for i in range(len(acc)):
            # low are weights 4c..4c+3 of the block, high 16+4c..16+4c+3
            VPBROADCASTD(bcast, row(i, CHUNK * c))
            VPMADDUBSW(prod, lo, bcast)
            VPBROADCASTD(bcast, row(i, BLOCK // 2 + CHUNK * c))
            VPMADDUBSW(bcast, hi, bcast)
            if c == 0:
                VPADDW(acc[i], prod, bcast)
            elif c == 1:
                VPADDW(acc[i], acc[i], prod)
                VPADDW(acc[i], acc[i], bcast)
                VPMADDWD(acc[i], acc[i], consts.ones)
            elif second is not None:
                if c == 2:
                    VPADDW(second[i], prod, bcast)
                else:
                    VPADDW(second[i], second[i], prod)
                    VPADDW(second[i], second[i], bcast)
            else:
                VPADDW(prod, prod, bcast)
                VPMADDWD(prod, prod, consts.ones)
                VPADDD(acc[i], acc[i], prod)
    if second is not None:
        for a, s in zip(acc, second):
            VPMADDWD(s, s, consts.ones)
            VPADDD(a, a, s)
    d_w, m_w = lo, hi
    VCVTPH2PS(d_w, [r.wscale])
    if kind.min_per_scale:
        VMULPS(m_w, d_w, consts.min_per_scale)
    else:
        VCVTPH2PS(m_w, [r.wscale + GROUP * 2])
    emit_block_scale(r, acc, facc, d_w, m_w, bcast, prod)


# vpternlogd truth table (bit a*4 + b*2 + c for dest a, sources b, c) of (a & c) | b:
# the shifted chunk keeps its mask's bits, the (clean) low bits fill the rest
SHIFTED_OR_LOW = 0b11101100


class Q5Masks:
    """The AVX-512 tile's byte masks (and q5_0's -16.0), broadcast once per tile."""

    def __init__(self, r, kind):
        self.low5 = broadcast_constant(r, LOW5)
        self.high3 = broadcast_constant(r, HIGH3)
        self.low2 = broadcast_constant(r, LOW2)
        self.min_per_scale = broadcast_constant(r, _f32_bits(kind.min_per_scale)) if kind.min_per_scale else None


def load_block_q5(r, kind, masks):
    """The block's unpacked weights of both groups: (low, high) per chunk, and d_w, m_w."""
    low_bits = ZMMRegister()
    load_pair(r, low_bits, 32 * Q5_LOW_BITS)
    weights = []
    for c in range(Q5_CHUNKS):
        low, high, tmp = ZMMRegister(), ZMMRegister(), ZMMRegister()
        load_pair(r, low, 32 * c)
        if c:
            VPSRLW(tmp, low_bits, 2 * c)
            VPANDD(tmp, tmp, masks.low2)
        else:
            VPANDD(tmp, low_bits, masks.low2)
        VPSRLW(high, low, 3)
        VPTERNLOGD(high, tmp, masks.high3, SHIFTED_OR_LOW)
        VPANDD(low, low, masks.low5)
        weights.append((low, high))
    d_w, m_w = ZMMRegister(), ZMMRegister()
    if kind.min_per_scale:
        halves = YMMRegister()
        VMOVDQU(halves.as_xmm, [r.wscale])
        VINSERTI128(halves, halves, [r.wscale + r.pair_scales * 1], 1)
        VCVTPH2PS(d_w, halves)
        VMULPS(m_w, d_w, masks.min_per_scale)
    else:
        first, second = ZMMRegister(), ZMMRegister()
        VCVTPH2PS(first, [r.wscale])
        VCVTPH2PS(second, [r.wscale + r.pair_scales * 1])
        VSHUFF64X2(d_w, first, second, 0b01_00_01_00)
        VSHUFF64X2(m_w, first, second, 0b11_10_11_10)
    return weights, d_w, m_w


def _f32_bits(value):
    import struct
    return struct.unpack("<I", struct.pack("<f", value))[0]


FAMILY = Family(SIGNATURE, tiles={"avx2": emit_tile_avx2, "avx512": emit_tile_avx512}, tilings=TILINGS,
                kind_tilings=KIND_TILINGS)


def emit(isa):
    return [emit_qgemm(kind, isa) for kind in KINDS]
