"""Binding: grouped-query causal attention over an f32 KV cache (decode and prefill).

Threads split the work by query heads (``heads=(h0, h1)``); each thread passes
its own scratch, allocated once with ``attention_scratch``.
"""
import functools

import numpy as np

from .. import buffers
from .. import validate as v
from .. import library
from ._lib import kernel

__all__ = ["attention", "attention_scratch"]

SYMBOL = "llb_attention_f32__avx2"
# Mirrors codegen/attention.py: query heads sharing a KV head done together,
# each with one score row of n_ctx floats padded to 8. Checked against the
# manifest's tile ("h3") when the kernel is first looked up.
MAX_HEADS = 3
LANES = 8
F32_MAX = float(np.finfo(np.float32).max)


def scratch_floats(n_ctx):
    return MAX_HEADS * ((n_ctx + LANES - 1) // LANES * LANES)


def attention_scratch(n_ctx, m_max=1):
    """The scratch one caller (one thread) passes to every ``attention`` call.

    Its size depends on n_ctx only: queries are processed one after another,
    so ``m_max`` does not enlarge it (it is accepted so callers need not care)."""
    v.positive_int("n_ctx", n_ctx)
    v.positive_int("m_max", m_max)
    return buffers.zeros(scratch_floats(n_ctx))


@functools.lru_cache(maxsize=None)
def _attention_kernel():
    entry = library.load("avx2").manifest.get(SYMBOL)
    if entry is not None and entry["tile"] != f"h{MAX_HEADS}":
        raise library.KernelLibraryError(f"{SYMBOL} was built with tile {entry['tile']} but the binding "
                                         f"expects h{MAX_HEADS}: codegen and runtime disagree")
    return kernel(SYMBOL)


def _non_negative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
    return int(value)


def _float32_scale(value):
    value = v.finite_float("scale", value)
    if abs(value) > F32_MAX:
        raise ValueError(f"scale: {value!r} overflows float32")
    return value


def _head_range(heads, n_head):
    if heads is None:
        return 0, n_head
    try:
        h0, h1 = heads
    except (TypeError, ValueError):
        raise ValueError(f"heads: expected a pair (h0, h1), got {heads!r}") from None
    h0 = _non_negative_int("heads[0]", h0)
    h1 = _non_negative_int("heads[1]", h1)
    if not h0 < h1 <= n_head:
        raise ValueError(f"heads: expected 0 <= h0 < h1 <= n_head={n_head}, got {heads!r}")
    return h0, h1


def _check_disjoint(written_name, written, others):
    for name, other in others:
        if np.may_share_memory(written, other):
            raise ValueError(f"{written_name}: overlaps {name} (the kernel writes it while reading {name})")


def attention(q, k_cache, v_cache, pos0, scale, out, scratch, heads=None):
    """out[i, h] = softmax_j<=pos0+i(scale * q[i, h] . k[kv, j]) @ v[kv, :], kv = h // (n_head // n_kv_head).

    q, out: f32 [m, n_head, head_dim]; k_cache, v_cache: f32 [n_kv_head, n_ctx, head_dim]
    with rows 0 .. pos0+m-1 valid; scratch from ``attention_scratch(n_ctx, ...)``;
    heads=(h0, h1) computes only query heads h0..h1-1 (out's other heads are untouched)."""
    v.array("q", q, np.float32, ndim=3)
    m, n_head, head_dim = q.shape
    v.array("k_cache", k_cache, np.float32, ndim=3)
    n_kv_head, n_ctx, k_head_dim = k_cache.shape
    if k_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {k_head_dim} differs from q's {head_dim}")
    v.array("v_cache", v_cache, np.float32, k_cache.shape)
    if n_head % n_kv_head:
        raise ValueError(f"k_cache: {n_kv_head} KV heads do not divide q's {n_head} query heads")
    pos0 = _non_negative_int("pos0", pos0)
    if pos0 + m > n_ctx:
        raise ValueError(f"pos0: pos0 + m = {pos0} + {m} exceeds the cache's n_ctx = {n_ctx}")
    scale = _float32_scale(scale)
    v.array("out", out, np.float32, q.shape, writable=True)
    v.array("scratch", scratch, np.float32, ndim=1, writable=True)
    if scratch.size < scratch_floats(n_ctx):
        raise ValueError(f"scratch: {scratch.size} floats, need {scratch_floats(n_ctx)} for n_ctx={n_ctx}; "
                         f"allocate it with attention_scratch(n_ctx, m_max)")
    h0, h1 = _head_range(heads, n_head)
    inputs = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    _check_disjoint("out", out, inputs + [("scratch", scratch)])
    _check_disjoint("scratch", scratch, inputs)
    group = n_head // n_kv_head
    _attention_kernel()(q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data, out.ctypes.data,
                        scratch.ctypes.data, m, head_dim, n_head, group, n_ctx, pos0, h0, h1, h0 // group,
                        scale)

