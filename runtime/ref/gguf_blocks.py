"""numpy reference dequantizers of GGUF block types, written from the format (ggml-common.h).

Each takes a tensor's raw bytes as ``gguf.GGUFReader`` returns them (uint8,
any shape whose size is a whole number of blocks) and returns f32 weights
[blocks * 32], computed with the same f32 operations as ggml's
``dequantize_row_*`` so the values are bit-equal to it (and to
``gguf.quants.dequantize``). Tests check the repacked layouts against them.

    Q5_0  32 weights in 22 bytes: f16 d, uint32 qh, 16 nibble bytes
    Q5_1  32 weights in 24 bytes: f16 d, f16 m, uint32 qh, 16 nibble bytes

A Q5 weight j (0..31) is ``q = nibble | bit j of qh << 4``, where nibble byte
j % 16 holds weight j in its low nibble (j < 16) and weight j + 16 in its high
one. Q5_0 means ``d * (q - 16)``, Q5_1 ``d * q + m``.
"""
import numpy as np

from ...codegen.contract import BLOCK

# Not backend ops: runtime/backend.py collects every ref module's __all__ into the numpy backend.
__all__ = []

Q5_BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24}
_SCALE_FIELDS = {"Q5_0": 1, "Q5_1": 2}      # f16 fields in front of qh


def whole_blocks(type_name, raw, size, unit="blocks"):
    """Raw GGUF bytes of any shape -> uint8 [blocks, size]; a clear error when they are not
    a whole number of ``size``-byte blocks (``unit`` names them)."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size % size:
        raise ValueError(f"{type_name}: {raw.size} bytes is not a whole number of {size}-byte {unit}")
    return raw.reshape(-1, size)


def checked_rows(type_name, raw, n, k, block, block_bytes, unit="GGUF blocks"):
    """The raw GGUF rows of an [n, k] tensor stored in blocks of ``block`` weights and
    ``block_bytes`` bytes, as contiguous uint8 [n, k / block, block_bytes]; a clear error
    naming the type for a k that is not whole blocks, an empty tensor or the wrong size."""
    if k < 1 or k % block:
        raise ValueError(f"{type_name}: k = {k} must be a positive multiple of {block} ({unit})")
    if n < 1:
        raise ValueError(f"{type_name}: n = {n} must be >= 1")
    row_bytes = k // block * block_bytes
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if raw.size != n * row_bytes:
        raise ValueError(f"{type_name}: expected {n} rows of {row_bytes} bytes for a [{n}, {k}] tensor, "
                         f"got {raw.size} bytes (shape {raw.shape})")
    return raw.reshape(n, k // block, block_bytes)


def _blocks(raw, type_name):
    return whole_blocks(type_name, raw, Q5_BLOCK_BYTES[type_name])


def q5_quants(raw, type_name):
    """(q uint8 [blocks, 32] in 0..31, f16 scale fields [blocks, 1 or 2]) of Q5 bytes."""
    blocks = _blocks(raw, type_name)
    fields = _SCALE_FIELDS[type_name]
    scales = np.ascontiguousarray(blocks[:, :2 * fields]).view(np.float16)
    qh = np.ascontiguousarray(blocks[:, 2 * fields:2 * fields + 4]).view("<u4")    # [blocks, 1]
    nibbles = blocks[:, 2 * fields + 4:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)                      # weights 0..31
    high = (qh >> np.arange(BLOCK, dtype=np.uint32)) & 1
    return (low | (high.astype(np.uint8) << 4)), scales


def dequantize_q5_0(raw):
    q, scales = q5_quants(raw, "Q5_0")
    d = scales[:, :1].astype(np.float32)
    return (d * (q.astype(np.float32) - np.float32(16))).reshape(-1)


def dequantize_q5_1(raw):
    q, scales = q5_quants(raw, "Q5_1")
    d, m = scales[:, :1].astype(np.float32), scales[:, 1:2].astype(np.float32)
    return (d * q.astype(np.float32) + m).reshape(-1)
