"""Binding: grouped-query causal attention over an f32 KV cache (decode and prefill),
optionally within a sliding window.

Threads split the work by query heads (``heads=(h0, h1)``); each thread passes
its own scratch, allocated once with ``attention_scratch``. ``attention_call``
validates like ``attention`` and returns ``(kernel symbol, args)`` in the
kernel's C argument order (the floats ``scale`` and, windowed, ``window`` last)
for a plan: one call per thread, each with its own heads and scratch.

``window`` 0, or one that no query in a cache of n_ctx rows can exceed
(window >= n_ctx), selects the unlimited kernel; any other window the
windowed one (codegen/attention.py), which sees keys pos - window < j <= pos.
"""
import functools

import numpy as np

from .. import buffers
from .. import validate as v
from .. import library
from ._lib import checked_address, index_range, kernel

__all__ = ["attention", "attention_scratch"]

SYMBOL = "llb_attention_f32__avx2"
WINDOW_SYMBOL = "llb_attention_window_f32__avx2"
# The windowed kernel receives the window as a float32 (codegen/attention.py), exact below 2^24.
MAX_EXACT_WINDOW = 2 ** 24
# Mirrors codegen/attention.py: query heads sharing a KV head done together,
# each with one score row of n_ctx floats padded to 8. Checked against the
# manifest's tile ("h3") when the kernel is first looked up.
MAX_HEADS = 3
LANES = 8
F32_MAX = float(np.finfo(np.float32).max)
F32 = np.dtype(np.float32)


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
def _check_tile():
    """Once: the kernel in the library was built for the scratch layout this binding assumes."""
    manifest = library.load("avx2").manifest
    for symbol in (SYMBOL, WINDOW_SYMBOL):
        entry = manifest.get(symbol)
        if entry is not None and entry["tile"] != f"h{MAX_HEADS}":
            raise library.KernelLibraryError(f"{symbol} was built with tile {entry['tile']} but the binding "
                                             f"expects h{MAX_HEADS}: codegen and runtime disagree")


def _non_negative_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
    return int(value)


def _float32_scale(value):
    value = v.finite_float("scale", value)
    if abs(value) > F32_MAX:
        raise ValueError(f"scale: {value!r} overflows float32")
    return value


def _check_disjoint(written_name, written, others):
    for name, other in others:
        if np.may_share_memory(written, other):
            raise ValueError(f"{written_name}: overlaps {name} (the kernel writes it while reading {name})")


def attention(q, k_cache, v_cache, pos0, scale, out, scratch, heads=None, window=0):
    """out[i, h] = softmax_j(scale * q[i, h] . k[kv, j]) @ v[kv, j], kv = h // (n_head // n_kv_head),
    over keys j <= pos0 + i, and j > pos0 + i - window when window > 0 (sliding window).

    q, out: f32 [m, n_head, head_dim]; k_cache, v_cache: f32 [n_kv_head, n_ctx, head_dim]
    with rows 0 .. pos0+m-1 valid (rows before a query's window are not read);
    scratch from ``attention_scratch(n_ctx, ...)``; heads=(h0, h1) computes only
    query heads h0..h1-1 (out's other heads are untouched); window 0: unlimited."""
    symbol, args = attention_call(q, k_cache, v_cache, pos0, scale, out, scratch, heads, window)
    kernel(symbol)(*args)


def _window(window, n_ctx):
    """The window the kernel gets: 0 (unlimited) or 1 .. n_ctx - 1."""
    window = _non_negative_int("window", window)
    if window == 0 or window >= n_ctx:
        return 0                   # unlimited, or no query of this cache can look back n_ctx rows
    if n_ctx > MAX_EXACT_WINDOW:
        raise ValueError(f"window: a window below n_ctx={n_ctx} needs n_ctx <= {MAX_EXACT_WINDOW} "
                         "(the kernel receives it as a float32)")
    return window


def attention_call(q, k_cache, v_cache, pos0, scale, out, scratch, heads=None, window=0):
    """``window`` as in ``attention``; the returned symbol is the windowed kernel unless
    the window is 0 or >= n_ctx, and its args end with the window (a float)."""
    _check_tile()
    q_at = checked_address("q", q, F32, ndim=3)
    m, n_head, head_dim = q.shape
    k_at = checked_address("k_cache", k_cache, F32, ndim=3)
    n_kv_head, n_ctx, k_head_dim = k_cache.shape
    if k_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {k_head_dim} differs from q's {head_dim}")
    v_at = checked_address("v_cache", v_cache, F32, k_cache.shape)
    if n_head % n_kv_head:
        raise ValueError(f"k_cache: {n_kv_head} KV heads do not divide q's {n_head} query heads")
    pos0 = _non_negative_int("pos0", pos0)
    if pos0 + m > n_ctx:
        raise ValueError(f"pos0: pos0 + m = {pos0} + {m} exceeds the cache's n_ctx = {n_ctx}")
    scale = _float32_scale(scale)
    window = _window(window, n_ctx)
    out_at = checked_address("out", out, F32, q.shape, writable=True)
    scratch_at = checked_address("scratch", scratch, F32, ndim=1, writable=True)
    if scratch.size < scratch_floats(n_ctx):
        raise ValueError(f"scratch: {scratch.size} floats, need {scratch_floats(n_ctx)} for n_ctx={n_ctx}; "
                         f"allocate it with attention_scratch(n_ctx, m_max)")
    h0, h1 = index_range("heads", heads, n_head, labels=("h0", "h1"), limit=f"n_head={n_head}")
    inputs = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    _check_disjoint("out", out, inputs + [("scratch", scratch)])
    _check_disjoint("scratch", scratch, inputs)
    group = n_head // n_kv_head
    args = [q_at, k_at, v_at, out_at, scratch_at, m, head_dim, n_head, group, n_ctx, pos0, h0, h1, scale]
    if window:
        return WINDOW_SYMBOL, args + [float(window)]
    return SYMBOL, args
