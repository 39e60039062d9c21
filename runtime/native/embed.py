"""Binding: embedding lookup from a quantized weight (codegen/embed.py).

``embed(w, ids, out)`` writes out[i] = row ids[i] of ``w`` dequantized, bit
for bit what ``runtime.layouts.rows(w, ids)`` gives. Kinds "q8_0" and "q4_1"
have kernels; float kinds ("f32", "f16", panels of 16 rows) are refused with
a ValueError, and callers keep ``layouts.rows`` for them.

``embed_call`` validates the same way and returns ``(symbol, args)`` for a
plan; ``rows=(r0, r1)`` restricts it to tokens r0..r1-1. The kernel reads the
ids from memory when it runs, so a recorded plan stays valid when the model
writes new ids into the same buffer. The ids are checked here, once: a plan
must keep them in [0, n) itself, since the kernel trusts them.
"""
import numpy as np

from ...codegen.contract import BLOCK, GROUP, QUANT_ARRAYS, embed_symbol
from ..kinds import embed_kinds
from ..layouts import PackedWeight
from ._lib import checked_address, index_range, kernel

__all__ = ["embed"]

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


def embed(w, ids, out):
    """out[i, :] = W[ids[i], :] as f32, for ids int32 [m] and out f32 [m, k]."""
    symbol, args = embed_call(w, ids, out)
    kernel(symbol)(*args)


def embed_call(w, ids, out, rows=None):
    qs_at, scales_at = _weight_addresses(w)
    ids_at = checked_address("ids", ids, I32, ndim=1, align=4)
    m = ids.shape[0]
    out_at = checked_address("out", out, F32, (m, w.k), writable=True)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= w.n:
        raise ValueError(f"ids: expected row indices in [0, {w.n}), got {low}..{high}")
    if np.may_share_memory(ids, out):
        raise ValueError("out: overlaps ids, which the kernel reads while writing out")
    r0, r1 = index_range("rows", rows, m, labels=("r0", "r1"))
    return embed_symbol(w.kind), [qs_at, scales_at, ids_at + 4 * r0, out_at + 4 * w.k * r0,
                                        r1 - r0, w.k // BLOCK]


def _weight_addresses(w):
    """Check w's kind and arrays; returns the addresses of its quants and f16 scales."""
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w: expected a PackedWeight, got {type(w).__name__}")
    if w.kind not in embed_kinds():
        raise ValueError(f"w: embed has kernels for kinds {', '.join(embed_kinds())}, got kind {w.kind!r} "
                         "(use runtime.layouts.rows)")
    if w.k < 1 or w.k % BLOCK or w.n < 1:
        raise ValueError(f"w: expected n >= 1 and k a positive multiple of {BLOCK}, got n={w.n}, k={w.k}")
    if w.meta.get("group", GROUP) != GROUP:
        raise ValueError(f"w: packed with row groups of {w.meta.get('group')}, the kernel needs {GROUP}")
    groups, blocks = -(-w.n // GROUP), w.k // BLOCK
    return [checked_address(f"w.{spec.name}", w.arrays.get(spec.name), spec.dtype, spec.shape(groups, blocks))
            for spec in QUANT_ARRAYS[w.kind]]
