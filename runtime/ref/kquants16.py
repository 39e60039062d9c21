"""numpy reference dequantizers of GGUF's K-quants with 16-weight sub-blocks: Q6_K, Q3_K, Q2_K.

Written from the block formats (ggml-common.h ``block_q6_K`` / ``block_q3_K`` /
``block_q2_K``): super-blocks of 256 weights, each in 16 sub-blocks of 16 with
their own integer scale. Each ``decode_*`` splits raw GGUF rows into integers
(quants, sub-block scales, f16 super-block scales); each ``dequantize_*``
turns those into f32 with the same f32 operations as ggml's
``dequantize_row_*``, so the results are bit-equal to gguf's dequantization:

    Q6_K  w = (d * sc) * (q - 32)                q 0..63, sc int8
    Q3_K  w = (d * (sc - 32)) * (q - 4)          q 0..7 (2 low bits + 1 high bit), sc 0..63
    Q2_K  w = (d * sc) * q - dmin * m            q 0..3, sc and m 0..15

The packer (runtime/layout_kquant16.py) repacks the decoded integers.
"""
import numpy as np

from ...codegen.contract import SUPER_BLOCK
from .gguf_blocks import checked_rows
SUB_BLOCK = 16
SUBS = SUPER_BLOCK // SUB_BLOCK
# bytes per super-block
BLOCK_BYTES = {"Q6_K": 128 + 64 + 16 + 2, "Q3_K": 32 + 64 + 12 + 2, "Q2_K": 16 + 64 + 2 + 2}


def super_blocks(type_name, raw, n, k):
    """Raw GGUF rows -> uint8 [n, k/256, bytes]; a clear error for a shape that is not one."""
    return checked_rows(type_name, raw, n, k, SUPER_BLOCK, BLOCK_BYTES[type_name], "K-quant super-blocks")


def _f16(field):
    return np.ascontiguousarray(field).view(np.float16)[..., 0]


def _two_bit_fields(qs):
    """qs uint8 [..., 64] -> [..., 256]: weight 128 h + 32 j + l is bits 2j..2j+1 of byte 32 h + l."""
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    halves = qs.reshape(qs.shape[:-1] + (2, 1, 32)) >> shifts
    return (halves & 3).reshape(qs.shape[:-1] + (SUPER_BLOCK,))


# --------------------------------------------------------------------------- Q6_K

def decode_q6_k(blocks):
    """[..., 210] -> q uint8 [..., 256] (0..63), sc int8 [..., 16], d f16 [...].

    ql[128] low nibbles, qh[64] high 2 bits, scales[16], d: in each half of 128
    weights, weight 32 j + l takes the low (j < 2) or high nibble of ql byte
    32 (j % 2) + l and bits 2j..2j+1 of qh byte l."""
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    lead = blocks.shape[:-1]
    low = ql.reshape(lead + (2, 1, 2, 32)) >> np.array([0, 4], np.uint8).reshape(2, 1, 1)
    low = (low & 0x0F).reshape(lead + (2, 4, 32))                   # [half, j, l]: nibble j//2 of byte 32(j%2)+l
    high = qh.reshape(lead + (2, 1, 32)) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (high & 3).reshape(lead + (2, 4, 32))
    q = (low | (high << 4)).reshape(lead + (SUPER_BLOCK,))
    sc = blocks[..., 192:208].view(np.int8)
    return q, sc, _f16(blocks[..., 208:210])


def dequantize_q6_k(raw, n, k):
    q, sc, d = decode_q6_k(super_blocks("Q6_K", raw, n, k))
    dl = d.astype(np.float32)[..., None] * sc.astype(np.float32)          # [n, sb, 16]
    w = dl[..., None] * (q.astype(np.float32) - np.float32(32)).reshape(q.shape[:-1] + (SUBS, SUB_BLOCK))
    return w.reshape(n, k)


# --------------------------------------------------------------------------- Q3_K

def _q3_k_scales(packed):
    """12 bytes -> 16 6-bit scales: low nibbles from bytes 0..7 (low nibble for scales
    0..7, high for 8..15), top 2 bits from bytes 8..11 (bits 2(s//4).. of byte 8 + s%4)."""
    s = np.arange(SUBS)
    low = (packed[..., s % 8] >> (4 * (s // 8)).astype(np.uint8)) & 0x0F
    high = (packed[..., 8 + s % 4] >> (2 * (s // 4)).astype(np.uint8)) & 3
    return low | (high << 4)


def decode_q3_k(blocks):
    """[..., 110] -> q uint8 [..., 256] (0..7: the weight is q - 4), sc uint8 [..., 16] (0..63:
    the scale is sc - 32), d f16 [...].

    hmask[32], qs[64], scales[12], d: weight 128 h + 32 j + l has its low 2 bits in
    bits 2j.. of qs byte 32 h + l and its high bit (set: no -4 offset) in bit 4h + j
    of hmask byte l."""
    hmask, qs = blocks[..., :32], blocks[..., 32:96]
    lead = blocks.shape[:-1]
    bits = (hmask.reshape(lead + (1, 32)) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = _two_bit_fields(qs) | (bits.reshape(lead + (SUPER_BLOCK,)) << 2)
    return q, _q3_k_scales(blocks[..., 96:108]), _f16(blocks[..., 108:110])


def dequantize_q3_k(raw, n, k):
    q, sc, d = decode_q3_k(super_blocks("Q3_K", raw, n, k))
    dl = d.astype(np.float32)[..., None] * (sc.astype(np.float32) - np.float32(32))
    w = dl[..., None] * (q.astype(np.float32) - np.float32(4)).reshape(q.shape[:-1] + (SUBS, SUB_BLOCK))
    return w.reshape(n, k)


# --------------------------------------------------------------------------- Q2_K

def decode_q2_k(blocks):
    """[..., 84] -> q uint8 [..., 256] (0..3), scales uint8 [..., 16] (scale | min << 4, as
    stored), d f16 [...], dmin f16 [...].

    scales[16], qs[64], d, dmin: weight 128 h + 32 j + l is bits 2j.. of qs byte 32 h + l."""
    return (_two_bit_fields(blocks[..., 16:80]), blocks[..., :16], _f16(blocks[..., 80:82]),
            _f16(blocks[..., 82:84]))


def dequantize_q2_k(raw, n, k):
    q, scales, d, dmin = decode_q2_k(super_blocks("Q2_K", raw, n, k))
    dl = d.astype(np.float32)[..., None] * (scales & 0x0F).astype(np.float32)
    ml = dmin.astype(np.float32)[..., None] * (scales >> 4).astype(np.float32)
    w = dl[..., None] * q.astype(np.float32).reshape(q.shape[:-1] + (SUBS, SUB_BLOCK)) - ml[..., None]
    return w.reshape(n, k)


DEQUANTIZERS = {"Q6_K": dequantize_q6_k, "Q3_K": dequantize_q3_k, "Q2_K": dequantize_q2_k}


def random_blocks(type_name, n, k, rng, magnitude=1.0):
    """Valid raw GGUF rows of random quants and scales, with f16 super-block scales of about
    ``magnitude`` (some zero, some negative): for tests and synthetic models."""
    blocks = rng.integers(0, 256, (n, k // SUPER_BLOCK, BLOCK_BYTES[type_name]), dtype=np.uint8)
    fields = 2 if type_name == "Q2_K" else 1
    scales = (rng.standard_normal((n, k // SUPER_BLOCK, fields)) * magnitude).astype(np.float16)
    scales[rng.random(scales.shape) < 0.05] = 0
    blocks[..., -2 * fields:] = scales.view(np.uint8).reshape(blocks.shape[:-1] + (2 * fields,))
    return blocks.reshape(n, -1)
