"""The paged kernels' shared pieces: the arena constants and C signatures, the attention
kernel's stack frame (``new_frame``) and the small address and row helpers the passes, the
drivers and the stores all use."""
from types import SimpleNamespace

from peachpy import Constant
from peachpy.x86_64 import (ADD, AND, CMOVA, CMP, DEC, IMUL, JNZ, LEA, LOAD, LocalVariable, Loop, MOV, MOVZX,
                            NEG, SHR, VANDPS, VCMPPS, VCVTPS2DQ, VDIVPS, VEXTRACTI128, VMAXPS, VMOVAPS, VMOVQ,
                            VMOVSS, VMOVUPS, VMULPS, VPACKSSDW, VPACKSSWB, VXORPS, YMMRegister, ZMMRegister)

from ..attention import CHUNK, FLOAT, LANES, MAX_HEADS, gp, ymms
from ..common import fold_lanes
from ..contract import ARENA_TILES, KV_BLOCK, KV_Q8_BLOCK, KV_SEGMENT, MAX_Q8_QUERY_HEAD_DIM, kv_q8_row_bytes


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
    # only (docs/perf-journal/2026-12-06-2146-q8_0-attention-from-memory.md)
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


def unpack_tiles(packed, low, block_tiles, head_tiles):
    """Unpack ``packed`` = low | block_tiles << 16 | head_tiles << 40 (ARENA_TILES)."""
    low_bits, block_bits, _ = ARENA_TILES
    MOVZX(low.as_dword, packed.as_word)
    MOV(block_tiles, packed)
    SHR(block_tiles, low_bits)
    AND(block_tiles.as_dword, (1 << block_bits) - 1)   # zero-extends
    MOV(head_tiles, packed)
    SHR(head_tiles, low_bits + block_bits)


def typed(signature, arena, names):
    """``signature`` with the arena arguments ``names`` of the arena's C type."""
    if arena == "f32":
        return signature
    return [(name, ctype.replace("float", ARENA_C_TYPES[arena]) if name in names else ctype)
            for name, ctype in signature]


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
