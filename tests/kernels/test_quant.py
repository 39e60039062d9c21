import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import nan_buffer, sizes, float_arrays
from llambda.runtime import buffers

from llambda.codegen.contract import BLOCK


def quantized_outputs(m, k):
    """NaN/garbage-prefilled outputs, so an unwritten element fails."""
    qs = buffers.full((m, k), 0x5A, np.int8)
    return qs, nan_buffer((m, k // BLOCK)), nan_buffer((m, k // BLOCK))


@given(st.data(), sizes(6, 40), st.sampled_from([32, 64, 96, 576, 32 * 37]))
def test_quantize_q8_matches_reference(native, ref, data, m, k):
    scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4, 1e30, 1e-30, 1e-40]))
    x = float_arrays(data.draw, (m, k), scale=scale)
    if data.draw(st.booleans()):
        x[:, :BLOCK] = 0.0          # an all-zero block: d = 0, q = 0, s = 0
    got, want = quantized_outputs(m, k), quantized_outputs(m, k)
    native.quantize_q8(x, *got)
    ref.quantize_q8(x, *want)
    # The same IEEE single operations in the same order (amax/127, 1/d, x*(1/d), round half
    # to even, d*sum(q)) on both sides: exact, ties included. Against GGUF's own
    # quantizer (round half away) see test_gguf_compat.py.
    for name, g, w in zip(("qs", "d", "s"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    qs, d, _ = got
    assert qs.min() >= -127 and qs.max() <= 127


def test_quantize_q8_block_values(native):
    x = buffers.zeros((2, 64))
    x[0, :BLOCK] = np.linspace(-2.54, 1.0, BLOCK)
    x[1, BLOCK:] = 5.0
    qs, d, s = quantized_outputs(2, 64)
    native.quantize_q8(x, qs, d, s)
    assert d[0, 0] == np.float32(2.54) / np.float32(127)
    assert qs[0, 0] == -127 and qs[1, BLOCK] == 127
    np.testing.assert_array_equal(qs[0, BLOCK:], 0)
    np.testing.assert_array_equal(d[:, 1], [0.0, np.float32(5) / np.float32(127)])
    assert s[1, 1] == d[1, 1] * np.float32(127 * BLOCK)
    assert s[0, 1] == 0 and s[1, 0] == 0


def test_quantize_q8_rejects_bad_arguments(native):
    x = buffers.zeros((2, 64))
    qs, d, s = buffers.zeros((2, 64), np.int8), buffers.zeros((2, 2)), buffers.zeros((2, 2))
    with pytest.raises(ValueError, match="x: k = 48 must be a multiple of 32"):
        native.quantize_q8(buffers.zeros((2, 48)), buffers.zeros((2, 48), np.int8), d, s)
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        native.quantize_q8(buffers.zeros((2, 64), np.float64), qs, d, s)
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        native.quantize_q8(buffers.zeros(64), qs, d, s)
    with pytest.raises(ValueError, match="qs: expected dtype int8"):
        native.quantize_q8(x, buffers.zeros((2, 64), np.uint8), d, s)
    with pytest.raises(ValueError, match="d: expected shape"):
        native.quantize_q8(x, qs, buffers.zeros((2, 3)), s)
    with pytest.raises(ValueError, match="s: array must be C-contiguous"):
        native.quantize_q8(x, qs, d, buffers.zeros((2, 4))[:, ::2])
    with pytest.raises(ValueError, match="x: data must be 32-byte aligned"):
        native.quantize_q8(buffers.zeros(2 * 64 + 1)[1:].reshape(2, 64), qs, d, s)
    with pytest.raises(ValueError, match="qs: array is read-only"):
        qs.flags.writeable = False
        native.quantize_q8(x, qs, d, s)
    with pytest.raises(ValueError, match="x: array is empty"):
        native.quantize_q8(buffers.zeros((0, 32)), buffers.zeros((0, 32), np.int8),
                           buffers.zeros((0, 1)), buffers.zeros((0, 1)))
    native.quantize_q8(x, buffers.zeros((2, 64), np.int8), d, s)     # and the process is fine


@settings(max_examples=20)
@given(st.data(), sizes(1, 40), st.sampled_from([32, 576]))
def test_quantize_q8_rows_quantize_only_those_rows(native, data, m, k):
    """quantize_q8_call(rows=...) gives the rows the whole call gives them, bit for bit,
    and leaves the other rows alone (what the recorder's row chunks rely on)."""
    from llambda.runtime.native.quant import quantize_q8_call
    from llambda.runtime.native._lib import kernel
    x = float_arrays(data.draw, (m, k), scale=10.0)
    r0 = data.draw(st.integers(0, m - 1))
    r1 = data.draw(st.integers(r0 + 1, m))
    whole, part = quantized_outputs(m, k), quantized_outputs(m, k)
    for out in part:
        out[...] = 7
    native.quantize_q8(x, *whole)
    symbol, args = quantize_q8_call(x, *part, rows=(r0, r1))
    kernel(symbol)(*args)
    for name, w, p in zip(("qs", "d", "s"), whole, part):
        np.testing.assert_array_equal(p[r0:r1], w[r0:r1], err_msg=name)
        assert (p[:r0] == 7).all() and (p[r1:] == 7).all(), name
