"""K-quant weight layouts: GGUF Q4_K / Q5_K rows interleaved for the int8 kernels.

GGUF's super-blocks (runtime/ref/kquants.py) hold 256 weights as eight
32-weight blocks with 6-bit scales ``sc`` and mins ``m`` under f16 ``d`` and
``dmin``. Their blocks line up with the Q8 activation blocks, so the kernels
(codegen/qgemm.py) take the q4_1 path per block with the block's scale
``d * sc`` and min ``-dmin * m``, formed from the packed bytes in a few
instructions. Rows go in groups of ``GROUP = 8`` as for q4_1::

    kind q4_k (from Q4_K)
      qs      uint8 [groups, k/32, 4 chunks, 8 rows, 4 bytes]   nibbles, q4_1's order
      scales  uint8 [groups, k/256, 160]                        one record per super-block
    kind q5_k (from Q5_K)
      qs      uint8 [groups, k/32, 5 chunks, 8 rows, 4 bytes]   nibbles, then high bits
      scales  uint8 [groups, k/256, 160]

Nibbles are rearranged from GGUF's pairing of blocks 2p and 2p + 1 into q4_1's
byte order: byte b of a block holds weight b in its low nibble and weight
b + 16 in its high one, and chunk c holds bytes 4c..4c+3. Q5_K's fifth chunk
holds each row's 32 high bits as 4 bytes, byte i carrying, for each chunk c,
the high bit of weight 4c + i in bit 2c and that of weight 16 + 4c + i in bit
2c + 1: one shift and a mask put a chunk's bits under its nibbles.

The scale record (offsets in codegen/contract.py, ``KQ_*``) is the 8 rows' f16
``d``, their f16 ``-dmin`` (negated here, exactly, so that the kernel's min
term is an add), then per block the 8 rows' uint8 ``sc`` and the 8 rows'
uint8 ``m``. One record serves the 8 blocks of a super-block, so the kernel
walks two weight streams, as for q4_1. Q4_K costs 148 bytes per 256 weights
of a row (GGUF: 144), Q5_K 180 (GGUF: 176). (f32 block scales and mins
instead would cost 192 and 224.)

Exactness: ``d * sc`` and ``-dmin * m`` are exact in f32, and dequantizing
does GGUF's operations in GGUF's order, so ``dequantize(pack(raw))`` equals
gguf's dequantization bit for bit.
"""
import numpy as np

from . import buffers
from .layouts import Layout, PackedWeight, register
from .ref.gguf_blocks import checked_rows
from .layout_quant import _by_group, _checked_ids, _dequantize_with, _groups, _interleave
from .ref import kquants

from ..codegen.contract import (BLOCK, CHUNK, GROUP, SUPER_BLOCK, KQ_SUB_BLOCKS, KQ_MINS_OFFSET,
                                KQ_BLOCK_SCALES_OFFSET, KQ_SCALE_RECORD)

NIBBLE_BYTES = BLOCK // 2                 # 16 nibble bytes of one block's row
NIBBLE_CHUNKS = NIBBLE_BYTES // CHUNK     # 4
KINDS = {"Q4_K": "q4_k", "Q5_K": "q5_k"}


def _check_shape(type_name, raw, n, k):
    """``raw`` as uint8 [super-blocks, bytes]; a clear error for a row length that cannot be
    the type's, an empty tensor or the wrong size."""
    return checked_rows(type_name, raw, n, k, SUPER_BLOCK, kquants.SUPER_BYTES[type_name],
                        "K-quant super-blocks").reshape(-1, kquants.SUPER_BYTES[type_name])


def high_bit_bytes(high):
    """High bits uint8 [..., 32] (0/1, in weight order) -> the fifth chunk's 4 bytes [..., 4]."""
    out = np.zeros(high.shape[:-1] + (CHUNK,), np.uint8)
    for c in range(NIBBLE_CHUNKS):
        out |= high[..., CHUNK * c:CHUNK * (c + 1)] << (2 * c)
        out |= high[..., NIBBLE_BYTES + CHUNK * c:NIBBLE_BYTES + CHUNK * (c + 1)] << (2 * c + 1)
    return out


def _high_bits(packed):
    """The fifth chunk's bytes [..., 4] -> high bits [..., 32] in weight order."""
    low, high = [], []
    for c in range(NIBBLE_CHUNKS):
        low.append((packed >> (2 * c)) & 1)
        high.append((packed >> (2 * c + 1)) & 1)
    return np.concatenate(low + high, axis=-1)


def pack_kquant(type_name, raw, n, k):
    blocks = _check_shape(type_name, raw, n, k)
    kb, supers = k // BLOCK, k // SUPER_BLOCK
    _, _, sc, m, q = kquants.fields(type_name, blocks)
    q = q.reshape(n, kb, BLOCK)
    quants = (q[..., :NIBBLE_BYTES] & 0x0F) | ((q[..., NIBBLE_BYTES:] & 0x0F) << 4)
    chunks = NIBBLE_CHUNKS
    if type_name == "Q5_K":
        quants = np.concatenate([quants, high_bit_bytes(q >> 4)], axis=-1)
        chunks += 1

    halves = np.ascontiguousarray(blocks[:, :4]).view(np.float16).reshape(n, supers, 2)
    record = buffers.empty((_groups(n), supers, KQ_SCALE_RECORD), np.uint8)
    d = np.ascontiguousarray(_by_group(halves[..., 0], n))             # [groups, supers, 8]
    neg_dmin = np.ascontiguousarray(_by_group(-halves[..., 1], n))
    per_block = np.stack([sc, m], axis=-1).reshape(n, supers, KQ_SUB_BLOCKS, 2)
    record[..., :KQ_MINS_OFFSET] = d.view(np.uint8)
    record[..., KQ_MINS_OFFSET:KQ_BLOCK_SCALES_OFFSET] = neg_dmin.view(np.uint8)
    record[..., KQ_BLOCK_SCALES_OFFSET:] = _by_group(per_block, n).reshape(_groups(n), supers, -1)
    return PackedWeight(KINDS[type_name], n, k, dict(qs=_interleave(quants, n, chunks), scales=record),
                        dict(group=GROUP, source=type_name))


def rows_kquant(w, ids):
    ids = _checked_ids(w, ids)
    groups, rows = np.divmod(ids, GROUP)
    count, kb, supers = len(ids), w.k // BLOCK, w.k // SUPER_BLOCK
    packed = w.arrays["qs"][groups, :, :, rows, :]                   # [len, kb, chunk, 4]
    nibbles = packed[:, :, :NIBBLE_CHUNKS].reshape(count, kb, NIBBLE_BYTES)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    if w.kind == "q5_k":
        q = q | (_high_bits(packed[:, :, NIBBLE_CHUNKS]) << 4)

    record = w.arrays["scales"][groups]                              # [len, supers, 160]
    halves = np.ascontiguousarray(record[..., :KQ_BLOCK_SCALES_OFFSET]).view(np.float16)
    halves = halves.reshape(count, supers, 2, GROUP)[np.arange(count), :, :, rows].astype(np.float32)
    per_block = record[..., KQ_BLOCK_SCALES_OFFSET:].reshape(count, supers, KQ_SUB_BLOCKS, 2, GROUP)
    per_block = per_block[np.arange(count), :, :, :, rows].astype(np.float32)   # [len, supers, 8, 2]
    scale = halves[:, :, 0, None] * per_block[..., 0]                         # d * sc, exact
    offset = halves[:, :, 1, None] * per_block[..., 1]                        # -dmin * m, exact
    out = scale.reshape(count, kb, 1) * q.astype(np.float32) + offset.reshape(count, kb, 1)
    return out.reshape(count, w.k)


register(Layout("q4_k", ("Q4_K",), pack_kquant, _dequantize_with(rows_kquant), rows_kquant))
register(Layout("q5_k", ("Q5_K",), pack_kquant, _dequantize_with(rows_kquant), rows_kquant))
