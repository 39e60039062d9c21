"""The bindings' ``<op>_call`` twins: the calls a plan records, split across threads.

For every op, running the kernel through ``_call`` once per thread's share
(``runtime.plan.split_range`` into 1, 2 and 3 chunks, the way a plan splits)
must give bit for bit what the one-shot op gives: the splits only move the
start and the count, never the arithmetic. Outputs start as NaN, so an element
no share wrote shows up. Bad splits are refused with a ValueError naming them.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import nan_buffer, sizes, float_arrays
from llambda.runtime import buffers, layout_float
from llambda.runtime.plan import split_range
import llambda.runtime.native.elementwise as native_elementwise
import llambda.runtime.native.gemm as native_gemm
from llambda.runtime.native._lib import kernel

THREAD_COUNTS = (1, 2, 3)
LINE = 16                      # f32 per 64-byte line: spans and gemm columns start on one


def run_split(make_call, n, n_threads, multiple=1):
    """Call the kernel once per non-empty chunk of [0, n), as the threads of a plan would."""
    for chunk in split_range(n, n_threads, multiple):
        if chunk is not None:
            symbol, args = make_call(chunk)
            kernel(symbol)(*args)


def assert_same_bits(got, want):
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def check_split(op, make_call, out_shape, n, multiple=1, prepare=None):
    """``op(out)`` once, then ``make_call(out, chunk)`` over 1, 2, 3 chunks: same bits.

    ``prepare(out)`` resets shared state (e.g. a cache) before each run."""
    want = nan_buffer(out_shape)
    if prepare:
        prepare(want)
    op(want)
    for n_threads in THREAD_COUNTS:
        got = nan_buffer(out_shape)
        if prepare:
            prepare(got)
        run_split(lambda chunk: make_call(got, chunk), n, n_threads, multiple)
        assert_same_bits(got, want)


# --------------------------------------------------------------------------- elementwise spans

@given(st.data(), sizes(LINE, 2000))
def test_elementwise_spans_match_the_op(native, data, n):
    a = float_arrays(data.draw, (n,))
    b = float_arrays(data.draw, (n,), scale=data.draw(st.sampled_from([1e-3, 1.0, 30.0])))
    ew = native_elementwise
    check_split(lambda out: native.add(a, b, out), lambda out, s: ew.add_call(a, b, out, span=s), n, n, LINE)
    check_split(lambda out: native.scale(a, 0.75, out), lambda out, s: ew.scale_call(a, 0.75, out, span=s),
                n, n, LINE)
    check_split(lambda out: native.exp(b, out), lambda out, s: ew.exp_call(b, out, span=s), n, n, LINE)
    check_split(lambda out: native.silu_mul(b, a, out), lambda out, s: ew.silu_mul_call(b, a, out, span=s),
                n, n, LINE)
    check_split(lambda out: native.gelu_mul(b, a, out), lambda out, s: ew.gelu_mul_call(b, a, out, span=s),
                n, n, LINE)


def test_a_span_covers_the_flattened_array(native):
    a = buffers.aligned_copy(np.arange(3 * 20, dtype=np.float32).reshape(3, 20))
    out = nan_buffer(a.shape)
    run_split(lambda s: native_elementwise.add_call(a, a, out, span=s), a.size, 3, LINE)
    assert_same_bits(out, a + a)


# --------------------------------------------------------------------------- rows

@given(st.data(), st.integers(1, 9), sizes(8, 300))
def test_row_ranges_match_the_op(native, data, m, d):
    x = float_arrays(data.draw, (m, d))
    w = float_arrays(data.draw, (d,))
    ew = native_elementwise
    check_split(lambda out: native.rmsnorm(x, w, 1e-5, out),
                lambda out, r: ew.rmsnorm_call(x, w, 1e-5, out, rows=r), (m, d), m)
    check_split(lambda out: native.softmax(x, out), lambda out, r: ew.softmax_call(x, out, rows=r), (m, d), m)
    check_split(lambda out: native.add_bias(x, w, out), lambda out, r: ew.add_bias_call(x, w, out, rows=r),
                (m, d), m)


def test_rows_of_a_3d_input_count_every_leading_axis(native):
    x = buffers.aligned_copy(np.random.default_rng(1).standard_normal((2, 3, 24)), np.float32)
    want, got = nan_buffer(x.shape), nan_buffer(x.shape)
    native.softmax(x, want)
    run_split(lambda r: native_elementwise.softmax_call(x, got, rows=r), 6, 3)
    assert_same_bits(got, want)


@given(st.data(), st.sampled_from(["pairs", "halves"]), st.integers(1, 7), st.integers(1, 4),
       st.sampled_from([2, 8, 10, 64]))
def test_rope_token_ranges_match_the_op(native, ref, data, style, m, n_heads, head_dim):
    n_ctx = 32
    cos, sin = ref.rope_tables(n_ctx, head_dim, 10000.0, style)
    x = float_arrays(data.draw, (m, n_heads, head_dim))
    positions = buffers.aligned_copy(data.draw(st.lists(st.integers(0, n_ctx - 1), min_size=m, max_size=m)),
                                     np.int32)
    check_split(lambda out: native.rope(x, positions, cos, sin, style, out),
                lambda out, r: native_elementwise.rope_call(x, positions, cos, sin, style, out, rows=r),
                x.shape, m)


# --------------------------------------------------------------------------- gemm

@given(st.data(), st.sampled_from(["f32", "f16"]), st.sampled_from([1, 2, 6, 7, 13]),
       st.one_of(st.sampled_from([1, 15, 16, 17, 33, 48, 49]), st.integers(1, 120)),
       st.sampled_from([1, 8, 9, 64]))
def test_gemm_column_ranges_match_the_op(native, data, kind, m, n, k):
    x = float_arrays(data.draw, (m, k))
    raw = float_arrays(data.draw, (n, k), scale=1.0)
    w = layout_float.pack(kind.upper(), raw.astype(np.float16) if kind == "f16" else raw, n, k)
    op = native.gemm_f16 if kind == "f16" else native.gemm_f32
    make = native_gemm.gemm_f16_call if kind == "f16" else native_gemm.gemm_f32_call
    check_split(lambda out: op(x, w, out), lambda out, r: make(x, w, out, rows=r), (m, n), n, LINE)


@pytest.mark.parametrize("m, k", [(native_gemm.M_BLOCK + 1, 8),                          # two row blocks
                                  (native_gemm.ROW_TILE + 1, native_gemm.K_BLOCK + 8)])     # two k blocks
def test_a_cache_blocked_gemm_is_several_calls(native, m, k):
    """Past the blocking thresholds the op makes several calls: ``_calls`` lists them (per
    thread, in order), and ``_call``, which promises one, refuses."""
    n = 20
    rng = np.random.default_rng(2)
    x = buffers.aligned_copy(rng.standard_normal((m, k)), np.float32)
    w = layout_float.pack("F32", rng.standard_normal((n, k)).astype(np.float32), n, k)
    with pytest.raises(ValueError, match="cache-blocked into 2 kernel calls.*use gemm_f32_calls"):
        native_gemm.gemm_f32_call(x, w, nan_buffer((m, n)))

    def run_calls(out, rows):
        for symbol, args in native_gemm.gemm_f32_calls(x, w, out, rows=rows):
            kernel(symbol)(*args)

    want = nan_buffer((m, n))
    native.gemm_f32(x, w, want)
    for n_threads in THREAD_COUNTS:
        got = nan_buffer((m, n))
        for chunk in split_range(n, n_threads, LINE):
            if chunk is not None:
                run_calls(got, chunk)
        assert_same_bits(got, want)


# --------------------------------------------------------------------------- conventions

def test_call_returns_the_symbol_and_the_c_arguments_in_order(native):
    a, b, out = buffers.zeros(64), buffers.zeros(64), buffers.zeros(64)
    symbol, args = native_elementwise.add_call(a, b, out, span=(16, 40))
    assert symbol == "llb_add_f32__avx2"
    assert args == [a.ctypes.data + 64, b.ctypes.data + 64, out.ctypes.data + 64, 24]
    symbol, args = native_elementwise.scale_call(a, 0.5, out)
    assert args == [a.ctypes.data, 0.5, out.ctypes.data, 64]            # the float in its C position


def test_call_functions_stay_out_of_the_backend_namespace(native, ref):
    for backend in (native, ref):
        assert not [name for name in vars(backend) if name.endswith(("_call", "_calls"))]
    assert "kv_store_paged" in vars(native) and "kv_store_paged" in vars(ref)


def bad_split_cases():
    a, out = buffers.zeros(64), buffers.zeros(64)
    x, xout = buffers.zeros((4, 8)), buffers.zeros((4, 8))
    w8 = buffers.zeros(8)
    cos, sin = buffers.zeros((8, 8)), buffers.zeros((8, 8))
    tokens, positions = buffers.zeros((4, 2, 8)), buffers.aligned_copy([0, 1, 2, 3], np.int32)
    n = 40
    gx, gout = buffers.zeros((1, 8)), buffers.zeros((1, n))
    gw = layout_float.pack("F32", np.zeros((n, 8), np.float32), n, 8)
    ew = native_elementwise
    return [
        (lambda s: ew.add_call(a, a, out, span=s), [
            ((8, 64), "span: i0 must be a multiple of 16"),
            ((16, 65), r"span: expected 0 <= i0 < i1 <= 64"),
            ((32, 32), r"span: expected 0 <= i0 < i1"),
            ((-16, 8), r"span: expected 0 <= i0 < i1"),
            (16, "span: expected a pair"),
            ((0, 16, 32), "span: expected a pair"),
            ((0.0, 16), r"span\[0\]: expected an integer"),
            ((True, 16), r"span\[0\]: expected an integer")]),
        (lambda s: ew.scale_call(a, 2.0, out, span=s), [((0, 80), "span: expected 0 <= i0 < i1 <= 64")]),
        (lambda s: ew.exp_call(a, out, span=s), [((4, 8), "span: i0 must be a multiple of 16")]),
        (lambda s: ew.silu_mul_call(a, a, out, span=s), [((0, 0), "span: expected 0 <= i0 < i1")]),
        (lambda r: ew.rmsnorm_call(x, w8, 1e-5, xout, rows=r), [
            ((0, 5), r"rows: expected 0 <= r0 < r1 <= 4"),
            ((2, 1), "rows: expected"),
            ("01", r"rows\[0\]: expected an integer")]),
        (lambda r: ew.softmax_call(x, xout, rows=r), [((4, 5), "rows: expected 0 <= r0 < r1 <= 4")]),
        (lambda r: ew.rope_call(tokens, positions, cos, sin, "pairs", tokens, rows=r), [
            ((0, 5), "rows: expected 0 <= r0 < r1 <= 4"), ((1, None), r"rows\[1\]: expected an integer")]),
        (lambda r: native_gemm.gemm_f32_call(gx, gw, gout, rows=r), [
            ((8, 40), "rows: n0 must be a multiple of 16"), ((16, 41), "rows: expected 0 <= n0 < n1 <= 40")]),
    ]


def test_bad_splits_are_refused(native):
    for make_call, cases in bad_split_cases():
        for split, message in cases:
            with pytest.raises(ValueError, match=message):
                make_call(split)
    out = nan_buffer(64)                   # the process is fine and the kernels still run
    native.add(buffers.full(64, 1.0), buffers.full(64, 2.0), out)
    assert_same_bits(out, np.full(64, 3.0, np.float32))
