"""Q5_0 / Q5_1 layouts: five-bit weights packed densely for the int8 kernels.

As for q4_1 (layout_quant.py), rows go in groups of 8 and every 32-byte load
of a block holds 4 bytes of each row, so one activation broadcast and one
``vpmaddubsw`` / ``vpdpbusd`` serve eight rows. GGUF's own form (nibbles plus a
32-bit word of fifth bits) would cost the kernel a shift, an AND and an OR per
32 weights to move each fifth bit into place; instead a block's 32 five-bit
quants q[0..31] of a row are repacked into 20 bytes, in 5 chunks of 4::

    chunk c < 4, byte i:  q[4c + i]                     in bits 0-4
                          q[16 + 4c + i] >> 2           in bits 5-7
    chunk 4, byte i:      (q[16 + 4c + i] & 3) << 2c    for c = 0..3

so the kernel unpacks the 8 vectors of a block as ``B_c & 31`` (weights
4c..4c+3) and ``((B_c >> 3) & 28) | ((B_4 >> 2c) & 3)`` (weights 16+4c..):
23 simple operations per 256 weights, no lookups. (A 16-bit shift of B_c
drags bits of the next byte into bits 5-7; the masks drop them.) Bytes per
weight stay GGUF's::

    kind q5_0 (from Q5_0: weight d * (q - 16))
      qs  uint8   [groups, k/32, 5 chunks, 8 rows, 4 bytes]
      d   float16 [groups, k/32, 8 rows]                22 bytes per 32 weights
    kind q5_1 (from Q5_1: weight d * q + m)
      qs  uint8   [groups, k/32, 5 chunks, 8 rows, 4 bytes]
      dm  float16 [groups, k/32, 2, 8 rows]             24 bytes per 32 weights

Quants stay unsigned (0..31): the kernel adds the offset through the
activation block sums, with m = -16 d for q5_0 formed in f32 inside the kernel
(so no f16 overflow to refuse, and no bytes spent on it).
"""
import numpy as np

from . import buffers
from .layouts import Layout, PackedWeight, register
from .layout_quant import _by_group, _checked_ids, _dequantize_with, _groups, _interleave
from .ref.gguf_blocks import Q5_BLOCK_BYTES, checked_rows, q5_quants

from ..codegen.contract import BLOCK, CHUNK, GROUP, QUANT_ARRAYS

HALF = BLOCK // 2
CHUNKS = len(range(0, HALF, CHUNK))          # 4 chunks of the first half (and of the second)
PACKED_CHUNKS = CHUNKS + 1                   # + the chunk of low bits of the second half


def _check_raw(type_name, raw, n, k):
    return checked_rows(type_name, raw, n, k, BLOCK, Q5_BLOCK_BYTES[type_name]).reshape(-1)


def packed_quants(q):
    """q uint8 [..., 32] (0..31) -> the 20 packed bytes [..., 5 chunks * 4] (see the module doc)."""
    first = q[..., :HALF].reshape(q.shape[:-1] + (CHUNKS, CHUNK))
    second = q[..., HALF:].reshape(q.shape[:-1] + (CHUNKS, CHUNK))
    main = first | ((second >> 2) << 5)
    shifts = (2 * np.arange(CHUNKS, dtype=np.uint8))[:, None]
    low_bits = np.bitwise_or.reduce((second & 3) << shifts, axis=-2)
    return np.concatenate([main.reshape(q.shape[:-1] + (HALF,)), low_bits], axis=-1).astype(np.uint8)


def unpacked_quants(packed):
    """The inverse of packed_quants: [..., 20] -> q [..., 32]."""
    main = packed[..., :HALF].reshape(packed.shape[:-1] + (CHUNKS, CHUNK))
    low_bits = packed[..., None, HALF:]
    shifts = (2 * np.arange(CHUNKS, dtype=np.uint8))[:, None]
    first = main & 0x1F
    second = ((main >> 5) << 2) | ((low_bits >> shifts) & 3)
    shape = packed.shape[:-1] + (HALF,)
    return np.concatenate([first.reshape(shape), second.reshape(shape)], axis=-1)


def pack_q5(type_name, raw, n, k):
    raw = _check_raw(type_name, raw, n, k)
    q, scales = q5_quants(raw, type_name)
    kb = k // BLOCK
    kind = type_name.lower()
    qs = _interleave(packed_quants(q).reshape(n, kb, PACKED_CHUNKS * CHUNK), n, PACKED_CHUNKS)
    scale_spec = QUANT_ARRAYS[kind][1]
    grouped = buffers.empty(scale_spec.shape(_groups(n), kb), np.float16)
    if kind == "q5_0":
        grouped[...] = _by_group(scales[:, 0].reshape(n, kb), n)
    else:
        grouped[:, :, 0] = _by_group(scales[:, 0].reshape(n, kb), n)
        grouped[:, :, 1] = _by_group(scales[:, 1].reshape(n, kb), n)
    return PackedWeight(kind, n, k, {"qs": qs, scale_spec.name: grouped}, dict(group=GROUP, source=type_name))


def _q5_rows(w, ids):
    """q (0..31) [len, kb, 32] uint8 of rows ``ids``."""
    groups, rows = np.divmod(ids, GROUP)
    packed = w.arrays["qs"][groups, :, :, rows, :]                # [len, kb, 5, 4]
    return unpacked_quants(packed.reshape(len(ids), -1, PACKED_CHUNKS * CHUNK))


def rows_q5_0(w, ids):
    ids = _checked_ids(w, ids)
    groups, rows = np.divmod(ids, GROUP)
    d = w.arrays["d"][groups, :, rows].astype(np.float32)[..., None]
    q = _q5_rows(w, ids).astype(np.float32)
    return (d * (q - np.float32(16))).reshape(len(ids), w.k)


def rows_q5_1(w, ids):
    ids = _checked_ids(w, ids)
    groups, rows = np.divmod(ids, GROUP)
    dm = w.arrays["dm"][groups, :, :, rows].astype(np.float32)     # [len, kb, 2]
    q = _q5_rows(w, ids).astype(np.float32)
    return (dm[..., 0:1] * q + dm[..., 1:2]).reshape(len(ids), w.k)


register(Layout("q5_0", ("Q5_0",), pack_q5, _dequantize_with(rows_q5_0), rows_q5_0))
register(Layout("q5_1", ("Q5_1",), pack_q5, _dequantize_with(rows_q5_1), rows_q5_1))
