"""numpy reference: the paged KV cache's ops (what runtime/native/paged.py's kernels must match).

The cache of one layer is an arena of fixed-size blocks, ``[n_blocks, n_kv_head, KV_BLOCK,
head_dim]``. Every row i of a step belongs to one sequence: ``row_seq[i]`` picks its block
table, ``tables[row_seq[i]]`` (int32 block indices), and ``positions[i]`` is the row's absolute
position in that sequence. Key j of a sequence lives in block ``tables[s, j // KV_BLOCK]`` at
row ``j % KV_BLOCK``. Positions, row_seq and tables are read when the op runs (a plan records
their addresses), so one recorded plan serves any mix of sequences and positions; the caller
(llambda/serving/kv_pool.py) guarantees every index is in range.

Arenas are float32 or float16 (stored values rounded to the arena's type), or q8_0: uint8
rows of int8 quants and f32 scales (codegen/contract.py ``kv_q8_row_bytes``), quantized by
``quantize_kv_q8`` on store and read as ``dequantize_kv_q8``.
"""
import numpy as np

from ...codegen.contract import ATTENTION_ROWS, KV_BLOCK, KV_Q8_BLOCK, KV_SEGMENT, kv_partial_floats, kv_segments

__all__ = ["kv_store_paged", "attention_paged", "paged_attention_scratch", "gather_rows"]
# quantize_kv_q8 / dequantize_kv_q8 / key_tiles / key_rows are module functions (not ops): the
# layouts' definition.

MAX_HEADS = 3          # query heads sharing a KV head done together (the kernel's tile)
SCORE_SLACK = KV_BLOCK # floats before the kernel's score rows
LANES = 16


def paged_attention_scratch(max_keys, head_dim=256):
    """The scratch one thread passes to every ``attention_paged`` call, for rows that see up to
    ``max_keys`` keys with heads of up to ``head_dim``: the kernels' score rows of a segment and
    the partial records of the segments a row can span (codegen/contract.py KV_SEGMENT)."""
    for name, value in (("max_keys", max_keys), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    spans = kv_segments(int(max_keys)) + 1
    rows = ATTENTION_ROWS * MAX_HEADS
    return np.zeros(SCORE_SLACK + rows * KV_SEGMENT + spans * rows * kv_partial_floats(int(head_dim)), np.float32)


def quantize_kv_q8(x):
    """f32 [..., head_dim] (head_dim % 32 == 0) -> uint8 q8_0 rows [..., kv_q8_row_bytes(head_dim)]:
    per block of 32, d = max|x| / 127 and q = rint(x * (1 / d)) in float32 (0 where d = 0)."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    blocks = x.reshape(lead + (-1, KV_Q8_BLOCK))
    d = np.abs(blocks).max(-1) / np.float32(127)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0))
    q = np.clip(np.rint(blocks * inverse[..., None].astype(np.float32)), -127, 127).astype(np.int8)
    quants = q.reshape(lead + (-1,)).view(np.uint8)
    scales = np.ascontiguousarray(d.astype(np.float32)).view(np.uint8).reshape(lead + (-1,))
    return np.concatenate([quants, scales], axis=-1)


def dequantize_kv_q8(rows, head_dim):
    """uint8 q8_0 rows [..., kv_q8_row_bytes(head_dim)] -> f32 [..., head_dim]: d * q in float32."""
    rows = np.ascontiguousarray(rows)
    q = rows[..., :head_dim].view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(rows[..., head_dim:]).view(np.float32)
    return (q.reshape(q.shape[:-1] + (-1, KV_Q8_BLOCK)) * d[..., None]).reshape(q.shape)


def quantized(x):
    """x's values as its q8_0 rows hold them: the queries q8_0 attention scores with."""
    return dequantize_kv_q8(quantize_kv_q8(x), np.shape(x)[-1])


def _slot(tables, row_seq, positions, i):
    p = int(positions[i])
    return int(tables[int(row_seq[i]), p // KV_BLOCK]), p % KV_BLOCK


def key_tiles(arena, head_dim=None):
    """A key arena from an arena of rows (same shape, dtype and bytes per (block, head)):
    each (block, KV head) becomes a tile [head_dim][KV_BLOCK], key j of the block in lane j;
    for q8_0 the quants so, then the scales as [head_dim / 32][KV_BLOCK] f32. The scores
    kernel then has the block's keys in the lanes of a vector (codegen/paged/)."""
    nb, n_kv, block, row = arena.shape
    if arena.dtype != np.uint8:
        return np.ascontiguousarray(arena.transpose(0, 1, 3, 2)).reshape(arena.shape)
    head_dim = head_dim or row * 8 // 9             # q8_0 rows: head_dim quants + head_dim / 8 scale bytes
    quants = np.ascontiguousarray(arena[..., :head_dim].transpose(0, 1, 3, 2)).reshape(nb, n_kv, -1)
    scales = np.ascontiguousarray(np.ascontiguousarray(arena[..., head_dim:]).view(np.float32)
                                  .transpose(0, 1, 3, 2)).view(np.uint8).reshape(nb, n_kv, -1)
    return np.concatenate([quants, scales], axis=-1).reshape(arena.shape)


def key_rows(arena, head_dim):
    """The arena of rows a key arena holds (``key_tiles`` undone)."""
    nb, n_kv, block, row = arena.shape
    if arena.dtype != np.uint8:
        return np.ascontiguousarray(arena.reshape(nb, n_kv, row, block).transpose(0, 1, 3, 2))
    flat = np.ascontiguousarray(arena).reshape(nb, n_kv, -1)
    quants = flat[..., :head_dim * block].reshape(nb, n_kv, head_dim, block).transpose(0, 1, 3, 2)
    scales = (np.ascontiguousarray(flat[..., head_dim * block:]).view(np.float32)
              .reshape(nb, n_kv, -1, block).transpose(0, 1, 3, 2))
    return np.concatenate([quants, np.ascontiguousarray(scales).view(np.uint8)], axis=-1)


def kv_store_paged(src, positions, row_seq, tables, arena, heads=None, keys=False):
    """arena[block, h, p % KV_BLOCK, :] = src[i, h, :] with p = positions[i] and
    block = tables[row_seq[i], p // KV_BLOCK], for rows i in order (the later wins a shared
    slot) and KV heads h in heads=(h0, h1), default all; keys=True: a key arena (``key_tiles``).

    src f32 [m, n_kv, head_dim]; positions, row_seq int32 [m]; tables int32 [n_tables, max_blocks];
    arena f32 or f16 [n_blocks, n_kv, KV_BLOCK, head_dim]."""
    if keys:
        rows = key_rows(arena, src.shape[-1])
        kv_store_paged(src, positions, row_seq, tables, rows, heads)
        arena[...] = key_tiles(rows, src.shape[-1])
        return
    h0, h1 = heads if heads is not None else (0, src.shape[1])
    for i in range(src.shape[0]):
        block, row = _slot(tables, row_seq, positions, i)
        if arena.dtype == np.uint8:
            arena[block, h0:h1, row, :] = quantize_kv_q8(src[i, h0:h1, :])
        else:
            arena[block, h0:h1, row, :] = src[i, h0:h1, :]


def attention_paged(q, k_arena, v_arena, positions, row_seq, tables, scale, out, scratch,
                    heads=None, window=0):
    """out[i, h] = sum_j p_j v_j, p = softmax_j(scale * q[i, h] . k_j), over the keys row i at
    position p = positions[i] sees in its sequence (tables[row_seq[i]]): j <= p, and
    p - j < window when window > 0; kv = h // (n_head // n_kv_head). In float64, from the math.

    q, out f32 [m, n_head, head_dim]; arenas as in ``kv_store_paged``, k_arena a key arena
    (``key_tiles``); heads=(h0, h1) computes
    only those query heads; scratch (from ``paged_attention_scratch``) is unused here.

    Over q8_0 arenas each head of q scores as its q8_0 row (``quantize_kv_q8``, dequantized),
    as the kernels compute int8 dot products."""
    m, n_head, _ = q.shape
    if k_arena.dtype == np.uint8:
        q = quantized(q)
    group = n_head // k_arena.shape[1]
    k_arena = key_rows(k_arena, q.shape[-1])
    h0, h1 = heads if heads is not None else (0, n_head)
    for i in range(m):
        p, seq = int(positions[i]), int(row_seq[i])
        first = max(0, p - window + 1) if window else 0
        keys = np.arange(first, p + 1)
        blocks = tables[seq, keys // KV_BLOCK]
        rows = keys % KV_BLOCK
        for h in range(h0, h1):
            kv = h // group
            k, v = k_arena[blocks, kv, rows], v_arena[blocks, kv, rows]
            if k_arena.dtype == np.uint8:
                k, v = dequantize_kv_q8(k, q.shape[-1]), dequantize_kv_q8(v, q.shape[-1])
            k, v = k.astype(np.float64), v.astype(np.float64)
            s = scale * (k @ q[i, h].astype(np.float64))
            e = np.exp(s - s.max())
            out[i, h] = (e / e.sum()) @ v


def gather_rows(src, rows, out):
    """out[r] = src[rows[r]] for r < len(rows): the step rows whose logits are wanted, gathered
    for the LM head. src f32 [m, d]; rows int32 [h] (read when the op runs, each < m); out f32 [h, d]."""
    out[:] = src[rows]
