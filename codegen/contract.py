"""The contract between the kernels and the runtime: sizes, layouts and names both sides rely on.

PeachPy-free (numpy only), so ``runtime/`` imports it at run time without
importing the generators. A change here changes the library's source key
(codegen/build.py hashes every module of this folder), so kernels and
bindings never disagree about a size.
"""
from dataclasses import dataclass

import numpy as np

# -- quantized weights (runtime/layout_quant.py packs them, codegen/qgemm.py reads them)
BLOCK = 32           # weights per quantization block (GGUF's QK4_0 = QK8_0 = 32), activations too
SUPER_BLOCK = 256    # weights per K-quant super-block (GGUF's QK_K)
GROUP = 8            # weight rows interleaved together = f32 lanes of one ymm output vector
CHUNK = 4            # quant bytes of one row per 32-byte load of a group

# -- float weights (runtime/layout_float.py packs them, codegen/gemm.py reads them)
PANEL = 16           # weight rows per panel: two ymm of f32 columns

# -- the paged KV cache (llambda/serving/kv_pool.py owns it; runtime/ref/paged.py defines the ops that
#    read it): per layer an arena [n_blocks, n_kv_head, KV_BLOCK, head_dim], each (block, KV
#    head) tile contiguous, the tiles block_tiles apart from one block to the next and
#    head_tiles from one KV head to the next (the pool's arenas are views of one buffer
#    [n_layer, n_kv_head, n_blocks, ...]: block_tiles 1, head_tiles n_blocks); a sequence's key
#    j lives in block tables[seq, j // KV_BLOCK] at row j % KV_BLOCK.
KV_BLOCK = 16        # positions per KV block
# The kernels take an arena's strides in tiles, packed under a 16-bit count (head_dim, n_kv):
# low | block_tiles << 16 | head_tiles << 40, these bits each.
ARENA_TILES = (16, 24, 24)
# A q8_0 arena (uint8, [n_blocks, n_kv_head, KV_BLOCK, kv_q8_row_bytes(head_dim)]): each row (one
# position of one KV head) holds head_dim int8 quants, then one f32 scale d per KV_Q8_BLOCK of
# them; value = d * q (rounded to f32). runtime/ref/paged.py quantizes: d = max|x| / 127,
# q = rint(x / d) (x times the f32 1/d, nearest even), d = 0 for an all-zero block.
KV_Q8_BLOCK = 32
KV_Q8_SCALE_BYTES = 4
# q8_0 attention quantizes each head of q into a q8_0 row on the kernel's stack
# (codegen/paged/scores.py emit_query_quants): head_dim up to this; the binding refuses more.
MAX_Q8_QUERY_HEAD_DIM = 1024
# Key arenas (the K cache) hold the same bytes per (block, KV head) as KV_BLOCK rows, laid out
# as a key tile: [head_dim][KV_BLOCK], element d of key j of the block at d * KV_BLOCK + j, so
# the scores kernel multiplies a vector of the block's keys by one broadcast q element (no
# horizontal sums). A q8_0 key tile is the quants so ([head_dim][KV_BLOCK] int8), then the
# scales as [head_dim / KV_Q8_BLOCK][KV_BLOCK] f32. Value arenas (V) keep rows: P V multiplies
# a row by one broadcast probability. runtime/ref/paged.py key_tiles / key_rows convert.


def kv_q8_row_bytes(head_dim):
    """Bytes of one q8_0 arena row: the quants, then the f32 scales."""
    return head_dim + head_dim // KV_Q8_BLOCK * KV_Q8_SCALE_BYTES


# -- attention segments (flash-decoding): a row's keys are cut at multiples of KV_SEGMENT
#    (absolute key index). Each (row, head, segment) gives a partial record of
#    kv_partial_floats(head_dim) floats: the unnormalised output sum_j e_j v_j
#    (head_dim, padded to 8), then the segment's max score, sum of e_j = exp(s_j - max), and
#    one spare float the combine uses for the segment's weight. The combine merges a row's
#    segments in segment order: the bits depend only on the row's keys.
KV_SEGMENT = 256
KV_SEGMENT_BLOCKS = KV_SEGMENT // KV_BLOCK
PARTIAL_EXTRA = 8


def kv_partial_floats(head_dim):
    return -(-head_dim // 8) * 8 + PARTIAL_EXTRA


def kv_segments(keys):
    """Segments a table of ``keys`` key slots can hold (absolute segment indices 0..n-1)."""
    return -(-keys // KV_SEGMENT)


# -- attention's scratch (runtime/native/paged.py paged_attention_scratch): KV_BLOCK floats of
#    slack, score rows of KV_SEGMENT floats for ATTENTION_ROWS rows of up to 3 heads, then
#    per row the partial records [segment][3 heads] of the segments its keys can span. A
#    prompt's rows go through the AVX-512 float kernels ATTENTION_ROWS at a time, sharing
#    each K and V row they load (codegen/paged/__init__.py "Rows in pairs").
ATTENTION_ROWS = 2

# -- plans (runtime/plan.py writes records, codegen/executor.py walks them)
RECORD_BYTES = 128
FN_OFFSET = 0
FLOAT_ARGS_OFFSET = 8
BARRIER_OFFSET = 16
CHUNKS_OFFSET = 20   # u32: 0 = a static op (one record per thread); n = n chunks any thread may claim
INT_ARGS_OFFSET = 24
MAX_INT_ARGS = 13
MAX_FLOAT_ARGS = 2
STAMP_WORDS = 2      # per op and thread: kernel returned, released
# Per op, two 64-byte lines of the plan's state: chunks claimed, and records finished, both
# counted over every run of the plan (codegen/executor.py explains the claiming). Apart, so
# that threads spinning on the one do not take the line from threads claiming on the other.
STATE_LINE_BYTES = 128
CLAIMED_OFFSET = 0
DONE_OFFSET = 64

@dataclass(frozen=True)
class ArraySpec:
    """One array of a packed quantized weight: shape [row groups, k / (BLOCK * blocks_per), *tail].

    ``blocks_per`` > 1 holds values shared by that many consecutive blocks (e.g. a
    K-quant super-block's scale: blocks_per = SUPER_BLOCK // BLOCK)."""
    name: str
    dtype: type
    tail: tuple
    blocks_per: int = 1

    def shape(self, groups, blocks):
        return (groups, blocks // self.blocks_per) + self.tail

    @property
    def bytes_per_entry(self):
        """Bytes per row group per entry along the block axis (the kernel's stride)."""
        return int(np.dtype(self.dtype).itemsize * np.prod(self.tail))


# -- K-quants (q4_k, q5_k: runtime/layout_kquant.py). Per super-block of a row group, one
#    scale record: f16 d of the 8 rows, f16 -dmin of the 8 rows, then per 32-weight block
#    the 8 rows' uint8 6-bit scales and the 8 rows' uint8 6-bit mins.
KQ_SUB_BLOCKS = SUPER_BLOCK // BLOCK                                 # 8 blocks per super-block
KQ_MINS_OFFSET = 2 * GROUP                                           # -dmin after d
KQ_BLOCK_SCALES_OFFSET = 2 * 2 * GROUP                               # block 0's scales after both
KQ_BLOCK_SCALES_BYTES = 2 * GROUP                                    # scales, mins of one block
KQ_SCALE_RECORD = KQ_BLOCK_SCALES_OFFSET + KQ_SUB_BLOCKS * KQ_BLOCK_SCALES_BYTES   # 160 bytes

# -- the arrays of each packed quantized kind, in the order the kernels take them.
#    Both the packer (runtime/layout_*.py) and the kernels' strides follow it.
QUANT_ARRAYS = {
    "q4_1": (ArraySpec("qs", np.uint8, (BLOCK // 2 // CHUNK, GROUP, CHUNK)),    # nibbles, 4 chunks
             ArraySpec("dm", np.float16, (2, GROUP))),                          # d then m of each row
    "q8_0": (ArraySpec("qs", np.int8, (BLOCK // CHUNK, GROUP, CHUNK)),          # int8, 8 chunks
             ArraySpec("d", np.float16, (GROUP,))),
    # five-bit quants: 4 chunks of q[4c..] | q[16+4c..] >> 2 << 5, then the low bits (layout_q5.py)
    "q5_0": (ArraySpec("qs", np.uint8, (BLOCK // 2 // CHUNK + 1, GROUP, CHUNK)),
             ArraySpec("d", np.float16, (GROUP,))),                             # m = -16 d in the kernel
    "q5_1": (ArraySpec("qs", np.uint8, (BLOCK // 2 // CHUNK + 1, GROUP, CHUNK)),
             ArraySpec("dm", np.float16, (2, GROUP))),
    # K-quants with 16-weight sub-blocks (runtime/layout_kquant16.py, codegen/qgemm_k16.py):
    # per block of 32 weights, planes of packed quants (each 8 rows x 4 bytes) and the two
    # sub-blocks' integer scales of each row; per super-block of 256, f16 scales per row.
    "q6_k": (ArraySpec("qs", np.uint8, (2, 3, GROUP, CHUNK)),                   # 6-bit q, 3 planes a half
             ArraySpec("sc", np.int8, (GROUP, 2)),                              # sc of each row's halves
             ArraySpec("d", np.float16, (GROUP,), SUPER_BLOCK // BLOCK)),
    "q3_k": (ArraySpec("qs", np.uint8, (3, GROUP, CHUNK)),                      # 3-bit q, 3 planes
             ArraySpec("sc", np.int8, (GROUP, 2)),                              # sc - 32
             ArraySpec("d", np.float16, (GROUP,), SUPER_BLOCK // BLOCK)),
    "q2_k": (ArraySpec("qs", np.uint8, (2, GROUP, CHUNK)),                      # 2-bit q, 2 planes
             ArraySpec("sm", np.uint8, (GROUP, 2)),                             # sc | m << 4, as GGUF
             ArraySpec("dm", np.float16, (2, GROUP), SUPER_BLOCK // BLOCK)),    # d then dmin
    # 4 nibble chunks as q4_1 (byte b: weights b and b + 16 of the block)
    "q4_k": (ArraySpec("qs", np.uint8, (BLOCK // 2 // CHUNK, GROUP, CHUNK)),
             ArraySpec("scales", np.uint8, (KQ_SCALE_RECORD,), blocks_per=KQ_SUB_BLOCKS)),
    # the same 4 nibble chunks, then a fifth holding each row's 32 high bits
    "q5_k": (ArraySpec("qs", np.uint8, (BLOCK // 2 // CHUNK + 1, GROUP, CHUNK)),
             ArraySpec("scales", np.uint8, (KQ_SCALE_RECORD,), blocks_per=KQ_SUB_BLOCKS)),
}

# Register tiles of the qgemm kernels whose tile differs from their ISA's default
# (runtime/native/quant.py QGEMM_TILES), by kind and ISA.
# A kind listed here has kernels for the ISAs listed, and only those.
QGEMM_KIND_TILES = {"q6_k": {"avx2": "3x8", "avx512": "16x16"}, "q3_k": {"avx2": "3x8", "avx512": "16x16"},
                    "q2_k": {"avx2": "3x8", "avx512": "16x16"}}
# Kinds with a second AVX2 kernel for decode (m = 1): one activation row over a group pair, the
# activation's per-block work done once for 16 columns (codegen/qgemm_k16.py, qgemm_kquant.py
# "AVX2 decode"). Same bits as the kind's AVX2 tile; the binding picks it for one row.
QGEMM_AVX2_DECODE_TILE = "1x16"
QGEMM_AVX2_DECODE_KINDS = ("q6_k", "q3_k", "q2_k", "q4_k")


def block_multiple(kind):
    """k must be a multiple of this for ``kind`` (BLOCK, or SUPER_BLOCK for K-quants)."""
    return BLOCK * max(spec.blocks_per for spec in QUANT_ARRAYS[kind])


def symbol(op, types, tile, isa):
    """``llb_<op>_<types>_<tile>__<isa>``: what a symbol is, readable from ``nm``."""
    parts = ["llb", op]
    if types:
        parts.append(types)
    if tile:
        parts.append(tile)
    return "_".join(parts) + "__" + isa


def qgemm_symbol(kind, tile, isa):
    return symbol("qgemm", f"{kind}_q8", tile, isa)


def embed_symbol(kind, isa="avx2"):
    return symbol("embed", kind, "", isa)
