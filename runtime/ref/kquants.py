"""numpy references for GGUF's Q4_K and Q5_K blocks: raw bytes -> f32, written from the format.

A K-quant row is a run of super-blocks of 256 weights, each eight sub-blocks of
32 (ggml-common.h ``block_q4_K`` / ``block_q5_K``)::

    Q4_K (144 bytes)  d f16 | dmin f16 | scales[12] | qs[128]
    Q5_K (176 bytes)  d f16 | dmin f16 | scales[12] | qh[32] | qs[128]

``scales`` packs eight 6-bit sub-block scales ``sc_j`` and eight 6-bit mins
``m_j`` (see ``scale_min``). Weight i of sub-block j is

    d * sc_j * q - dmin * m_j,   q = 4-bit nibble (+ 16 * high bit for Q5_K)

Nibbles pair sub-blocks: the 32 bytes ``qs[32 p : 32 p + 32]`` hold sub-block
2p in their low nibbles and 2p + 1 in their high ones. Q5_K's high bit of
weight l of sub-block j is bit j of ``qh[l]``.

In f32, ``d * sc_j`` and ``dmin * m_j`` are exact (11-bit by 6-bit mantissas),
as is the product with q; only the final subtraction rounds. The packed
layouts (runtime/layout_kquant.py) and gguf's dequantizer do the same
operations, so all three agree bit for bit.
"""
import numpy as np

from ...codegen.contract import BLOCK, SUPER_BLOCK
from .gguf_blocks import whole_blocks

SUB_BLOCKS = SUPER_BLOCK // BLOCK       # 8 sub-blocks of 32 per super-block
SCALE_BYTES = 12                        # K_SCALE_SIZE: 8 six-bit scales + 8 six-bit mins
# bytes of one super-block, and the offset of its 4-bit quants
SUPER_BYTES = {"Q4_K": 4 + SCALE_BYTES + SUPER_BLOCK // 2,
               "Q5_K": 4 + SCALE_BYTES + SUPER_BLOCK // 8 + SUPER_BLOCK // 2}


def scale_min(scales):
    """uint8 [..., 12] -> (sc, m) uint8 [..., 8], the 6-bit sub-block scales and mins.

    Sub-blocks 0..3: scale = low 6 bits of byte j, min = low 6 bits of byte j + 4.
    Sub-blocks 4..7: the low 4 bits come from byte j + 4 (scale: its low nibble,
    min: its high nibble), the top 2 bits from the top bits of bytes j - 4 (scale)
    and j (min)."""
    scales = np.asarray(scales, np.uint8)
    first, second, low = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([first & 0x3F, (low & 0x0F) | ((first >> 6) << 4)], axis=-1)
    m = np.concatenate([second & 0x3F, (low >> 4) | ((second >> 6) << 4)], axis=-1)
    return sc, m


def pack_scale_min(sc, m):
    """The inverse of ``scale_min``: 6-bit sc, m uint8 [..., 8] -> the 12 packed bytes [..., 12]."""
    sc, m = np.asarray(sc, np.uint8), np.asarray(m, np.uint8)
    if sc.max(initial=0) > 63 or m.max(initial=0) > 63:
        raise ValueError("pack_scale_min: scales and mins must fit in 6 bits (0..63)")
    first = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    second = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    low = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([first, second, low], axis=-1).astype(np.uint8)


def super_blocks(type_name, raw, k=None):
    """Raw K-quant bytes -> uint8 [super-blocks, bytes]; k (if given) must be a multiple of 256."""
    if k is not None and (k < 1 or k % SUPER_BLOCK):
        raise ValueError(f"{type_name}: k = {k} must be a positive multiple of {SUPER_BLOCK} "
                         f"(K-quant super-blocks)")
    return whole_blocks(type_name, raw, SUPER_BYTES[type_name], "super-blocks")


def fields(type_name, blocks):
    """Super-blocks [b, bytes] -> (d, dmin f32 [b], sc, m uint8 [b, 8], q uint8 [b, 8, 32]).

    q is each sub-block's quants in weight order (0..15, or 0..31 for Q5_K)."""
    halves = np.ascontiguousarray(blocks[:, :4]).view(np.float16).astype(np.float32)
    sc, m = scale_min(blocks[:, 4:4 + SCALE_BYTES])
    qs = blocks[:, -SUPER_BLOCK // 2:].reshape(-1, SUB_BLOCKS // 2, 1, BLOCK)
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F   # [b, pair, low/high, 32]
    q = q.reshape(-1, SUB_BLOCKS, BLOCK)
    if type_name == "Q5_K":
        qh = blocks[:, 4 + SCALE_BYTES:4 + SCALE_BYTES + BLOCK]              # [b, 32]: bit j = sub-block j
        bits = (qh[:, None, :] >> np.arange(SUB_BLOCKS, dtype=np.uint8)[None, :, None]) & 1
        q = q | (bits << 4)
    return halves[:, 0], halves[:, 1], sc, m, q


def dequantize(type_name, raw, k=None):
    """Raw Q4_K / Q5_K bytes (any shape; whole super-blocks) -> f32, flat in weight order."""
    d, dmin, sc, m, q = fields(type_name, super_blocks(type_name, raw, k))
    scale = (d[:, None] * sc.astype(np.float32))[..., None]
    offset = (dmin[:, None] * m.astype(np.float32))[..., None]
    return (scale * q.astype(np.float32) - offset).reshape(-1)


def dequantize_q4_k(raw, k=None):
    return dequantize("Q4_K", raw, k)


def dequantize_q5_k(raw, k=None):
    return dequantize("Q5_K", raw, k)


def random_blocks(type_name, n, k, rng, magnitude=1.0):
    """Valid raw bytes uint8 [n, k/256 * bytes]: random quants and scale bytes, f16 d and dmin
    of either sign mixing zeros and ``magnitude`` (ggml writes dmin >= 0, but nothing in the
    format requires it)."""
    blocks = rng.integers(0, 256, (n * (k // SUPER_BLOCK), SUPER_BYTES[type_name]), dtype=np.uint8)
    halves = (rng.standard_normal((blocks.shape[0], 2)) * magnitude).astype(np.float16)
    halves[rng.random(halves.shape) < 0.1] = 0
    blocks[:, :4] = halves.view(np.uint8)
    return blocks.reshape(n, -1)
