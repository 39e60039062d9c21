"""Grouped-query causal attention against the float64 numpy reference (written from the math),
unlimited and within a sliding window.

Shapes: m in {1, 2, 7, ~20} queries; head_dim in {1, 7, 8, 9, 64, 65, 80, 256} (masked tails,
whole chunks, both, Gemma 3's 256); (n_head, n_kv_head) in {(1,1), (4,2), (9,3), (6,1), (4,1)} (groups
of 1, 2, 3, 4 and 6 heads: every head tile, and a group split across tiles); pos0 in
{0, 1, 31, ~200}. Cache rows past pos0 + m are NaN (must never be read); out
starts as NaN (every computed element written, heads outside the range untouched).
Windowed: head_dim {9, 64, 80, 128, 256}, GQA up to 6:1 (4:1 with one KV head, Gemma 3
270M's shape), windows 1, 2, 3, 8, up to 70 and beyond the cache, pos0 straddling the
window's edge; cache rows before the first query's window are NaN as well.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import nan_buffer, float_arrays
from llambda.runtime import buffers

HEAD_CONFIGS = [(1, 1), (4, 2), (9, 3), (6, 1), (4, 1)]
HEAD_DIMS = [1, 7, 8, 9, 64, 65, 80, 256]
U = 2.0 ** -24          # float32 unit roundoff


def draw_shape(data):
    n_head, n_kv_head = data.draw(st.sampled_from(HEAD_CONFIGS), label="heads")
    head_dim = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    m = data.draw(st.one_of(st.sampled_from([1, 2, 7]), st.integers(18, 22)), label="m")
    pos0 = data.draw(st.one_of(st.sampled_from([0, 1, 31]), st.integers(190, 210)), label="pos0")
    n_ctx = pos0 + m + data.draw(st.sampled_from([0, 1, 13]), label="spare rows")
    return n_head, n_kv_head, head_dim, m, pos0, n_ctx


def draw_head_range(data, n_head):
    if data.draw(st.booleans(), label="all heads"):
        return None
    h0 = data.draw(st.integers(0, n_head - 1), label="h0")
    return h0, data.draw(st.integers(h0 + 1, n_head), label="h1")


def cache(values, n_ctx):
    """A cache of n_ctx rows per KV head: ``values`` in the first rows, NaN in the rest."""
    n_kv_head, valid, head_dim = values.shape
    c = buffers.full((n_kv_head, n_ctx, head_dim), np.nan)
    c[:, :valid] = values
    return c


def draw_queries_and_keys(data, q_shape, k_shape):
    """(q, k, scale, exact): either float data at a drawn magnitude, or small integers and a
    power-of-two scale, whose dot products and scores float32 computes exactly -- scores
    up to ~8000 then test the max-subtraction (exp overflows past 88) at full precision."""
    if data.draw(st.booleans(), label="exact scores"):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        q = rng.integers(-4, 5, q_shape).astype(np.float32)
        k = rng.integers(-4, 5, k_shape).astype(np.float32)
        scale = data.draw(st.sampled_from([1.0, 0.25, 8.0]), label="scale")
        return buffers.aligned_copy(q), k, scale, True
    magnitude = data.draw(st.sampled_from([1e-3, 0.1, 1.0, 5.0]), label="q, k magnitude")
    q = float_arrays(data.draw, q_shape, scale=magnitude)
    k = float_arrays(data.draw, k_shape, scale=magnitude)
    scale = data.draw(st.sampled_from([0.125, 1.0 / np.sqrt(q_shape[-1]), 1.0]), label="scale")
    return q, k, scale, False


def visible_keys(position, window):
    """The keys query ``position`` attends to: all earlier ones, or the last ``window``."""
    first = max(0, position - window + 1) if window else 0
    return slice(first, position + 1)


def tolerance(q, k, v, pos0, scale, exact, group, window=0):
    """Allowed |error| per (query, head), as [m, n_head, 1].

    A score error d changes every p_j by a factor within exp(+-2d), so out moves by at
    most ~2d * max|v|. Float scores are dot products of head_dim terms summed per lane
    (head_dim/8 FMAs) then over 8 lanes, times scale: |d| <= (head_dim/8 + 5) u
    scale sum|q_d k_d|. Exact scores have d = 0. On top, 1e-5 * max|v| for exp (< 1
    ulp), the sum and 1/sum, and sum_j p_j v_j over up to ~230 keys (random-walk
    rounding, measured below 1e-6 * max|v|)."""
    m, n_head, head_dim = q.shape
    atol = np.empty((m, n_head, 1))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for i in range(m):
        keys = visible_keys(pos0 + i, window)
        for h in range(n_head):
            kv = h // group
            v_max = np.abs(v64[kv, keys]).max()
            score_error = 0.0
            if not exact:
                dot_magnitude = (np.abs(k64[kv, keys]) @ np.abs(q64[i, h])).max()
                score_error = (head_dim / 8 + 5) * U * abs(scale) * dot_magnitude
            atol[i, h] = v_max * (1e-5 + 2 * score_error)
    return atol


def assert_heads_close(got, want, atol, h0, h1):
    """Heads h0..h1 written and within ``atol`` of the reference, the others untouched (NaN)."""
    error = np.abs(got[:, h0:h1].astype(np.float64) - want[:, h0:h1])
    assert not np.isnan(got[:, h0:h1]).any()
    assert (error <= atol[:, h0:h1]).all(), f"max error / tolerance {(error / atol[:, h0:h1]).max()}"
    assert np.isnan(got[:, :h0]).all() and np.isnan(got[:, h1:]).all()


@given(st.data())
def test_attention_matches_reference(native, ref, data):
    n_head, n_kv_head, head_dim, m, pos0, n_ctx = draw_shape(data)
    q, k_values, scale, exact = draw_queries_and_keys(data, (m, n_head, head_dim),
                                                      (n_kv_head, pos0 + m, head_dim))
    v_magnitude = data.draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4]), label="v magnitude")
    v_values = float_arrays(data.draw, (n_kv_head, pos0 + m, head_dim), scale=v_magnitude)
    k_cache, v_cache = cache(k_values, n_ctx), cache(v_values, n_ctx)
    heads = draw_head_range(data, n_head)
    h0, h1 = heads if heads is not None else (0, n_head)

    want, got = nan_buffer(q.shape), nan_buffer(q.shape)
    ref.attention(q, k_cache, v_cache, pos0, scale, want, ref.attention_scratch(n_ctx, m), heads=heads)
    native.attention(q, k_cache, v_cache, pos0, scale, got, native.attention_scratch(n_ctx, m), heads=heads)

    assert_heads_close(got, want, tolerance(q, k_values, v_values, pos0, scale, exact, n_head // n_kv_head), h0, h1)


@settings(max_examples=20)
@given(st.data())
def test_splitting_heads_or_queries_changes_no_bit(native, data):
    """Threads split by heads, prefill splits by queries: every split gives the same bits
    (each key's score and each output sum are accumulated in one fixed order)."""
    n_head, n_kv_head, head_dim, m, pos0, n_ctx = draw_shape(data)
    q, k_values, scale, _ = draw_queries_and_keys(data, (m, n_head, head_dim), (n_kv_head, pos0 + m, head_dim))
    v_values = float_arrays(data.draw, (n_kv_head, pos0 + m, head_dim))
    k_cache, v_cache = cache(k_values, n_ctx), cache(v_values, n_ctx)
    scratch = native.attention_scratch(n_ctx, m)
    whole = nan_buffer(q.shape)
    native.attention(q, k_cache, v_cache, pos0, scale, whole, scratch)

    cut = data.draw(st.integers(1, n_head), label="head cut")
    by_heads = nan_buffer(q.shape)
    for heads in ((0, cut), (cut, n_head)):
        if heads[0] < heads[1]:
            native.attention(q, k_cache, v_cache, pos0, scale, by_heads, native.attention_scratch(n_ctx, m),
                             heads=heads)
    np.testing.assert_array_equal(by_heads, whole)

    one_query = nan_buffer((1,) + q.shape[1:])
    for i in range(m):
        native.attention(buffers.aligned_copy(q[i:i + 1]), k_cache, v_cache, pos0 + i, scale, one_query, scratch)
        np.testing.assert_array_equal(one_query[0], whole[i])


# ---------------------------------------------------------------- sliding window

WINDOW_HEAD_CONFIGS = [(1, 1), (4, 1), (8, 2), (4, 2), (9, 3), (6, 1), (3, 3)]   # GQA 1:1 .. 6:1
WINDOW_HEAD_DIMS = [64, 80, 128, 256, 9]


def draw_window_shape(data):
    """Shapes where the window matters: windows of 1, 2, a few keys, about the position, and
    beyond the cache; positions before, at and across the window's edge (pos0 < window <=
    pos0 + m), prefill and decode."""
    n_head, n_kv_head = data.draw(st.sampled_from(WINDOW_HEAD_CONFIGS), label="heads")
    head_dim = data.draw(st.sampled_from(WINDOW_HEAD_DIMS), label="head_dim")
    m = data.draw(st.one_of(st.sampled_from([1, 2, 9]), st.integers(10, 24)), label="m")
    window = data.draw(st.one_of(st.sampled_from([1, 2, 3, 8]), st.integers(4, 70)), label="window")
    pos0 = data.draw(st.one_of(st.sampled_from([0, max(0, window - 1), window, window + 1]),
                               st.integers(max(0, window - m), window + 3), st.integers(0, 90)), label="pos0")
    n_ctx = pos0 + m + data.draw(st.sampled_from([0, 1, 13]), label="spare rows")
    if data.draw(st.integers(0, 5), label="window beyond the cache") == 0:
        window = n_ctx + data.draw(st.sampled_from([0, 1, 1000]))
    return n_head, n_kv_head, head_dim, m, pos0, n_ctx, window


def window_cache(values, n_ctx, pos0, window):
    """``cache``, plus NaN in the rows before the first query's window: never to be read."""
    c = cache(values, n_ctx)
    c[:, :visible_keys(pos0, window).start] = np.nan
    return c


@settings(max_examples=40)
@given(st.data())
def test_windowed_attention_matches_reference(native, ref, data):
    n_head, n_kv_head, head_dim, m, pos0, n_ctx, window = draw_window_shape(data)
    q, k_values, scale, exact = draw_queries_and_keys(data, (m, n_head, head_dim),
                                                      (n_kv_head, pos0 + m, head_dim))
    v_magnitude = data.draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4]), label="v magnitude")
    v_values = float_arrays(data.draw, (n_kv_head, pos0 + m, head_dim), scale=v_magnitude)
    k_cache, v_cache = window_cache(k_values, n_ctx, pos0, window), window_cache(v_values, n_ctx, pos0, window)
    heads = draw_head_range(data, n_head)
    h0, h1 = heads if heads is not None else (0, n_head)

    want, got = nan_buffer(q.shape), nan_buffer(q.shape)
    ref.attention(q, k_cache, v_cache, pos0, scale, want, ref.attention_scratch(n_ctx, m), heads=heads,
                  window=window)
    native.attention(q, k_cache, v_cache, pos0, scale, got, native.attention_scratch(n_ctx, m), heads=heads,
                     window=window)

    assert_heads_close(got, want, tolerance(q, k_values, v_values, pos0, scale, exact, n_head // n_kv_head, window),
                       h0, h1)


@settings(max_examples=20)
@given(st.data())
def test_windowed_splits_change_no_bit(native, data):
    """Split by heads or queries, the windowed kernel gives the same bits; a window the cache
    cannot exceed (>= n_ctx) gives exactly the unlimited kernel's bits."""
    n_head, n_kv_head, head_dim, m, pos0, n_ctx, window = draw_window_shape(data)
    q, k_values, scale, _ = draw_queries_and_keys(data, (m, n_head, head_dim), (n_kv_head, pos0 + m, head_dim))
    v_values = float_arrays(data.draw, (n_kv_head, pos0 + m, head_dim))
    k_cache, v_cache = cache(k_values, n_ctx), cache(v_values, n_ctx)
    scratch = native.attention_scratch(n_ctx, m)
    whole = nan_buffer(q.shape)
    native.attention(q, k_cache, v_cache, pos0, scale, whole, scratch, window=window)

    cut = data.draw(st.integers(1, n_head), label="head cut")
    by_heads = nan_buffer(q.shape)
    for heads in ((0, cut), (cut, n_head)):
        if heads[0] < heads[1]:
            native.attention(q, k_cache, v_cache, pos0, scale, by_heads, scratch, heads=heads, window=window)
    np.testing.assert_array_equal(by_heads, whole)

    one_query = nan_buffer((1,) + q.shape[1:])
    for i in range(m):
        native.attention(buffers.aligned_copy(q[i:i + 1]), k_cache, v_cache, pos0 + i, scale, one_query, scratch,
                         window=window)
        np.testing.assert_array_equal(one_query[0], whole[i])

    unlimited = nan_buffer(q.shape)
    native.attention(q, k_cache, v_cache, pos0, scale, unlimited, scratch)
    if window >= n_ctx:
        np.testing.assert_array_equal(whole, unlimited)
    for i in range(m):                        # queries whose window reaches key 0 see what the unlimited one sees
        if pos0 + i < window:
            np.testing.assert_array_equal(whole[i], unlimited[i])


@pytest.mark.parametrize("backend", ["native", "ref"])
@pytest.mark.parametrize("window", [0, 1, 2, 5, 11, 12, 100])
def test_window_sees_exactly_the_last_keys(backend, window, request):
    """q = 0 makes every visible key equally likely; V rows one-hot by position then show
    which keys a query saw: p - window < j <= p (llama.cpp masks p - j >= window)."""
    be = request.getfixturevalue(backend)
    n_ctx, pos0, m = 12, 3, 9
    q = buffers.zeros((m, 4, n_ctx))
    k_cache = buffers.aligned_copy(np.random.default_rng(0).standard_normal((1, n_ctx, n_ctx)), np.float32)
    v_cache = buffers.aligned_copy(np.eye(n_ctx, dtype=np.float32)[None])
    out = nan_buffer(q.shape)
    be.attention(q, k_cache, v_cache, pos0, 0.5, out, be.attention_scratch(n_ctx, m), window=window)
    for i in range(m):
        p = pos0 + i
        seen = np.array([p - j < window if window else True for j in range(n_ctx)]) & (np.arange(n_ctx) <= p)
        np.testing.assert_allclose(out[i], np.broadcast_to(seen / seen.sum(), (4, n_ctx)), rtol=1e-6)


def test_window_picks_the_kernel(native):
    from llambda.runtime.native.attention import attention_call, SYMBOL, WINDOW_SYMBOL
    q, out = buffers.zeros((2, 2, 8)), buffers.zeros((2, 2, 8))
    k = v = buffers.zeros((1, 16, 8))
    scratch = native.attention_scratch(16)
    for window, symbol in ((0, SYMBOL), (1, WINDOW_SYMBOL), (15, WINDOW_SYMBOL), (16, SYMBOL), (10**9, SYMBOL)):
        got, args = attention_call(q, k, v, 3, 0.5, out, scratch, window=window)
        assert got == symbol
        assert args[-1] == (float(window) if symbol == WINDOW_SYMBOL else 0.5)


def test_huge_scores_do_not_overflow(native, ref):
    """Scores ~1e6 apart: exp without the max subtracted would be inf; the result is
    the value row of the best key (or the mean of tied best keys)."""
    head_dim, n_ctx = 16, 40
    q = buffers.full((1, 2, head_dim), 100.0)
    k_values = np.zeros((1, n_ctx, head_dim), np.float32)
    k_values[0, :, 0] = np.arange(n_ctx) % 7          # keys 6, 13, 20, 27, 34 tie for best
    v_values = np.arange(n_ctx * head_dim, dtype=np.float32).reshape(1, n_ctx, head_dim)
    k_cache, v_cache = buffers.aligned_copy(k_values), buffers.aligned_copy(v_values)
    got = nan_buffer(q.shape)
    native.attention(q, k_cache, v_cache, n_ctx - 1, 1000.0, got, native.attention_scratch(n_ctx))
    best = v_values[0, 6::7].mean(axis=0)
    np.testing.assert_allclose(got[0], np.stack([best, best]), rtol=1e-6)


def test_attention_scratch_is_the_same_size_in_both_backends(native, ref):
    for n_ctx in (1, 7, 8, 9, 4096):
        assert native.attention_scratch(n_ctx, 1).shape == ref.attention_scratch(n_ctx, 512).shape


def test_attention_rejects_bad_arguments(native):
    m, n_head, n_kv_head, head_dim, n_ctx = 2, 4, 2, 9, 16
    q = buffers.zeros((m, n_head, head_dim))
    k = buffers.zeros((n_kv_head, n_ctx, head_dim))
    v = buffers.zeros((n_kv_head, n_ctx, head_dim))
    out = buffers.zeros((m, n_head, head_dim))
    scratch = native.attention_scratch(n_ctx, m)

    def call(**changes):
        args = dict(q=q, k_cache=k, v_cache=v, pos0=3, scale=0.5, out=out, scratch=scratch, heads=None, window=0)
        args.update(changes)
        native.attention(**args)

    call()                                                  # the baseline is valid
    call(window=3)
    bad = [
        (dict(pos0=n_ctx - m + 1), "pos0: pos0 \\+ m = 15 \\+ 2 exceeds"),
        (dict(pos0=-1), "pos0: expected an integer >= 0"),
        (dict(pos0=1.0), "pos0: expected an integer >= 0"),
        (dict(q=buffers.zeros((m, 3, head_dim)), out=buffers.zeros((m, 3, head_dim))),
         "k_cache: 2 KV heads do not divide q's 3 query heads"),
        (dict(k_cache=buffers.zeros((n_kv_head, n_ctx, 8))), "k_cache: head_dim 8 differs"),
        (dict(v_cache=buffers.zeros((n_kv_head, n_ctx + 1, head_dim))), "v_cache: expected shape"),
        (dict(q=buffers.zeros((m, n_head, head_dim), np.float64)), "q: expected dtype float32"),
        (dict(k_cache=buffers.zeros((n_kv_head, n_ctx, head_dim), np.float16)), "k_cache: expected dtype"),
        (dict(out=buffers.zeros((m, n_head, head_dim + 1))), "out: expected shape"),
        (dict(q=buffers.zeros((n_head, head_dim))), "q: expected 3 dimensions"),
        (dict(q=buffers.zeros(m * n_head * head_dim + 1)[1:].reshape(m, n_head, head_dim)),
         "q: data must be 32-byte aligned"),
        (dict(v_cache=buffers.zeros((n_kv_head, n_ctx, 2 * head_dim))[:, :, ::2]),
         "v_cache: array must be C-contiguous"),
        (dict(scale=float("nan")), "scale: expected a finite number"),
        (dict(scale=1e39), "scale: 1e\\+39 overflows float32"),
        (dict(scratch=native.attention_scratch(n_ctx - 8)), "scratch: 24 floats, need 48"),
        (dict(scratch=buffers.zeros((2, 48))), "scratch: expected 1 dimensions"),
        (dict(heads=(2, 2)), "heads: expected 0 <= h0 < h1 <= n_head=4"),
        (dict(heads=(0, 5)), "heads: expected 0 <= h0 < h1"),
        (dict(heads=3), "heads: expected a pair"),
        (dict(out=q), "out: overlaps q"),
        (dict(scratch=k.reshape(-1)), "scratch: overlaps k_cache"),
        (dict(window=-1), "window: expected an integer >= 0"),
        (dict(window=2.0), "window: expected an integer >= 0"),
        (dict(window=True), "window: expected an integer >= 0"),
        (dict(window=None), "window: expected an integer >= 0"),
        (dict(window=4, pos0=-1), "pos0: expected an integer >= 0"),
    ]
    for changes, message in bad:
        with pytest.raises(ValueError, match=message):
            call(**changes)
    read_only = buffers.zeros((m, n_head, head_dim))
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out: array is read-only"):
        call(out=read_only)
    call()                                                  # the process is still fine
    call(window=5)


def test_a_window_must_fit_float32():
    """The windowed kernel receives the window as a float32: exact below 2^24, so a window
    shorter than a longer cache is refused (windows >= n_ctx need no window at all)."""
    from llambda.runtime.native.attention import _window
    assert _window(5, 2 ** 24) == 5 and _window(2 ** 24 + 7, 2 ** 24 + 1) == 0 and _window(0, 2 ** 30) == 0
    with pytest.raises(ValueError, match="window: a window below n_ctx=16777217 needs n_ctx <= 16777216"):
        _window(5, 2 ** 24 + 1)
