"""Pass 1 of paged attention: a segment's scores, one KV block's key tile at a time, into
the tile's score rows (f32/f16 FMAs, q8_0 integer dot products with q quantized once per
row), with the K and V prefetches that run beside them."""
from peachpy import Constant
from peachpy.x86_64 import (ADD, AND, Block, CMOVA, CMOVAE, CMOVGE, CMP, DEC, IMUL, JB, JNZ, JZ, LEA, Loop,
                            MOV, PREFETCHT1, SHL, SHR, SUB, TEST, VADDPS, VBROADCASTI64X4, VBROADCASTSS,
                            VCVTDQ2PS, VCVTPH2PS, VFMADD213PS, VFMADD231PS, VINSERTI64X4, VMOVSS, VMOVUPS,
                            VMULPS, VPABSB, VPADDD, VPBROADCASTD, VPERM2F128, VPERMD, VPERMQ, VPMADDUBSW,
                            VPMADDWD, VPMOVSXBD, VPSHUFB, VPSIGNB, VPSLLD, VPSUBD, VPUNPCKHWD, VPUNPCKLWD,
                            VPXOR, VPXORD, VXORPS, YMMRegister, ZMMRegister)

from ..attention import CHUNK, FLOAT, KEY_BLOCK, LANES, MAX_HEADS, gp, row
from ..common import fold_lanes
from ..contract import ATTENTION_ROWS, KV_BLOCK, KV_Q8_BLOCK, KV_SEGMENT, kv_q8_row_bytes
from ..peachpy_ext import UPPER_ZMM, VPDPBUSD, broadcast
from ..vmath import first_dword

from .frame import (ARENA_BYTES, KEY_PARTIALS, LOG2_KV_BLOCK, LOG2_SEGMENT, Q8_CHUNKS, Q8_GROUP, Q8_QUERY_ROW,
                    TRANSPOSE_BYTES, TRANSPOSE_DWORDS, block_row_address, bump, quantize_row)


def key_vector(frame, out, at):
    """out = the f32 values of frame.lanes consecutive K tile elements at ``at``: f32 loaded,
    f16 converted exactly (q8_0 keys: tile_scores_vnni / tile_scores_int8)."""
    if frame.half:
        VCVTPH2PS(out, at)
    else:
        VMOVUPS(out, at)


CACHE_LINE = 64
PREFETCH_BLOCKS = 2                 # K tiles asked for this many blocks ahead
# P V asks for the V rows KEY_BLOCK keys on while it multiplies this block's: each pass of a
# tile asks, per key, for the lines of that key's row the tile itself reads (pv_prefetch_lines),
# so the passes of a row's columns together ask for the row once. The scores pass asks for a
# segment's first KEY_BLOCK keys' V only, so each pass of a segment spreads its own reads
# instead of the scores pass asking for K and V at once.


def pv_prefetch_lines(frame, chunks):
    """Lines of a V row one P V tile of ``chunks`` columns reads: its bytes over a line, at
    least one (a q8_0 tile of 32 quants reads half a line; the row's scales sit after its
    quants, in the line the next row starts in, which the next key's prefetch asks for). A
    zmm q8_0 tile of 64 quants reads a whole line's worth from a row that starts anywhere in
    a line (72-byte rows at head_dim 64): one more line, or every ninth line of a run, which
    no row starts in, came from memory when read (docs/perf-journal/2026-12-06-2356-kv-cache-by-kv-head.md)."""
    element = 1 if frame.q8 else 2 if frame.half else 4
    lines = max(1, chunks * frame.lanes * element // CACHE_LINE)
    return lines + 1 if frame.q8 and frame.wide and lines * CACHE_LINE == chunks * frame.lanes else lines


def prefetch_share(pointers, lines):
    """PREFETCHT1 ``lines`` lines at each of ``pointers`` (then advanced): a share
    of the next tiles spread over the dimension loop, so the requests trickle out between the
    FMAs instead of stalling the core in a burst when the fill buffers run out."""
    for pointer in pointers:
        for i in range(lines):
            PREFETCHT1([pointer + i * CACHE_LINE])
        ADD(pointer, lines * CACHE_LINE)


def tile_scores(heads, frame, tile, out, prefetch):
    """Scores of the KV_BLOCK keys of one block for up to MAX_HEADS heads:
    out[h][j] = scale * q[h] . k_j, from a key tile [head_dim][KV_BLOCK] (codegen/contract.py).

    Keys sit in the lanes, so there is no horizontal sum: for each dimension d, the tile's
    row d (KV_BLOCK keys) times q[h][d] broadcast. Each score sums its products in
    KEY_PARTIALS interleaved partials (d = r mod KEY_PARTIALS, d ascending), added
    pairwise at the end: a fixed order per key, whatever the block, the lane, the tile's
    heads or the row. ``prefetch``: the pointers the dimension loop prefetches from."""
    partials = KEY_PARTIALS[frame.wide]
    halves = KV_BLOCK // frame.lanes
    e = ARENA_BYTES[frame.arena]
    accs = [[[frame.vec() for _ in range(partials)] for _ in range(halves)] for _ in range(heads)]
    for a in sum(sum(accs, []), []):
        VXORPS(a, a, a)
    kp, qd, hd4 = gp(), gp(), gp()
    MOV(kp, tile)
    MOV(qd, frame.q_heads)
    MOV(hd4, frame.hd4)

    def dims(count):
        """``count`` dimensions from kp / qd on: dimension r of them into partial r % partials."""
        for r in range(count):
            k = [frame.vec() for _ in range(halves)]
            for v in range(halves):
                key_vector(frame, k[v], [kp + (r * KV_BLOCK + v * frame.lanes) * e])
            for h in range(heads):
                b = frame.vec()
                VBROADCASTSS(b, row(qd, hd4, h, r * FLOAT))
                for v in range(halves):
                    VFMADD231PS(accs[h][v][r % partials], k[v], b)

    count = gp()
    MOV(count, frame.head_dim)
    SHR(count, partials.bit_length() - 1)
    groups = Loop()
    JZ(groups.end)                                   # f32 head_dim 1
    with groups:
        prefetch_share(prefetch, max(1, KV_BLOCK * e * partials // CACHE_LINE))
        dims(partials)
        ADD(kp, partials * KV_BLOCK * e)
        ADD(qd, partials * FLOAT)
        DEC(count)
        JNZ(groups.begin)
    if frame.arena == "f32" and not frame.wide:      # any head_dim: the last odd dimension
        odd = Block()
        with odd:
            TEST(frame.head_dim, 1)
            JZ(odd.end)
            dims(1)

    scale = frame.vec()
    VBROADCASTSS(scale, frame.scale)
    stride4 = gp()
    MOV(stride4, frame.stride4)
    for h in range(heads):
        for v in range(halves):
            total = sum_partials(accs[h][v])
            VMULPS(total, total, scale)
            VMOVUPS(row(out, stride4, h, v * frame.lanes * FLOAT), total)


def sum_partials(partials):
    """(p0 + p1) + (p2 + p3): a score's partial sums added pairwise, in place; the register
    holding the total."""
    while len(partials) > 1:
        for i in range(0, len(partials), 2):
            VADDPS(partials[i], partials[i], partials[i + 1])
        partials = partials[0::2]
    return partials[0]


# Row B's score rows sit this many bytes after row A's (the scratch's ATTENTION_ROWS x
# MAX_HEADS score rows); zmm16-31 hold row B's accumulators (UpperZmmFunction).
ROW_B_SCORES = MAX_HEADS * KV_SEGMENT * FLOAT
assert ATTENTION_ROWS == 2, "the scratch's layout (codegen/contract.py) must match emit_row_pair's pairs"


def tile_scores_pair(heads, frame, tile, out, prefetch):
    """tile_scores for two rows at once (emit_row_pair): each loaded K vector is multiplied
    into row A's heads (q at frame.q_heads, score rows at ``out``) and row B's (frame.q_heads_b,
    ROW_B_SCORES on). Each row's scores are tile_scores' operations in tile_scores' order:
    the same bits as the row alone."""
    partials = KEY_PARTIALS[frame.wide]
    assert frame.pairs and KV_BLOCK == frame.lanes
    e = ARENA_BYTES[frame.arena]
    accs = [[frame.vec() for _ in range(partials)] for _ in range(heads)]
    upper = iter(UPPER_ZMM)
    accs_b = [[next(upper) for _ in range(partials)] for _ in range(heads)]
    for a in sum(accs + accs_b, []):
        VXORPS(a, a, a)
    kp, qd, qb, hd4 = gp(), gp(), gp(), gp()
    MOV(kp, tile)
    MOV(qd, frame.q_heads)
    MOV(qb, frame.q_heads_b)
    MOV(hd4, frame.hd4)

    def dims(count):
        for r in range(count):
            k = frame.vec()
            key_vector(frame, k, [kp + r * KV_BLOCK * e])
            for h in range(heads):
                for q_base, acc in ((qd, accs), (qb, accs_b)):
                    b = frame.vec()
                    VBROADCASTSS(b, row(q_base, hd4, h, r * FLOAT))
                    VFMADD231PS(acc[h][r % partials], k, b)

    count = gp()
    MOV(count, frame.head_dim)
    SHR(count, partials.bit_length() - 1)
    with Loop() as groups:                           # head_dim % 16 == 0: at least one group
        prefetch_share(prefetch, max(1, KV_BLOCK * e * partials // CACHE_LINE))
        dims(partials)
        ADD(kp, partials * KV_BLOCK * e)
        ADD(qd, partials * FLOAT)
        ADD(qb, partials * FLOAT)
        DEC(count)
        JNZ(groups.begin)

    scale = frame.vec()
    VBROADCASTSS(scale, frame.scale)
    stride4 = gp()
    MOV(stride4, frame.stride4)
    for base, row_accs in ((0, accs), (ROW_B_SCORES, accs_b)):
        for h in range(heads):
            total = sum_partials(row_accs[h])
            VMULPS(total, total, scale)
            VMOVUPS(row(out, stride4, h, base), total)


def q8_tile_pointers(frame, tile):
    """Registers at the first block of 32 dimensions of a q8_0 key tile and of the tile's
    first head in frame.query_rows: (key quants, key scales [head_dim / 32][KV_BLOCK],
    query quants, query scales (a q8_0 row: after the quants), blocks of 32 to go)."""
    kp, scales, quants, query_scales, count = gp(), gp(), gp(), gp(), gp()
    MOV(kp, tile)
    MOV(scales, frame.head_dim)
    SHL(scales, LOG2_KV_BLOCK)
    ADD(scales, tile)
    LEA(quants, frame.query_rows)
    MOV(count, frame.head_dim)
    LEA(query_scales, [quants + count * 1])
    SHR(count, 5)
    return kp, scales, quants, query_scales, count


def next_q8_block(kp, scales, quants, query_scales):
    """q8_tile_pointers' pointers on to the next block of 32 dimensions."""
    ADD(kp, KV_Q8_BLOCK * KV_BLOCK)
    ADD(scales, KV_BLOCK * FLOAT)
    ADD(quants, KV_Q8_BLOCK)
    ADD(query_scales, FLOAT)


def tile_scores_vnni(heads, frame, tile, out, prefetch):
    """tile_scores for a q8_0 arena on AVX512_VNNI: out[h][j] = scale * sum_b (d_kb * d_qb) *
    (k_b . q_b) over the blocks b of 32 dimensions, k_b . q_b exact in int32 from the key's
    quants and the head's quants (emit_query_quants: q as a q8_0 row, as the store quantizes).

    Each VPDPBUSD adds 4 dimensions of 16 keys: the tile's [d][key] bytes transposed to
    [key][d] (TRANSPOSE_*), made unsigned by xor 0x80 (k + 128), times the head's 4 quants
    broadcast; the block's sum starts at -128 * sum(q_b), which takes the 128 back out. Two
    interleaved int32 chains per head, added at the block's end, then to f32 and one FMA per
    block: a fixed order per key, whatever the block, lane, heads or row."""
    stride = Q8_QUERY_ROW
    accs = [frame.vec() for _ in range(heads)]
    for a in accs:
        VXORPS(a, a, a)
    kp, scales, quants, query_scales, count = q8_tile_pointers(frame, tile)
    sums, t = gp(), gp()
    MOV(t, frame.head_dim)
    SHR(t, 3)
    LEA(sums, [query_scales + t * 1])                # then -128 * each block's sum of quants
    order, lanes, bias = ZMMRegister(), ZMMRegister(), ZMMRegister()
    # 256-bit constants: PeachPy takes one constant size per function
    VBROADCASTI64X4(order, Constant.uint32x8(*TRANSPOSE_DWORDS[:8]))
    VINSERTI64X4(order, order, Constant.uint32x8(*TRANSPOSE_DWORDS[8:]), 1)
    VBROADCASTI64X4(lanes, Constant.uint32x8(*TRANSPOSE_BYTES[:8]))
    VPBROADCASTD(bias, first_dword(Constant.uint32x8(0x80808080)))
    with Loop() as blocks:
        prefetch_share(prefetch, KV_BLOCK * kv_q8_row_bytes(KV_Q8_BLOCK) // CACHE_LINE)
        chains = [[ZMMRegister(), ZMMRegister()] for _ in range(heads)]
        for h in range(heads):
            VPBROADCASTD(chains[h][0], [sums + h * stride])
            VXORPS(chains[h][1], chains[h][1], chains[h][1])
        for g in range(KV_Q8_BLOCK // Q8_GROUP):
            k = ZMMRegister()
            VPERMD(k, order, [kp + g * KV_BLOCK * Q8_GROUP])
            VPSHUFB(k, k, lanes)
            VPXORD(k, k, bias)
            for h in range(heads):
                VPDPBUSD(chains[h][g % 2], k, broadcast([quants + h * stride + g * Q8_GROUP]))
        key_scales = ZMMRegister()
        VMOVUPS(key_scales, [scales])
        for h in range(heads):
            total, both = chains[h]
            VPADDD(total, total, both)
            VCVTDQ2PS(total, total)
            product = ZMMRegister()
            VMULPS(product, key_scales, broadcast([query_scales + h * stride]))
            VFMADD231PS(accs[h], total, product)
        next_q8_block(kp, scales, quants, query_scales)
        ADD(sums, FLOAT)
        DEC(count)
        JNZ(blocks.begin)
    scale = frame.vec()
    VBROADCASTSS(scale, frame.scale)
    stride4 = gp()
    MOV(stride4, frame.stride4)
    for h in range(heads):
        VMULPS(accs[h], accs[h], scale)
        VMOVUPS(row(out, stride4, h), accs[h])


# AVX2's int8 scores (tile_scores_int8): a 4-dimension group's 64 tile bytes [d][key] to
# [key][d] dwords. VPERMQ puts keys 0-7 of two dimensions in the low lane and keys 8-15 in
# the high one; VPSHUFB pairs the two dimensions' bytes of each key (control byte o takes
# o / 2 + 8 (o % 2)); VPUNPCK{L,H}WD join the two pairs: keys (0-3, 8-11) in one register
# and (4-7, 12-15) in the other, the order the scores keep until they are stored.
KEYS_BY_LANE = 0b11011000                     # VPERMQ: qwords 0, 2, 1, 3
_PAIRS = [o // 2 + 8 * (o % 2) for o in range(16)]
PAIR_DWORDS = [sum(_PAIRS[4 * i + j] << (8 * j) for j in range(4)) for i in range(4)] * 2


def tile_scores_int8(heads, frame, tile, out, prefetch):
    """tile_scores for a q8_0 arena on AVX2, the same sums as tile_scores_vnni: each block's
    k_b . q_b exact in int32, VPMADDUBSW of |q| and k * sign(q) (VPSIGNB; no product pair
    reaches 2^15), VPMADDWD with ones, then to f32 and one FMA per block into the score row,
    which holds the tile's partial sums in the keys' (0-3, 8-11 | 4-7, 12-15) order until the
    last block (the 16 registers hold no more than the int32 sums)."""
    stride = Q8_QUERY_ROW
    stride4 = gp()
    MOV(stride4, frame.stride4)
    zero = YMMRegister()
    VXORPS(zero, zero, zero)
    for h in range(heads):
        for half in range(2):
            VMOVUPS(row(out, stride4, h, half * CHUNK), zero)
    kp, scales, quants, query_scales, count = q8_tile_pointers(frame, tile)
    with Loop() as blocks:
        prefetch_share(prefetch, KV_BLOCK * kv_q8_row_bytes(KV_Q8_BLOCK) // CACHE_LINE)
        sums = [[YMMRegister(), YMMRegister()] for _ in range(heads)]
        for pair in sum(sums, []):
            VPXOR(pair, pair, pair)
        for g in range(KV_Q8_BLOCK // Q8_GROUP):
            low, high = YMMRegister(), YMMRegister()
            VPERMQ(low, [kp + g * KV_BLOCK * Q8_GROUP], KEYS_BY_LANE)
            VPERMQ(high, [kp + g * KV_BLOCK * Q8_GROUP + CHUNK], KEYS_BY_LANE)
            VPSHUFB(low, low, Constant.uint32x8(*PAIR_DWORDS))
            VPSHUFB(high, high, Constant.uint32x8(*PAIR_DWORDS))
            keys = [YMMRegister(), YMMRegister()]
            VPUNPCKLWD(keys[0], low, high)
            VPUNPCKHWD(keys[1], low, high)
            for h in range(heads):
                q, magnitude = YMMRegister(), YMMRegister()
                VPBROADCASTD(q, [quants + h * stride + g * Q8_GROUP])
                VPABSB(magnitude, q)
                for half in range(2):
                    product = YMMRegister()
                    VPSIGNB(product, keys[half], q)
                    VPMADDUBSW(product, magnitude, product)
                    VPMADDWD(product, product, Constant.uint16x16(1))
                    VPADDD(sums[h][half], sums[h][half], product)
        key_low, key_high, by_lane = YMMRegister(), YMMRegister(), [YMMRegister(), YMMRegister()]
        VMOVUPS(key_low, [scales])
        VMOVUPS(key_high, [scales + CHUNK])
        VPERM2F128(by_lane[0], key_low, key_high, 0x20)      # the scales of keys 0-3, 8-11
        VPERM2F128(by_lane[1], key_low, key_high, 0x31)      # and of 4-7, 12-15
        for h in range(heads):
            scale_q = YMMRegister()
            VBROADCASTSS(scale_q, [query_scales + h * stride])
            for half in range(2):
                total, product = sums[h][half], YMMRegister()
                VCVTDQ2PS(total, total)
                VMULPS(product, by_lane[half], scale_q)
                VFMADD213PS(total, product, row(out, stride4, h, half * CHUNK))
                VMOVUPS(row(out, stride4, h, half * CHUNK), total)
        next_q8_block(kp, scales, quants, query_scales)
        DEC(count)
        JNZ(blocks.begin)
    scale = YMMRegister()
    VBROADCASTSS(scale, frame.scale)
    for h in range(heads):
        first, second = YMMRegister(), YMMRegister()
        VMOVUPS(first, row(out, stride4, h))
        VMOVUPS(second, row(out, stride4, h, CHUNK))
        keys_low, keys_high = YMMRegister(), YMMRegister()
        VPERM2F128(keys_low, first, second, 0x20)            # keys 0-3, 4-7
        VPERM2F128(keys_high, first, second, 0x31)           # keys 8-11, 12-15
        VMULPS(keys_low, keys_low, scale)
        VMULPS(keys_high, keys_high, scale)
        VMOVUPS(row(out, stride4, h), keys_low)
        VMOVUPS(row(out, stride4, h, CHUNK), keys_high)


def emit_query_quants(heads, frame):
    """The tile's heads of q as q8_0 rows in frame.query_rows (Q8_QUERY_ROW bytes apart):
    quantize_row's bytes (runtime/ref/paged.py quantize_kv_q8), then, for the avx512
    variant, per block of 32 -128 * the sum of its quants (int32), which tile_scores_vnni
    starts each block's sum at (AVX2's sign trick needs no bias)."""
    head_dim, src, dst = gp(), gp(), gp()
    for h in range(heads):
        MOV(head_dim, frame.head_dim)
        MOV(src, frame.q_heads)
        if h:
            t = gp()
            MOV(t, frame.hd4)
            IMUL(t, t, h)
            ADD(src, t)
        LEA(dst, frame.query_rows)
        if h:
            ADD(dst, h * Q8_QUERY_ROW)
        quantize_row(head_dim, src, dst)
        if not frame.wide:
            continue
        quants, sums, count = gp(), gp(), gp()
        MOV(quants, dst)
        MOV(sums, head_dim)
        SHR(sums, 3)
        ADD(sums, head_dim)
        ADD(sums, dst)
        MOV(count, head_dim)
        SHR(count, 5)
        with Loop() as blocks:
            total, part = YMMRegister(), YMMRegister()
            VPMOVSXBD(total, [quants])
            for c in range(1, Q8_CHUNKS):
                VPMOVSXBD(part, [quants + c * LANES])
                VPADDD(total, total, part)
            fold_lanes(VPADDD, total, integer=True)
            VPSLLD(total, total, 7)
            VPXOR(part, part, part)
            VPSUBD(total, part, total)
            VMOVSS([sums], total.as_xmm)
            ADD(quants, KV_Q8_BLOCK)
            ADD(sums, FLOAT)
            DEC(count)
            JNZ(blocks.begin)


def attended_ahead(frame, ahead, key):
    """``ahead``, a key some way past ``key``, as a prefetch counts it: past the segment's end
    it continues in the next segment this call attends (seg_step segments on: a split decode
    step leaves the ones between to the other threads), and past the row's last key it is
    ``key`` itself (nothing ahead to ask for)."""
    end, later = gp(), gp()
    MOV(end, frame.first)
    ADD(end, frame.n_keys)                           # the first key past the segment
    MOV(later, frame.seg_step)
    SUB(later, 1)
    SHL(later, LOG2_SEGMENT)
    ADD(later, ahead)
    CMP(ahead, end)
    CMOVAE(ahead, later)
    CMP(ahead, frame.row_last)
    CMOVA(ahead, key)


def prefetch_targets(frame, key):
    """(V tile of key's block, K tile PREFETCH_BLOCKS blocks on, or this block's when the row
    ends sooner): what tile_scores asks for while it computes this block's scores. "On" as
    attended_ahead counts it, so a segment's first tiles are on their way when it starts.
    The V tile only in the segment's first KEY_BLOCK keys: P V asks for the later ones."""
    block, v_tile, k_tile = gp(), gp(), gp()
    MOV(block, key)
    AND(block, -KV_BLOCK)
    block_row_address(frame, block, frame.v_head, v_tile)
    into = gp()
    MOV(into, block)
    SUB(into, frame.first)                           # keys into the segment (negative: its first block)
    ADD(block, PREFETCH_BLOCKS * KV_BLOCK)
    attended_ahead(frame, block, key)
    AND(block, -KV_BLOCK)
    block_row_address(frame, block, frame.k_head, k_tile)
    CMP(into, KEY_BLOCK)                             # later V blocks: P V asks for them (emit_pv_tile)
    CMOVGE(v_tile, k_tile)
    return (v_tile, k_tile)


def emit_scores(heads, frame, pair=False):
    """Score rows [head][key - first] = scale * q . k for the segment's keys, a whole block at
    a time. A block's 16 scores are stored whole: the first block's lanes before ``first``
    land in the SCORE_SLACK floats before the first row (and, for the other heads, in the
    previous row's last floats, past any key of the segment); the last block's lanes past
    the segment's last key stay inside its row (segments are block aligned). Only
    [0, n_keys) is read afterwards."""
    block, out = gp(), gp()
    MOV(block, frame.first)
    AND(block, -KV_BLOCK)
    MOV(out, block)
    SUB(out, frame.first)                            # 0 or -(first % KV_BLOCK)
    SHL(out, 2)
    ADD(out, frame.scores)
    MOV(frame.key, block)
    MOV(frame.offset, out)
    with Loop() as blocks:
        block, tile = gp(), gp()
        MOV(block, frame.key)
        prefetch = prefetch_targets(frame, block)
        block_row_address(frame, block, frame.k_head, tile)
        out = gp()
        MOV(out, frame.offset)
        scores = tile_scores_pair if pair else tile_scores
        if frame.q8:
            scores = tile_scores_vnni if frame.wide else tile_scores_int8
        scores(heads, frame, tile, out, prefetch)
        ADD(frame.offset, KV_BLOCK * FLOAT)
        block = bump(frame.key, KV_BLOCK)
        end = gp()
        MOV(end, frame.first)
        ADD(end, frame.n_keys)
        CMP(block, end)
        JB(blocks.begin)
