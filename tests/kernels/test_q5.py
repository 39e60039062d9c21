"""Q5_0 / Q5_1: the reference dequantizers against gguf's, the dense layout (runtime/layout_q5.py)
against the reference, and the qgemm kernels (codegen/qgemm.py, five-bit kinds) against the
numpy reference GEMM on both ISAs."""
import dataclasses

import gguf
import numpy as np
import pytest
from hypothesis import given, strategies as st

import fetched_files
from helpers import (LEGACY_BLOCKS, activation_magnitudes, assert_close_to_reference, assert_on_row_slices,
                     assert_reads_nothing_past_the_weight, assert_refused,
                     assert_row_range_writes_only_its_columns, drawn_weight, misaligned, q8_activations,
                     qgemm_both, qgemm_on, quantized_activations, random_activations,
                     random_gguf_weight as random_q5, runnable, widest_isa_chosen_under, zero_operands)
from llambda.runtime import buffers, layouts
from llambda.runtime.layout_q5 import packed_quants, unpacked_quants
from llambda.runtime.layouts import PackedWeight
from llambda.runtime.ref.gguf_blocks import Q5_BLOCK_BYTES, dequantize_q5_0, dequantize_q5_1

from llambda.codegen.contract import BLOCK, GROUP
TYPES = ("Q5_0", "Q5_1")
REFERENCE = {"Q5_0": dequantize_q5_0, "Q5_1": dequantize_q5_1}
SCALE_FIELDS = {name: LEGACY_BLOCKS[name][1] for name in TYPES}
# Real files holding these types (llama.cpp falls back to Q5_0 where Q4_K does not fit, as
# in Gemma 3 270M's Q4_K_M; Q5_1 only from llama.cpp re-quantizing the default model).
REAL_FILES = {"Q5_1": lambda: fetched_files.variant("Q5_1"), "Q5_0": fetched_files.gemma_gguf}

# AVX2 tiles: 6 rows (remainders 1..5); AVX-512: 16, 8, 4, 2, 1 rows and a lone last row group.
m_sizes = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 24, 25, 33, 37]) | st.integers(1, 40)
n_sizes = st.sampled_from([1, 7, 8, 9, 15, 16, 17, 24, 25, 33, 100]) | st.integers(1, 120)
k_sizes = st.sampled_from([32, 64, 96, 576]) | st.integers(1, 20).map(lambda b: BLOCK * b)


def bits(values):
    return np.asarray(values, np.float32).view(np.uint32)


# --------------------------------------------------------------------------- reference and layout

@given(st.sampled_from(TYPES), st.integers(1, 12), st.integers(1, 6), st.integers(0, 2**32 - 1),
       st.sampled_from([1e-7, 1e-3, 1.0, 300.0, 60000.0]))
def test_reference_dequantizer_is_gguf_bit_for_bit(type_name, n, blocks, seed, magnitude):
    raw = random_q5(type_name, n, BLOCK * blocks, seed, magnitude)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    np.testing.assert_array_equal(bits(REFERENCE[type_name](raw)), bits(want))


@given(st.sampled_from(TYPES), st.integers(1, 12), st.integers(1, 6))
def test_reference_dequantizer_on_gguf_quantized_values(type_name, n, blocks):
    x = np.random.default_rng(n * 7 + blocks).standard_normal((n, BLOCK * blocks)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(x, qtype)
    np.testing.assert_array_equal(bits(REFERENCE[type_name](raw)), bits(gguf.quants.dequantize(raw, qtype).reshape(-1)))


def real_tensors(type_name, count=3):
    path = REAL_FILES[type_name]()
    found = fetched_files.tensors_of_type(path, type_name, count)
    assert found, f"{path} holds no {type_name} tensor"
    return found


@pytest.mark.parametrize("type_name", TYPES)
def test_reference_layout_and_kernels_on_real_tensors(native, ref, type_name):
    from llambda.runtime.native.quant import qgemm_isas
    for tensor in real_tensors(type_name):
        k, n = (int(v) for v in tensor.shape[:2])
        raw = np.asarray(tensor.data)
        want = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(n, k)
        np.testing.assert_array_equal(bits(REFERENCE[type_name](raw)).reshape(n, k), bits(want), err_msg=tensor.name)
        w = layouts.pack(type_name, raw, n, k)
        np.testing.assert_array_equal(bits(layouts.dequantize(w)), bits(want), err_msg=tensor.name)
        qs, d, s = q8_activations(native, random_activations(5, k, seed=n))
        for isa in qgemm_isas():
            got, expected = qgemm_both(native, ref, qs, d, s, w, isa)
            assert_close_to_reference(got, expected, magnitude_bound(qs, d, w))


@given(st.sampled_from(TYPES), st.integers(1, 40), st.sampled_from([32, 64, 96, 160]), st.integers(0, 2**32 - 1),
       st.sampled_from([1e-7, 1e-3, 1.0, 300.0, 60000.0]))
def test_pack_then_dequantize_is_the_reference_bit_for_bit(type_name, n, k, seed, magnitude):
    raw = random_q5(type_name, n, k, seed, magnitude)
    w = layouts.pack(type_name, raw, n, k)
    assert w.kind == type_name.lower() and w.meta == dict(group=GROUP, source=type_name)
    want = REFERENCE[type_name](raw).reshape(n, k)
    np.testing.assert_array_equal(bits(layouts.dequantize(w)), bits(want))
    ids = np.random.default_rng(seed).integers(0, n, 5)
    np.testing.assert_array_equal(bits(layouts.rows(w, ids)), bits(want[ids]))


def test_packed_quants_round_trip_every_value():
    q = np.random.default_rng(0).integers(0, 32, (500, BLOCK)).astype(np.uint8)
    q[0], q[1] = 0, 31
    packed = packed_quants(q)
    assert packed.shape == (500, 20) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpacked_quants(packed), q)


def test_layout_arrays_are_aligned_padded_and_as_compact_as_gguf():
    for type_name, scale_name, scale_shape in (("Q5_0", "d", (2, 3, GROUP)), ("Q5_1", "dm", (2, 3, 2, GROUP))):
        w = layouts.pack(type_name, random_q5(type_name, 9, 96), 9, 96)
        assert w.arrays["qs"].shape == (2, 3, 5, GROUP, 4) and w.arrays[scale_name].shape == scale_shape
        assert all(a.ctypes.data % 64 == 0 for a in w.arrays.values())
        np.testing.assert_array_equal(w.arrays["qs"][1, :, :, 1:], 0)          # rows 9..15 are padding
        np.testing.assert_array_equal(w.arrays[scale_name][1, ..., 1:], 0)
        full = layouts.pack(type_name, random_q5(type_name, 16, 64), 16, 64)
        assert full.nbytes == 16 * 2 * Q5_BLOCK_BYTES[type_name]               # GGUF's own bytes


def test_pack_rejects_bad_tensors():
    w = layouts.pack("Q5_0", np.zeros((4, 22), np.uint8), 4, 32)
    assert_refused([
        ("Q5_0: k = 48 must be a positive multiple of 32",
         lambda: layouts.pack("Q5_0", np.zeros((4, 33), np.uint8), 4, 48)),
        (r"Q5_1: expected 4 rows of 48 bytes for a \[4, 64\] tensor",
         lambda: layouts.pack("Q5_1", np.zeros((4, 44), np.uint8), 4, 64)),
        ("Q5_0: n = 0 must be >= 1", lambda: layouts.pack("Q5_0", np.zeros((0, 22), np.uint8), 0, 32)),
        ("ids: row indices must be integers in", lambda: layouts.rows(w, [4])),
    ])


# --------------------------------------------------------------------------- kernels

def magnitude_bound(qs, d, w):
    """sum_k (|d_w q_w| + |m_w|) |d_a q_a|: the terms the kernel adds (m = -16 d for q5_0)."""
    groups, kb = w.arrays["qs"].shape[:2]
    if w.kind == "q5_1":
        dm = np.abs(w.arrays["dm"].astype(np.float64))                 # [groups, kb, 2, 8]
        d_w, m_w = dm[:, :, 0], dm[:, :, 1]
    else:
        d_w = np.abs(w.arrays["d"].astype(np.float64))
        m_w = 16 * d_w
    q = np.stack([unpacked_quants(w.arrays["qs"][:, :, :, r].reshape(groups, kb, 20)) for r in range(GROUP)], axis=2)
    per_weight = d_w[..., None] * q + m_w[..., None]                   # [groups, kb, 8, 32]
    weights = per_weight.transpose(0, 2, 1, 3).reshape(groups * GROUP, -1)[:w.n]
    return activation_magnitudes(qs, d) @ weights.T


@given(st.data(), st.sampled_from(TYPES), m_sizes, n_sizes, k_sizes)
def test_qgemm_matches_reference(native, ref, isa, data, type_name, m, n, k):
    w = drawn_weight(data.draw, type_name, n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    assert_close_to_reference(got, want, magnitude_bound(qs, d, w))


@given(st.data(), st.sampled_from(TYPES), m_sizes, st.integers(1, 70), k_sizes)
def test_qgemm_row_range_writes_only_its_columns(native, ref, isa, data, type_name, m, n, k):
    w = drawn_weight(data.draw, type_name, n, k)
    assert_row_range_writes_only_its_columns(native, ref, isa, data.draw, w, m,
                                             lambda qs, d: magnitude_bound(qs, d, w))


@given(st.data(), st.sampled_from(TYPES), m_sizes, n_sizes, k_sizes)
def test_qgemm_isas_agree_bit_for_bit_on_every_row(native, data, type_name, m, n, k):
    """Every five-bit tile sums a row's blocks with the same f32 operations in the same order
    (one accumulator per row), so decode (AVX2) and prefill (AVX-512) give the same bits."""
    runnable("avx512")
    w = drawn_weight(data.draw, type_name, n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    np.testing.assert_array_equal(qgemm_on(native, "avx512", qs, d, s, w), qgemm_on(native, "avx2", qs, d, s, w))


@pytest.mark.parametrize("type_name", TYPES)
def test_qgemm_extreme_scales(native, ref, isa, type_name):
    """q5_0 forms m = -16 d in f32: a d near the f16 maximum (where -16 d has no f16 value)
    still multiplies correctly; all-31 and all-0 quants reach the int16 sums' limits."""
    m, n, k = 7, 17, 256
    raw = random_q5(type_name, n, k, seed=3).reshape(n, k // BLOCK, -1)
    fields = SCALE_FIELDS[type_name]
    raw[..., :2 * fields] = np.full(fields, 60000.0, np.float16).view(np.uint8)
    raw[0, :, 2 * fields:] = 0xFF                                      # q = 31 everywhere
    raw[1, :, 2 * fields:] = 0                                          # q = 0
    w = layouts.pack(type_name, raw.reshape(n, -1), n, k)
    x = np.full((m, k), 127.0, np.float32)
    x[1::2] = -127.0
    qs, d, s = q8_activations(native, buffers.aligned_copy(x))
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    assert np.isfinite(got).all()
    assert_close_to_reference(got, want, magnitude_bound(qs, d, w))


@given(st.data(), st.sampled_from(TYPES), st.integers(2, 20), st.integers(1, 40), st.sampled_from([32, 96]))
def test_qgemm_on_row_slices(native, ref, isa, data, type_name, m, n, k):
    w = drawn_weight(data.draw, type_name, n, k)
    assert_on_row_slices(native, ref, isa, data.draw, w, m, lambda qs, d: magnitude_bound(qs, d, w))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [8, 17, 24, 40])
def test_qgemm_reads_nothing_past_the_weight(native, ref, isa, type_name, n):
    """The weight's arrays end at an unreadable page (k = 64: every array a multiple of 32 bytes)."""
    k = 64
    w = layouts.pack(type_name, random_q5(type_name, n, k), n, k)
    assert_reads_nothing_past_the_weight(native, ref, isa, w, 5, n, lambda qs, d: magnitude_bound(qs, d, w))


@pytest.mark.parametrize("type_name, scale_name", [("Q5_0", "d"), ("Q5_1", "dm")])
def test_qgemm_rejects_bad_five_bit_weights(native, isa, type_name, scale_name):
    m, n, k = 3, 10, 64
    w = layouts.pack(type_name, random_q5(type_name, n, k), n, k)
    qs, d, s = buffers.zeros((m, k), np.int8), buffers.zeros((m, 2)), buffers.zeros((m, 2))
    out = buffers.zeros((m, n))
    other = "dm" if scale_name == "d" else "d"

    def qgemm(weight, **kwargs):
        native.qgemm(qs, d, s, weight, out, isa=isa, **kwargs)

    def with_arrays(**arrays):
        qgemm(dataclasses.replace(w, arrays=arrays))

    assert_refused([
        ("w.qs: data must be 32-byte aligned", lambda: with_arrays(**dict(w.arrays, qs=misaligned(w.arrays["qs"])))),
        ("w.qs: expected shape", lambda: with_arrays(**dict(w.arrays, qs=w.arrays["qs"][:, :, :4].copy()))),
        ("w.qs: expected dtype uint8", lambda: with_arrays(**dict(w.arrays, qs=w.arrays["qs"].view(np.int8)))),
        (f"w.{scale_name}: expected a numpy array", lambda: with_arrays(qs=w.arrays["qs"])),
        (f"w.{scale_name}: expected a numpy array",
         lambda: with_arrays(qs=w.arrays["qs"], **{other: w.arrays[scale_name]})),
        ("w: has k = 64 but the activations have k = 32",
         lambda: native.qgemm(buffers.zeros((m, 32), np.int8), buffers.zeros((m, 1)), buffers.zeros((m, 1)), w, out,
                              isa=isa)),
        ("w: qgemm needs a weight of kind .*q5_0, q5_1.*got kind 'q5_2'",
         lambda: qgemm(dataclasses.replace(w, kind="q5_2"))),
        ("w: qgemm needs a weight of kind", lambda: qgemm(PackedWeight("f32", n, k))),
    ])
    qgemm(w)                                  # and the process is fine


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("cap, expected", [(None, "avx512"), ("avx2", "avx2")])
def test_five_bit_decode_runs_on_the_widest_variant(native, monkeypatch, type_name, cap, expected):
    """Unlike q4_1 / q8_0, five-bit weights decode (m < 4) on AVX-512 when the CPU has it
    (runtime/native/quant.py AVX512_DECODE_KINDS); LLAMBDA_ISA=avx2 still caps it."""
    runnable("avx512")
    n, k = 16, 32
    w = layouts.pack(type_name, random_q5(type_name, n, k), n, k)
    with widest_isa_chosen_under(monkeypatch, cap) as n_quant:
        for m in (1, 3, 16):
            qs, d, s, out = zero_operands(m, n, k)
            symbol, _ = n_quant.qgemm_call(qs, d, s, w, out)
            assert symbol.endswith(f"__{expected}")


# --------------------------------------------------------------------------- end to end, llama.cpp as referee

@pytest.mark.parametrize("type_name", TYPES)
def test_tiny_models_match_recorded_llama_cpp_logits(tmp_path, type_name):
    """Random-weight llama GGUFs (3 heads, GQA 3:1, k = 96 and 160) in Q5_0 / Q5_1, run by
    llama.cpp once (tools/record_llamacpp_logits.py --set q5). Both the fast path and the
    reference forward quantize differently from llama.cpp (int8 activations / none), so: the
    same top-1 wherever llama.cpp's top-2 margin is clear, KL(llama.cpp || ours) <= 0.01 on
    average, and max |dlogit| <= 5% of the logit spread."""
    import llambda
    from llambda.bench.llamacpp_compare import kl_divergence
    from llamacpp_fixtures import synth_recording
    from reference_forward import reference_logits
    recording, path = synth_recording("q5", type_name, tmp_path)
    ids, expected = recording.ids, recording.logits
    top2 = np.sort(expected, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.01 * (expected.max() - expected.min())
    fast = llambda.load(path, n_ctx=256, progress=False).logits(ids)
    for name, got in (("fast path", fast), ("reference forward", reference_logits(str(path), ids))):
        got = got[recording.positions]
        assert (got.argmax(-1) == expected.argmax(-1))[clear].all(), name
        assert kl_divergence(expected, got).mean() <= 0.01, name
        assert np.abs(got - expected).max() <= 0.05 * (expected.max() - expected.min()), name
