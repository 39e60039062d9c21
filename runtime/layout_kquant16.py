"""K-quant layouts with 16-weight sub-blocks: GGUF Q6_K / Q3_K / Q2_K repacked for the int8 kernels.

The kernels (codegen/qgemm_k16.py) take a weight's 32-weight blocks one at a
time against one Q8 activation block, eight rows at once, as the Q4/Q8
kernels do: "chunk" c of a block is its weights 4c..4c+3, and one 32-byte
vector of a chunk holds those 4 weights of each of the 8 rows of a group (one
unsigned byte each), so a broadcast of 4 activation bytes and one
``vpmaddubsw`` serve all 8 rows. Chunks 0-3 are the block's first 16-weight
sub-block, chunks 4-7 its second. The quants are packed into "planes" of 32
bytes from which the kernel recovers the chunks with a few shifts and masks;
nothing is wider than GGUF's own bits:

    kind q6_k (Q6_K, w = (d sc) (q - 32), q 0..63)           bytes / 256 weights: 210 (GGUF: 210)
      qs  uint8   [groups, k/32, 2 halves, 3 planes, 8 rows, 4]  plane p of half h: bits 0-5 =
                  chunk 4h + p's q, bits 6-7 = bits 2p, 2p+1 of chunk 4h + 3's q
      sc  int8    [groups, k/32, 8 rows, 2 halves]               GGUF's sub-block scales
      d   float16 [groups, k/256, 8 rows]
    kind q3_k (Q3_K, w = (d (sc - 32)) (q - 4), q 0..7)      bytes / 256 weights: 114 (GGUF: 110)
      qs  uint8   [groups, k/32, 3 planes, 8 rows, 4]            plane p: bits 0-2 = chunk 2p,
                  bits 4-6 = chunk 2p + 1, bit 3 / bit 7 = bit p of chunk 6 / chunk 7
      sc  int8    [groups, k/32, 8 rows, 2 halves]               sc - 32 (GGUF packs 6 bits)
      d   float16 [groups, k/256, 8 rows]
    kind q2_k (Q2_K, w = (d sc) q - dmin m, q 0..3)          bytes / 256 weights: 84 (GGUF: 84)
      qs  uint8   [groups, k/32, 2 planes, 8 rows, 4]            plane p: bits 2j.. = chunk 4p + j
      sm  uint8   [groups, k/32, 8 rows, 2 halves]               sc | m << 4, GGUF's bytes
      dm  float16 [groups, k/256, 2, 8 rows]                     d then dmin

The quants stay unsigned: the kernel subtracts Q6_K's 32 and Q3_K's 4 (times
the activations) in its int16 sums. Q3_K's scales take a byte each instead of
GGUF's 6 bits, so the kernel reads them without unpacking (the only growth,
3.6%). ``rows`` recomputes each weight with the same f32 operations as
gguf's dequantization: ``dequantize(pack(raw))`` is bit-equal to it.
"""
import numpy as np

from . import buffers
from .layouts import Layout, PackedWeight, register
from .layout_quant import _by_group, _checked_ids, _dequantize_with, _groups
from .ref import kquants16 as ref
from ..codegen.contract import BLOCK, CHUNK, GROUP, QUANT_ARRAYS, SUPER_BLOCK

CHUNKS = BLOCK // CHUNK                  # 8 chunks of 4 weights a block
BLOCKS_PER_SUPER = SUPER_BLOCK // BLOCK


def _chunks_by_group(q, n):
    """q uint8 [n, k/256, 256] -> [groups, k/32, 8 chunks, 8 rows, 4] (zero-padded rows)."""
    kb = q.shape[1] * BLOCKS_PER_SUPER
    padded = np.zeros((_groups(n) * GROUP, kb, CHUNKS, CHUNK), np.uint8)
    padded[:n] = q.reshape(n, kb, CHUNKS, CHUNK)
    return padded.reshape(_groups(n), GROUP, kb, CHUNKS, CHUNK).transpose(0, 2, 3, 1, 4)


def _row_chunks(w, ids, unpack):
    """The chunks of rows ``ids`` from the packed planes: q uint8 [len, k/32, 8, 4]."""
    groups, rows = np.divmod(ids, GROUP)
    planes = w.arrays["qs"][groups]                        # [len, kb, ..., 8 rows, 4]
    planes = np.take_along_axis(planes, rows.reshape((-1,) + (1,) * (planes.ndim - 1)),
                                axis=planes.ndim - 2)[..., 0, :]
    return unpack(planes)


def _sub_scales(w, name, ids):
    """Per-row sub-block scale bytes [len, k/16] of rows ``ids``."""
    groups, rows = np.divmod(ids, GROUP)
    return w.arrays[name][groups, :, rows, :].reshape(len(ids), -1)


def _super_scales(w, name, ids, field=None):
    groups, rows = np.divmod(ids, GROUP)
    a = w.arrays[name]
    values = a[groups, :, rows] if field is None else a[groups, :, field, rows]
    return values.astype(np.float32)                      # [len, k/256]


def _per_sub(values):
    """[len, k/256] super-block values -> [len, k/16] (one per sub-block)."""
    return np.repeat(values, SUPER_BLOCK // 16, axis=1)


def _layout_arrays(kind, qs, scales, supers):
    """The packed arrays of ``kind``, named and typed as contract.QUANT_ARRAYS says, 64-byte aligned."""
    arrays = {}
    for spec, values in zip(QUANT_ARRAYS[kind], (qs, scales, supers)):
        arrays[spec.name] = buffers.empty(values.shape, spec.dtype)
        arrays[spec.name][...] = values
    return arrays


def _scales_by_group(per_row, n):
    """[n, k/16] per-row sub-block scales -> [groups, k/32, 8 rows, 2 halves]."""
    kb = per_row.shape[1] // 2
    return np.swapaxes(_by_group(per_row.reshape(n, kb, 2), n), -1, -2)


def _weights(q, offset, dl, ml=None):
    """(dl * (q - offset)) [- ml] per sub-block of 16, in the reference's f32 operations."""
    count = len(q)
    qf = q.reshape(count, -1, 16).astype(np.float32)
    if offset:
        qf = qf - np.float32(offset)
    w = dl[..., None] * qf
    if ml is not None:
        w = w - ml[..., None]
    return w.reshape(count, -1)


# --------------------------------------------------------------------------- q6_k

def pack_q6_k(type_name, raw, n, k):
    q, sc, d = ref.decode_q6_k(ref.super_blocks(type_name, raw, n, k))
    c = _chunks_by_group(q, n)                                     # [G, kb, 8, 8, 4]
    halves = c.reshape(c.shape[:2] + (2, 4) + c.shape[3:])         # [G, kb, half, 4 chunks, 8, 4]
    last = halves[:, :, :, 3:4]
    shifts = np.array([0, 2, 4], np.uint8).reshape(3, 1, 1)
    qs = halves[:, :, :, :3] | (((last >> shifts) & 3) << 6)
    scales = _scales_by_group(sc.reshape(n, -1), n)
    d_grouped = _by_group(d, n)
    return PackedWeight("q6_k", n, k, _layout_arrays("q6_k", qs, scales, d_grouped),
                        dict(group=GROUP, source=type_name))


def _unpack_q6_k(planes):
    """[..., 2, 3, 4] planes -> [..., 8 chunks, 4] q."""
    low = planes & 0x3F
    top = planes >> 6
    last = top[..., 0:1, :] | (top[..., 1:2, :] << 2) | (top[..., 2:3, :] << 4)
    chunks = np.concatenate([low, last], axis=-2)                  # [..., 2, 4, 4]
    return chunks.reshape(chunks.shape[:-3] + (CHUNKS, CHUNK))


def _offset_rows(unpack, offset):
    """The ``rows`` of a kind whose weights are d * sc * (q - offset) (Q6_K, Q3_K)."""
    def rows(w, ids):
        ids = _checked_ids(w, ids)
        q = _row_chunks(w, ids, unpack).reshape(len(ids), -1)
        dl = _per_sub(_super_scales(w, "d", ids)) * _sub_scales(w, "sc", ids).astype(np.float32)
        return _weights(q, offset, dl)
    return rows


rows_q6_k = _offset_rows(_unpack_q6_k, 32)


# --------------------------------------------------------------------------- q3_k

def pack_q3_k(type_name, raw, n, k):
    q, sc, d = ref.decode_q3_k(ref.super_blocks(type_name, raw, n, k))
    c = _chunks_by_group(q, n)                                     # [G, kb, 8, 8, 4]
    p = np.arange(3, dtype=np.uint8).reshape(3, 1, 1)
    qs = (c[:, :, 0:6:2] | (c[:, :, 1:6:2] << 4) | (((c[:, :, 6:7] >> p) & 1) << 3)
          | (((c[:, :, 7:8] >> p) & 1) << 7))
    scales = _scales_by_group((sc.astype(np.int16) - 32).astype(np.int8).reshape(n, -1), n)
    return PackedWeight("q3_k", n, k, _layout_arrays("q3_k", qs, scales, _by_group(d, n)),
                        dict(group=GROUP, source=type_name))


def _unpack_q3_k(planes):
    """[..., 3, 4] planes -> [..., 8 chunks, 4] q."""
    low, high = planes & 7, (planes >> 4) & 7
    p = np.arange(3, dtype=np.uint8).reshape(3, 1)
    six = (((planes >> 3) & 1) << p).sum(axis=-2, keepdims=True, dtype=np.uint8)
    seven = (((planes >> 7) & 1) << p).sum(axis=-2, keepdims=True, dtype=np.uint8)
    pairs = np.stack([low, high], axis=-2).reshape(planes.shape[:-2] + (6, CHUNK))
    return np.concatenate([pairs, six, seven], axis=-2)


rows_q3_k = _offset_rows(_unpack_q3_k, 4)          # sc is stored as sc - 32


# --------------------------------------------------------------------------- q2_k

def pack_q2_k(type_name, raw, n, k):
    q, scales, d, dmin = ref.decode_q2_k(ref.super_blocks(type_name, raw, n, k))
    c = _chunks_by_group(q, n)                                     # [G, kb, 8, 8, 4]
    quads = c.reshape(c.shape[:2] + (2, 4) + c.shape[3:])          # [G, kb, plane, j, 8, 4]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    qs = (quads << shifts).sum(axis=3, dtype=np.uint8)
    dm = _by_group(np.stack([d, dmin], axis=-1), n)                # [G, sb, 2, 8]
    arrays = _layout_arrays("q2_k", qs, _scales_by_group(scales.reshape(n, -1), n), dm)
    return PackedWeight("q2_k", n, k, arrays,
                        dict(group=GROUP, source=type_name))


def _unpack_q2_k(planes):
    """[..., 2, 4] planes -> [..., 8 chunks, 4] q."""
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    chunks = (planes[..., None, :] >> shifts) & 3                  # [..., 2, 4, 4]
    return chunks.reshape(planes.shape[:-2] + (CHUNKS, CHUNK))


def rows_q2_k(w, ids):
    ids = _checked_ids(w, ids)
    q = _row_chunks(w, ids, _unpack_q2_k).reshape(len(ids), -1)
    sm = _sub_scales(w, "sm", ids)
    dl = _per_sub(_super_scales(w, "dm", ids, 0)) * (sm & 0x0F).astype(np.float32)
    ml = _per_sub(_super_scales(w, "dm", ids, 1)) * (sm >> 4).astype(np.float32)
    return _weights(q, 0, dl, ml)


register(Layout("q6_k", ("Q6_K",), pack_q6_k, _dequantize_with(rows_q6_k), rows_q6_k))
register(Layout("q3_k", ("Q3_K",), pack_q3_k, _dequantize_with(rows_q3_k), rows_q3_k))
register(Layout("q2_k", ("Q2_K",), pack_q2_k, _dequantize_with(rows_q2_k), rows_q2_k))
