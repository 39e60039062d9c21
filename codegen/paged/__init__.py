"""The paged KV cache's kernels: store this step's K/V rows into their blocks, attend over a
sequence's blocks, gather the rows the LM head wants (runtime/ref/paged.py defines them).

The package, by the kernel's passes: ``frame`` (constants, signatures, the stack frame and
shared helpers), ``scores`` (pass 1), ``softmax`` (pass 2 and the combine), ``pv`` (pass 3),
``drivers`` (the row, segment and head loops and the attention kernels), ``store``
(kv_store_paged, gather_rows). ``emit(isa)`` gives every kernel; ``PARTS`` cuts them into
pieces the build runs in processes of their own (codegen/build.py).

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
everything else, the caller (llambda/serving/kv_pool.py) keeps those in range.

A plan record holds 13 integer arguments; the attention kernel needs 18 values, so pairs
of 32-bit values travel packed in one size_t each (low | high << 32): ``rows`` = m |
table_stride << 32, ``kv_heads`` = n_kv | group << 32, ``heads`` = h0 | h1 << 32 and
``segments`` = seg0 | step << 32. ``head_dim`` = head_dim | block_tiles << 16 | head_tiles <<
40 (codegen/contract.py ARENA_TILES): an arena's (block, KV head) tiles are block_tiles
tiles from one block to the next and head_tiles from one KV head to the next, so a layer's
arena can be a view of a buffer that keeps each (layer, KV head)'s blocks together
(llambda/serving/kv_pool.py: a sequence's tiles of one KV head are then one run the kernel reads in
order)."""
from .drivers import emit_attention_combine, emit_attention_paged
# The signatures too: runtime/recorder.py's tests read them from the family.
from .frame import ARENA_BYTES, ATTENTION_SIGNATURE, COMBINE_SIGNATURE, GATHER_SIGNATURE, STORE_SIGNATURE
from .store import emit_gather_rows, emit_kv_store_paged

ISAS = ("avx2", "avx512")

# One attention kernel is the bulk of a build (tens of KB of code each, and PeachPy's
# analysis of it); the build runs each part in a process of its own, so the cores share
# them. A literal: the build reads it without importing PeachPy (codegen/sources.py).
PARTS = {
    "avx2": ("store", "attention_f32", "attention_f16", "attention_q8_0", "combine"),
    "avx512": ("attention_f32", "attention_f16", "attention_q8_0"),
}


def _stores(isa):
    return ([emit_kv_store_paged(isa, arena) for arena in ARENA_BYTES]
            + [emit_kv_store_paged(isa, arena, keys=True) for arena in ARENA_BYTES])


def _attention(arena):
    return lambda isa: [emit_attention_paged(isa, arena)]


def _combine(isa):
    return [emit_attention_combine(isa), emit_gather_rows(isa)]


_EMITTERS = {"store": _stores, "combine": _combine, **{f"attention_{arena}": _attention(arena) for arena in ARENA_BYTES}}


def emit(isa, part=None):
    """The kernels of ``isa`` (on avx512 attention only: the rest is the AVX2 kernels'), or
    of one of its PARTS, in the same order either way."""
    names = PARTS[isa] if part is None else (part,)
    return [kernel for name in names for kernel in _EMITTERS[name](isa)]
