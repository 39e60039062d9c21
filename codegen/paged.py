"""The paged KV cache's kernels: store this step's K/V rows into their blocks, attend over a
sequence's blocks, gather the rows the LM head wants (runtime/ref/paged.py defines them).

Every row i of a step reads its position ``positions[i]`` and its sequence ``row_seq[i]``
from memory when the kernel runs, and key j of that sequence lives in block
``tables[row_seq[i], j // KV_BLOCK]`` at row ``j % KV_BLOCK``. An arena is
``[n_blocks, n_kv, KV_BLOCK, head_dim]``: within a block, one KV head's KV_BLOCK rows
are contiguous, so keys come in runs of up to KV_BLOCK contiguous rows.

``attention_paged`` cuts each row's keys into segments of KV_SEGMENT keys aligned to the
absolute key index (codegen/contract.py) and runs three passes per segment and tile of up
to MAX_HEADS heads sharing a KV head: scores a block at a time from the block's key tile
(K is stored [head_dim][KV_BLOCK] per block and KV head: the block's keys sit in vector
lanes, q's elements are broadcast, no horizontal sums) into a score row of KV_SEGMENT
floats (L1-resident), the segment's max, e_j = exp(s_j - max) and their sum, then
sum_j e_j v_j over V rows in key blocks of KEY_BLOCK keys counted from the segment's first
key. Each (row, head, segment) leaves a partial record (unnormalised output, max, sum);
the combine (``emit_combine``) merges a row's records in segment order:
out = sum_s w_s o_s / sum_s w_s l_s, w_s = exp(max_s - max). Every sum runs in an order
fixed by the row's keys alone, never by where its blocks are, the other rows of the step,
m, the threads or how the segments were split between calls: a row gives the same bits as
a decode row, inside a prefill chunk, or split over segments (flash-decoding).

Two ways to call it (``segments`` = seg0 | step << 32): step 0, whole rows, every segment
of each row, the records in the caller's scratch and combined into ``dest`` = out at
once; step > 0, the segments s = seg0 (mod step) only, the records written to ``dest`` =
partials [m, n_segments, n_head, rec] for ``attention_combine`` (runtime/recorder.py
splits a decode step's keys between threads this way). While a block's scores are
computed the kernel prefetches the K tile PREFETCH_BLOCKS blocks on (and, for the
segment's first KEY_BLOCK keys, the block's V rows), a few lines per step of the dimension
loop; P V prefetches the V rows KEY_BLOCK keys on, per key the lines its tile reads: a long
cache does not fit the caches near the core, its blocks sit anywhere, and each pass asks for what it
reads next rather than the scores pass for both. The zmm kernel of a q8_0 arena's P V also
asks for the next segment's K tiles.

The avx512 variant runs the scores and P V passes on zmm (16 lanes, head_dim % 16 == 0,
f16 converted and q8_0 values dequantized as they load) and the softmax on zmm up to the
segment's last 16 keys, and sums each score in KEY_PARTIALS[True] partials (avx2:
KEY_PARTIALS[False]). Its bits differ from avx2's, so the binding picks the variant per
machine and head_dim, never per m. q8_0 scores are integer dot products of the key's quants
and q's, each head of q quantized once per row as the store quantizes a row
(emit_query_quants): on AVX512_VNNI (tile_scores_vnni) and on AVX2 (tile_scores_int8), the
same sums in the same order, so the same scores. The window is one code path: the row sees the last
``min(p + 1, window)`` keys (window 0: all), i.e. n_keys - 1 = min(p, window - 1) in
unsigned arithmetic, where window - 1 wraps to the largest integer for 0.

Rows in pairs: the avx512 f32 and f16 kernels take a call's rows two at a time when both
belong to one sequence and there is no window (a prompt chunk's rows), whole rows only.
The segments both rows see whole (s < pair_end, emit_pair_segments) go through
tile_scores_pair and emit_pv_tile_pair, which multiply each K and V vector they load
(and widen) into both rows' heads, then each row's later segments go alone
(emit_segments from pair_end) and each row is combined. Each row's sums are the one-row
passes' operations in their order, so a row gives the same bits paired or alone; a pair
shares the conversions and the K and V reads from the caches. Decode steps (split calls)
and q8_0 arenas (each row's own query quants) take rows one at a time.

The scratch holds SCORE_SLACK floats, ATTENTION_ROWS x MAX_HEADS score rows of KV_SEGMENT
floats (row B's after row A's), then (whole rows) each row's partial records
[segment][MAX_HEADS] of the segments one row spans, row A's then row B's
(``paged_attention_scratch`` sizes it). The block table, positions and row_seq are trusted: the binding checks
everything else, the caller (llambda/kv_pool.py) keeps those in range.

A plan record holds 13 integer arguments; the attention kernel needs 18 values, so pairs
of 32-bit values travel packed in one size_t each (low | high << 32): ``rows`` = m |
table_stride << 32, ``kv_heads`` = n_kv | group << 32, ``heads`` = h0 | h1 << 32 and
``segments`` = seg0 | step << 32. ``head_dim`` = head_dim | block_tiles << 16 | head_tiles <<
40 (codegen/contract.py ARENA_TILES): an arena's (block, KV head) tiles are block_tiles
tiles from one block to the next and head_tiles from one KV head to the next, so a layer's
arena can be a view of a buffer that keeps each (layer, KV head)'s blocks together
(llambda/kv_pool.py: a sequence's tiles of one KV head are then one run the kernel reads in
order)."""
from types import SimpleNamespace

from peachpy.x86_64 import (YMMRegister, ZMMRegister, LocalVariable, LOAD, Loop, Block,
                            RETURN, MOV, MOVZX, LEA, ADD, SUB, IMUL, SHL, SHR, AND, CMP, TEST, DEC, CMOVA,
                            JA, JB, JAE, JE, JNE, JZ, JNZ, JMP, XOR, NEG, CMOVB, CMOVAE, CMOVGE,
                            PREFETCHT1, VMOVUPS, VMOVSS, VMASKMOVPS, VBROADCASTSS, VXORPS, VCVTTSS2SI,
                            VFMADD231PS, VADDPS, VMULPS, VCVTPH2PS, VCVTPS2PH, VEXTRACTF64X4,
                            VPMOVSXBD, VCVTDQ2PS, VCVTPS2DQ, VPACKSSDW, VPACKSSWB, VMOVQ, VEXTRACTI128,
                            VANDPS, VMAXPS, VDIVPS, VCMPPS, VMOVAPS, VSUBPS, VBLENDVPS,
                            VPERMD, VPSHUFB, VPXORD, VPBROADCASTD, VPADDD, VPSUBD, VPSLLD, VPXOR,
                            VBROADCASTI64X4, VINSERTI64X4, VPERMQ, VPUNPCKLWD, VPUNPCKHWD,
                            VPSIGNB, VPABSB, VPMADDUBSW, VPMADDWD, VPERM2F128, VFMADD213PS)
from peachpy import Constant
from peachpy.x86_64 import byte, word, dword

from .attention import (CHUNK, FLOAT, LANES, MAX_HEADS, NEG_INF, PV_CHUNKS, KEY_BLOCK,
                        gp, row, ymms)
from .common import Kernel, fold_lanes, function, stream, symbol, tail_mask
from .peachpy_ext import UPPER_ZMM, VPDPBUSD, broadcast, upper_zmm_function
from .contract import (ARENA_TILES, ATTENTION_ROWS, KV_BLOCK, KV_Q8_BLOCK, KV_SEGMENT, MAX_Q8_QUERY_HEAD_DIM,
                       PARTIAL_EXTRA,
                       kv_q8_row_bytes)
from .vmath import exp_ps, first_dword

FAMILY = "paged"
LOG2_KV_BLOCK = KV_BLOCK.bit_length() - 1
assert 1 << LOG2_KV_BLOCK == KV_BLOCK
LOG2_SEGMENT = KV_SEGMENT.bit_length() - 1
assert 1 << LOG2_SEGMENT == KV_SEGMENT and KV_SEGMENT % KV_BLOCK == 0
INDEX = 4                      # bytes of an int32 position, sequence or block index
# Arena element types and their bytes. An f16 arena is read with VCVTPH2PS (the exact f32
# of each stored half, then the same FMAs as f32) and written with VCVTPS2PH (round to
# nearest even, as numpy's astype): its results are the f32 kernel's on the rounded
# values. f16 arenas need head_dim % 8 == 0 (no masked half loads; the binding checks).
# A q8_0 arena (codegen/contract.py) holds rows of head_dim int8 quants then one f32 scale
# per 32. Its scores are int8 dot products with q quantized the same way (tile_scores_vnni,
# tile_scores_int8); P V widens each V chunk's quants to f32 (VPMOVSXBD, VCVTDQ2PS, exact),
# then on AVX2 takes each key's p times its V block's scale d once per head and block (an
# f32 product) and FMAs it with the quants, and on AVX-512 multiplies the chunk by d once
# (shared by the heads) and FMAs it with each head's p (other bits than AVX2's, as the
# other zmm passes). It needs head_dim % 32 == 0.
ARENA_BYTES = {"f32": 4, "f16": 2, "q8_0": 1}
ARENA_C_TYPES = {"f16": "uint16_t", "q8_0": "uint8_t"}
ROUND_NEAREST_EVEN = 0
Q8_CHUNKS = KV_Q8_BLOCK // LANES         # chunks of 8 per scale
# P V tiles of q8_0 (heads x chunks): whole blocks of 32 (AVX2: 4 chunks) in heads x 4 accumulators,
# the heads' p times the block's scale and one chunk of quants besides (3 heads: all 16 ymm)
PV_CHUNKS_Q8 = {1: 8, 2: 4, 3: 4}
# Scores: partial sums per key (interleaved over head_dim) by ISA (wide = avx512): enough
# independent FMA chains for heads x KV_BLOCK / lanes x partials = 12 accumulators.
KEY_PARTIALS = {True: 4, False: 2}
SCORE_SLACK = KV_BLOCK              # floats before the first score row: a first block's early lanes
# q8_0 scores (tile_scores_vnni, tile_scores_int8): each head of a tile quantized to a q8_0 row on the
# stack (quants, scales, then -128 * the sum of each block's quants), Q8_QUERY_ROW bytes apart.
# Not a multiple of 64: a {1to16} operand's displacement h * Q8_QUERY_ROW + 4 g must not be
# one (peachpy_ext.broadcast).
Q8_QUERY_ROW = kv_q8_row_bytes(MAX_Q8_QUERY_HEAD_DIM) + MAX_Q8_QUERY_HEAD_DIM // KV_Q8_BLOCK * 4 + 4
Q8_GROUP = 4                        # dimensions per vpdpbusd dword
# A key tile's 64 bytes of 4 dimensions x 16 keys ([d][key]) to 16 dwords of one key's 4
# dimensions ([key][d]): VPERMD puts dword d * 4 + L (keys 4L..4L+3 of dimension d) in 128-bit
# lane L, then VPSHUFB transposes each lane's 4 x 4 bytes.
TRANSPOSE_DWORDS = [d * 4 + lane for lane in range(4) for d in range(4)]
TRANSPOSE_BYTES = [sum((kk + 4 * d) << (8 * d) for d in range(4)) for kk in range(4)] * 4

ATTENTION_SIGNATURE = [("q", "const float*"), ("k_arena", "const float*"), ("v_arena", "const float*"),
                       ("dest", "float*"), ("scratch", "float*"), ("positions", "const int32_t*"),
                       ("row_seq", "const int32_t*"), ("tables", "const int32_t*"),
                       ("rows", "size_t"), ("head_dim", "size_t"), ("kv_heads", "size_t"),
                       ("heads", "size_t"), ("segments", "size_t"),
                       ("scale", "float"), ("window", "float")]
# rows = m | table_stride << 32; head_dim = head_dim | block_tiles << 16 | head_tiles << 40
# (ARENA_TILES); segments = seg0 | step << 32. step 0: whole rows (every
# segment, partials in the scratch, combined into dest = out). step > 0: the segments
# s = seg0 (mod step) of every row, their partial records written to dest = partials
# [m, n_segments, n_head, kv_partial_floats(head_dim)] for attention_combine.

COMBINE_SIGNATURE = [("partials", "const float*"), ("out", "float*"), ("positions", "const int32_t*"),
                     ("m", "size_t"), ("head_dim", "size_t"), ("n_head", "size_t"),
                     ("table_stride", "size_t"), ("heads", "size_t"), ("window", "float")]
# window travels as a float (no integer slot left): exact below 2^24, the binding checks it.

STORE_SIGNATURE = [("src", "const float*"), ("positions", "const int32_t*"), ("row_seq", "const int32_t*"),
                   ("tables", "const int32_t*"), ("arena", "float*"),
                   ("m", "size_t"), ("n_heads", "size_t"), ("head_dim", "size_t"), ("n_kv", "size_t"),
                   ("table_stride", "size_t")]

GATHER_SIGNATURE = [("src", "const float*"), ("rows", "const int32_t*"), ("out", "float*"),
                    ("n_rows", "size_t"), ("d", "size_t")]


def load_all(args):
    regs = []
    for arg in args:
        reg = gp()
        LOAD.ARGUMENT(reg, arg)
        regs.append(reg)
    return regs


def block_row_address(frame, key, head_base, out):
    """out = head_base + tables_row[key / KV_BLOCK] * block_stride + (key % KV_BLOCK) * hd4:
    the address of key ``key``'s row of one KV head (``head_base`` is that head in block 0)."""
    t, table_row = gp(), gp()
    MOV(t, key)
    SHR(t, LOG2_KV_BLOCK)
    MOV(table_row, frame.table_row)
    MOV(out.as_dword, [table_row + t * INDEX])       # zero-extends: block indices are >= 0
    IMUL(out, frame.block_stride)
    MOV(t, key)
    AND(t, KV_BLOCK - 1)
    IMUL(t, frame.kd)
    ADD(out, t)
    ADD(out, head_base)


def run_length(key, keys_left, out):
    """out = min(KV_BLOCK - key % KV_BLOCK, keys_left): the keys left in key's block."""
    MOV(out, key)
    AND(out, KV_BLOCK - 1)
    NEG(out)
    ADD(out, KV_BLOCK)
    CMP(out, keys_left)
    CMOVA(out, keys_left)


# ---------------------------------------------------------------- frame

def new_frame(arena, isa="avx2"):
    """Stack slots for the loop state; ``kd`` is an arena row's bytes (hd4 for f32). The
    scores and P V passes run on vectors of ``frame.lanes`` floats: 8 (ymm) for avx2, 16
    (zmm) for avx512, whose kernels need head_dim % 16 == 0 (the binding checks)."""
    names = ["q_row", "out_row", "rows_left", "positions", "row_seq", "tables", "table_stride4",
             "table_row", "first", "n_keys", "window1", "h", "h1", "kv", "group_end", "group",
             "k", "v", "block_stride", "kv_stride", "row_stride", "hd4", "full_chunks", "tail",
             "stride4", "scores", "q_heads", "k_head", "v_head", "out_heads", "heads_count", "h0",
             "kv0", "group_end0", "key", "keys_left", "kb_first", "kb_keys", "offset", "chunks_left", "kd",
             "seg", "seg0", "seg_step", "rec4", "stat", "seg_stride", "pbase", "dest_step", "phead", "hbase",
             "row_first", "row_last", "whole", "partial_scratch", "rec_heads", "combine_rec", "combine_count",
             "combine_out", "pass_chunks", "seg_start",
             # a pair of prompt rows (emit_row_pair): row B's, and row A's while B's are in place
             "q_heads_b", "out_heads_b", "hbase_b", "row_last_b", "partial_scratch_b", "rec_heads_b",
             "pair_end", "q_heads_a", "out_heads_a", "hbase_a", "row_last_a"]
    frame = SimpleNamespace(**{name: LocalVariable(8) for name in names})
    frame.scale = LocalVariable(4)
    frame.arena = arena
    frame.half = arena == "f16"
    frame.q8 = arena == "q8_0"
    # P V asks for the next segment's K tiles (pv_runs): measured on the zmm q8_0 kernel
    # only (README, "q8_0 attention from memory")
    frame.q8_ahead = frame.q8 and isa == "avx512"
    frame.head_dim = LocalVariable(8)
    frame.wide = isa == "avx512"
    frame.lanes = 16 if frame.wide else LANES
    frame.vec = ZMMRegister if frame.wide else YMMRegister
    frame.chunk = frame.lanes * FLOAT
    frame.q8_chunks = KV_Q8_BLOCK // frame.lanes
    frame.pairs = frame.wide and not frame.q8        # prompt rows in pairs (emit_row_pair)
    if frame.q8:                                     # the tile's queries as q8_0 rows (emit_query_quants)
        frame.query_rows = LocalVariable(MAX_HEADS * Q8_QUERY_ROW, alignment=8)
    return frame


def bump(slot, step):
    """slot += step (an immediate or another stack slot) through a register, which holds
    the new value afterwards: a loop counter the driver keeps on the stack."""
    reg = gp()
    MOV(reg, slot)
    ADD(reg, step)
    MOV(slot, reg)
    return reg


def zeroed_vectors(frame, heads, n):
    accs = [[frame.vec() for _ in range(n)] for _ in range(heads)]
    for a in sum(accs, []):
        VXORPS(a, a, a)
    return accs


# ---------------------------------------------------------------- pass 1: scores

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
    no row starts in, came from memory when read (README, "a KV cache laid out by KV head")."""
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


# ---------------------------------------------------------------- pass 3: out = P V

def pv_first_key(frame):
    """A P V tile's start: frame.key and frame.keys_left the key block's first key and count;
    returns a register at its first p (head 0's score row)."""
    probs, t = gp(), gp()
    MOV(probs, frame.kb_first)
    SHL(probs, 2)
    ADD(probs, frame.scores)
    MOV(t, frame.kb_first)
    ADD(t, frame.first)
    MOV(frame.key, t)
    MOV(t, frame.kb_keys)
    MOV(frame.keys_left, t)
    return probs


def pv_runs(frame, probs, chunks, key_body):
    """The key block's keys, run by run through the block table (a run: the keys of one KV
    block), ``key_body(values, stride4, scales)`` for each key: ``values`` at this tile's
    columns of the key's V row, ``stride4`` between heads' score rows (probs at the key's p),
    ``scales`` (q8_0) from the row to the tile's first scale. Each key asks for the lines
    the tile reads of the V row KEY_BLOCK keys on."""
    with Loop() as runs:
        values, run, key, keys_left, hd4, stride4 = gp(), gp(), gp(), gp(), gp(), gp()
        MOV(key, frame.key)
        MOV(keys_left, frame.keys_left)
        block_row_address(frame, key, frame.v_head, values)
        offset = gp()
        MOV(offset, frame.offset)
        scales = None
        if frame.q8:
            SHR(offset, 2)                           # out's f32 columns -> the arena's bytes
            scales = gp()                            # the tile's first scale from its first quant:
            MOV(scales, offset)                      # head_dim - quants + quants / 32 * 4
            SHR(scales, 5)
            SHL(scales, 2)
            SUB(scales, offset)
            ADD(scales, frame.head_dim)
        elif frame.half:
            SHR(offset, 1)                           # out's f32 columns -> the arena's halves
        ADD(values, offset)
        later, ahead = gp(), gp()                    # the V row KEY_BLOCK keys on
        LEA(later, [key + KEY_BLOCK])
        attended_ahead(frame, later, key)
        block_row_address(frame, later, frame.v_head, ahead)
        ADD(ahead, offset)                           # this tile's columns of that row
        if frame.q8_ahead:
            # A q8_0 segment's scores pass reads its K tiles faster than one core's memory
            # delivers them, while P V computes for longer on fewer bytes: P V asks for the
            # next segment's K tile of this key's block, a key's share of it per key: the tile
            # is KV_BLOCK shares of kd bytes, and the lines of each share's first byte and of
            # 64 bytes on cover it while kd <= 128 (head_dim <= 112; a wider tile's other
            # lines come with the scores pass's own requests).
            k_ahead = gp()
            LEA(later, [key + KV_SEGMENT])
            attended_ahead(frame, later, key)
            block_row_address(frame, later, frame.k_head, k_ahead)
        run_length(key, keys_left, run)
        ADD(key, run)
        SUB(keys_left, run)
        MOV(frame.key, key)
        MOV(frame.keys_left, keys_left)
        MOV(hd4, frame.kd)
        MOV(stride4, frame.stride4)
        with Loop() as keys:
            key_body(values, stride4, scales)
            for i in range(pv_prefetch_lines(frame, chunks)):
                PREFETCHT1([ahead + i * CACHE_LINE])
            ADD(ahead, hd4)
            if frame.q8_ahead:                       # the next segment's K tile, this key's share
                for i in range(2):
                    PREFETCHT1([k_ahead + i * CACHE_LINE])
                ADD(k_ahead, hd4)
            ADD(probs, FLOAT)
            ADD(values, hd4)
            DEC(run)
            JNZ(keys.begin)
        CMP(frame.keys_left, 0)
        JNE(runs.begin)


def pv_store(frame, records, accs, mask=None):
    """A tile's sums into the heads' partial records at ``records`` (rec4 bytes apart): stored
    by the first key block, added to what they hold by the later ones."""
    out, hd4 = gp(), gp()
    MOV(hd4, frame.rec4)
    MOV(out, records)
    ADD(out, frame.offset)
    width = CHUNK if mask is not None else frame.chunk
    accumulate = Block()
    with accumulate:
        CMP(frame.kb_first, 0)
        JE(accumulate.end)
        for h, per_head in enumerate(accs):
            for c, acc in enumerate(per_head):
                if mask is not None:
                    old = YMMRegister()
                    VMASKMOVPS(old, mask, row(out, hd4, h, c * width))
                    VADDPS(acc, acc, old)
                else:
                    VADDPS(acc, acc, row(out, hd4, h, c * width))
    for h, per_head in enumerate(accs):
        for c, acc in enumerate(per_head):
            if mask is not None:
                VMASKMOVPS(row(out, hd4, h, c * width), mask, acc)
            else:
                VMOVUPS(row(out, hd4, h, c * width), acc)


def emit_pv_tile(heads, chunks, masked, frame):
    """out[heads, offset .. offset + chunks*8) (+)= P[heads, key block] V[key block, same columns],
    the key block's V rows found run by run through the block table. The first key block
    stores, later blocks add to what out holds."""
    accs = zeroed_vectors(frame, heads, chunks)
    probs = pv_first_key(frame)
    mask = None
    if masked:
        tail = gp()
        MOV(tail, frame.tail)
        mask = YMMRegister()
        tail_mask(mask, tail)

    def key_body(values, stride4, scales):
        p = [frame.vec() for _ in range(heads)]
        if not frame.q8:
            for h in range(heads):
                VBROADCASTSS(p[h], row(probs, stride4, h))
        for c in range(chunks):
            if frame.q8:
                if c % frame.q8_chunks == 0:             # the block's scale d
                    d = frame.vec()
                    VBROADCASTSS(d, [values + scales * 1 + c // frame.q8_chunks * 4])
                    if not frame.wide:                   # AVX2: p times d, per head
                        p = [frame.vec() for _ in range(heads)]
                        for h in range(heads):
                            VBROADCASTSS(p[h], row(probs, stride4, h))
                            VMULPS(p[h], p[h], d)
                vm = frame.vec()
                VPMOVSXBD(vm, [values + c * frame.lanes])
                VCVTDQ2PS(vm, vm)
                if frame.wide:
                    # d v once per chunk, shared by the heads, then each head's p broadcast
                    # straight from its score row: 26 ops a key at head_dim 64 and 3 heads
                    # where p d per head and block took 34 (the FMA pipes run 16 zmm ops a
                    # key, not 18)
                    VMULPS(vm, vm, d)
                    for h in range(heads):
                        VFMADD231PS(accs[h][c], vm, broadcast(row(probs, stride4, h)))
                else:
                    for h in range(heads):
                        VFMADD231PS(accs[h][c], p[h], vm)
            elif frame.half:
                vm = frame.vec()
                VCVTPH2PS(vm, [values + c * frame.chunk // 2])
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], vm)
            elif masked:
                vm = YMMRegister()
                VMASKMOVPS(vm, mask, [values + c * CHUNK])
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], vm)
            else:
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], [values + c * frame.chunk])
    pv_runs(frame, probs, chunks, key_body)
    pv_store(frame, frame.rec_heads, accs, mask)


# P V tiles of a pair: chunks of 16 columns. Row B's heads x chunks accumulators in zmm16-31,
# then row A's in what is left of them and in the 16 others, beside each row's p of the key and
# the key's V vector: 3 heads x 4 chunks x 2 rows = 16 + 8, then 3 + 3 + 1.
PAIR_PV_CHUNKS = 4


def emit_pv_tile_pair(heads, chunks, frame):
    """emit_pv_tile for two rows at once (emit_row_pair): each V vector loaded (and widened)
    once for both rows' heads, row A's records at frame.rec_heads, row B's at
    frame.rec_heads_b. Each output column is emit_pv_tile's chain in its order (the tile's
    width changes no bit): the same bits as the row alone."""
    assert frame.pairs
    upper = iter(UPPER_ZMM)
    accs_b = [[next(upper) for _ in range(chunks)] for _ in range(heads)]
    accs = [[next(upper, None) or frame.vec() for _ in range(chunks)] for _ in range(heads)]
    for a in sum(accs + accs_b, []):
        VXORPS(a, a, a)
    probs = pv_first_key(frame)

    def key_body(values, stride4, scales):
        p = [frame.vec() for _ in range(heads)]
        p_b = [frame.vec() for _ in range(heads)]
        for h in range(heads):
            VBROADCASTSS(p[h], row(probs, stride4, h))
            VBROADCASTSS(p_b[h], row(probs, stride4, h, ROW_B_SCORES))
        for c in range(chunks):
            vm = frame.vec()
            if frame.half:
                VCVTPH2PS(vm, [values + c * frame.chunk // 2])
            else:
                VMOVUPS(vm, [values + c * frame.chunk])
            for h in range(heads):
                VFMADD231PS(accs[h][c], p[h], vm)
                VFMADD231PS(accs_b[h][c], p_b[h], vm)
    pv_runs(frame, probs, chunks, key_body)
    pv_store(frame, frame.rec_heads, accs)
    pv_store(frame, frame.rec_heads_b, accs_b)


def advance_offset(frame, chunks):
    t = gp()
    MOV(t, frame.offset)
    ADD(t, chunks * frame.chunk)
    MOV(frame.offset, t)


def emit_pv(heads, frame, pair=False):
    tile = PAIR_PV_CHUNKS if pair else (PV_CHUNKS_Q8 if frame.q8 else PV_CHUNKS)[heads]

    def emit_tile(chunks):
        if pair:
            emit_pv_tile_pair(heads, chunks, frame)
        else:
            emit_pv_tile(heads, chunks, False, frame)
    # q8_0 (head_dim % 32 == 0) leaves only whole scale blocks after the full tiles
    narrower = [c for c in range(1, tile) if not frame.q8 or c % frame.q8_chunks == 0]
    t = gp()
    MOV(frame.kb_first, 0)
    with Loop() as key_blocks:
        block_keys, limit = gp(), gp()
        MOV(block_keys, frame.n_keys)
        SUB(block_keys, frame.kb_first)
        MOV(limit, KEY_BLOCK)
        CMP(block_keys, limit)
        CMOVA(block_keys, limit)
        MOV(frame.kb_keys, block_keys)

        MOV(frame.offset, 0)
        MOV(t, frame.pass_chunks)
        MOV(frame.chunks_left, t)
        full_tiles = Loop()
        CMP(frame.chunks_left, tile)
        JB(full_tiles.end)
        with full_tiles:
            emit_tile(tile)
            advance_offset(frame, tile)
            left = gp()
            MOV(left, frame.chunks_left)
            SUB(left, tile)
            MOV(frame.chunks_left, left)
            CMP(left, tile)
            JAE(full_tiles.begin)
        remainder = Block()
        with remainder:
            for chunks in narrower:
                width = Block()
                with width:
                    CMP(frame.chunks_left, chunks)
                    JNE(width.end)
                    emit_tile(chunks)
                    advance_offset(frame, chunks)
                    JMP(remainder.end)
        if frame.arena == "f32" and not frame.wide:  # f16, q8_0, AVX-512: no tail
            masked = Block()
            with masked:
                CMP(frame.tail, 0)
                JE(masked.end)
                emit_pv_tile(heads, 1, True, frame)

        first = gp()
        MOV(first, frame.kb_first)
        ADD(first, KEY_BLOCK)
        MOV(frame.kb_first, first)
        CMP(first, frame.n_keys)
        JB(key_blocks.begin)


# ---------------------------------------------------------------- pass 2: the segment's softmax

def head_address(out, base, stride, h):
    """out = the stack slot ``base`` + h times the stack slot ``stride``: head h of the tile's
    score rows or partial records."""
    MOV(out, base)
    if h:
        t = gp()
        MOV(t, stride)
        IMUL(t, t, h)
        ADD(out, t)


def emit_partial_softmax(heads, frame, row_b=False):
    """Per head of the tile: the segment's max score, e_j = exp(s_j - max) in place on the
    score row, and their sum (the same order as codegen/attention.py's softmax), max and sum
    stored in the head's partial record; nothing is normalised (the combine does it).
    ``row_b``: row B of a pair (its score rows and records)."""
    for h in range(heads):
        score_row = gp()
        head_address(score_row, frame.scores, frame.stride4, h)
        if row_b:
            ADD(score_row, ROW_B_SCORES)
        peak, total = emit_exp_row(frame, score_row)
        rec = gp()
        head_address(rec, frame.rec_heads_b if row_b else frame.rec_heads, frame.rec4, h)
        ADD(rec, frame.stat)
        VMOVSS([rec], peak.as_xmm)
        VMOVSS([rec + 4], total.as_xmm)


def emit_exp_row(frame, score_row):
    """codegen/attention.py's softmax up to the sum: (peak, total) ymm, every lane equal.

    The avx512 variant runs both passes on zmm over the row's whole 16s, then on ymm over
    what is left (an 8, then a masked tail): each e_j is the same bits either way (exp_ps
    computes lane by lane); the sum is the zmm partials (high half + low half) plus the
    ymm chunks' (an 8, then the tail), in an order that depends on n_keys alone."""
    p, chunks, tail = gp(), gp(), gp()
    wide = frame.wide

    def whole_chunks(lanes, body):
        """body() on each whole run of ``lanes`` scores from p on (p advanced past them)."""
        MOV(chunks, frame.n_keys)
        SHR(chunks, lanes.bit_length() - 1)
        loop = Loop()
        JZ(loop.end)
        with loop:
            body()
            ADD(p, lanes * FLOAT)
            DEC(chunks)
            JNZ(loop.begin)

    def for_each_chunk(body, masked_body, wide_body):
        MOV(p, score_row)
        if wide:
            whole_chunks(2 * LANES, wide_body)
            eight = Block()
            with eight:
                TEST(frame.n_keys, LANES)
                JZ(eight.end)
                body()
                ADD(p, CHUNK)
        else:
            whole_chunks(LANES, body)
        last = Block()
        with last:
            MOV(tail, frame.n_keys)
            AND(tail, LANES - 1)
            JZ(last.end)
            mask = YMMRegister()
            tail_mask(mask, tail)
            masked_body(mask)

    peak = YMMRegister()
    if wide:
        wide_peak = ZMMRegister()
        VBROADCASTSS(wide_peak, first_dword(NEG_INF))
    VMOVAPS(peak, NEG_INF)

    def max_wide():
        VMAXPS(wide_peak, wide_peak, [p])

    def max_masked(mask):
        x, neg_inf = YMMRegister(), YMMRegister()
        VMASKMOVPS(x, mask, [p])
        VMOVAPS(neg_inf, NEG_INF)
        VBLENDVPS(x, neg_inf, x, mask)
        VMAXPS(peak, peak, x)
    for_each_chunk(lambda: VMAXPS(peak, peak, [p]), max_masked, max_wide)
    if wide:
        fold_high_half(VMAXPS, peak, wide_peak)
    fold_lanes(VMAXPS, peak)

    total = YMMRegister()
    VXORPS(total, total, total)
    if wide:
        wide_total, wide_shift = ZMMRegister(), ZMMRegister()
        VXORPS(wide_total, wide_total, wide_total)
        VBROADCASTSS(wide_shift, peak.as_xmm)

    def exp_wide():
        x, t1, t2 = ZMMRegister(), ZMMRegister(), ZMMRegister()
        VMOVUPS(x, [p])
        VSUBPS(x, x, wide_shift)
        exp_ps(x, x, t1, t2)
        VMOVUPS([p], x)
        VADDPS(wide_total, wide_total, x)

    def exp_chunk(mask=None):
        x, t1, t2 = YMMRegister(), YMMRegister(), YMMRegister()
        if mask is None:
            VMOVUPS(x, [p])
        else:
            VMASKMOVPS(x, mask, [p])
        VSUBPS(x, x, peak)
        exp_ps(x, x, t1, t2)
        if mask is None:
            VMOVUPS([p], x)
        else:
            VANDPS(x, x, mask)          # lanes past n_keys loaded as 0: exp(0 - max) must not count
            VMASKMOVPS([p], mask, x)
        VADDPS(total, total, x)
    for_each_chunk(exp_chunk, exp_chunk, exp_wide)
    if wide:
        fold_high_half(VADDPS, total, wide_total)
    fold_lanes(VADDPS, total)
    return peak, total


def fold_high_half(op, acc, wide):
    """acc (ymm) = op(op(high half of ``wide``, its low half), acc): a zmm's partials into a
    ymm accumulator, in that fixed order."""
    high = YMMRegister()
    VEXTRACTF64X4(high, wide, 1)
    op(high, high, wide.as_ymm)
    op(acc, high, acc)


# ---------------------------------------------------------------- the combine

def emit_combine(frame):
    """out[0 .. head_dim) of one head = sum_s w_s o_s / sum_s w_s l_s over the head's
    combine_count partial records from combine_rec (seg_stride bytes apart, in segment
    order), w_s = exp(max_s - max over s). Each w_s is kept in its record's spare float.
    The sums run in segment order: the same bits whoever wrote the records."""
    rec, n, stride, stat = gp(), gp(), gp(), gp()
    MOV(stride, frame.seg_stride)
    MOV(stat, frame.stat)

    def over_segments(body):
        MOV(rec, frame.combine_rec)
        MOV(n, frame.combine_count)
        with Loop() as loop:
            body()
            ADD(rec, stride)
            DEC(n)
            JNZ(loop.begin)

    peak = YMMRegister()
    VMOVAPS(peak, NEG_INF)

    def max_body():
        x = YMMRegister()
        VBROADCASTSS(x, [rec + stat * 1])
        VMAXPS(peak, peak, x)
    over_segments(max_body)
    total = YMMRegister()
    VXORPS(total, total, total)

    def weight_body():
        w, t1, t2, l = YMMRegister(), YMMRegister(), YMMRegister(), YMMRegister()
        VBROADCASTSS(w, [rec + stat * 1])
        VSUBPS(w, w, peak)
        exp_ps(w, w, t1, t2)
        VMOVSS([rec + stat * 1 + 8], w.as_xmm)
        VBROADCASTSS(l, [rec + stat * 1 + 4])
        VFMADD231PS(total, w, l)
    over_segments(weight_body)
    inverse = YMMRegister()
    VMOVAPS(inverse, Constant.float32x8(1.0))
    VDIVPS(inverse, inverse, total)
    ADD(stat, 8)                                     # the weights

    column, out, chunks = gp(), gp(), gp()
    XOR(column.as_dword, column.as_dword)
    MOV(out, frame.combine_out)

    def column_sum():
        acc = YMMRegister()
        VXORPS(acc, acc, acc)

        def body():
            w = YMMRegister()
            VBROADCASTSS(w, [rec + stat * 1])
            ADD(rec, column)
            VFMADD231PS(acc, w, [rec])
            SUB(rec, column)
        over_segments(body)
        VMULPS(acc, acc, inverse)
        return acc

    MOV(chunks, frame.full_chunks)
    full = Loop()
    TEST(chunks, chunks)
    JZ(full.end)
    with full:
        acc = column_sum()
        VMOVUPS([out + column * 1], acc)
        ADD(column, CHUNK)
        DEC(chunks)
        JNZ(full.begin)
    if frame.arena == "f32":
        masked = Block()
        with masked:
            tail = gp()
            MOV(tail, frame.tail)
            TEST(tail, tail)
            JZ(masked.end)
            acc = column_sum()
            mask = YMMRegister()
            MOV(tail, frame.tail)
            tail_mask(mask, tail)
            VMASKMOVPS([out + column * 1], mask, acc)


# ---------------------------------------------------------------- the attention driver

def emit_segments(heads, frame):
    """The segments s = seg0 (mod seg_step) of this row's keys [row_first, row_last]: each
    one's scores, softmax and P V into the tile's partial records at hbase + s * seg_stride."""
    s, t = gp(), gp()
    MOV(s, frame.seg_start)
    skip = Loop()
    with skip:                                       # segments wholly before the row's first key
        LEA(t, [s + 1])
        SHL(t, LOG2_SEGMENT)
        CMP(t, frame.row_first)
        JA(skip.end)
        ADD(s, frame.seg_step)
        JMP(skip.begin)
    MOV(frame.seg, s)
    segments = Loop()
    with segments:
        s, first, last, bound = gp(), gp(), gp(), gp()
        MOV(s, frame.seg)
        MOV(first, s)
        SHL(first, LOG2_SEGMENT)
        MOV(bound, frame.row_last)
        CMP(first, bound)
        JA(segments.end)
        LEA(last, [first + KV_SEGMENT - 1])
        CMP(last, bound)
        CMOVA(last, bound)
        MOV(bound, frame.row_first)
        CMP(first, bound)
        CMOVB(first, bound)
        MOV(frame.first, first)
        SUB(last, first)
        ADD(last, 1)
        MOV(frame.n_keys, last)
        rec = gp()
        MOV(rec, s)
        IMUL(rec, frame.seg_stride)
        ADD(rec, frame.hbase)
        MOV(frame.rec_heads, rec)
        emit_scores(heads, frame)
        emit_partial_softmax(heads, frame)
        emit_pv(heads, frame)
        bump(frame.seg, frame.seg_step)
        JMP(segments.begin)


def emit_row_combine(heads, frame):
    """Whole rows: combine the tile's heads' segments into out."""
    whole = Block()
    with whole:
        CMP(frame.whole, 0)
        JE(whole.end)
        for h in range(heads):
            lo, hi, rec, t = gp(), gp(), gp(), gp()
            MOV(lo, frame.row_first)
            SHR(lo, LOG2_SEGMENT)
            MOV(hi, frame.row_last)
            SHR(hi, LOG2_SEGMENT)
            SUB(hi, lo)
            ADD(hi, 1)
            MOV(frame.combine_count, hi)
            MOV(rec, lo)
            IMUL(rec, frame.seg_stride)
            ADD(rec, frame.hbase)
            if h:
                MOV(t, frame.rec4)
                IMUL(t, t, h)
                ADD(rec, t)
            MOV(frame.combine_rec, rec)
            MOV(t, frame.out_heads)
            if h:
                ADD(t, frame.hd4)
                if h == 2:
                    ADD(t, frame.hd4)
            MOV(frame.combine_out, t)
            emit_combine(frame)


def emit_heads(frame):
    """The next min(MAX_HEADS, heads left, heads left in the KV group) heads of this row."""
    def variant(heads):
        if frame.q8:
            emit_query_quants(heads, frame)
        emit_segments(heads, frame)
        emit_row_combine(heads, frame)
    emit_head_variants(frame, variant)


def emit_head_variants(frame, emit_variant):
    """frame.heads_count = min(MAX_HEADS, heads left, heads left in the KV group), and
    ``emit_variant(heads)`` for each count, the one that matches run."""
    count, heads_left, group_left = gp(), gp(), gp()
    MOV(heads_left, frame.h1)
    SUB(heads_left, frame.h)
    MOV(group_left, frame.group_end)
    SUB(group_left, frame.h)
    MOV(count, MAX_HEADS)
    CMP(count, heads_left)
    CMOVA(count, heads_left)
    CMP(count, group_left)
    CMOVA(count, group_left)
    MOV(frame.heads_count, count)
    done = Block()
    with done:
        for heads in range(1, MAX_HEADS + 1):
            variant = Block()
            with variant:
                if heads < MAX_HEADS:
                    CMP(count, heads)
                    JNE(variant.end)
                emit_variant(heads)
                JMP(done.end)


# ---------------------------------------------------------------- rows in pairs

def emit_pair_segments(heads, frame):
    """The segments both rows of a pair see whole, s < pair_end = (min(row_last, row_last_b)
    + 1) / KV_SEGMENT (no window: every row's keys start at 0): scores, softmax and P V of
    both rows' heads, each K and V vector loaded once, each row's partial records its own."""
    end, t = gp(), gp()
    MOV(end, frame.row_last)
    CMP(end, frame.row_last_b)
    CMOVA(end, frame.row_last_b)
    ADD(end, 1)
    SHR(end, LOG2_SEGMENT)
    MOV(frame.pair_end, end)
    MOV(frame.seg, 0)
    segments = Loop()
    CMP(end, 0)
    JE(segments.end)
    with segments:
        s, first, rec = gp(), gp(), gp()
        MOV(s, frame.seg)
        MOV(first, s)
        SHL(first, LOG2_SEGMENT)
        MOV(frame.first, first)
        MOV(frame.n_keys, KV_SEGMENT)
        for base, slot in ((frame.hbase, frame.rec_heads), (frame.hbase_b, frame.rec_heads_b)):
            MOV(rec, s)
            IMUL(rec, frame.seg_stride)
            ADD(rec, base)
            MOV(slot, rec)
        emit_scores(heads, frame, pair=True)
        emit_partial_softmax(heads, frame)
        emit_partial_softmax(heads, frame, row_b=True)
        emit_pv(heads, frame, pair=True)
        s = bump(frame.seg, 1)
        CMP(s, frame.pair_end)
        JB(segments.begin)
    MOV(t, frame.pair_end)
    MOV(frame.seg_start, t)


def swap_rows(frame, to_b):
    """Put row B's pointers and last key where the one-row passes read row A's (to_b), or
    row A's back."""
    t = gp()
    for slot, a, b in ((frame.q_heads, frame.q_heads_a, frame.q_heads_b),
                       (frame.out_heads, frame.out_heads_a, frame.out_heads_b),
                       (frame.hbase, frame.hbase_a, frame.hbase_b),
                       (frame.row_last, frame.row_last_a, frame.row_last_b)):
        if to_b:
            MOV(t, slot)
            MOV(a, t)
        MOV(t, b if to_b else a)
        MOV(slot, t)


def emit_heads_pair(frame):
    """emit_heads for a pair of rows: the segments both see whole together, then each row's
    later segments alone (emit_segments from pair_end), then each row's combine."""
    def variant(heads):
        emit_pair_segments(heads, frame)
        emit_segments(heads, frame)              # row A's segments from pair_end
        swap_rows(frame, to_b=True)
        emit_segments(heads, frame)              # row B's
        emit_row_combine(heads, frame)
        swap_rows(frame, to_b=False)
        emit_row_combine(heads, frame)
    emit_head_variants(frame, variant)


def emit_row_pair(frame):
    """Heads h0..h1-1 of the current row (A) and the next (B), MAX_HEADS of a KV group at a
    time: emit_row for two rows of one sequence and no window (emit_row_keys has set up A;
    row_last_b and partial_scratch_b are B's)."""
    def group():
        p = gp()
        MOV(p, frame.q_heads)
        ADD(p, frame.row_stride)
        MOV(frame.q_heads_b, p)
        MOV(p, frame.out_heads)
        ADD(p, frame.dest_step)
        MOV(frame.out_heads_b, p)
        MOV(p, frame.h)
        IMUL(p, frame.phead)
        ADD(p, frame.partial_scratch_b)
        MOV(frame.hbase_b, p)
        emit_heads_pair(frame)
    emit_head_groups(frame, group)


def next_row(frame, rows):
    """Step the row pointers ``rows`` rows on."""
    step = gp()
    for _ in range(rows):
        MOV(step, frame.row_stride)
        ADD(frame.q_row, step)
        MOV(step, frame.dest_step)
        ADD(frame.out_row, step)
        ADD(frame.positions, INDEX)
        ADD(frame.row_seq, INDEX)


def emit_head_pointers(frame):
    """q, out of heads h.. of this row; K, V of their KV head in block 0; their partials."""
    head_offset, kv_offset, p = gp(), gp(), gp()
    MOV(head_offset, frame.h)
    IMUL(head_offset, frame.hd4)
    MOV(p, frame.q_row)
    ADD(p, head_offset)
    MOV(frame.q_heads, p)
    MOV(p, frame.out_row)
    ADD(p, head_offset)
    MOV(frame.out_heads, p)
    MOV(kv_offset, frame.kv)
    IMUL(kv_offset, frame.kv_stride)
    MOV(p, frame.k)
    ADD(p, kv_offset)
    MOV(frame.k_head, p)
    MOV(p, frame.v)
    ADD(p, kv_offset)
    MOV(frame.v_head, p)
    MOV(p, frame.h)
    IMUL(p, frame.phead)
    ADD(p, frame.pbase)
    MOV(frame.hbase, p)


def emit_row_keys(frame):
    """This row's keys [row_first, row_last] and block table, from positions / row_seq in
    memory, and where its partial records go."""
    position, seq, n1, t = gp(), gp(), gp(), gp()
    MOV(t, frame.positions)
    MOV(position.as_dword, [t])                      # zero-extends: positions are >= 0
    MOV(t, frame.row_seq)
    MOV(seq.as_dword, [t])
    IMUL(seq, frame.table_stride4)
    ADD(seq, frame.tables)
    MOV(frame.table_row, seq)
    MOV(frame.row_last, position)
    MOV(n1, frame.window1)                           # n_keys - 1 = min(p, window - 1)
    CMP(n1, position)
    CMOVA(n1, position)
    SUB(position, n1)
    MOV(frame.row_first, position)
    # partials: whole rows in the scratch, counted from the row's first segment; else dest's row
    pbase = gp()
    MOV(pbase, frame.out_row)
    split = Block()
    with split:
        CMP(frame.whole, 0)
        JE(split.end)
        SHR(position, LOG2_SEGMENT)
        IMUL(position, frame.seg_stride)
        MOV(pbase, frame.partial_scratch)
        SUB(pbase, position)
    MOV(frame.pbase, pbase)


def emit_row(frame):
    """Heads h0..h1-1 of the current row, MAX_HEADS of a KV group at a time."""
    t = gp()
    MOV(t, frame.seg0)
    MOV(frame.seg_start, t)
    emit_head_groups(frame, lambda: emit_heads(frame))


def emit_head_groups(frame, emit_group):
    """Heads h0..h1-1, a tile of up to MAX_HEADS of one KV group at a time: each tile's
    pointers (emit_head_pointers), then ``emit_group()``, which sets frame.heads_count."""
    t = gp()
    for slot, start in ((frame.h, frame.h0), (frame.kv, frame.kv0), (frame.group_end, frame.group_end0)):
        MOV(t, start)
        MOV(slot, t)
    with Loop() as head_groups:
        emit_head_pointers(frame)
        emit_group()
        h = bump(frame.h, frame.heads_count)
        next_kv = Block()
        with next_kv:
            CMP(h, frame.group_end)
            JNE(next_kv.end)
            ADD(frame.kv, 1)
            group = gp()
            MOV(group, frame.group)
            ADD(frame.group_end, group)
        CMP(h, frame.h1)
        JB(head_groups.begin)


def unpack_tiles(packed, low, block_tiles, head_tiles):
    """Unpack ``packed`` = low | block_tiles << 16 | head_tiles << 40 (ARENA_TILES)."""
    low_bits, block_bits, _ = ARENA_TILES
    MOVZX(low.as_dword, packed.as_word)
    MOV(block_tiles, packed)
    SHR(block_tiles, low_bits)
    AND(block_tiles.as_dword, (1 << block_bits) - 1)   # zero-extends
    MOV(head_tiles, packed)
    SHR(head_tiles, low_bits + block_bits)


def low_high(packed, low, high):
    """Unpack ``packed`` = low | high << 32 into two registers."""
    MOV(low.as_dword, packed.as_dword)               # zero-extends
    MOV(high, packed)
    SHR(high, 32)


def record_layout(frame, head_dim):
    """rec4: a partial record's bytes; stat: the offset of its max, sum, weight."""
    t = gp()
    LEA(t, [head_dim + LANES - 1])
    AND(t, -LANES)
    SHL(t, 2)
    MOV(frame.stat, t)
    ADD(t, PARTIAL_EXTRA * FLOAT)
    MOV(frame.rec4, t)


def argument_loader(args):
    """load(name): a fresh register holding the integer or pointer argument ``name``."""
    by_name = {a.name: a for a in args}

    def load(name):
        reg = gp()
        LOAD.ARGUMENT(reg, by_name[name])
        return reg
    return load


def store_window(frame, arg):
    """frame.window1 = window - 1 from the float argument ``arg``."""
    window_f, window = YMMRegister(), gp()
    LOAD.ARGUMENT(window_f.as_xmm, arg)
    VCVTTSS2SI(window, window_f.as_xmm)
    SUB(window, 1)                                   # window 0 (unlimited) wraps to 2^64 - 1
    MOV(frame.window1, window)


def store_head_dim(frame, head_dim):
    """The frame's row sizes of head_dim (hd4, full ymm chunks, tail, record layout); returns hd4."""
    t, hd4 = gp(), gp()
    LEA(hd4, [head_dim * FLOAT])
    MOV(frame.hd4, hd4)
    MOV(t, head_dim)
    SHR(t, 3)
    MOV(frame.full_chunks, t)
    MOV(t, head_dim)
    AND(t, LANES - 1)
    MOV(frame.tail, t)
    record_layout(frame, head_dim)
    return hd4


def emit_setup(frame, args):
    by_name = {a.name: a for a in args}
    load = argument_loader(args)

    for name, slot in (("q", frame.q_row), ("k_arena", frame.k), ("v_arena", frame.v),
                       ("dest", frame.out_row), ("scratch", frame.scores), ("positions", frame.positions),
                       ("row_seq", frame.row_seq), ("tables", frame.tables)):
        MOV(slot, load(name))
    ADD(frame.scores, SCORE_SLACK * FLOAT)           # score rows after the slack (emit_scores)
    packed = load("rows")
    m, table_stride = gp(), gp()
    low_high(packed, m, table_stride)
    MOV(frame.rows_left, m)
    scale = YMMRegister()
    LOAD.ARGUMENT(scale.as_xmm, by_name["scale"])
    VMOVSS(frame.scale, scale.as_xmm)
    store_window(frame, by_name["window"])

    packed = load("kv_heads")
    n_kv, group = gp(), gp()
    low_high(packed, n_kv, group)
    MOV(frame.group, group)
    packed = load("heads")
    h0, h1 = gp(), gp()
    low_high(packed, h0, h1)
    MOV(frame.h0, h0)
    MOV(frame.h1, h1)
    # kv0 = h0 // group by counting (no DIV: its implicit rax/rdx are invisible to PeachPy)
    kv0, group_start = gp(), gp()
    XOR(kv0, kv0)
    MOV(group_start, frame.group)
    with Loop() as count_groups:
        CMP(group_start, frame.h0)
        JA(count_groups.end)
        ADD(kv0, 1)
        ADD(group_start, frame.group)
        JMP(count_groups.begin)
    MOV(frame.kv0, kv0)
    group_end = gp()
    LEA(group_end, [kv0 + 1])
    IMUL(group_end, frame.group)
    MOV(frame.group_end0, group_end)

    head_dim, block_tiles, head_tiles, t = gp(), gp(), gp(), gp()
    unpack_tiles(load("head_dim"), head_dim, block_tiles, head_tiles)
    hd4 = store_head_dim(frame, head_dim)
    MOV(t, head_dim)
    SHR(t, frame.lanes.bit_length() - 1)
    MOV(frame.pass_chunks, t)
    MOV(frame.head_dim, head_dim)
    if frame.q8:
        MOV(t, head_dim)                             # head_dim quants + head_dim / 8 scale bytes
        SHR(t, 3)
        ADD(t, head_dim)
    else:
        LEA(t, [head_dim * ARENA_BYTES[frame.arena]])
    MOV(frame.kd, t)
    SHL(t, LOG2_KV_BLOCK)                            # a tile's bytes
    IMUL(head_tiles, t)
    MOV(frame.kv_stride, head_tiles)                 # from one KV head to the next
    IMUL(t, block_tiles)
    MOV(frame.block_stride, t)
    n_head = gp()
    MOV(n_head, group)                               # q, out rows: n_head = n_kv * group heads
    IMUL(n_head, n_kv)
    MOV(t, n_head)
    IMUL(t, hd4)
    MOV(frame.row_stride, t)
    MOV(frame.stride4, KV_SEGMENT * FLOAT)           # score rows: one segment each
    p = gp()
    MOV(p, frame.scores)
    ADD(p, ATTENTION_ROWS * MAX_HEADS * KV_SEGMENT * FLOAT)
    MOV(frame.partial_scratch, p)
    MOV(t, table_stride)
    SHL(t, 2)
    MOV(frame.table_stride4, t)

    packed = load("segments")
    seg0, step = gp(), gp()
    low_high(packed, seg0, step)
    whole, split = Block(), Block()
    # whole rows: every segment, records [segment][MAX_HEADS] in the scratch, combined into out
    rec4 = gp()
    MOV(rec4, frame.rec4)
    with whole:
        TEST(step, step)
        JNZ(whole.end)
        MOV(frame.whole, 1)
        MOV(frame.seg0, 0)
        MOV(frame.seg_step, 1)
        MOV(frame.phead, 0)
        MOV(t, rec4)
        IMUL(t, t, MAX_HEADS)
        MOV(frame.seg_stride, t)
        MOV(t, frame.row_stride)
        MOV(frame.dest_step, t)
        # row B of a pair keeps its records after row A's: the segments a table holds, + 1
        MOV(t, table_stride)
        ADD(t, KV_SEGMENT // KV_BLOCK - 1)
        SHR(t, LOG2_SEGMENT - LOG2_KV_BLOCK)
        ADD(t, 1)
        IMUL(t, frame.seg_stride)
        ADD(t, frame.partial_scratch)
        MOV(frame.partial_scratch_b, t)
        JMP(split.end)
    with split:                                      # records [row][segment][n_head] in dest
        MOV(frame.whole, 0)
        MOV(frame.seg0, seg0)
        MOV(frame.seg_step, step)
        MOV(frame.phead, rec4)
        IMUL(rec4, n_head)
        MOV(frame.seg_stride, rec4)
        ADD(table_stride, KV_SEGMENT // KV_BLOCK - 1)  # segments of a table
        SHR(table_stride, LOG2_SEGMENT - LOG2_KV_BLOCK)
        IMUL(rec4, table_stride)
        MOV(frame.dest_step, rec4)


def emit_attention_paged(isa, arena):
    signature = typed(ATTENTION_SIGNATURE, arena, ("k_arena", "v_arena"))
    open_function = upper_zmm_function if isa == "avx512" else function
    fn, args = open_function(symbol("attention_paged", arena, "", isa), signature, isa)
    with fn:
        frame = new_frame(arena, isa)
        emit_setup(frame, args)
        with Loop() as rows:
            emit_row_keys(frame)
            if frame.pairs:
                alone = Block()
                with alone:
                    # a pair: two rows left, whole rows, no window, one sequence
                    CMP(frame.rows_left, 2)
                    JB(alone.end)
                    CMP(frame.whole, 0)
                    JE(alone.end)
                    CMP(frame.window1, -1)
                    JNE(alone.end)
                    seqs, position = gp(), gp()
                    MOV(seqs, frame.row_seq)
                    MOV(position.as_dword, [seqs])
                    CMP(position.as_dword, [seqs + INDEX])
                    JNE(alone.end)
                    MOV(seqs, frame.positions)
                    MOV(position.as_dword, [seqs + INDEX])   # zero-extends
                    MOV(frame.row_last_b, position)
                    emit_row_pair(frame)
                    next_row(frame, 2)
                    SUB(frame.rows_left, 2)
                    JZ(rows.end)
                    JMP(rows.begin)
            emit_row(frame)
            next_row(frame, 1)
            SUB(frame.rows_left, 1)
            JNZ(rows.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile=f"h{MAX_HEADS}s{KV_SEGMENT}k{KV_BLOCK}r{ATTENTION_ROWS}", args=signature)


def emit_attention_combine(isa):
    """out[i, h] for rows i < m and heads h0 <= h < h1 from the partial records
    [m, n_segments, n_head, rec] that attention_paged's split calls wrote (segments of the
    table_stride blocks), each head as the whole-row kernel combines it."""
    fn, args = function(symbol("attention_combine", "f32", "", isa), COMBINE_SIGNATURE, isa)
    with fn:
        frame = new_frame("f32")
        by_name = {a.name: a for a in args}
        load = argument_loader(args)
        for name, slot in (("partials", frame.pbase), ("out", frame.out_row), ("positions", frame.positions),
                           ("m", frame.rows_left)):
            MOV(slot, load(name))
        store_window(frame, by_name["window"])
        head_dim, t = load("head_dim"), gp()
        hd4 = store_head_dim(frame, head_dim)
        n_head = load("n_head")
        MOV(t, n_head)
        IMUL(t, hd4)
        MOV(frame.row_stride, t)
        rec4 = gp()
        MOV(rec4, frame.rec4)
        IMUL(rec4, n_head)
        MOV(frame.seg_stride, rec4)
        table_stride = load("table_stride")
        ADD(table_stride, KV_SEGMENT // KV_BLOCK - 1)
        SHR(table_stride, LOG2_SEGMENT - LOG2_KV_BLOCK)
        IMUL(rec4, table_stride)
        MOV(frame.dest_step, rec4)
        packed = load("heads")
        h0, h1 = gp(), gp()
        low_high(packed, h0, h1)
        MOV(frame.h0, h0)
        MOV(frame.h1, h1)
        with Loop() as rows:
            position, n1, lo, hi = gp(), gp(), gp(), gp()
            MOV(t, frame.positions)
            MOV(position.as_dword, [t])
            MOV(n1, frame.window1)
            CMP(n1, position)
            CMOVA(n1, position)
            MOV(hi, position)
            SUB(position, n1)
            MOV(lo, position)
            SHR(lo, LOG2_SEGMENT)
            SHR(hi, LOG2_SEGMENT)
            SUB(hi, lo)
            ADD(hi, 1)
            MOV(frame.combine_count, hi)
            IMUL(lo, frame.seg_stride)
            ADD(lo, frame.pbase)
            MOV(frame.row_first, lo)                 # the row's first record of head 0
            MOV(t, frame.h0)
            MOV(frame.h, t)
            with Loop() as heads:
                h, p = gp(), gp()
                MOV(h, frame.h)
                MOV(p, h)
                IMUL(p, frame.rec4)
                ADD(p, frame.row_first)
                MOV(frame.combine_rec, p)
                MOV(p, h)
                IMUL(p, frame.hd4)
                ADD(p, frame.out_row)
                MOV(frame.combine_out, p)
                emit_combine(frame)
                h = bump(frame.h, 1)
                CMP(h, frame.h1)
                JB(heads.begin)
            MOV(t, frame.dest_step)
            ADD(frame.pbase, t)
            MOV(t, frame.row_stride)
            ADD(frame.out_row, t)
            ADD(frame.positions, INDEX)
            SUB(frame.rows_left, 1)
            JNZ(rows.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=COMBINE_SIGNATURE)


def typed(signature, arena, names):
    """``signature`` with the arena arguments ``names`` of the arena's C type."""
    if arena == "f32":
        return signature
    return [(name, ctype.replace("float", ARENA_C_TYPES[arena]) if name in names else ctype)
            for name, ctype in signature]


# ---------------------------------------------------------------- kv_store_paged, gather_rows

def copy_row(length, src, dst):
    """dst[0 .. length) = src[0 .. length) floats (masked tail: nothing past either row touched)."""
    count, index = gp(), gp()
    MOV(count, length)
    XOR(index.as_dword, index.as_dword)

    def step(v):
        value = YMMRegister()
        v.load(value, src)
        v.store(dst, value)
    stream(count, [index], step, 4)


def convert_row(length, src, dst):
    """dst[0 .. length) = src[0 .. length) rounded to halves (length % 8 == 0)."""
    count, from_at, to_at = gp(), gp(), gp()
    MOV(count, length)
    SHR(count, 3)
    MOV(from_at, src)
    MOV(to_at, dst)
    with Loop() as chunks:
        value = YMMRegister()
        VMOVUPS(value, [from_at])
        VCVTPS2PH([to_at], value, ROUND_NEAREST_EVEN)
        ADD(from_at, CHUNK)
        ADD(to_at, CHUNK // 2)
        DEC(count)
        JNZ(chunks.begin)


NOT_EQUAL = 4                       # VCMPPS predicate NEQ_UQ


def quantize_row(head_dim, src, dst):
    """q8_0 row at dst from head_dim floats at src (head_dim % 32 == 0): per block of 32,
    d = max|x| / 127, q = x * (1 / d) rounded to nearest even (0 where d = 0), quants first,
    then the f32 scales (codegen/contract.py), as runtime/ref/paged.py quantize_kv_q8."""
    blocks, from_at, to_at, scale_at = gp(), gp(), gp(), gp()
    MOV(blocks, head_dim)
    SHR(blocks, 5)
    MOV(from_at, src)
    MOV(to_at, dst)
    LEA(scale_at, [dst + head_dim * 1])
    with Loop() as loop:
        x = ymms(Q8_CHUNKS)
        for c in range(Q8_CHUNKS):
            VMOVUPS(x[c], [from_at + c * CHUNK])
        amax, t = YMMRegister(), YMMRegister()
        VANDPS(amax, x[0], Constant.uint32x8(0x7FFFFFFF))
        for c in range(1, Q8_CHUNKS):
            VANDPS(t, x[c], Constant.uint32x8(0x7FFFFFFF))
            VMAXPS(amax, amax, t)
        fold_lanes(VMAXPS, amax)
        d, inverse, nonzero = amax, YMMRegister(), YMMRegister()
        VDIVPS(d, amax, Constant.float32x8(127.0))
        VMOVAPS(inverse, Constant.float32x8(1.0))
        VDIVPS(inverse, inverse, d)
        VXORPS(nonzero, nonzero, nonzero)
        VCMPPS(nonzero, d, nonzero, NOT_EQUAL)
        VANDPS(inverse, inverse, nonzero)
        for c in range(Q8_CHUNKS):
            q, high = x[c], YMMRegister()
            VMULPS(q, q, inverse)
            VCVTPS2DQ(q, q)
            VEXTRACTI128(high.as_xmm, q, 1)
            VPACKSSDW(q.as_xmm, q.as_xmm, high.as_xmm)
            VPACKSSWB(q.as_xmm, q.as_xmm, q.as_xmm)
            VMOVQ([to_at + c * LANES], q.as_xmm)
        VMOVSS([scale_at], d.as_xmm)
        ADD(from_at, KV_Q8_BLOCK * FLOAT)
        ADD(to_at, KV_Q8_BLOCK)
        ADD(scale_at, 4)
        DEC(blocks)
        JNZ(loop.begin)


MAX_KEY_ROW_BYTES = 2048            # a key row's stack copy: f16 head_dim <= 1024 (the binding checks)


def scatter_key(head_dim, row, tile, element):
    """Copy a key row (head_dim elements of ``element`` bytes at ``row``, as the value
    layout holds it) into its lane of a key tile: element d to tile + d * KV_BLOCK * element
    (``tile`` already points at the lane). A row per store: this is not a hot loop."""
    move = {4: (dword, "as_dword"), 2: (word, "as_word"), 1: (byte, "as_low_byte")}[element]
    count, src, dst, t = gp(), gp(), gp(), gp()
    MOV(count, head_dim)
    MOV(src, row)
    MOV(dst, tile)
    with Loop() as loop:
        if element == 4:
            MOV(t.as_dword, [src])
        else:
            MOVZX(t.as_dword, move[0][src])
        MOV([dst], getattr(t, move[1]))
        ADD(src, element)
        ADD(dst, KV_BLOCK * element)
        DEC(count)
        JNZ(loop.begin)


def emit_kv_store_paged(isa, arena_type, keys=False):
    """arena[block, h, p % KV_BLOCK] = src[i, h] for rows i < m in order and heads h < n_heads,
    block = tables[row_seq[i], p / KV_BLOCK], p = positions[i]. The binding offsets src and
    arena to the first head; ``kv_heads`` = n_kv | block_tiles << 16 | head_tiles << 40
    (ARENA_TILES): src rows are n_kv heads long, and the arena's tiles are block_tiles tiles
    from one block to the next, head_tiles from one KV head to the next.

    ``keys``: the key layout (codegen/contract.py), each (block, head) a tile [head_dim]
    [KV_BLOCK] (q8_0: the quants so, then [head_dim / 32][KV_BLOCK] scales): the row is
    made as for values (the same rounding, the same quants), then put in lane p % KV_BLOCK."""
    signature = typed(STORE_SIGNATURE, arena_type, ("arena",))
    fn, args = function(symbol("key_store_paged" if keys else "kv_store_paged", arena_type, "", isa),
                        signature, isa)
    with fn:
        src, positions, row_seq, tables, arena, m, n_heads, head_dim, kv_heads, table_stride = load_all(args)
        n_kv, block_tiles, head_tiles = gp(), gp(), gp()
        unpack_tiles(kv_heads, n_kv, block_tiles, head_tiles)
        saved = SimpleNamespace(**{name: LocalVariable(8) for name in
                                   ("tables", "table_stride4", "n_heads", "block_stride", "src_stride", "m",
                                    "arena", "lane")})
        saved.row = LocalVariable(MAX_KEY_ROW_BYTES, alignment=8) if keys and arena_type != "f32" else None
        MOV(saved.tables, tables)
        MOV(saved.arena, arena)
        MOV(saved.m, m)
        MOV(saved.n_heads, n_heads)
        SHL(table_stride, 2)
        MOV(saved.table_stride4, table_stride)
        hd4, kd, head_stride = gp(), gp(), gp()
        LEA(hd4, [head_dim * FLOAT])
        if arena_type == "q8_0":                      # an arena row's bytes
            MOV(kd, head_dim)
            SHR(kd, 3)
            ADD(kd, head_dim)
        else:
            LEA(kd, [head_dim * ARENA_BYTES[arena_type]])
        MOV(head_stride, kd)
        SHL(head_stride, LOG2_KV_BLOCK)              # a tile's bytes
        IMUL(block_tiles, head_stride)
        MOV(saved.block_stride, block_tiles)
        IMUL(head_stride, head_tiles)                # from one KV head to the next
        IMUL(n_kv, hd4)                               # src row bytes: n_kv * hd4
        MOV(saved.src_stride, n_kv)
        with Loop() as rows:
            dst, position, t = gp(), gp(), gp()
            MOV(position.as_dword, [positions])
            MOV(t.as_dword, [row_seq])
            IMUL(t, saved.table_stride4)
            ADD(t, saved.tables)
            MOV(dst, position)
            SHR(dst, LOG2_KV_BLOCK)
            MOV(dst.as_dword, [t + dst * INDEX])
            IMUL(dst, saved.block_stride)
            AND(position, KV_BLOCK - 1)
            if keys:                                  # the lane's first element
                SHL(position, ARENA_BYTES[arena_type].bit_length() - 1)
            else:                                     # the row
                IMUL(position, kd)
            ADD(dst, position)
            ADD(dst, saved.arena)
            if keys:
                MOV(saved.lane, position)
            src_head, heads_left = gp(), gp()
            MOV(src_head, src)
            MOV(heads_left, saved.n_heads)
            with Loop() as heads:
                if keys:
                    emit_key_row(arena_type, head_dim, src_head, dst, saved)
                elif arena_type == "q8_0":
                    quantize_row(head_dim, src_head, dst)
                elif arena_type == "f16":
                    convert_row(head_dim, src_head, dst)
                else:
                    copy_row(head_dim, src_head, dst)
                ADD(src_head, hd4)
                ADD(dst, head_stride)
                DEC(heads_left)
                JNZ(heads.begin)
            ADD(src, saved.src_stride)
            ADD(positions, INDEX)
            ADD(row_seq, INDEX)
            SUB(saved.m, 1)
            JNZ(rows.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=signature)


def emit_key_row(arena_type, head_dim, src, tile_lane, saved):
    """One key row into its tile lane (``tile_lane`` = the tile + lane * element bytes)."""
    if arena_type == "f32":
        scatter_key(head_dim, src, tile_lane, 4)
        return
    row = gp()
    LEA(row, saved.row)
    if arena_type == "f16":
        convert_row(head_dim, src, row)
        scatter_key(head_dim, row, tile_lane, 2)
        return
    quantize_row(head_dim, src, row)
    scatter_key(head_dim, row, tile_lane, 1)
    # the scales: [head_dim / 32][KV_BLOCK] f32 after the tile's quants
    count, scales, t = gp(), gp(), gp()
    ADD(row, head_dim)                               # row still points at the stack copy
    MOV(scales, head_dim)
    SHL(scales, LOG2_KV_BLOCK)
    ADD(scales, tile_lane)
    SUB(scales, saved.lane)                          # the tile's first byte
    MOV(t, saved.lane)
    LEA(scales, [scales + t * FLOAT])
    MOV(count, head_dim)
    SHR(count, 5)
    with Loop() as loop:
        MOV(t.as_dword, [row])
        MOV([scales], t.as_dword)
        ADD(row, FLOAT)
        ADD(scales, KV_BLOCK * FLOAT)
        DEC(count)
        JNZ(loop.begin)


def emit_gather_rows(isa):
    """out[r] = src[rows[r]] for r < n_rows, rows of d floats."""
    fn, args = function(symbol("gather_rows", "f32", "", isa), GATHER_SIGNATURE, isa)
    with fn:
        src, rows, out, n_rows, d = load_all(args)
        d4 = gp()
        LEA(d4, [d * FLOAT])
        with Loop() as loop:
            from_row = gp()
            MOV(from_row.as_dword, [rows])
            IMUL(from_row, d4)
            ADD(from_row, src)
            copy_row(d, from_row, out)
            ADD(out, d4)
            ADD(rows, INDEX)
            DEC(n_rows)
            JNZ(loop.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=GATHER_SIGNATURE)


ISAS = ("avx2", "avx512")


def emit(isa):
    if isa == "avx512":                              # attention only: the rest is the AVX2 kernels'
        return [emit_attention_paged(isa, arena) for arena in ARENA_BYTES]
    return ([emit_kv_store_paged(isa, arena) for arena in ARENA_BYTES]
            + [emit_kv_store_paged(isa, arena, keys=True) for arena in ARENA_BYTES]
            + [emit_attention_paged(isa, arena) for arena in ARENA_BYTES] + [emit_attention_combine(isa),
                                                                              emit_gather_rows(isa)])
