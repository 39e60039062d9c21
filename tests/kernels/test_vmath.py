"""vmath.exp_ps, through the elementwise ``exp`` kernel that wraps it."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import nan_buffer, sizes
from llambda.runtime import buffers, cpu

# Where exp_ps promises accuracy: below it results flush to 0 (true value
# < 1.9e-38), above it the float range ends (ln FLT_MAX = 88.7228).
ACCURATE_LOW, ACCURATE_HIGH = -86.9, 88.72


def native_exp(native, x):
    x = buffers.aligned_copy(np.asarray(x, np.float32))
    out = nan_buffer(x.shape)
    native.exp(x, out)
    return x, out


def ulp_error(x, got):
    """|got - exp(x)| in units of the last place of the correctly rounded float32 result."""
    true = np.exp(x.astype(np.float64))
    ulp = np.spacing(true.astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - true) / ulp


def test_exp_within_one_ulp_on_a_dense_sweep(native):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(ACCURATE_LOW, ACCURATE_HIGH, 1_000_001),
                        rng.uniform(-1.0, 1.0, 200_000),           # around the reduction's centre
                        np.linspace(-1e-6, 1e-6, 1001)])
    x, got = native_exp(native, x)
    # measured max 0.97 ulp: degree-7 polynomial (< 0.5 ulp) plus the final roundings
    assert ulp_error(x, got).max() < 1.0


def test_exp_edges(native):
    x = [-np.inf, -1e30, -100.0, -87.7, -87.0, 0.0, -0.0, 88.73, 89.0, 1e30, np.inf, np.nan]
    _, got = native_exp(native, x)
    expected = [0, 0, 0, 0, 0, 1, 1, np.inf, np.inf, np.inf, np.inf, np.nan]
    np.testing.assert_array_equal(got, np.float32(expected))


def test_exp_never_returns_subnormals(native):
    x, got = native_exp(native, np.linspace(-90.0, -86.0, 100_001))
    tiny = np.finfo(np.float32).tiny
    assert np.all((got == 0) | (got >= tiny))
    assert np.all(np.diff(got) >= 0)           # monotone through the flush to zero
    # the flush costs at most exp(-86.99) absolute
    assert np.max(np.abs(got - np.exp(x.astype(np.float64)))) < 1.7e-38


@given(st.data(), sizes(8, 3000))
def test_exp_any_length_matches_reference(native, ref, data, n):
    seed = data.draw(st.integers(0, 2**32 - 1))
    x = np.random.default_rng(seed).uniform(ACCURATE_LOW, ACCURATE_HIGH, n).astype(np.float32)
    x, got = native_exp(native, x)
    want = nan_buffer(n)
    ref.exp(x, want)
    np.testing.assert_allclose(got, want, rtol=2.5e-7)     # < 1 ulp, and every lane written


def test_exp_rejects_bad_arguments(native):
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        native.exp(buffers.zeros(8, np.float64), buffers.zeros(8))
    with pytest.raises(ValueError, match="out: expected shape"):
        native.exp(buffers.zeros(8), buffers.zeros(9))


def _wide_exp(tmp_path):
    """exp_ps on zmm (as the avx512 attention's softmax runs it) as a one-off function:
    out[i] = exp(x[i]) for n % 16 == 0, built here with PeachPy, since no library kernel
    exposes it alone."""
    import ctypes
    from peachpy.x86_64 import ZMMRegister, LOAD, Loop, RETURN, VMOVUPS, ADD, SUB, JNZ
    from peachpy.x86_64 import GeneralPurposeRegister64 as gp
    from llambda.codegen.build import link
    from llambda.codegen.common import function
    from llambda.codegen.vmath import exp_ps

    signature = [("x", "const float*"), ("out", "float*"), ("n", "size_t")]
    fn, (x_arg, out_arg, n_arg) = function("wide_exp", signature, "avx512")
    with fn:
        x, out, n = gp(), gp(), gp()
        LOAD.ARGUMENT(x, x_arg)
        LOAD.ARGUMENT(out, out_arg)
        LOAD.ARGUMENT(n, n_arg)
        with Loop() as loop:
            value, t1, t2 = ZMMRegister(), ZMMRegister(), ZMMRegister()
            VMOVUPS(value, [x])
            exp_ps(value, value, t1, t2)
            VMOVUPS([out], value)
            ADD(x, 64)
            ADD(out, 64)
            SUB(n, 16)
            JNZ(loop.begin)
        RETURN()
    lib = tmp_path / "wide_exp.so"
    link([fn], tmp_path / "wide_exp.o", lib)
    call = ctypes.CDLL(str(lib)).wide_exp
    call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def run(values):
        values = buffers.aligned_copy(np.asarray(values, np.float32))
        got = nan_buffer(values.shape)
        call(values.ctypes.data, got.ctypes.data, values.size)
        return got
    return run


def test_exp_on_zmm_gives_the_ymm_bits(native, tmp_path):
    """The zmm form (16 lanes, broadcast constants, VRNDSCALEPS) computes every lane as the
    ymm form does: bit for bit, edges and NaN included."""
    if not cpu.supports("avx512"):
        pytest.skip("this CPU has no AVX-512")
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-100.0, 100.0, 400_000), rng.uniform(-1.0, 1.0, 99_984),
                        [-np.inf, -1e30, -87.7, -87.0, -0.0, 0.0, 88.73, 89.0, 1e30, np.inf, np.nan,
                         -np.nan, 1e-30, -1e-30, 5e-45, -5e-45]]).astype(np.float32)
    assert x.size % 16 == 0
    x, want = native_exp(native, x)
    got = _wide_exp(tmp_path)(x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
