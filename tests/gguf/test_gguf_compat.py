"""Byte compatibility with GGUF's own quantizers (the gguf package, a port of ggml's)."""

import gguf
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import nan_buffer, float_arrays
from llambda.runtime import buffers, layouts
from llambda.runtime.ref.quant import quantize_gguf

from llambda.codegen.contract import BLOCK
TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_values(draw, n, k):
    """f32 [n, k] with zero blocks, exact ties and mixed magnitudes (all f16-representable scales)."""
    x = float_arrays(draw, (n, k), scale=draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3])))
    if draw(st.booleans()):
        x[0, :BLOCK] = 0.0
    if draw(st.booleans()):
        # amax 127 -> d = 1: halves are exact .5 ties for Q8_0 rounding
        x[-1, -BLOCK:] = np.arange(BLOCK, dtype=np.float32) - 15.5
        x[-1, -1] = 127.0
    return x


@given(st.data(), st.sampled_from(TYPES), st.integers(1, 20), st.sampled_from([32, 64, 160]))
def test_our_gguf_quantizer_is_byte_equal(data, type_name, n, k):
    x = gguf_values(data.draw, n, k)
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])
    got = quantize_gguf(x, type_name)
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@given(st.data(), st.sampled_from(TYPES), st.integers(1, 20), st.sampled_from([32, 64, 160]))
def test_pack_then_dequantize_is_gguf_dequantize(native, ref, data, type_name, n, k):
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(gguf_values(data.draw, n, k), qtype)
    w = layouts.pack(type_name, raw, n, k)
    # Q4_0's d*(q-8) becomes d*q + (-8d): both exact in f32, so bit-equal too
    np.testing.assert_array_equal(layouts.dequantize(w), gguf.quants.dequantize(raw, qtype))

    m = data.draw(st.integers(1, 8))
    x = float_arrays(data.draw, (m, k))
    qs, d, s = buffers.empty((m, k), np.int8), buffers.empty((m, k // BLOCK)), buffers.empty((m, k // BLOCK))
    native.quantize_q8(x, qs, d, s)
    assert_qgemm_matches(native, ref, qs, d, s, w, raw, type_name)


def assert_qgemm_matches(native, ref, qs, d, s, w, raw, type_name):
    m, k = qs.shape
    got, want = nan_buffer((m, w.n)), nan_buffer((m, w.n))
    native.qgemm(qs, d, s, w, got)
    ref.qgemm(qs, d, s, w, want)
    # f32 rounding of scale products and of the sum over blocks (see test_qgemm.py),
    # relative to sum(|d q| + |m|) |a|, the terms the kernel adds
    weights = np.abs(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float64))
    act = np.abs(qs * np.repeat(d, BLOCK, axis=1).astype(np.float64))
    bound = act @ (weights + 2 * _abs_min(raw, type_name, k)).T
    np.testing.assert_array_less(np.abs(got - want), 1e-5 * bound + 1e-30)


def _abs_min(raw, type_name, k):
    """|m| per weight (Q4_1's min, Q4_0's -8d), which the kernel adds as a separate term."""
    blocks = raw.reshape(raw.shape[0], k // BLOCK, -1)
    if type_name == "Q8_0":
        return 0.0
    field = 1 if type_name == "Q4_1" else 0
    scale = np.abs(np.ascontiguousarray(blocks[..., 2 * field:2 * field + 2]).view(np.float16)[..., 0])
    scale = scale.astype(np.float64) * (8 if type_name == "Q4_0" else 1)
    return np.repeat(scale, BLOCK, axis=1)


@given(st.data(), st.integers(1, 12), st.sampled_from([32, 64, 576]))
def test_quantize_q8_is_gguf_q8_0_up_to_ties(native, data, m, k):
    x = gguf_values(data.draw, m, k)
    qs, d, s = buffers.empty((m, k), np.int8), buffers.empty((m, k // BLOCK)), buffers.empty((m, k // BLOCK))
    native.quantize_q8(x, qs, d, s)
    want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(m, k // BLOCK, 2 + BLOCK)
    # d rounded to f16 is GGUF's stored scale, bit for bit
    np.testing.assert_array_equal(d.astype(np.float16).view(np.uint8).reshape(m, -1, 2), want[..., :2])
    # q: the same f32 x * (1/d), rounded: vcvtps2dq rounds exact .5 ties to even, GGUF away
    # from zero, so q may differ by 1 there and only there
    want_q = want[..., 2:].view(np.int8).reshape(m, k).astype(np.int32)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    scaled = x.reshape(m, -1, BLOCK) * inverse[..., None]
    tie = (np.abs(scaled) % 1 == 0.5).reshape(m, k)
    diff = np.abs(qs.astype(np.int32) - want_q)
    np.testing.assert_array_equal(diff[~tie], 0)
    assert (diff[tie] <= 1).all()


def test_quantize_q8_ties_round_to_even(native):
    x = buffers.zeros((1, BLOCK))
    x[0, :4] = [127.0, 2.5, -2.5, 3.5]                 # d = 1 exactly
    qs, d, s = buffers.empty((1, BLOCK), np.int8), buffers.empty((1, 1)), buffers.empty((1, 1))
    native.quantize_q8(x, qs, d, s)
    np.testing.assert_array_equal(qs[0, :4], [127, 2, -2, 4])   # GGUF: 127, 3, -3, 4
    assert s[0, 0] == 131


@pytest.fixture(scope="module")
def default_gguf_reader(default_gguf):
    return gguf.GGUFReader(default_gguf)


@pytest.mark.parametrize("name, n_rows", [("blk.0.attn_q.weight", None), ("blk.0.ffn_down.weight", None),
                                          ("token_embd.weight", 200)])
def test_real_gguf_tensor(native, ref, default_gguf_reader, name, n_rows):
    tensor = next(t for t in default_gguf_reader.tensors if t.name == name)
    k, n = (int(v) for v in tensor.shape)           # GGUF ne = [k, n]
    raw = np.asarray(tensor.data)
    assert raw.dtype == np.uint8 and raw.shape[0] == n
    if n_rows:
        raw, n = raw[:n_rows], n_rows
    type_name = tensor.tensor_type.name
    w = layouts.pack(type_name, raw, n, k)
    np.testing.assert_array_equal(layouts.dequantize(w), gguf.quants.dequantize(raw, tensor.tensor_type))

    m = 7
    x = buffers.aligned_copy(np.random.default_rng(0).standard_normal((m, k)).astype(np.float32))
    qs, d, s = buffers.empty((m, k), np.int8), buffers.empty((m, k // BLOCK)), buffers.empty((m, k // BLOCK))
    native.quantize_q8(x, qs, d, s)
    assert_qgemm_matches(native, ref, qs, d, s, w, raw, type_name)
