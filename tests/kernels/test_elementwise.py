"""Elementwise and row-wise kernels against their numpy references.

Each property draws an awkward length (1, 7, 8, 9, 17, up to a few thousand),
values mixing zeros, negatives, tiny and huge magnitudes, and whether to run in
place; outputs start as NaN so an unwritten element fails.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import nan_buffer, sizes, float_arrays
from llambda.runtime import buffers
from llambda.runtime.ref.elementwise import rope_partner

LARGE = 3000
ROW_SCALES = [0.0, 1e-30, 1e-3, 1.0, 30.0, 1e4, 1e30]      # 0.0: an all-zero row


def output_for(data, like):
    """A NaN-filled output, or (drawn) ``like`` itself to run the kernel in place."""
    if data.draw(st.booleans(), label="in_place"):
        return like
    return nan_buffer(like.shape)


def rows_with_scales(data, m, n, scales):
    """[m, n] values, each row at its own drawn scale: one batch mixes huge, tiny and zero rows."""
    x = buffers.empty((m, n))
    for row in range(m):
        x[row] = float_arrays(data.draw, (n,), scale=data.draw(st.sampled_from(scales)))
    return x


# --------------------------------------------------------------------------- add, scale

@given(st.data(), sizes(8, 5000))
def test_add_matches_reference(native, ref, data, n):
    a = float_arrays(data.draw, (n,))
    b = float_arrays(data.draw, (n,))
    want = nan_buffer(n)
    ref.add(a, b, want)
    got = output_for(data, a)
    native.add(a, b, got)
    np.testing.assert_array_equal(got, want)   # one IEEE add: exact


@given(st.data(), sizes(8, 5000),
       st.one_of(st.sampled_from([0.0, -1.0, 0.125, 1e-30, 3e30]), st.floats(-1e4, 1e4, width=32)))
def test_scale_matches_reference(native, ref, data, n, s):
    x = float_arrays(data.draw, (n,))
    want = nan_buffer(n)
    ref.scale(x, s, want)
    got = output_for(data, x)
    native.scale(x, s, got)
    np.testing.assert_array_equal(got, want)   # one IEEE multiply by float32(s): exact


# --------------------------------------------------------------------------- SiLU * up

@given(st.data(), sizes(8, LARGE))
def test_silu_mul_matches_reference(native, ref, data, n):
    gate = float_arrays(data.draw, (n,), scale=data.draw(st.sampled_from([1e-3, 1.0, 10.0, 100.0, 1e4, 1e30])))
    up = float_arrays(data.draw, (n,))
    want = nan_buffer(n)
    ref.silu_mul(gate, up, want)
    got = output_for(data, data.draw(st.sampled_from([gate, up])))
    native.silu_mul(gate, up, got)
    # exp < 1 ulp, then +1, divide, multiply (0.5 ulp each): < 3 ulp = 3.6e-7 relative.
    # atol: gate < -88.7 makes exp(-gate) inf and the result -0, where the truth is
    # below |gate| * 3e-39 * |up|.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


# --------------------------------------------------------------------------- GELU * up

GELU_C = np.sqrt(2.0 / np.pi)
FLT_U = 2.0 ** -24


def gelu_tolerance(gate, up):
    """Allowed |error| of gelu_mul, elementwise.

    The kernel computes g / (1 + exp(z)), z = -2y rounded to f32 after three roundings
    (x^2, FMA, x): exp(z) errs by up to ~3|z| u relative, which reaches the result
    where exp(z) dominates 1 + exp(z) (negative gates), plus exp (< 1 ulp), +1, divide
    and multiply: 4 (1 + |z|) u relative (measured max 2.6 (1 + |z|) u on a dense
    sweep of [-10.2, 10]). atol: a gate below ~-10.1 makes exp(z) overflow and the
    result -0, where the truth is below 10.2 e^-88.7 = 3.3e-38 times |up|."""
    g = gate.astype(np.float64)
    z = np.minimum(np.abs(2 * GELU_C * (g + 0.044715 * g ** 3)), 89.0)
    want = np.abs(ref_gelu_tanh(gate) * up.astype(np.float64))
    return 4 * (1 + z) * FLT_U * want + 4e-38 * np.abs(up.astype(np.float64))


def ref_gelu_tanh(gate):
    from llambda.runtime.ref.elementwise import gelu_tanh
    return gelu_tanh(gate)


@given(st.data(), sizes(8, LARGE))
def test_gelu_mul_matches_reference(native, ref, data, n):
    gate_scale = data.draw(st.sampled_from([1e-30, 1e-3, 1.0, 3.0, 10.0, 1e4, 1e30]), label="gate scale")
    gate = float_arrays(data.draw, (n,), scale=gate_scale)
    up_scales = [1e-3, 1.0, 1e4] + ([1e30] if gate_scale <= 10 else [])    # the product stays finite
    up = float_arrays(data.draw, (n,), scale=data.draw(st.sampled_from(up_scales), label="up scale"))
    want = nan_buffer(n)
    ref.gelu_mul(gate, up, want)
    tolerance = gelu_tolerance(gate, up)
    got = output_for(data, data.draw(st.sampled_from([gate, up])))
    native.gelu_mul(gate, up, got)
    assert np.isfinite(got).all()
    error = np.abs(got.astype(np.float64) - want)
    assert (error <= tolerance).all(), f"max error / tolerance {(error / np.maximum(tolerance, 1e-300)).max()}"


def test_gelu_mul_edges(native, ref):
    """Huge gates: gate itself (x^3 overflows to inf, exp(-2y) to 0) or -0 (exp(-2y) to inf), never
    NaN; infinities are the limits; NaN stays NaN; zero gives zero with its sign."""
    gate = buffers.aligned_copy(np.float32([-np.inf, -3e38, -1e30, -1e19, -100.0, -20.0, -0.0, 0.0, 1e-38,
                                            20.0, 1e19, 1e30, 3e38, np.inf, np.nan]))
    up = buffers.full(gate.shape, 1.0)
    got, want = nan_buffer(gate.shape), nan_buffer(gate.shape)
    native.gelu_mul(gate, up, got)
    ref.gelu_mul(gate, up, want)
    expected = np.float32([-0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, 0.0, 5e-39, 20.0, 1e19, 1e30, 3e38,
                           np.inf, np.nan])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got[:8]), np.signbit(expected[:8]))
    np.testing.assert_array_equal(want, expected)


def test_gelu_reference_is_the_tanh_formula():
    """The reference's logistic form equals 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) where
    the tanh form is well conditioned (x > -4: 1 + tanh does not cancel yet)."""
    x = np.linspace(-4.0, 12.0, 100_001)
    tanh_form = 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(ref_gelu_tanh(x), tanh_form, rtol=1e-11, atol=1e-300)


# --------------------------------------------------------------------------- bias

@given(st.data(), st.integers(1, 5), sizes(8, LARGE))
def test_add_bias_matches_reference(native, ref, data, m, n):
    x = rows_with_scales(data, m, n, ROW_SCALES)
    bias = float_arrays(data.draw, (n,), scale=data.draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4, 1e30])))
    want = nan_buffer((m, n))
    ref.add_bias(x, bias, want)
    got = output_for(data, x)
    native.add_bias(x, bias, got)
    np.testing.assert_array_equal(got, want)   # one IEEE add: exact


def test_add_bias_takes_any_leading_shape(native, ref):
    x = buffers.aligned_copy(np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5))
    bias = buffers.aligned_copy(np.float32([1, -2, 0.5, 0, 1e30]))
    want = nan_buffer(x.shape)
    ref.add_bias(x, bias, want)
    native.add_bias(x, bias, x)                # in place
    np.testing.assert_array_equal(x, want)


# --------------------------------------------------------------------------- RMSNorm

@given(st.data(), st.integers(1, 4), sizes(8, LARGE), st.sampled_from([1e-6, 1e-5, 1.0]))
def test_rmsnorm_matches_reference(native, ref, data, m, d, eps):
    x = rows_with_scales(data, m, d, ROW_SCALES)
    w = float_arrays(data.draw, (d,), scale=data.draw(st.sampled_from([1e-3, 1.0, 30.0])))
    want = nan_buffer((m, d))
    ref.rmsnorm(x, w, eps, want)
    got = output_for(data, x)
    native.rmsnorm(x, w, eps, got)
    # The f32 sum of squares over 32 lanes errs by at most (d/32 + 5) * 2^-24
    # (5.6e-6 at d = 3000, positive terms only), halved by the square root, plus
    # three roundings: rtol 1e-5. Rows of 1e30 or 1e-30 take the f64 path.
    # atol: outputs of tiny rows times small weights may be subnormal.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-37)


@given(st.data(), st.integers(1, 5), st.sampled_from([(1, 64), (2, 80), (3, 128), (4, 256), (7, 9)]))
def test_rmsnorm_per_head(native, ref, data, m, heads):
    """Q/K norms (Qwen 3, Gemma 3): q [m, n_head * head_dim] normalised per head, as the model
    calls it, through a contiguous reshape to [m * n_head, head_dim] with w [head_dim]."""
    n_head, head_dim = heads
    q = rows_with_scales(data, m * n_head, head_dim, ROW_SCALES).reshape(m, n_head * head_dim)
    w = float_arrays(data.draw, (head_dim,))
    want = nan_buffer(q.shape)
    ref.rmsnorm(q.reshape(m * n_head, head_dim), w, 1e-6, want.reshape(m * n_head, head_dim))
    for h in range(n_head):        # the same, written per head from the math
        part = q[:, h * head_dim:(h + 1) * head_dim].astype(np.float64)
        by_head = part / np.sqrt(np.mean(part * part, axis=-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(want[:, h * head_dim:(h + 1) * head_dim], by_head, rtol=1e-6, atol=1e-37)
    got = output_for(data, q)
    native.rmsnorm(q.reshape(m * n_head, head_dim), w, 1e-6, got.reshape(m * n_head, head_dim))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-37)    # as test_rmsnorm_matches_reference


def test_rmsnorm_huge_and_tiny_rows_normalise_like_ordinary_ones(native):
    base = np.linspace(-1.0, 1.0, 19, dtype=np.float32)
    # 1e-18: squares underflow f32's sum; 1e30, 3e38: squares overflow it
    x = buffers.aligned_copy(np.stack([base, base * 1e30, base * 1e-18, base * 3e38]))
    w = buffers.full(19, 1.0)
    out = nan_buffer(x.shape)
    native.rmsnorm(x, w, 1e-45, out)            # eps negligible even for the 1e-18 row
    for row in out:
        np.testing.assert_allclose(row, out[0], rtol=1e-6)


# --------------------------------------------------------------------------- softmax

@given(st.data(), st.integers(1, 4), sizes(8, LARGE))
def test_softmax_matches_reference(native, ref, data, m, n):
    x = rows_with_scales(data, m, n, ROW_SCALES[1:])
    if data.draw(st.booleans(), label="some -inf"):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        holes = rng.random((m, n)) < 0.3
        holes[np.arange(m), rng.integers(0, n, m)] = False       # keep one finite entry per row
        x[holes] = -np.inf
    want = nan_buffer((m, n))
    ref.softmax(x, want)
    got = output_for(data, x)
    native.softmax(x, got)
    # x - max is rounded to f32: up to 87 * 2^-24 = 5.2e-6 relative in exp; exp < 1 ulp;
    # the sum and 1/sum add ~1e-6: rtol 1e-5. atol: results below exp(-87) flush to 0.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-37)
    assert np.all(got[~np.isfinite(x)] == 0)


# --------------------------------------------------------------------------- RoPE

HEAD_DIMS = st.one_of(st.sampled_from([2, 4, 6, 8, 10, 14, 16, 18, 34, 64, 128]),
                      st.integers(1, 128).map(lambda k: 2 * k))


@given(st.data(), st.sampled_from(["pairs", "halves"]), st.integers(1, 5), st.integers(1, 4), HEAD_DIMS,
       st.integers(1, 64), st.sampled_from([10000.0, 500000.0]))
def test_rope_matches_reference(native, ref, data, style, m, n_heads, head_dim, n_ctx, base):
    cos, sin = ref.rope_tables(n_ctx, head_dim, base, style)
    x = float_arrays(data.draw, (m, n_heads, head_dim))
    positions = buffers.aligned_copy(data.draw(st.lists(st.integers(0, n_ctx - 1), min_size=m, max_size=m)),
                                     np.int32)
    want = nan_buffer(x.shape)
    ref.rope(x, positions, cos, sin, style, want)
    partner_size = np.abs(x) + np.abs(rope_partner(x, style))
    got = output_for(data, x)
    native.rope(x, positions, cos, sin, style, got)
    # two products and an FMA: a few ulp of |x| + |partner|, wherever the angle puts the result
    assert np.all(np.abs(got - want) <= 1e-6 * partner_size)


ROPE_VARIANTS = [  # style, n_rot, freq_scale, freq_factors
    ("pairs", None, 1.0, None),
    ("halves", None, 1.0, None),
    ("pairs", 8, 1.0, None),                        # partial rotation: lanes 8.. pass through
    ("pairs", None, 0.25, [1.0, 1.0, 2.0, 4.0, 8.0, 8.0]),   # linear scaling, Llama 3 factors
]


@pytest.mark.parametrize("style, n_rot, freq_scale, freq_factors", ROPE_VARIANTS)
def test_rope_tables_rotate_like_complex_numbers(native, style, n_rot, freq_scale, freq_factors):
    """The table convention, checked against the rotation itself: pair (a, b) as a + ib,
    turned by theta_i = pos * freq_scale * base^(-2i/n_rot) / freq_factors[i]."""
    n_ctx, head_dim, base = 40, 12, 10000.0
    cos, sin = native.rope_tables(n_ctx, head_dim, base, style, n_rot=n_rot, freq_scale=freq_scale,
                                  freq_factors=freq_factors)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (n_ctx, head_dim)
    assert buffers.is_aligned(cos) and buffers.is_aligned(sin)
    rng = np.random.default_rng(0)
    x = buffers.aligned_copy(rng.standard_normal((n_ctx, 3, head_dim)), np.float32)
    positions = buffers.aligned_copy(np.arange(n_ctx), np.int32)
    got = nan_buffer(x.shape)
    native.rope(x, positions, cos, sin, style, got)

    n_rot = n_rot or head_dim
    half = n_rot // 2
    if style == "pairs":
        first, second = np.arange(0, n_rot, 2), np.arange(1, n_rot, 2)         # llama.cpp LLaMA
    else:
        first, second = np.arange(half), np.arange(half, head_dim)             # NeoX / HF
    inv_freq = base ** (-2.0 * np.arange(half) / n_rot) / np.asarray(freq_factors or np.ones(half))
    theta = (np.arange(n_ctx) * freq_scale)[:, None] * inv_freq
    z = (x[..., first] + 1j * x[..., second].astype(np.float64)) * np.exp(1j * theta)[:, None, :]
    np.testing.assert_allclose(got[..., first], z.real, atol=2e-6)
    np.testing.assert_allclose(got[..., second], z.imag, atol=2e-6)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


def test_both_backends_export_the_same_rope_tables(native, ref):
    assert native.rope_tables is ref.rope_tables


# --------------------------------------------------------------------------- bad arguments

def test_elementwise_reject_bad_arguments(native):
    a = buffers.zeros(16)
    out = buffers.zeros(16)
    with pytest.raises(ValueError, match="b: expected dtype float32"):
        native.add(a, buffers.zeros(16, np.float64), out)
    with pytest.raises(ValueError, match="out: expected shape"):
        native.add(a, a, buffers.zeros(15))
    with pytest.raises(ValueError, match="a: data must be 32-byte aligned"):
        native.add(buffers.zeros(17)[1:], buffers.zeros(16), out)
    with pytest.raises(ValueError, match="b: array must be C-contiguous"):
        native.add(a, buffers.zeros(32)[::2], out)
    with pytest.raises(ValueError, match="s: expected a finite number"):
        native.scale(a, float("nan"), out)
    with pytest.raises(ValueError, match="s: expected a number"):
        native.scale(a, None, out)
    read_only = buffers.zeros(16)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out: array is read-only"):
        native.silu_mul(a, a, read_only)
    shared = buffers.zeros(24)
    with pytest.raises(ValueError, match="out: overlaps gate"):
        native.silu_mul(shared[:16], a, shared[8:])
    with pytest.raises(ValueError, match="up: expected shape"):
        native.silu_mul(a, buffers.zeros((2, 8)), out)
    with pytest.raises(ValueError, match="up: expected shape"):
        native.gelu_mul(a, buffers.zeros(15), out)
    with pytest.raises(ValueError, match="gate: expected dtype float32"):
        native.gelu_mul(buffers.zeros(16, np.float16), a, out)
    with pytest.raises(ValueError, match="out: overlaps up"):
        native.gelu_mul(a, shared[:16], shared[8:])
    with pytest.raises(ValueError, match="out: array is read-only"):
        native.gelu_mul(a, a, read_only)
    with pytest.raises(ValueError, match="up: data must be 32-byte aligned"):
        native.gelu_mul(a, buffers.zeros(17)[1:], out)
    assert_still_working(native)


def test_add_bias_rejects_bad_arguments(native):
    x = buffers.zeros((2, 16))
    bias = buffers.zeros(16)
    out = buffers.zeros((2, 16))
    read_only = buffers.zeros((2, 16))
    read_only.flags.writeable = False
    flat = buffers.zeros(48)
    bad = [
        (dict(bias=buffers.zeros(15)), "bias: expected shape \\(16\\)"),
        (dict(bias=buffers.zeros((1, 16))), "bias: expected shape"),
        (dict(bias=buffers.zeros(16, np.float64)), "bias: expected dtype float32"),
        (dict(x=buffers.zeros((2, 16), np.float16)), "x: expected dtype float32"),
        (dict(x=buffers.zeros(()), out=buffers.zeros(())), "x: expected at least one dimension"),
        (dict(x=buffers.zeros((16, 2)).T), "x: array must be C-contiguous"),
        (dict(out=buffers.zeros((2, 15))), "out: expected shape"),
        (dict(out=read_only), "out: array is read-only"),
        (dict(x=flat[:32].reshape(2, 16), out=flat[16:].reshape(2, 16)), "out: overlaps x"),
        (dict(x=flat[:32].reshape(2, 16), bias=flat[16:32], out=flat[:32].reshape(2, 16)), "out: overlaps bias"),
        (dict(bias=buffers.zeros(17)[1:]), "bias: data must be 32-byte aligned"),
    ]
    for changes, message in bad:
        args = dict(x=x, bias=bias, out=out)
        args.update(changes)
        with pytest.raises(ValueError, match=message):
            native.add_bias(**args)
    assert_still_working(native)


def test_row_kernels_reject_bad_arguments(native):
    x = buffers.zeros((2, 16))
    w = buffers.zeros(16)
    out = buffers.zeros((2, 16))
    with pytest.raises(ValueError, match="w: expected shape"):
        native.rmsnorm(x, buffers.zeros(15), 1e-5, out)
    with pytest.raises(ValueError, match="eps: expected a number > 0"):
        native.rmsnorm(x, w, 0.0, out)
    with pytest.raises(ValueError, match="eps: expected a finite number"):
        native.rmsnorm(x, w, float("inf"), out)
    with pytest.raises(ValueError, match="out: overlaps w"):
        native.rmsnorm(buffers.zeros((1, 16)), w, 1e-5, w.reshape(1, 16))
    with pytest.raises(ValueError, match="x: "):     # empty (or, as empty buffers go, misaligned)
        native.softmax(buffers.zeros((2, 0)), buffers.zeros((2, 0)))
    with pytest.raises(ValueError, match="x: expected at least one dimension"):
        native.softmax(buffers.zeros(()), buffers.zeros(()))
    with pytest.raises(ValueError, match="x: array must be C-contiguous"):
        native.softmax(buffers.zeros((16, 2)).T, out)
    flat = buffers.zeros(24)
    with pytest.raises(ValueError, match="out: overlaps x"):
        native.softmax(flat[:16].reshape(2, 8), flat[8:].reshape(2, 8))
    assert_still_working(native)


def test_rope_rejects_bad_arguments(native, ref):
    cos, sin = ref.rope_tables(8, 4, 10000.0, "pairs")
    x = buffers.zeros((2, 3, 4))
    positions = buffers.aligned_copy([0, 7], np.int32)
    with pytest.raises(ValueError, match="style: expected one of"):
        native.rope(x, positions, cos, sin, "interleaved", x)
    with pytest.raises(ValueError, match="x: expected 3 dimensions"):
        native.rope(buffers.zeros((2, 12)), positions, cos, sin, "pairs", buffers.zeros((2, 12)))
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        native.rope(buffers.zeros((2, 3, 5)), positions, cos, sin, "pairs", buffers.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match="positions: expected dtype int32"):
        native.rope(x, buffers.aligned_copy([0, 7], np.int64), cos, sin, "pairs", x)
    with pytest.raises(ValueError, match="positions: expected shape"):
        native.rope(x, buffers.aligned_copy([0, 1, 2], np.int32), cos, sin, "pairs", x)
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 8\)"):
        native.rope(x, buffers.aligned_copy([0, 8], np.int32), cos, sin, "pairs", x)
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 8\)"):
        native.rope(x, buffers.aligned_copy([-1, 0], np.int32), cos, sin, "pairs", x)
    with pytest.raises(ValueError, match="cos: expected shape"):
        native.rope(x, positions, ref.rope_tables(8, 6, 10000.0, "pairs")[0], sin, "pairs", x)
    with pytest.raises(ValueError, match="sin: expected shape"):
        native.rope(x, positions, cos, sin[:4], "pairs", x)
    with pytest.raises(ValueError, match="out: overlaps cos"):
        native.rope(x, positions, cos, sin, "pairs", cos[:6].reshape(2, 3, 4))
    with pytest.raises(ValueError, match="style: expected one of"):
        ref.rope_tables(8, 4, 10000.0, "neox")
    with pytest.raises(ValueError, match="head_dim: expected an even number"):
        ref.rope_tables(8, 5, 10000.0, "halves")
    with pytest.raises(ValueError, match="n_rot: partial rotation"):
        ref.rope_tables(8, 8, 10000.0, "halves", n_rot=4)
    with pytest.raises(ValueError, match="n_rot: expected an even number"):
        ref.rope_tables(8, 8, 10000.0, "pairs", n_rot=10)
    with pytest.raises(ValueError, match="freq_factors: expected shape"):
        ref.rope_tables(8, 8, 10000.0, "pairs", freq_factors=[1.0, 2.0])
    assert_still_working(native)


def assert_still_working(native):
    """After refusing bad calls, the library still computes."""
    x = buffers.aligned_copy(np.arange(10, dtype=np.float32).reshape(1, 10))
    out = nan_buffer(x.shape)
    native.softmax(x, out)
    e = np.exp(np.arange(10) - 9.0)
    np.testing.assert_allclose(out[0], e / e.sum(), rtol=1e-5)
