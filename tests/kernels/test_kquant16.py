"""Q6_K, Q3_K and Q2_K (K-quants with 16-weight sub-blocks): reference dequantizers, layouts, kernels, models.

Tolerances. Dequantization is exact: the reference dequantizers and
``layouts.dequantize(pack(raw))`` equal ``gguf.quants.dequantize`` bit for
bit. The kernels' integer block sums are exact (|X| < 2^24, so their f32
conversion is too); what remains is f32 rounding of d * d_a, of the FMA per
block (Q2_K: two) and of the running sum over k/32 blocks, relative to
sum_k (|d sc q'| + |dmin m|) |a|: within 1e-5 of it for these k (as
test_qgemm.py states for the other kinds).
"""
import dataclasses

import gguf
import numpy as np
import pytest
from hypothesis import given, strategies as st

import fetched_files
from helpers import (activation_magnitudes, assert_close_to_reference, assert_on_row_slices,
                     assert_reads_nothing_past_the_weight, assert_refused,
                     assert_row_range_writes_only_its_columns, float_arrays, misaligned,
                     q8_activations, qgemm_both, qgemm_on, random_activations, runnable, zero_operands)
from llambda.runtime import buffers, layouts
from llambda.runtime.native import quant as native_quant
from llambda.runtime.ref import kquants16 as kq

TYPES = ["Q6_K", "Q3_K", "Q2_K"]
KINDS = {"Q6_K": "q6_k", "Q3_K": "q3_k", "Q2_K": "q2_k"}
BLOCK, GROUP, SUPER = 32, 8, 256
# Tiles (codegen/qgemm_k16.py): AVX2 3 activation rows x 8 columns
# (remainders of 1 and 2 rows); AVX-512 16 x 16, then 8, 4, 2, 1 rows, a lone last group
m_sizes = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 9, 16, 17]) | st.integers(1, 24)
n_sizes = st.sampled_from([1, 7, 8, 9, 15, 16, 17, 33]) | st.integers(1, 60)
k_sizes = st.sampled_from([256, 512, 768, 1280])


def raw_rows(type_name, n, k, seed=0, magnitude=1.0):
    return kq.random_blocks(type_name, n, k, np.random.default_rng(seed), magnitude)


def drawn_weight(draw, type_name, n, k):
    raw = raw_rows(type_name, n, k, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from([1e-6, 1e-2, 1.0, 300.0])))
    return raw, layouts.pack(type_name, raw, n, k)


def term_magnitudes(type_name, raw, n, k):
    """|each f32 term the kernel adds| per weight: |d sc (q - o)| (+ |dmin m| for Q2_K)."""
    blocks = kq.super_blocks(type_name, raw, n, k)
    if type_name == "Q2_K":
        q, scales, d, dmin = kq.decode_q2_k(blocks)
        dl = np.abs(d.astype(np.float64))[..., None] * (scales & 15)
        ml = np.abs(dmin.astype(np.float64))[..., None] * (scales >> 4)
        w = dl[..., None] * q.reshape(n, -1, 16, 16) + ml[..., None]
    else:
        raw_w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
        w = np.abs(raw_w.astype(np.float64))
    return np.asarray(w).reshape(n, k)


def magnitude_bound(qs, d, raw, type_name, n, k):
    return activation_magnitudes(qs, d) @ term_magnitudes(type_name, raw, n, k).T


def assert_qgemm_close(native, ref, qs, d, s, w, raw, type_name, rows=None, isa=None):
    n0, n1 = rows if rows is not None else (0, w.n)
    got, want = qgemm_both(native, ref, qs, d, s, w, isa, rows=rows)
    bound = magnitude_bound(qs, d, raw, type_name, w.n, w.k)[:, n0:n1]
    assert_close_to_reference(got[:, n0:n1], want[:, n0:n1], bound)


# --------------------------------------------------------------------------- dequantization

@given(st.data(), st.sampled_from(TYPES), st.integers(1, 20), st.sampled_from([256, 512, 768]))
def test_reference_and_layout_dequantize_like_gguf(data, type_name, n, k):
    raw, w = drawn_weight(data.draw, type_name, n, k)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, k)
    np.testing.assert_array_equal(kq.DEQUANTIZERS[type_name](raw, n, k).view(np.uint32), want.view(np.uint32))
    got = layouts.dequantize(w)
    assert got.dtype == np.float32 and w.kind == KINDS[type_name] and w.meta["source"] == type_name
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4)))
    np.testing.assert_array_equal(layouts.rows(w, ids), got[ids])


@pytest.mark.parametrize("type_name", TYPES)
def test_layouts_are_as_compact_as_stated(type_name):
    """Bytes per 256 weights (GGUF's own: Q6_K 210, Q3_K 110, Q2_K 84)."""
    n, k = 16, 512
    w = layouts.pack(type_name, raw_rows(type_name, n, k), n, k)
    assert w.nbytes * SUPER // (n * k) == {"Q6_K": 210, "Q3_K": 114, "Q2_K": 84}[type_name]
    assert all(a.ctypes.data % 64 == 0 for a in w.arrays.values())


# Where a real tensor of each type is: Gemma 3 270M's Q4_K_M (fetched), or llama.cpp's
# re-quantizations of the default model (made when llama-cpp-python is installed).
REAL_FILES = {"Q6_K": fetched_files.gemma_gguf, "Q3_K": lambda: fetched_files.variant("Q2_K"),
              "Q2_K": lambda: fetched_files.variant("Q2_K-pure")}


@pytest.mark.parametrize("type_name", TYPES)
def test_real_gguf_tensor(native, ref, type_name):
    path = REAL_FILES[type_name]()
    found = fetched_files.tensors_of_type(path, type_name, 1)
    assert found, f"{path} holds no {type_name} tensor"
    tensor = found[0]
    k, n = (int(v) for v in tensor.shape)
    raw = np.asarray(tensor.data)[:300]
    n = raw.shape[0]
    want = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(n, k)
    np.testing.assert_array_equal(kq.DEQUANTIZERS[type_name](raw, n, k).view(np.uint32), want.view(np.uint32))
    w = layouts.pack(type_name, raw, n, k)
    np.testing.assert_array_equal(layouts.dequantize(w).view(np.uint32), want.view(np.uint32))
    assert_qgemm_close(native, ref, *q8_activations(native, random_activations(5, k, seed=0)), w, raw, type_name)


def test_pack_rejects_bad_tensors():
    w = layouts.pack("Q2_K", raw_rows("Q2_K", 3, 256), 3, 256)
    assert_refused([
        (r"Q6_K: k = 576 must be a positive multiple of 256",
         lambda: layouts.pack("Q6_K", np.zeros((2, 576 // 256 * 210), np.uint8), 2, 576)),
        ("Q3_K: expected 3 rows of 110 bytes", lambda: layouts.pack("Q3_K", np.zeros((2, 110), np.uint8), 3, 256)),
        ("Q2_K: n = 0 must be >= 1", lambda: layouts.pack("Q2_K", np.zeros((0, 84), np.uint8), 0, 256)),
        ("ids: row indices must be integers in", lambda: layouts.rows(w, [3])),
    ])


# --------------------------------------------------------------------------- kernels

@pytest.fixture(scope="module", params=["avx2", "avx512"])
def isa(request, native):
    """Every qgemm variant this CPU runs for these kinds; the others are skipped (and say so)."""
    for kind in KINDS.values():
        runnable(request.param, kind)
    return request.param


@given(st.data(), st.sampled_from(TYPES), m_sizes, n_sizes, k_sizes)
def test_qgemm_matches_reference(native, ref, isa, data, type_name, m, n, k):
    raw, w = drawn_weight(data.draw, type_name, n, k)
    x = float_arrays(data.draw, (m, k))
    assert_qgemm_close(native, ref, *q8_activations(native, x), w, raw, type_name, isa=isa)


@given(st.data(), st.sampled_from(TYPES), m_sizes, st.integers(1, 50), st.sampled_from([256, 512]))
def test_qgemm_row_range_writes_only_its_columns(native, ref, isa, data, type_name, m, n, k):
    """Threads split the columns at multiples of 8: a range may start at an odd row group."""
    raw, w = drawn_weight(data.draw, type_name, n, k)
    assert_row_range_writes_only_its_columns(native, ref, isa, data.draw, w, m,
                                             lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@given(st.data(), st.sampled_from(TYPES), st.integers(2, 20), st.integers(1, 20))
def test_qgemm_on_row_slices(native, ref, isa, data, type_name, m, n):
    k = 256
    raw, w = drawn_weight(data.draw, type_name, n, k)
    assert_on_row_slices(native, ref, isa, data.draw, w, m,
                         lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@given(st.data(), st.sampled_from(TYPES), m_sizes, n_sizes, k_sizes)
def test_qgemm_variants_agree_bit_for_bit(native, data, type_name, m, n, k):
    """Both variants sum exact integer block sums with the same f32 operations in k order
    (codegen/qgemm_k16.py): a row's result does not depend on which kernel computed it."""
    runnable("avx512", KINDS[type_name])
    _, w = drawn_weight(data.draw, type_name, n, k)
    qs, d, s = q8_activations(native, float_arrays(data.draw, (m, k)))
    np.testing.assert_array_equal(qgemm_on(native, "avx512", qs, d, s, w), qgemm_on(native, "avx2", qs, d, s, w))


@pytest.mark.parametrize("type_name", TYPES)
def test_extreme_quants_and_scales_do_not_overflow(native, ref, isa, type_name):
    """Every quant at its maximum (or 0), scales at their extremes, activations at +-127:
    the int16 pair sums and int32 block sums stay exact."""
    n, k, m = 16, 512, 4
    raw = raw_rows(type_name, n, k, seed=5).reshape(n, k // SUPER, -1)
    nbytes = raw.shape[-1]
    if type_name == "Q6_K":
        raw[:8, :, :192] = 0xFF                   # q = 63
        raw[8:, :, :192] = 0                      # q = 0: q - 32 = -32
        raw[..., 192:208] = np.array([-128, 127], np.int8).view(np.uint8)[np.arange(16) % 2]
    elif type_name == "Q3_K":
        raw[:8, :, :96] = 0                       # q = 0: q - 4 = -4
        raw[8:, :, :96] = 0xFF                    # q = 7
        raw[..., 96:108] = 0                      # sc = 0: sc - 32 = -32
    else:
        raw[:, :, 16:80] = 0xFF                   # q = 3
        raw[..., :16] = 0xFF                      # sc = m = 15
    raw = raw.reshape(n, k // SUPER * nbytes)
    w = layouts.pack(type_name, raw, n, k)
    x = buffers.full((m, k), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    qs, d, s = q8_activations(native, x)
    assert np.abs(qs).max() == 127
    assert_qgemm_close(native, ref, qs, d, s, w, raw, type_name, isa=isa)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [8, 17, 24])
def test_qgemm_reads_nothing_past_the_weight(native, ref, isa, type_name, n):
    """The last row group ends at an unreadable page (k = 512: every array is a multiple of
    32 bytes, so its copy there starts aligned)."""
    k = 512
    raw = raw_rows(type_name, n, k, seed=n)
    w = layouts.pack(type_name, raw, n, k)
    assert_reads_nothing_past_the_weight(native, ref, isa, w, 4, n,
                                         lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [8, 17, 24, 40])
def test_avx2_decode_kernel_reads_nothing_past_the_weight(native, ref, type_name, n):
    """One activation row runs the AVX2 decode kernel (a group pair a pass, a lone last group
    paired with itself): each array ends at an unreadable page; n = 17 and 40 end inside a pair."""
    runnable("avx2", KINDS[type_name])
    k = 512
    raw = raw_rows(type_name, n, k, seed=n + 1)
    w = layouts.pack(type_name, raw, n, k)
    assert_reads_nothing_past_the_weight(native, ref, "avx2", w, 1, n,
                                         lambda qs, d: magnitude_bound(qs, d, raw, type_name, n, k))


@pytest.mark.parametrize("type_name", TYPES)
def test_one_row_takes_the_avx2_decode_kernel(native, type_name):
    """m = 1 on AVX2 calls the 1 x 16 kernel, more rows the 3 x 8 one (their rows agree bit for
    bit: tests/kernels/test_batch_invariance.py)."""
    runnable("avx2", KINDS[type_name])
    n, k = 24, 256
    w = layouts.pack(type_name, raw_rows(type_name, n, k), n, k)
    for m, tile in ((1, "1x16"), (2, "3x8")):
        qs, d, s, out = zero_operands(m, n, k)
        symbol, _ = native_quant.qgemm_call(qs, d, s, w, out, isa="avx2")
        assert symbol == f"llb_qgemm_{KINDS[type_name]}_q8_{tile}__avx2"


def test_qgemm_rejects_bad_arguments(native):
    m, n, k = 2, 10, 256
    w = layouts.pack("Q6_K", raw_rows("Q6_K", n, k), n, k)
    qs, d, s = buffers.zeros((m, k), np.int8), buffers.zeros((m, 8)), buffers.zeros((m, 8))
    out = buffers.zeros((m, n))

    def with_arrays(**arrays):
        return native.qgemm(qs, d, s, dataclasses.replace(w, arrays=arrays), out)

    def with_k(k, isa=None):
        return native.qgemm(buffers.zeros((m, k), np.int8), buffers.zeros((m, k // BLOCK)),
                            buffers.zeros((m, k // BLOCK)), w, out, isa=isa)

    assert_refused([
        ("w.sc: expected a numpy array", lambda: with_arrays(qs=w.arrays["qs"], d=w.arrays["d"])),
        ("w.d: data must be 32-byte aligned", lambda: with_arrays(**dict(w.arrays, d=misaligned(w.arrays["d"])))),
        ("w.qs: expected dtype uint8", lambda: with_arrays(**dict(w.arrays, qs=w.arrays["qs"].view(np.int8)))),
        ("w: has k = 256 but the activations have k = 512", lambda: with_k(512)),
        ("isa: expected one of avx2.*kind q6_k.*got 'avx1024'", lambda: with_k(256, isa="avx1024")),
    ])
    native.qgemm(qs, d, s, w, out)
    np.testing.assert_array_equal(out, 0)


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("type_name", TYPES)
def test_random_model_matches_reference_forward(tmp_path, type_name):
    import llambda
    from synth import write_random_llama
    from reference_forward import reference_logits
    from helpers import mean_kl, random_prompt
    path = write_random_llama(tmp_path / f"tiny-{type_name}.gguf", tensor_type=type_name, embed_type="Q8_0",
                              seed=7, n_ctx=256, n_layer=2, dim=256, n_head=4, n_kv_head=2, ffn_dim=512,
                              vocab_size=300)
    model = llambda.load(path, n_ctx=256, progress=False)
    for n, seed in ((1, 0), (37, 1)):
        ids = random_prompt(model.config.vocab_size, n, seed)
        fast, want = model.logits(ids), reference_logits(str(path), ids)
        assert np.isfinite(fast).all()
        assert (fast.argmax(-1) == want.argmax(-1)).mean() >= 0.95
        assert mean_kl(want, fast) <= 0.01
        assert np.abs(fast - want).max() <= 0.05 * (want.max() - want.min())
    step = model.evaluate(ids[:5])
    np.testing.assert_array_equal(step, model.logits(ids[:5])[-1])      # tests/kernels/test_batch_invariance.py
