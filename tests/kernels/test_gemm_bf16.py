"""The BF16 linear layer (AVX512_BF16 ``vdpbf16ps``), its layout and the bf16 activations.

Activations are rounded to bf16 first, as llama.cpp does for its bf16 vec_dot (round to
nearest even). Against the float64 product of those bf16 values, each output is one chain
of exact products added in f32 (two per k pair), so

    |got - exact(bf16(x), w)| <= (k + 4) * eps32 * sum_k |bf16(x)||w|        (eps32 = 2^-23)

and against the f32 activations the rounding adds at most 2^-8 relative per activation:

    |got - exact(x, w)| <= (2^-8 + (k + 4) * eps32) * sum_k |x||w|

(the kernel flushes subnormal inputs and results to zero; the values here stay clear of them).
Batch invariance is checked bit for bit, as for the float kinds.
"""
import gguf
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import assert_refused, before_a_guard_page, float_arrays, nan_buffer
from llambda.runtime import buffers, layout_bf16
from llambda.runtime.native import gemm_bf16 as native_bf16
from llambda.runtime.native._lib import kernel
from llambda.runtime.ref import gemm_bf16 as ref_bf16

EPS32 = float(np.finfo(np.float32).eps)
PANEL = 16

pytestmark = pytest.mark.skipif(not native_bf16.bf16_supported(), reason="this CPU lacks avx512_bf16")

m_sizes = st.one_of(st.sampled_from([1, 7, 8, 9, 17]), st.integers(1, 60))
n_sizes = st.one_of(st.sampled_from([1, 15, 16, 17, 47, 48, 49, 97]), st.integers(1, 200))
k_sizes = st.one_of(st.sampled_from([1, 2, 3, 7, 8, 9, 16, 17]), st.integers(1, 700))
round_m_sizes = st.one_of(st.sampled_from([1, 15, 16, 17]), st.integers(1, 70))
round_k_sizes = st.one_of(st.sampled_from([1, 2, 15, 16, 17, 31, 33]), st.integers(1, 700))

# f32 bit patterns where rounding to bf16 goes wrong most easily
SPECIAL_BITS = np.array([
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,      # ties: high half even (stays), odd (rounds up)
    0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F808000,      # signalling NaNs (a low payload would round to inf)
    0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF,      # quiet NaNs
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,      # +-inf, +-0
    0x00000001, 0x80000001, 0x00008000, 0x00018000,      # subnormals (not flushed), ties among them
    0x007FFFFF, 0x807FFFFF, 0x007F8000, 0x00800000,      # ... the largest, rounding up to the smallest normal
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,      # the largest finite: to inf, tie to inf, just below
], np.uint32)
# Bits a kernel never wrote (a bf16 NaN), in the pad column too.
GARBAGE = 0x7FC1


def bf16_weight(matrix):
    n, k = matrix.shape
    return layout_bf16.pack("BF16", gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.BF16), n, k)


def assert_within(got, x, weights, extra_relative, what):
    x64, w64 = x.astype(np.float64), weights.astype(np.float64)
    exact = x64 @ w64.T
    bound = (extra_relative + (x.shape[1] + 4) * EPS32) * (np.abs(x64) @ np.abs(w64).T)
    error = np.abs(got - exact)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), f"{what}: |err| {error[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def assert_same_bits(got, want, what):
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.all(), f"{what}: {int((~same).sum())} outputs differ, first at {tuple(np.argwhere(~same)[0])}"


@given(st.data(), m_sizes, n_sizes, k_sizes)
def test_gemm_bf16_matches_exact_product(data, m, n, k):
    x = float_arrays(data.draw, (m, k))
    w = bf16_weight(float_arrays(data.draw, (n, k)))
    weights = layout_bf16.dequantize(w)
    xb = layout_bf16.to_bf16(x)
    n0 = PANEL * data.draw(st.integers(0, (n - 1) // PANEL))
    n1 = data.draw(st.integers(n0 + 1, n))
    for gemm in (native_bf16.gemm_bf16_pairs, ref_bf16.gemm_bf16_pairs):
        out = nan_buffer((m, n))
        gemm(xb, w, out, rows=(n0, n1))
        assert_within(out[:, n0:n1], layout_bf16.from_bf16(xb, k), weights[n0:n1], 0.0, gemm.__module__)
        assert_within(out[:, n0:n1], x, weights[n0:n1], 2.0 ** -8, f"{gemm.__module__} vs f32 x")
        assert np.isnan(out[:, :n0]).all() and np.isnan(out[:, n1:]).all(), "wrote outside the columns"


@given(st.data(), st.integers(2, 40), n_sizes, k_sizes)
def test_gemm_bf16_rows_are_batch_invariant(data, m, n, k):
    """Each row: the same bits alone (m = 1), at another position, and with the columns split."""
    xb = layout_bf16.to_bf16(float_arrays(data.draw, (m, k)))
    w = bf16_weight(float_arrays(data.draw, (n, k)))
    alone = np.empty((m, n), np.float32)
    for i in range(m):
        one = nan_buffer((1, n))
        native_bf16.gemm_bf16_pairs(buffers.aligned_copy(xb[i:i + 1]), w, one)
        alone[i] = one[0]
    out = nan_buffer((m, n))
    native_bf16.gemm_bf16_pairs(xb, w, out)
    assert_same_bits(out, alone, f"m={m}")
    perm = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).permutation(m)
    out = nan_buffer((m, n))
    native_bf16.gemm_bf16_pairs(buffers.aligned_copy(xb[perm]), w, out)
    assert_same_bits(out, alone[perm], "rows permuted")
    split = PANEL * data.draw(st.integers(0, (n - 1) // PANEL))
    out = nan_buffer((m, n))
    if split:
        native_bf16.gemm_bf16_pairs(xb, w, out, rows=(0, split))
    native_bf16.gemm_bf16_pairs(xb, w, out, rows=(split, n))
    assert_same_bits(out, alone, f"columns split at {split}")


def test_to_bf16_rounds_as_gguf_and_llama_cpp():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 37)) * 10.0 ** rng.integers(-30, 30, (5, 37))).astype(np.float32)
    x.flat[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8)]
    bits = layout_bf16.to_bf16(x)
    assert bits.shape == (5, 38) and not bits[:, 37].any()
    expected = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view("<u2").reshape(5, 37)
    np.testing.assert_array_equal(bits[:, :37], expected)
    assert list(bits.flat[5:8]) == [0x3F80, 0x3F82, 0xBF80]          # ties to even


def test_pack_then_dequantize_is_gguf_bit_for_bit():
    rng = np.random.default_rng(4)
    for n, k in [(1, 1), (17, 9), (16, 33), (40, 8)]:
        matrix = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-6, 4, (n, k))).astype(np.float32)
        raw = gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.BF16)
        w = layout_bf16.pack("BF16", raw, n, k)
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.BF16).reshape(n, k)
        np.testing.assert_array_equal(layout_bf16.dequantize(w).view(np.uint32), expected.view(np.uint32))
        panels = w.arrays["panels"]
        assert panels.shape == (-(-n // 16), -(-k // 2), 16, 2) and panels.ctypes.data % 32 == 0


def test_gemm_bf16_rejects_bad_arguments():
    m, n, k = 3, 20, 7
    w = bf16_weight(np.ones((n, k), np.float32))
    xb, out = layout_bf16.to_bf16(np.ones((m, k), np.float32)), buffers.zeros((m, n))
    assert_refused([
        ("w: expected a PackedWeight of kind 'bf16_pairs'",
         lambda: native_bf16.gemm_bf16_pairs(xb, w.__class__("f32", n, k, w.arrays), out)),
        ("xb: expected shape", lambda: native_bf16.gemm_bf16_pairs(buffers.zeros((m, k), np.uint16), w, out)),
        ("xb: expected dtype uint16", lambda: native_bf16.gemm_bf16_pairs(buffers.zeros((m, k + 1)), w, out)),
        ("out: expected shape", lambda: native_bf16.gemm_bf16_pairs(xb, w, buffers.zeros((m, n + 1)))),
        ("rows: n0 must be a multiple of 16", lambda: native_bf16.gemm_bf16_pairs(xb, w, out, rows=(8, 20))),
        ("rows: n0 must be a multiple of 16",
         lambda: native_bf16.gemm_bf16_pairs_calls_ranges(xb, w, out, [(0, 16), (8, 20)])),
        ("rows: expected 0 <= n0 < n1 <= 20",
         lambda: native_bf16.gemm_bf16_pairs_calls_ranges(xb, w, out, [(0, 16), (16, 21)])),
        ("cannot pack GGUF type F16", lambda: layout_bf16.pack("F16", np.zeros((2, 3), np.float16), 2, 3)),
        ("do not make a", lambda: layout_bf16.pack("BF16", np.zeros(10, np.uint8), 2, 3)),
    ])
    native_bf16.gemm_bf16_pairs(xb, w, out)
    np.testing.assert_array_equal(out, float(k))


# ---------------------------------------------------------------- rounding activations to bf16

def drawn_bits(draw, m, k):
    """f32 [m, k] mixing ordinary floats, arbitrary bit patterns, ties at every exponent and
    SPECIAL_BITS, in the proportions a draw picks."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = float_arrays(draw, (m, k)).view(np.uint32)
    ties = (rng.integers(0, 1 << 16, (m, k), dtype=np.uint32) << 16) | 0x8000
    arbitrary = rng.integers(0, 1 << 32, (m, k), dtype=np.uint64).astype(np.uint32)
    specials = SPECIAL_BITS[rng.integers(0, SPECIAL_BITS.size, (m, k))]
    source = rng.choice(4, (m, k), p=rng.dirichlet(np.ones(4)))
    picked = np.choose(source, [bits, ties, arbitrary, specials])
    return buffers.aligned_copy(picked.view(np.float32))


def garbage_bits(m, k):
    return buffers.full((m, layout_bf16.k_pairs(k) * layout_bf16.PAIR), GARBAGE, np.uint16)


def drawn_split(draw, n, multiple=1):
    """Consecutive ranges covering [0, n), each start a multiple of ``multiple``."""
    starts = sorted(draw(st.sets(st.integers(1, (n - 1) // multiple), max_size=4))) if n > multiple else []
    bounds = [0] + [multiple * s for s in starts] + [n]
    return list(zip(bounds[:-1], bounds[1:]))


def assert_same_words(got, want, what):
    same = got == want
    assert same.all(), (f"{what}: {int((~same).sum())} words differ, first at {tuple(np.argwhere(~same)[0])}: "
                        f"{got[~same][0]:#06x} != {want[~same][0]:#06x}")


def test_round_bf16_special_values():
    x = buffers.aligned_copy(SPECIAL_BITS.view(np.float32)[None, :])
    want = [0x3F80, 0x3F82, 0xBF80, 0xBF82,
            0x7FC0, 0xFFC0, 0x7FFF, 0x7FC0,
            0x7FC0, 0xFFC0, 0x7FFF, 0xFFFF,
            0x7F80, 0xFF80, 0x0000, 0x8000,
            0x0000, 0x8000, 0x0000, 0x0002,
            0x0080, 0x8080, 0x0080, 0x0080,
            0x7F80, 0xFF80, 0x7F80, 0x7F7F]
    for backend in (native_bf16, ref_bf16):
        xb = garbage_bits(*x.shape)
        backend.round_bf16(x, xb)
        assert_same_words(xb[0], np.array(want, np.uint16), backend.__name__)


@given(st.data(), round_m_sizes, round_k_sizes)
def test_round_bf16_is_to_bf16_bit_for_bit(data, m, k):
    """Both backends, over garbage (the pad column of an odd k included), whole and in row ranges."""
    x = drawn_bits(data.draw, m, k)
    want = layout_bf16.to_bf16(x)
    for backend in (native_bf16, ref_bf16):
        xb = garbage_bits(m, k)
        backend.round_bf16(x, xb)
        assert_same_words(xb, want, backend.__name__)
    ranges = drawn_split(data.draw, m)
    xb = garbage_bits(m, k)
    for symbol, args in native_bf16.round_bf16_calls(x, xb, ranges):
        kernel(symbol)(*args)
    assert_same_words(xb, want, f"rows split {ranges}")


@given(st.data(), round_m_sizes, round_k_sizes)
def test_round_bf16_touches_only_its_rows(data, m, k):
    """rows=(r0, r1) writes those rows only, and neither reads nor writes past the arrays' ends."""
    keep = []
    x = before_a_guard_page(drawn_bits(data.draw, m, k), keep)
    xb = before_a_guard_page(garbage_bits(m, k), keep)
    r0 = data.draw(st.integers(0, m - 1))
    r1 = data.draw(st.integers(r0 + 1, m))
    for backend in (native_bf16, ref_bf16):
        xb[...] = GARBAGE
        backend.round_bf16(x, xb, rows=(r0, r1))
        assert_same_words(xb[r0:r1], layout_bf16.to_bf16(x[r0:r1]), f"{backend.__name__} rows {r0}:{r1}")
        assert (xb[:r0] == GARBAGE).all() and (xb[r1:] == GARBAGE).all(), "wrote outside the rows"


def test_round_bf16_rejects_bad_arguments():
    m, k = 3, 7
    x, xb = buffers.zeros((m, k)), garbage_bits(m, k)
    read_only = garbage_bits(m, k)
    read_only.flags.writeable = False
    assert_refused([
        ("x: expected dtype float32", lambda: native_bf16.round_bf16(buffers.zeros((m, k), np.float64), xb)),
        ("x: expected 2 dimensions", lambda: native_bf16.round_bf16(buffers.zeros(k), xb)),
        ("x: array must be C-contiguous", lambda: native_bf16.round_bf16(buffers.zeros((m, 2 * k))[:, ::2], xb)),
        ("xb: expected dtype uint16", lambda: native_bf16.round_bf16(x, buffers.zeros((m, k + 1)))),
        ("xb: expected shape", lambda: native_bf16.round_bf16(x, buffers.zeros((m, k), np.uint16))),
        ("xb: expected shape", lambda: native_bf16.round_bf16(x, garbage_bits(m + 1, k))),
        ("xb: array must be C-contiguous", lambda: native_bf16.round_bf16(x, garbage_bits(m, 2 * k + 1)[:, ::2])),
        ("xb: array is read-only", lambda: native_bf16.round_bf16(x, read_only)),
        ("rows: expected 0 <= r0 < r1 <= 3", lambda: native_bf16.round_bf16(x, xb, rows=(1, 4))),
        ("rows: expected 0 <= r0 < r1 <= 3", lambda: native_bf16.round_bf16(x, xb, rows=(2, 2))),
        ("rows: expected a pair", lambda: native_bf16.round_bf16(x, xb, rows=3)),
        ("rows: expected 0 <= r0 < r1 <= 3", lambda: native_bf16.round_bf16_calls(x, xb, [(0, 2), (2, 5)])),
    ])
    assert (xb == GARBAGE).all(), "a refused call wrote"


@given(st.data(), m_sizes, n_sizes, k_sizes)
def test_gemm_bf16_pairs_calls_ranges_split_the_columns_bit_for_bit(data, m, n, k):
    """The plan recorder's split: the calls for consecutive column ranges give one call's bits."""
    xb = layout_bf16.to_bf16(float_arrays(data.draw, (m, k)))
    w = bf16_weight(float_arrays(data.draw, (n, k)))
    whole = nan_buffer((m, n))
    native_bf16.gemm_bf16_pairs(xb, w, whole)
    ranges = drawn_split(data.draw, n, PANEL)
    out = nan_buffer((m, n))
    calls = native_bf16.gemm_bf16_pairs_calls_ranges(xb, w, out, ranges)
    assert len(calls) == len(ranges)
    for symbol, args in data.draw(st.permutations(calls)):
        kernel(symbol)(*args)
    assert_same_bits(out, whole, f"columns split {ranges}")
