"""Quantized weight layouts: GGUF Q4_0 / Q4_1 / Q8_0 rows interleaved for the int8 kernels.

GGUF stores a weight ``W[n, k]`` row by row, each row a run of 32-weight
blocks. The kernels (codegen/qgemm.py) compute eight output rows at once: one
32-byte load must hold four quant bytes of each of eight rows, so that a
broadcast of four activation bytes and one ``vpmaddubsw`` + ``vpmaddwd``
leave one int32 lane per row. So rows are taken in groups of ``GROUP = 8``
(the last group padded with zero rows) and each block's quant bytes are
interleaved at 4-byte granularity::

    kind q4_1 (from Q4_1, and Q4_0 as Q4_1 with m = -8 d)
      qs  uint8   [groups, k/32, 4 chunks, 8 rows, 4 bytes]   GGUF nibble bytes, unchanged
      dm  float16 [groups, k/32, 2, 8 rows]                   d then m of each row's block
    kind q8_0
      qs  int8    [groups, k/32, 8 chunks, 8 rows, 4 bytes]
      d   float16 [groups, k/32, 8 rows]

A GGUF Q4 byte j holds weights j (low nibble) and j + 16 (high nibble), so
chunk c of a q4_1 block carries weights 4c..4c+3 and 16+4c..16+4c+3 of each
row. Nibbles stay unsigned (0..15): the weight is ``d * q + m``, and Q4_0's
``d * (q - 8)`` is the same with ``m = -8 d`` (exact in float16: a power-of-two
multiple), so one kernel serves both.

Scales stay float16, as in GGUF: a q4_1 block costs 20 bytes for 32 weights
(0.625 byte/weight) instead of 24 with float32 scales, 20% less to stream in
the memory-bound decode GEMV; the kernels widen them with ``vcvtph2ps``.
d and m share one array so that the kernel walks two streams, not three.
"""
import numpy as np

from . import buffers
from .layouts import Layout, PackedWeight, register
from .ref.gguf_blocks import checked_rows

from ..codegen.contract import BLOCK, CHUNK, GROUP
Q4_BYTES = BLOCK // 2       # quant bytes of a Q4 block (two nibbles a byte)

# GGUF block layouts: (bytes per block, f16 scale fields in front of the quants)
GGUF_BLOCKS = {"Q4_0": (2 + Q4_BYTES, 1), "Q4_1": (4 + Q4_BYTES, 2), "Q8_0": (2 + BLOCK, 1)}


def _check_shape(type_name, raw, n, k):
    """``raw`` as uint8 [n, k/32, block bytes]; a clear error for anything else."""
    return checked_rows(type_name, raw, n, k, BLOCK, GGUF_BLOCKS[type_name][0])


def _groups(n):
    return -(-n // GROUP)


def _split_blocks(type_name, blocks):
    """GGUF blocks [n, k/32, bytes] -> (scales f16 [n, k/32, fields], quant bytes [n, k/32, q])."""
    _, fields = GGUF_BLOCKS[type_name]
    scales = np.ascontiguousarray(blocks[..., :2 * fields]).view(np.float16)
    return scales, blocks[..., 2 * fields:]


def _interleave(quants, n, chunks):
    """Quant bytes [n, kb, chunks*4] -> [groups, kb, chunks, 8, 4] with zero padding rows."""
    kb = quants.shape[1]
    padded = np.zeros((_groups(n) * GROUP, kb, chunks * CHUNK), np.uint8)
    padded[:n] = quants
    by_row = padded.reshape(_groups(n), GROUP, kb, chunks, CHUNK)
    out = buffers.empty((_groups(n), kb, chunks, GROUP, CHUNK), np.uint8)
    out[...] = by_row.transpose(0, 2, 3, 1, 4)
    return out


def _by_group(per_row, n):
    """Per-row block values [n, kb, ...] -> [groups, kb, ..., 8], zero-padded."""
    kb = per_row.shape[1]
    padded = np.zeros((_groups(n) * GROUP,) + per_row.shape[1:], per_row.dtype)
    padded[:n] = per_row
    grouped = padded.reshape((_groups(n), GROUP, kb) + per_row.shape[2:])
    return np.moveaxis(grouped, 1, -1)


# --------------------------------------------------------------------------- q4_1

def pack_q4(type_name, raw, n, k):
    blocks = _check_shape(type_name, raw, n, k)
    scales, quants = _split_blocks(type_name, blocks)
    d = scales[..., 0]
    if type_name == "Q4_0":
        if np.any(np.abs(d.astype(np.float32)) > np.float32(np.finfo(np.float16).max / 8)):
            raise ValueError("Q4_0: a block scale is too large to express its offset -8*d in float16")
        m = d * np.float16(-8)
    else:
        m = scales[..., 1]
    dm = buffers.empty((_groups(n), k // BLOCK, 2, GROUP), np.float16)
    dm[:, :, 0] = _by_group(d, n)
    dm[:, :, 1] = _by_group(m, n)
    return PackedWeight("q4_1", n, k, dict(qs=_interleave(quants, n, Q4_BYTES // CHUNK), dm=dm),
                        dict(group=GROUP, source=type_name))


def _q4_rows(w, ids):
    """Nibbles, d and m of rows ``ids``: ([len, kb, 32] uint8, [len, kb, 1] f32 twice)."""
    groups, rows = np.divmod(ids, GROUP)
    packed = w.arrays["qs"][groups, :, :, rows, :]            # [len, kb, chunk, 4]
    packed = packed.reshape(len(ids), -1, Q4_BYTES)             # GGUF byte order within a block
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    dm = w.arrays["dm"][groups, :, :, rows].astype(np.float32)  # [len, kb, 2]
    return q, dm[..., 0:1], dm[..., 1:2]


def rows_q4(w, ids):
    ids = _checked_ids(w, ids)
    q, d, m = _q4_rows(w, ids)
    return (d * q.astype(np.float32) + m).reshape(len(ids), w.k)


# --------------------------------------------------------------------------- q8_0

def pack_q8(type_name, raw, n, k):
    blocks = _check_shape(type_name, raw, n, k)
    scales, quants = _split_blocks(type_name, blocks)
    d = buffers.empty((_groups(n), k // BLOCK, GROUP), np.float16)
    d[...] = _by_group(scales[..., 0], n)
    qs = _interleave(quants, n, BLOCK // CHUNK).view(np.int8)
    return PackedWeight("q8_0", n, k, dict(qs=qs, d=d), dict(group=GROUP, source=type_name))


def rows_q8(w, ids):
    ids = _checked_ids(w, ids)
    groups, rows = np.divmod(ids, GROUP)
    q = w.arrays["qs"][groups, :, :, rows, :].reshape(len(ids), -1, BLOCK)
    d = w.arrays["d"][groups, :, rows].astype(np.float32)[..., None]
    return (q.astype(np.float32) * d).reshape(len(ids), w.k)


# --------------------------------------------------------------------------- both

def _checked_ids(w, ids):
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= w.n):
        raise ValueError(f"ids: row indices must be integers in [0, {w.n}), got {ids}")
    return ids.astype(np.int64)


def _dequantize_with(rows):
    def dequantize(w):
        return rows(w, np.arange(w.n))
    return dequantize


register(Layout("q4_1", ("Q4_0", "Q4_1"), pack_q4, _dequantize_with(rows_q4), rows_q4))
register(Layout("q8_0", ("Q8_0",), pack_q8, _dequantize_with(rows_q8), rows_q8))
