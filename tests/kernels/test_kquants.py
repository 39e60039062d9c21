"""Q4_K and Q5_K: the reference dequantizers, the packed layouts and the qgemm kernels.

Reference and layouts are compared with gguf's own dequantization bit for bit,
on random valid super-blocks and on the real tensors of Gemma 3 270M Q4_K_M and of the
default model re-quantized by llama.cpp (tests/fetched_files.py). The kernels are fuzzed against
the numpy reference GEMM (runtime/ref/quant.py, through the layout).
"""
import dataclasses
import functools
import os

import gguf
import numpy as np
import pytest
from hypothesis import given, strategies as st

import fetched_files
from helpers import (activation_magnitudes, assert_close_to_reference, assert_reads_nothing_past_the_weight,
                     assert_refused, assert_row_range_writes_only_its_columns, misaligned, q8_activations,
                     qgemm_both, qgemm_on, quantized_activations, random_activations, runnable,
                     widest_isa_chosen_under, zero_operands)
from llambda.runtime import buffers, layouts
from llambda.runtime.ref import kquants

BLOCK, GROUP, SUPER = 32, 8, 256
TYPES = ["Q4_K", "Q5_K"]
# Where real tensors of each type are: a fetched file, or a llama.cpp re-quantization of the
# default model (made when llama-cpp-python is installed; tests/fetched_files.py).
REAL_FILES = {"Q4_K": (fetched_files.gemma_gguf, lambda: fetched_files.variant("Q4_K_M")),
              "Q5_K": (lambda: fetched_files.variant("Q5_K_M"),)}

m_sizes = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 24, 25, 33, 37]) | st.integers(1, 40)
n_sizes = st.sampled_from([1, 7, 8, 9, 15, 16, 17, 24, 25, 33, 100]) | st.integers(1, 120)
k_sizes = st.sampled_from([256, 512, 768, 2304]) | st.integers(1, 6).map(lambda s: SUPER * s)
magnitudes = st.sampled_from([1e-6, 1e-3, 1.0, 300.0])


def random_raw(draw, type_name, n, k):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return kquants.random_blocks(type_name, n, k, rng, magnitude=draw(magnitudes))


def gguf_dequantize(raw, type_name):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1)


def assert_bits_equal(got, want):
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@functools.lru_cache(maxsize=None)
def _tensors_on_disk(type_name):
    found, skipped = [], []
    for source in REAL_FILES[type_name]:
        try:
            path = source()
        except pytest.skip.Exception as e:      # a variant that cannot be made here
            skipped.append(str(e))
            continue
        for t in fetched_files.tensors_of_type(path, type_name):
            k, n = (int(x) for x in t.shape[:2])
            found.append((path.name, t.name, t.data, n, k))
    return found, tuple(skipped)


def real_tensors(type_name, per_file=None):
    """(file, name, raw, n, k) of the real ``type_name`` tensors on disk (the first ``per_file``
    of each file); skips when there are none."""
    found, skipped = _tensors_on_disk(type_name)
    if not found:
        pytest.skip("; ".join(skipped) or f"no {type_name} tensor in {', '.join(map(str, REAL_FILES[type_name]))}")
    if per_file is None:
        return found
    return [t for i, t in enumerate(found) if sum(u[0] == t[0] for u in found[:i]) < per_file]


# --------------------------------------------------------------------------- reference and layout

@given(st.data(), st.sampled_from(TYPES), st.integers(1, 20), k_sizes)
def test_reference_and_layout_are_gguf_dequantize_on_random_blocks(data, type_name, n, k):
    raw = random_raw(data.draw, type_name, n, k)
    want = gguf_dequantize(raw, type_name)
    assert_bits_equal(kquants.dequantize(type_name, raw, k), want)
    w = layouts.pack(type_name, raw, n, k)
    assert w.kind == type_name.lower() and w.meta == dict(group=GROUP, source=type_name)
    assert_bits_equal(layouts.dequantize(w), want.reshape(n, k))


@pytest.mark.parametrize("type_name", TYPES)
def test_reference_and_layout_are_gguf_dequantize_on_real_tensors(type_name):
    for file, name, raw, n, k in real_tensors(type_name):
        want = gguf_dequantize(raw, type_name)
        assert_bits_equal(kquants.dequantize(type_name, raw, k), want)
        assert_bits_equal(layouts.dequantize(layouts.pack(type_name, raw, n, k)), want.reshape(n, k))


def test_scale_min_unpacks_the_six_bit_fields():
    """Sub-blocks 0..3 read the low 6 bits of bytes j and j+4; 4..7 combine byte j+4's
    nibbles with the top bits of bytes j-4 and j (ggml-quants.c get_scale_min_k4)."""
    scales = np.zeros(12, np.uint8)
    scales[0], scales[4] = 0b11_000001, 0b10_000010       # sc0 = 1, m0 = 2; top bits for sc4, m4
    scales[8] = 0x5A                                       # sc4 low nibble 0xA, m4 low nibble 0x5
    sc, m = kquants.scale_min(scales)
    assert sc[0] == 1 and m[0] == 2
    assert sc[4] == 0xA | (0b11 << 4) and m[4] == 0x5 | (0b10 << 4)
    assert sc.max() <= 63 and m.max() <= 63


@given(st.data(), st.sampled_from(TYPES), st.integers(1, 40))
def test_rows_is_dequantize_of_those_rows(data, type_name, n):
    w = layouts.pack(type_name, random_raw(data.draw, type_name, n, SUPER), n, SUPER)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5)))
    np.testing.assert_array_equal(layouts.rows(w, ids), layouts.dequantize(w)[ids])


@pytest.mark.parametrize("type_name, chunks", [("Q4_K", 4), ("Q5_K", 5)])
def test_layout_arrays_are_compact_aligned_and_padded(type_name, chunks):
    n, k = 9, 512
    raw = kquants.random_blocks(type_name, n, k, np.random.default_rng(0))
    w = layouts.pack(type_name, raw, n, k)
    assert w.arrays["qs"].shape == (2, k // BLOCK, chunks, GROUP, 4)
    assert w.arrays["scales"].shape == (2, k // SUPER, 160)
    assert all(a.ctypes.data % 64 == 0 for a in w.arrays.values())
    np.testing.assert_array_equal(w.arrays["qs"][1, :, :, 1:], 0)          # rows 9..15 are padding
    # per 256 weights of a row: GGUF's bytes plus 4 (d and dmin are stored once per row
    # group, the 12 packed scale bytes become 16)
    assert w.nbytes / (2 * GROUP) / (k // SUPER) == kquants.SUPER_BYTES[type_name] + 4


def test_pack_refuses_rows_that_cannot_be_k_quants():
    raw = np.zeros((4, 144), np.uint8)
    w = layouts.pack("Q4_K", raw, 4, 256)
    assert_refused([
        ("Q4_K: k = 128 must be a positive multiple of 256", lambda: layouts.pack("Q4_K", raw, 4, 128)),
        ("Q5_K: k = 320 must be a positive multiple of 256", lambda: layouts.pack("Q5_K", raw, 4, 320)),
        ("Q4_K: expected 4 rows of 288 bytes", lambda: layouts.pack("Q4_K", raw, 4, 512)),
        ("Q5_K: expected 4 rows of 176 bytes", lambda: layouts.pack("Q5_K", raw, 4, 256)),
        ("k = 100 must be a positive multiple of 256", lambda: kquants.dequantize("Q4_K", raw, 100)),
        ("ids: row indices must be integers in", lambda: layouts.rows(w, [4])),
    ])


# --------------------------------------------------------------------------- kernels

def magnitude_bound(qs, d, raw, type_name, n, k):
    """sum_k (|d sc q| + |dmin m|) |d_a q_a|: the terms the kernel adds, which float rounding
    errors are relative to."""
    dd, dmin, sc, m, q = kquants.fields(type_name, kquants.super_blocks(type_name, raw))
    scale = np.abs(dd[:, None] * sc.astype(np.float64))[..., None] * q
    offset = np.abs(dmin[:, None] * m.astype(np.float64))[..., None]
    weights = (scale + offset).reshape(n, k)
    return activation_magnitudes(qs, d) @ weights.T


@given(st.data(), st.sampled_from(TYPES), m_sizes, n_sizes, k_sizes)
def test_qgemm_matches_reference(native, ref, isa, data, type_name, m, n, k):
    raw = random_raw(data.draw, type_name, n, k)
    w = layouts.pack(type_name, raw, n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    assert_close_to_reference(got, want, magnitude_bound(qs, d, raw, type_name, n, k))


@given(st.data(), st.sampled_from(TYPES), m_sizes, st.integers(1, 70), st.sampled_from([256, 768]))
def test_qgemm_row_range_writes_only_its_columns(native, ref, isa, data, type_name, m, n, k):
    raw = random_raw(data.draw, type_name, n, k)
    w = layouts.pack(type_name, raw, n, k)
    assert_row_range_writes_only_its_columns(native, ref, isa, data.draw, w, m,
                                             lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@given(st.data(), st.sampled_from(TYPES), m_sizes, n_sizes, st.sampled_from([256, 512, 1280]))
def test_qgemm_rows_do_not_depend_on_their_batch(native, isa, data, type_name, m, n, k):
    """Every tile of either ISA sums a row's blocks in the same order: a row computed alone
    (the one-row tile), within the batch on this ISA, and on the AVX2 baseline agree bit for bit."""
    w = layouts.pack(type_name, random_raw(data.draw, type_name, n, k), n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    batch = qgemm_on(native, isa, qs, d, s, w)
    np.testing.assert_array_equal(batch, qgemm_on(native, "avx2", qs, d, s, w))
    row = data.draw(st.integers(0, m - 1))
    alone = qgemm_on(native, isa, qs[row:row + 1], d[row:row + 1], s[row:row + 1], w)
    np.testing.assert_array_equal(alone[0], batch[row])


@pytest.mark.parametrize("type_name", TYPES)
def test_qgemm_on_real_tensors(native, ref, isa, type_name):
    """The first real tensor of each file, activations like a hidden state, decode and prefill."""
    for file, name, raw, n, k in real_tensors(type_name, per_file=1):
        w = layouts.pack(type_name, raw, n, k)
        for m in (1, 7, 17):
            qs, d, s = q8_activations(native, random_activations(m, k, seed=m))
            got, want = qgemm_both(native, ref, qs, d, s, w, isa)
            assert_close_to_reference(got, want, magnitude_bound(qs, d, raw, type_name, n, k))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [8, 17, 40])
def test_qgemm_reads_nothing_past_the_weight(native, ref, isa, type_name, n):
    """The last row groups end at an unreadable page: no read past either weight array."""
    k = 512
    raw = kquants.random_blocks(type_name, n, k, np.random.default_rng(n))
    w = layouts.pack(type_name, raw, n, k)
    assert_reads_nothing_past_the_weight(native, ref, isa, w, 5, n,
                                         lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@pytest.mark.parametrize("type_name", TYPES)
def test_qgemm_extreme_quants_do_not_overflow(native, ref, isa, type_name):
    """Every quant at its maximum (15 or 31) against activations of +-127: the int16 pair sums
    are at their bound, and the result is exact up to f32 rounding."""
    n, k, m = 16, 512, 3
    raw = kquants.random_blocks(type_name, n, k, np.random.default_rng(5)).reshape(-1, kquants.SUPER_BYTES[type_name])
    raw[:, 4:] = 0xFF                                       # scales 63, mins 63, all bits set
    raw[:, :4] = np.array([1.0, 0.0], np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    w = layouts.pack(type_name, raw, n, k)
    qs = buffers.empty((m, k), np.int8)
    qs[0], qs[1], qs[2] = 127, -127, np.where(np.arange(k) % 2, 127, -127)
    d, s = buffers.full((m, k // BLOCK), 1.0), buffers.empty((m, k // BLOCK))
    s[...] = qs.reshape(m, -1, BLOCK).sum(axis=-1)
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    top = 15 if type_name == "Q4_K" else 31
    np.testing.assert_array_equal(want[0], 63 * top * 127 * k)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [8, 17, 40])
def test_avx2_decode_kernel_reads_nothing_past_the_weight(native, ref, type_name, n):
    """One activation row on AVX2 (Q4_K: the decode kernel, a group pair a pass, a lone last
    group paired with itself): no read past either weight array; n = 17 and 40 end inside a pair."""
    runnable("avx2", type_name.lower())
    k = 512
    raw = kquants.random_blocks(type_name, n, k, np.random.default_rng(n + 1))
    w = layouts.pack(type_name, raw, n, k)
    assert_reads_nothing_past_the_weight(native, ref, "avx2", w, 1, n,
                                         lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@pytest.mark.parametrize("type_name", TYPES)
def test_avx2_decode_kernel_extreme_quants_do_not_overflow(native, ref, type_name):
    """test_qgemm_extreme_quants_do_not_overflow's rows one at a time on AVX2 (Q4_K: through the
    decode kernel, its own int16 sums)."""
    runnable("avx2", type_name.lower())
    n, k = 24, 512
    raw = kquants.random_blocks(type_name, n, k, np.random.default_rng(5)).reshape(-1, kquants.SUPER_BYTES[type_name])
    raw[:, 4:] = 0xFF                                       # scales 63, mins 63, all bits set
    raw[:, :4] = np.array([1.0, 0.0], np.float16).view(np.uint8)
    w = layouts.pack(type_name, raw.reshape(n, -1), n, k)
    top = 15 if type_name == "Q4_K" else 31
    for row in (np.full(k, 127), np.full(k, -127), np.where(np.arange(k) % 2, 127, -127)):
        qs = buffers.empty((1, k), np.int8)
        qs[0] = row
        d, s = buffers.full((1, k // BLOCK), 1.0), buffers.empty((1, k // BLOCK))
        s[...] = qs.reshape(1, -1, BLOCK).sum(axis=-1)
        got, want = qgemm_both(native, ref, qs, d, s, w, "avx2")
        if row[0] == row[1] == 127:
            np.testing.assert_array_equal(want, 63 * top * 127 * k)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("type_name, one_row", [("Q4_K", "1x16"), ("Q5_K", "6x8")])
def test_one_row_takes_the_avx2_decode_kernel(native, type_name, one_row):
    """m = 1 on AVX2 calls Q4_K's 1 x 16 kernel, more rows the 6 x 8 one (their rows agree bit
    for bit: test_qgemm_rows_do_not_depend_on_their_batch); Q5_K has no decode kernel."""
    from llambda.runtime.native import quant as n_quant
    runnable("avx2", type_name.lower())
    n, k = 24, 256
    w = layouts.pack(type_name, kquants.random_blocks(type_name, n, k, np.random.default_rng(0)), n, k)
    for m, tile in ((1, one_row), (2, "6x8")):
        qs, d, s, out = zero_operands(m, n, k)
        symbol, _ = n_quant.qgemm_call(qs, d, s, w, out, isa="avx2")
        assert symbol == f"llb_qgemm_{type_name.lower()}_q8_{tile}__avx2"


def test_qgemm_rejects_bad_k_quant_weights(native, isa):
    from llambda.runtime.native import quant as n_quant
    m, n, k = 2, 10, 256
    w = layouts.pack("Q5_K", kquants.random_blocks("Q5_K", n, k, np.random.default_rng(0)), n, k)
    out = buffers.zeros((m, n))
    odd = dataclasses.replace(w, k=288, arrays=dict(qs=buffers.zeros((2, 9, 5, 8, 4), np.uint8),
                                                    scales=w.arrays["scales"]))

    def call(weight, k=k):
        acts = buffers.zeros((m, k), np.int8), buffers.zeros((m, k // BLOCK)), buffers.zeros((m, k // BLOCK))
        return n_quant.qgemm_call(*acts, weight, out, isa=isa)

    def with_scales(scales):
        return call(dataclasses.replace(w, arrays=dict(w.arrays, scales=scales)))

    assert_refused([
        ("w.scales: data must be 32-byte aligned", lambda: with_scales(misaligned(w.arrays["scales"]))),
        ("w.scales: expected shape", lambda: with_scales(w.arrays["scales"][:, :0])),
        ("w.qs: expected shape", lambda: call(dataclasses.replace(w, kind="q4_k"))),
        ("w.scales: expected dtype uint8", lambda: with_scales(w.arrays["scales"].view(np.int8))),
        ("w: kind q5_k needs k to be a multiple of 256, got k = 288", lambda: call(odd, k=288)),
        ("w: has k = 256 but the activations have k = 512", lambda: call(w, k=512)),
    ])


def test_pack_scale_min_is_the_inverse_of_scale_min():
    rng = np.random.default_rng(3)
    sc, m = rng.integers(0, 64, (50, 8), dtype=np.uint8), rng.integers(0, 64, (50, 8), dtype=np.uint8)
    back = kquants.scale_min(kquants.pack_scale_min(sc, m))
    np.testing.assert_array_equal(back[0], sc)
    np.testing.assert_array_equal(back[1], m)
    with pytest.raises(ValueError, match="6 bits"):
        kquants.pack_scale_min(sc + 64, m)


@pytest.mark.parametrize("type_name", TYPES)
def test_k_quant_decode_runs_on_the_widest_isa(native, type_name):
    """Their AVX2 GEMV is bound by unpacking, not memory: decode (m < 4) takes AVX-512 too
    (bit-identical: test_qgemm_rows_do_not_depend_on_their_batch)."""
    runnable("avx512")
    with widest_isa_chosen_under(None, None) as n_quant:
        n, k = 16, 256
        w = layouts.pack(type_name, kquants.random_blocks(type_name, n, k, np.random.default_rng(0)), n, k)
        qs, d, s, out = zero_operands(1, n, k)
        symbol, _ = n_quant.qgemm_call(qs, d, s, w, out)
        expected = "avx2" if os.environ.get("LLAMBDA_ISA") == "avx2" else "avx512"
        assert symbol.endswith("__" + expected)


