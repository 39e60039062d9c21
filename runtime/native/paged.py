"""Bindings: the paged KV cache's kernels (codegen/paged/), the same ops and signatures as
runtime/ref/paged.py.

    kv_store_paged(src, positions, row_seq, tables, arena, heads=None)
    attention_paged(q, k_arena, v_arena, positions, row_seq, tables, scale, out, scratch,
                    heads=None, window=0)
    gather_rows(src, rows, out)
    paged_attention_scratch(max_keys)

    attention_combine(partials, positions, tables, out, heads=None, window=0)

Each ``*_call`` twin validates and returns ``(symbol, args)`` for a plan (the recorder
splits kv_store_paged by KV heads, attention_paged by query heads and rows, or for a
decode step by query heads and key segments, ``attention_paged_call(..., partials=,
segments=(seg0, step))``, then ``attention_combine_call``; gather_rows by rows). Every
split gives the bits of the whole call (codegen/paged/). ``isa=`` picks the attention
variant (``attention_isas()``); by default the widest this machine runs for head_dim.

What is checked here: shapes, dtypes, strides, alignment, that outputs overlap no input,
the head / row ranges and the window. What cannot be: the *contents* of positions,
row_seq, tables and rows, which a plan reads when it runs (they are written after the
plan is recorded). The caller (llambda/serving/kv_pool.py) guarantees, for every row i < m:
0 <= row_seq[i] < n_tables, 0 <= positions[i] < max_blocks * KV_BLOCK, and every block
index tables[row_seq[i], j // KV_BLOCK] of a key j the row touches is in [0, n_blocks);
for gather_rows, 0 <= rows[r] < m. ``llambda.runtime.step_indices.check_step_indices``
checks exactly that (debug runs and tests). The scratch is checked against the most keys
any valid row can see (max_blocks * KV_BLOCK, or the window), so valid indices never
overrun it.
"""
import functools
import os

import numpy as np

from ...codegen.contract import (ARENA_TILES, ATTENTION_ROWS, KV_BLOCK, KV_Q8_BLOCK, KV_SEGMENT,
                                 MAX_Q8_QUERY_HEAD_DIM, kv_partial_floats, kv_q8_row_bytes, kv_segments)
from .. import buffers
from .. import cpu
from .. import library
from .. import validate as v
from ._lib import checked_address, index_range, kernel

__all__ = ["kv_store_paged", "attention_paged", "paged_attention_scratch", "gather_rows"]
# attention_partials / attention_combine (split calls) are module functions, not backend ops:
# the recorder makes split calls, the reference computes whole rows only.

# Arena dtype -> kernel symbol (the arena's dtype decides the kernel). An f16 arena is
# stored rounded to nearest even (numpy's astype) and read exactly: its results are the
# f32 kernel's on the rounded values. It needs head_dim % 8 == 0 (whole 8-half chunks).
# A q8_0 arena is uint8 rows of int8 quants and f32 scales (codegen/contract.py
# kv_q8_row_bytes), quantized on store as runtime/ref/paged.py quantize_kv_q8; attention
# scores it with q quantized the same way (see MAX_Q8_QUERY_HEAD_DIM). It needs head_dim % 32 == 0.
STORE_SYMBOLS = {np.dtype(np.float32): "llb_kv_store_paged_f32__avx2",
                 np.dtype(np.float16): "llb_kv_store_paged_f16__avx2",
                 np.dtype(np.uint8): "llb_kv_store_paged_q8_0__avx2"}
# Keys are stored in the key layout (codegen/contract.py, key arenas): each (block, KV head) a
# tile [head_dim][KV_BLOCK], the same bytes as KV_BLOCK rows; values stay rows.
KEY_STORE_SYMBOLS = {dtype: name.replace("kv_store", "key_store") for dtype, name in STORE_SYMBOLS.items()}
MAX_KEY_HEAD_DIM = 1024             # f16 / q8_0: the key store's stack copy of a row (codegen/paged/)
ATTENTION_SYMBOLS = {np.dtype(np.float32): "llb_attention_paged_f32__avx2",
                     np.dtype(np.float16): "llb_attention_paged_f16__avx2",
                     np.dtype(np.uint8): "llb_attention_paged_q8_0__avx2"}
# The attention kernels' variants: avx512 runs the scores and P V passes on zmm and needs
# head_dim % 16 == 0. The variant is chosen per machine (and head_dim), never per m: the
# reductions differ between variants, so every row of a model takes the same one.
ATTENTION_ISAS = ("avx2", "avx512")
WIDE_HEAD_DIM_MULTIPLE = 16


def attention_symbol(dtype, isa):
    return ATTENTION_SYMBOLS[dtype].replace("__avx2", f"__{isa}")


# q8_0 scores are exact int8 dot products of the key's quants and q's, each head of q
# quantized once per row as the store quantizes a row (codegen/paged/scores.py tile_scores_vnni on
# avx512, which needs AVX512_VNNI as well, and tile_scores_int8 on avx2): the scores of the
# quantized q (runtime/ref/paged.py attention_paged). Both keep q's q8_0 rows on the stack:
# head_dim <= MAX_Q8_QUERY_HEAD_DIM (the key store's limit too, MAX_KEY_HEAD_DIM).
Q8_WIDE_FLAGS = ("avx512_vnni", "avx512vnni")          # as Linux or py-cpuinfo spell it


@functools.lru_cache(maxsize=None)
def attention_isas(dtype=None):
    """The attention variants this CPU runs and the kernel library has, baseline first; for
    an arena ``dtype``, those of its kernel (q8_0's avx512 variant also needs AVX512_VNNI)."""
    manifest = library.load("avx2").manifest
    isas = tuple(isa for isa in ATTENTION_ISAS if not cpu.missing_flags(isa)
                 and all(attention_symbol(d, isa) in manifest for d in ATTENTION_SYMBOLS))
    if dtype is not None and np.dtype(dtype) == np.uint8 and not cpu.cpu_flags() & set(Q8_WIDE_FLAGS):
        isas = tuple(isa for isa in isas if isa != "avx512")
    return isas


def wide_head_dim(head_dim):
    """Whether the avx512 variant takes this head_dim."""
    return head_dim % WIDE_HEAD_DIM_MULTIPLE == 0


def attention_isa(head_dim, isa=None, dtype=None):
    """``isa`` if given (checked), else the widest this machine runs for head_dim and the
    arena ``dtype`` (capped by LLAMBDA_ISA, as the float GEMM)."""
    if isa is not None:
        q8 = dtype is not None and np.dtype(dtype) == np.uint8
        if isa not in attention_isas(dtype):
            raise ValueError(f"isa: expected one of {', '.join(attention_isas(dtype))} (the attention variants "
                             f"this CPU and kernel library run{' for a q8_0 arena' if q8 else ''}), got {isa!r}")
        if isa == "avx512" and not wide_head_dim(head_dim):
            raise ValueError(f"isa: avx512 attention needs head_dim % {WIDE_HEAD_DIM_MULTIPLE} == 0, "
                             f"got head_dim {head_dim}")
        return isa
    cap = os.environ.get("LLAMBDA_ISA") or ATTENTION_ISAS[-1]
    if cap not in ATTENTION_ISAS:
        raise ValueError(f"LLAMBDA_ISA: expected one of {', '.join(ATTENTION_ISAS)}, got {cap!r}")
    wide = ("avx512" in attention_isas(dtype) and ATTENTION_ISAS.index(cap) >= 1
            and wide_head_dim(head_dim))
    return "avx512" if wide else "avx2"


ARENA_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint8): "q8_0 (uint8)"}
HEAD_DIM_MULTIPLE = {np.dtype(np.float16): 8, np.dtype(np.uint8): KV_Q8_BLOCK}
GATHER_SYMBOL = "llb_gather_rows_f32__avx2"
COMBINE_SYMBOL = "llb_attention_combine_f32__avx2"

# Mirrors codegen/paged/ (from codegen/attention.py): query heads sharing a KV head done
# together, each with one score row of KV_SEGMENT floats, for ATTENTION_ROWS rows at a time
# (a prompt's rows in pairs); after them, for whole rows, each row's partial records
# [segment][MAX_HEADS] of the segments its keys can span.
MAX_HEADS = 3
SCORE_SLACK = KV_BLOCK              # floats before the score rows (a first block's early lanes)
LANES = 16
MAX_HEAD_DIM = 256                  # the scratch's default: any head_dim up to this
MAX_EXACT_WINDOW = 2 ** 24          # the window travels as a float32
PACKED_MAX = 2 ** 32                # heads and (n_kv, group) travel as two 32-bit halves
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
F32_MAX = float(np.finfo(np.float32).max)


@functools.lru_cache(maxsize=None)
def _check_tile():
    """Once: the kernels in the library were built for the scratch layout this binding assumes."""
    manifest = library.load("avx2").manifest
    for symbol in [attention_symbol(d, isa) for d in ATTENTION_SYMBOLS for isa in ATTENTION_ISAS]:
        entry = manifest.get(symbol)
        if entry is not None and entry["tile"] != TILE:
            raise library.KernelLibraryError(f"{symbol} was built with tile {entry['tile']} but the binding "
                                             f"expects {TILE}: codegen and runtime disagree")


# k: key tiles, and SCORE_SLACK floats before the score rows; r: rows at a time (the scratch's layout)
TILE = f"h{MAX_HEADS}s{KV_SEGMENT}k{KV_BLOCK}r{ATTENTION_ROWS}"


def scratch_floats(max_keys, head_dim=MAX_HEAD_DIM):
    """SCORE_SLACK floats, the score rows of ATTENTION_ROWS rows, then each row's partial records
    of the segments a row of max_keys keys can span (a window's keys start anywhere in a
    segment: one more)."""
    spans = kv_segments(max_keys) + 1
    rows = ATTENTION_ROWS * MAX_HEADS
    return SCORE_SLACK + rows * KV_SEGMENT + spans * rows * kv_partial_floats(head_dim)


def paged_attention_scratch(max_keys, head_dim=MAX_HEAD_DIM):
    """The scratch one thread passes to every ``attention_paged`` call, for rows that see up
    to ``max_keys`` keys and heads of up to ``head_dim`` (aligned; the reference's size)."""
    if isinstance(max_keys, bool) or not isinstance(max_keys, (int, np.integer)) or max_keys < 1:
        raise ValueError(f"max_keys: expected a positive integer, got {max_keys!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"head_dim: expected a positive integer, got {head_dim!r}")
    return buffers.zeros(scratch_floats(int(max_keys), int(head_dim)))


def partial_shape(m, n_head, head_dim, tables):
    """[m, segments of the tables, n_head, record floats]: what split calls write."""
    return (m, kv_segments(tables.shape[1] * KV_BLOCK), n_head, kv_partial_floats(head_dim))


def attention_partials(m, n_head, head_dim, tables):
    """The partial records split ``attention_paged`` calls write and ``attention_combine`` reads."""
    return buffers.zeros(partial_shape(m, n_head, head_dim, tables))


def _arena_dtype(name, arena, symbols, head_dim):
    """The arena's dtype (it picks the kernel) and the length of its rows."""
    if not isinstance(arena, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(arena).__name__}")
    if arena.dtype not in symbols:
        kinds = ", ".join(ARENA_NAMES[d] for d in symbols)
        raise ValueError(f"{name}: expected dtype {kinds} (an arena type with a kernel), got {arena.dtype}")
    multiple = HEAD_DIM_MULTIPLE.get(arena.dtype, 1)
    if head_dim % multiple:
        raise ValueError(f"{name}: a {ARENA_NAMES[arena.dtype]} arena needs head_dim % {multiple} == 0, "
                         f"got head_dim {head_dim}")
    row = kv_q8_row_bytes(head_dim) if arena.dtype == np.uint8 else head_dim
    return arena.dtype, row


def _arena_address(name, arena, dtype, shape, writable=False):
    """(address, tiles) of an arena [n_blocks, n_kv, KV_BLOCK, row] of ``shape`` (None: any
    n_blocks): each (block, KV head) tile C-contiguous [KV_BLOCK, row], block_tiles tiles
    from one block to the next and head_tiles from one KV head to the next, no two tiles
    overlapping; ``tiles`` = block_tiles << 16 | head_tiles << 40, the kernels' packed
    strides under a 16-bit count (codegen/contract.py ARENA_TILES). So a layer's arena may be a
    view of the pool's buffer, which keeps each (layer, KV head)'s blocks together
    (llambda/serving/kv_pool.py), or of one that keeps block b of every layer together."""
    at = checked_address(name, arena, dtype, shape, writable=writable, ndim=4, contiguous=False)
    n_blocks, n_kv, block, row = arena.shape
    row_bytes = row * dtype.itemsize
    tile = block * row_bytes
    if arena.strides[2:] != (row_bytes, dtype.itemsize):
        raise ValueError(f"{name}: each (block, KV head) tile must be C-contiguous [KV_BLOCK, row] "
                         f"(strides {arena.strides})")

    def tiles_apart(axis, what, count):
        if count == 1:                                   # a lone block's or head's stride is moot
            return 1
        stride = arena.strides[axis]
        if stride <= 0 or stride % tile:
            raise ValueError(f"{name}: {what} {stride} bytes apart, not a positive whole number of "
                             f"tiles ({tile} bytes: KV_BLOCK rows of one KV head)")
        return stride // tile
    head_tiles = tiles_apart(1, "KV heads", n_kv)
    block_tiles = tiles_apart(0, "blocks", n_blocks)
    if block_tiles < n_kv * head_tiles and head_tiles < n_blocks * block_tiles:
        raise ValueError(f"{name}: tiles overlap: blocks {block_tiles} tiles apart and KV heads "
                         f"{head_tiles} (one must step over every tile of the other: >= "
                         f"{n_kv} x {head_tiles} or >= {n_blocks} x {block_tiles})")
    _, block_bits, head_bits = ARENA_TILES
    for what, value, bits in (("blocks", block_tiles, block_bits), ("KV heads", head_tiles, head_bits)):
        if value >> bits:
            raise ValueError(f"{name}: {what} {value} tiles apart, at most {(1 << bits) - 1}")
    return at, block_tiles << ARENA_TILES[0] | head_tiles << (ARENA_TILES[0] + block_bits)


def _packed_low(name, value):
    """``value`` as the 16-bit count under an arena's packed tiles (ARENA_TILES)."""
    if value >> ARENA_TILES[0]:
        raise ValueError(f"{name}: {value}, at most {(1 << ARENA_TILES[0]) - 1}")
    return value


def _step_indices(positions, row_seq, tables, m):
    """Addresses of positions, row_seq [m] and tables [n_tables, max_blocks], all int32."""
    positions_at = checked_address("positions", positions, I32, (m,), align=4)
    row_seq_at = checked_address("row_seq", row_seq, I32, (m,), align=4)
    tables_at = checked_address("tables", tables, I32, ndim=2, align=4)
    return positions_at, row_seq_at, tables_at


def _check_disjoint(written_name, written, others):
    for name, other in others:
        if np.may_share_memory(written, other):
            raise ValueError(f"{written_name}: overlaps {name} (the kernel writes it while reading {name})")


def _non_negative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
    return int(value)


# ---------------------------------------------------------------- kv_store_paged

def kv_store_paged(src, positions, row_seq, tables, arena, heads=None, keys=False):
    """arena[block, h, p % KV_BLOCK, :] = src[i, h, :], p = positions[i],
    block = tables[row_seq[i], p // KV_BLOCK], rows in order (the later wins a shared slot),
    KV heads h in heads=(h0, h1) (default all). src f32 [m, n_kv, head_dim]; positions,
    row_seq int32 [m]; tables int32 [n_tables, max_blocks]; arena [n_blocks, n_kv, KV_BLOCK,
    head_dim]. keys=True: a key arena, each (block, head) a tile [head_dim][KV_BLOCK] of the
    same bytes (runtime/ref/paged.py ``key_tiles``). Index contents are the caller's to keep
    in range (module docstring)."""
    symbol, args = kv_store_paged_call(src, positions, row_seq, tables, arena, heads, keys)
    kernel(symbol)(*args)


def kv_store_paged_call(src, positions, row_seq, tables, arena, heads=None, keys=False):
    src_at = checked_address("src", src, F32, ndim=3)
    m, n_kv, head_dim = src.shape
    positions_at, row_seq_at, tables_at = _step_indices(positions, row_seq, tables, m)
    dtype, row = _arena_dtype("arena", arena, STORE_SYMBOLS, head_dim)
    arena_at, tiles = _arena_address("arena", arena, dtype, (None, n_kv, KV_BLOCK, row), writable=True)
    for name, array in (("src", src), ("positions", positions), ("row_seq", row_seq), ("tables", tables)):
        if np.may_share_memory(array, arena):
            raise ValueError(f"arena: overlaps {name}, which the kernel reads while writing the arena")
    h0, h1 = index_range("heads", heads, n_kv, labels=("h0", "h1"), limit=f"n_kv={n_kv}")
    if not isinstance(keys, bool):
        raise ValueError(f"keys: expected True or False, got {keys!r}")
    if keys and dtype != F32 and head_dim > MAX_KEY_HEAD_DIM:
        raise ValueError(f"src: head_dim {head_dim} is above {MAX_KEY_HEAD_DIM}, the most a "
                         f"{ARENA_NAMES[dtype]} key arena stores (the key store's stack copy of a row)")
    symbols = KEY_STORE_SYMBOLS if keys else STORE_SYMBOLS
    return symbols[dtype], [src_at + F32.itemsize * head_dim * h0, positions_at, row_seq_at, tables_at,
                                  arena_at + arena.strides[1] * h0,
                                  m, h1 - h0, head_dim, _packed_low("src: n_kv", n_kv) | tiles, tables.shape[1]]


# ---------------------------------------------------------------- attention_paged

def attention_paged(q, k_arena, v_arena, positions, row_seq, tables, scale, out, scratch,
                    heads=None, window=0, *, isa=None):
    """out[i, h] = softmax_j(scale * q[i, h] . k_j) @ v_j over the keys row i sees in its
    sequence: j <= p = positions[i], and p - j < window when window > 0;
    kv = h // (n_head // n_kv). q, out f32 [m, n_head, head_dim]; arenas as in
    ``kv_store_paged``; scratch from ``paged_attention_scratch(max_keys)`` with max_keys at
    least max_blocks * KV_BLOCK (or the window); heads=(h0, h1) computes only those query heads
    (out's others untouched). Index contents are the caller's to keep in range."""
    symbol, args = attention_paged_call(q, k_arena, v_arena, positions, row_seq, tables, scale, out, scratch,
                                        heads, window, isa=isa)
    kernel(symbol)(*args)


def _float32_scale(value):
    value = v.finite_float("scale", value)
    if abs(value) > F32_MAX:
        raise ValueError(f"scale: {value!r} overflows float32")
    return value


def most_keys(tables, window):
    """The most keys a row can see: its table's max_blocks * KV_BLOCK, or the window."""
    keys = tables.shape[1] * KV_BLOCK
    return min(keys, window) if window else keys


def attention_paged_call(q, k_arena, v_arena, positions, row_seq, tables, scale, out, scratch,
                         heads=None, window=0, rows=None, partials=None, segments=None, *, isa=None):
    """``rows=(r0, r1)``: only those rows. ``partials`` (from ``attention_partials``) and
    ``segments=(seg0, step)``: a split call, which writes the partial records of the
    segments s = seg0 (mod step) of its rows and heads to ``partials`` (out untouched);
    ``attention_combine`` then merges them into out. The bits are the whole call's."""
    _check_tile()
    q_at = checked_address("q", q, F32, ndim=3)
    m, n_head, head_dim = q.shape
    dtype, row = _arena_dtype("k_arena", k_arena, ATTENTION_SYMBOLS, head_dim)
    if dtype == np.uint8 and head_dim > MAX_Q8_QUERY_HEAD_DIM:
        raise ValueError(f"k_arena: attention over a q8_0 arena needs head_dim <= {MAX_Q8_QUERY_HEAD_DIM} "
                         f"(the kernel's copy of q's quantized rows), got head_dim {head_dim}")
    k_at, tiles = _arena_address("k_arena", k_arena, dtype, None)
    n_blocks, n_kv, block, k_row = k_arena.shape
    if block != KV_BLOCK:
        raise ValueError(f"k_arena: blocks of {block} rows, expected KV_BLOCK = {KV_BLOCK} "
                         f"(shape [n_blocks, n_kv, {KV_BLOCK}, head_dim], got {k_arena.shape})")
    if k_row != row:
        what = f"rows of {k_row} bytes, q8_0 rows of q's head_dim {head_dim} have {row}" if dtype == np.uint8 \
            else f"head_dim {k_row} differs from q's {head_dim}"
        raise ValueError(f"k_arena: {what}")
    v_at, _ = _arena_address("v_arena", v_arena, dtype, k_arena.shape)
    if v_arena.strides != k_arena.strides:
        raise ValueError(f"v_arena: strides {v_arena.strides} differ from k_arena's {k_arena.strides} "
                         "(the kernel steps both by one block stride)")
    if n_head % n_kv:
        raise ValueError(f"k_arena: {n_kv} KV heads do not divide q's {n_head} query heads")
    if n_head >= PACKED_MAX:
        raise ValueError(f"q: {n_head} heads, at most {PACKED_MAX - 1}")
    positions_at, row_seq_at, tables_at = _step_indices(positions, row_seq, tables, m)
    scale = _float32_scale(scale)
    window = _non_negative_int("window", window)
    if window >= tables.shape[1] * KV_BLOCK:
        window = 0                 # no row of these tables can look back that far: unlimited
    if window >= MAX_EXACT_WINDOW:
        raise ValueError(f"window: {window} is not below {MAX_EXACT_WINDOW} (the kernel receives it as a float32)")
    out_at = checked_address("out", out, F32, q.shape, writable=True)
    scratch_at = checked_address("scratch", scratch, F32, ndim=1, writable=True)
    need = scratch_floats(most_keys(tables, window), head_dim)
    if scratch.size < need:
        raise ValueError(f"scratch: {scratch.size} floats, need {need} for rows seeing up to "
                         f"{most_keys(tables, window)} keys (tables' {tables.shape[1]} blocks of {KV_BLOCK}"
                         f"{f', window {window}' if window else ''}) at head_dim {head_dim}; "
                         "allocate it with paged_attention_scratch(max_keys, head_dim)")
    h0, h1 = index_range("heads", heads, n_head, labels=("h0", "h1"), limit=f"n_head={n_head}")
    r0, r1 = index_range("rows", rows, m, labels=("r0", "r1"))
    if r1 == r0:
        raise ValueError(f"rows: ({r0}, {r1}) is empty")
    if tables.shape[1] >= PACKED_MAX:
        raise ValueError(f"tables: {tables.shape[1]} blocks per table, at most {PACKED_MAX - 1}")
    inputs = [("q", q), ("k_arena", k_arena), ("v_arena", v_arena), ("positions", positions),
              ("row_seq", row_seq), ("tables", tables)]
    _check_disjoint("out", out, inputs + [("scratch", scratch)])
    _check_disjoint("scratch", scratch, inputs)
    group = n_head // n_kv
    dest_at = out_at + out.strides[0] * r0
    packed_segments = 0
    if (partials is None) != (segments is None):
        raise ValueError("partials, segments: give both (a split call) or neither")
    if partials is not None:
        shape = partial_shape(m, n_head, head_dim, tables)
        partials_at = checked_address("partials", partials, F32, shape, writable=True)
        _check_disjoint("partials", partials, inputs + [("scratch", scratch), ("out", out)])
        seg0, step = segments
        step = _non_negative_int("segments step", step)
        seg0 = _non_negative_int("segments seg0", seg0)
        if not 0 < step < PACKED_MAX or seg0 >= step:
            raise ValueError(f"segments: expected (seg0, step) with 0 <= seg0 < step, got {segments!r}")
        packed_segments = seg0 | step << 32
        dest_at = partials_at + partials.strides[0] * r0
    packed_head_dim = _packed_low("q: head_dim", head_dim) | tiles
    return attention_symbol(dtype, attention_isa(head_dim, isa, dtype)), [q_at + q.strides[0] * r0, k_at, v_at, dest_at, scratch_at,
                                      positions_at + I32.itemsize * r0, row_seq_at + I32.itemsize * r0,
                                      tables_at, (r1 - r0) | tables.shape[1] << 32, packed_head_dim,
                                      n_kv | group << 32, h0 | h1 << 32, packed_segments,
                                      scale, float(window)]


def attention_combine(partials, positions, tables, out, heads=None, window=0):
    """out[i, h] for heads=(h0, h1) from the partial records split ``attention_paged`` calls
    wrote for every segment of row i (same positions, tables, window)."""
    symbol, args = attention_combine_call(partials, positions, tables, out, heads, window)
    kernel(symbol)(*args)


def attention_combine_call(partials, positions, tables, out, heads=None, window=0, rows=None):
    out_at = checked_address("out", out, F32, ndim=3, writable=True)
    m, n_head, head_dim = out.shape
    positions_at = checked_address("positions", positions, I32, (m,), align=4)
    tables_at = checked_address("tables", tables, I32, ndim=2, align=4)
    del tables_at
    partials_at = checked_address("partials", partials, F32, partial_shape(m, n_head, head_dim, tables))
    _check_disjoint("out", out, [("partials", partials), ("positions", positions)])
    window = _non_negative_int("window", window)
    if window >= tables.shape[1] * KV_BLOCK:
        window = 0
    if window >= MAX_EXACT_WINDOW:
        raise ValueError(f"window: {window} is not below {MAX_EXACT_WINDOW} (the kernel receives it as a float32)")
    h0, h1 = index_range("heads", heads, n_head, labels=("h0", "h1"), limit=f"n_head={n_head}")
    r0, r1 = index_range("rows", rows, m, labels=("r0", "r1"))
    return COMBINE_SYMBOL, [partials_at + partials.strides[0] * r0, out_at + out.strides[0] * r0,
                            positions_at + I32.itemsize * r0, r1 - r0, head_dim, n_head, tables.shape[1],
                            h0 | h1 << 32, float(window)]


# ---------------------------------------------------------------- gather_rows

def gather_rows(src, rows, out):
    """out[r] = src[rows[r]] for r < len(rows). src f32 [m, d]; rows int32 [h] (read when the
    op runs, each < m: the caller's to keep); out f32 [h, d]."""
    symbol, args = gather_rows_call(src, rows, out)
    kernel(symbol)(*args)


def gather_rows_call(src, rows, out, part=None):
    """``part=(r0, r1)``: only out rows r0..r1-1 (a thread's share)."""
    src_at = checked_address("src", src, F32, ndim=2)
    d = src.shape[1]
    rows_at = checked_address("rows", rows, I32, ndim=1, align=4)
    n = rows.shape[0]
    out_at = checked_address("out", out, F32, (n, d), writable=True)
    _check_disjoint("out", out, [("src", src), ("rows", rows)])
    r0, r1 = index_range("part", part, n, labels=("r0", "r1"))
    return GATHER_SYMBOL, [src_at, rows_at + I32.itemsize * r0, out_at + F32.itemsize * d * r0, r1 - r0, d]
