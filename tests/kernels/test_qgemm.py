import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import (activation_magnitudes, assert_close_to_reference, assert_on_row_slices,
                     assert_reads_nothing_past_the_weight, assert_refused,
                     assert_row_range_writes_only_its_columns, drawn_weight, misaligned, q8_activations,
                     qgemm_both, qgemm_on, quantized_activations, random_activations, random_gguf_weight,
                     runnable, widest_isa_chosen_under, zero_operands)
from llambda.runtime import buffers, layouts
from llambda.runtime.layouts import PackedWeight

from llambda.codegen.contract import BLOCK, GROUP
# The qgemm variants, baseline first. Register tiles in codegen/qgemm.py: AVX2 6 rows x 8
# columns (remainders of 1..5 rows); AVX-512 16 x 16 (then 8-row tiles, remainders of 4, 2
# and 1 rows; a lone last row group), sampled below with their edges.
ISAS = ("avx2", "avx512")

m_sizes = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 24, 25, 33, 37]) | st.integers(1, 40)
n_sizes = st.sampled_from([1, 7, 8, 9, 15, 16, 17, 24, 25, 33, 100]) | st.integers(1, 120)
k_sizes = st.sampled_from([32, 64, 96, 576]) | st.integers(1, 20).map(lambda b: BLOCK * b)


@pytest.fixture(scope="module", params=ISAS[1:])
def wide_isa(request, native):
    """The variants beyond the AVX2 baseline, compared with it."""
    return runnable(request.param)


def magnitude_bound(qs, d, w):
    """sum_k |d_w q_w| + |m_w|) * |d_a q_a|: what float rounding errors are relative to."""
    if w.kind == "q4_1":
        w = dataclasses.replace(w, arrays=dict(w.arrays, dm=np.abs(w.arrays["dm"])))
    weights = np.abs(layouts.dequantize(w).astype(np.float64))
    return activation_magnitudes(qs, d) @ weights.T


@given(st.data(), st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), m_sizes, n_sizes, k_sizes)
def test_qgemm_matches_reference(native, ref, isa, data, type_name, m, n, k):
    w = drawn_weight(data.draw, type_name, n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    assert_close_to_reference(got, want, magnitude_bound(qs, d, w))


@given(st.data(), st.sampled_from(["Q4_1", "Q8_0"]), m_sizes, st.integers(1, 70), k_sizes)
def test_qgemm_row_range_writes_only_its_columns(native, ref, isa, data, type_name, m, n, k):
    """Threads split the columns at multiples of 8 (16 in plans): a range may start at an odd
    row group and end inside one."""
    w = drawn_weight(data.draw, type_name, n, k)
    assert_row_range_writes_only_its_columns(native, ref, isa, data.draw, w, m,
                                             lambda qs, d: magnitude_bound(qs, d, w))


@given(st.data(), st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), m_sizes, n_sizes, k_sizes)
def test_qgemm_variants_agree_bit_for_bit(native, wide_isa, data, type_name, m, n, k):
    """Every tile of both variants sums a row in the same order (codegen/qgemm.py), so every
    row agrees; tests/kernels/test_batch_invariance.py checks rows against their batch."""
    w = drawn_weight(data.draw, type_name, n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    baseline, got = qgemm_on(native, "avx2", qs, d, s, w), qgemm_on(native, wide_isa, qs, d, s, w)
    np.testing.assert_array_equal(got, baseline)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [8, 9, 17, 37])
def test_qgemm_rows_a_page_apart(native, ref, isa, type_name, m):
    """k = 4096: activation rows share cache sets, and the AVX-512 q4_1 kernel switches to
    8-row tiles; the results must not notice."""
    n, k = 40, 4096
    w = layouts.pack(type_name, random_gguf_weight(type_name, n, k, seed=m), n, k)
    qs, d, s = q8_activations(native, random_activations(m, k, seed=m))
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    assert_close_to_reference(got, want, magnitude_bound(qs, d, w))
    np.testing.assert_array_equal(got, qgemm_on(native, "avx2", qs, d, s, w))


# AVX-512 q4_1 / q8_0 (codegen/qgemm.py KIND_TILINGS): 16-row tiles, then one tile of exactly
# the rows left (1..15), rows interleaved four at a time; q4_1 runs 8-row tiles instead of
# 16-row ones where activation rows lie 4096 bytes apart (k = 4096).
every_row_count = st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 19, 31, 32, 33, 47, 48, 49])
n_not_whole_pairs = st.sampled_from([1, 8, 9, 15, 17, 24, 31, 40]) | st.integers(1, 70)


@given(st.data(), st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), every_row_count, n_not_whole_pairs,
       st.sampled_from([32, 64, 576, 4096]) | st.integers(1, 24).map(lambda b: BLOCK * b))
def test_qgemm_tile_of_every_row_count(native, ref, wide_isa, data, type_name, m, n, k):
    """Each row count's tile against the reference, and bit for bit against the AVX2 baseline
    (whose tiles are 6 rows and 1..5): one block and many, an odd last row group."""
    w = drawn_weight(data.draw, type_name, n, k)
    qs, d, s = quantized_activations(native, data.draw, m, k)
    got, want = qgemm_both(native, ref, qs, d, s, w, wide_isa)
    assert_close_to_reference(got, want, magnitude_bound(qs, d, w))
    np.testing.assert_array_equal(got, qgemm_on(native, "avx2", qs, d, s, w))


@pytest.mark.parametrize("vendor, single_row", [("AuthenticAMD", "avx2"), ("GenuineIntel", "avx512"), ("", "avx2")])
def test_qgemm_picks_avx512_from_three_rows_for_q4_1_and_q8_0(native, monkeypatch, vendor, single_row):
    """The tiles above stream both groups with a prefetch: from m = 3 rows on the binding
    picks them (m = 2 stays on AVX2; m = 1 too, except on Intel CPUs, where the model decodes
    faster on them); other kinds keep AVX512_MIN_ROWS. The bits are the same either way."""
    from llambda.runtime.native import quant as n_quant
    if n_quant.widest_qgemm_isa("q4_1") != "avx512":
        pytest.skip("the AVX-512 qgemm kernels do not run here (or LLAMBDA_ISA caps them)")
    monkeypatch.setattr(n_quant.cpu, "vendor", lambda: vendor)
    picks = {(kind, m): n_quant._qgemm_isa(None, m, kind) for kind in ("q4_1", "q8_0") for m in (1, 2, 3, 4)}
    want = {1: single_row, 2: "avx2", 3: "avx512", 4: "avx512"}
    assert picks == {(kind, m): want[m] for kind in ("q4_1", "q8_0") for m in (1, 2, 3, 4)}
    assert n_quant._qgemm_isa(None, 1, "q6_k") == "avx2" and n_quant._qgemm_isa(None, 3, "q6_k") == "avx2"


@given(st.data(), st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), st.integers(1, 40), st.sampled_from([32, 96]))
def test_rows_is_dequantize_of_those_rows(data, type_name, n, k):
    w = drawn_weight(data.draw, type_name, n, k)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5)))
    full = layouts.dequantize(w)
    assert full.shape == (n, k) and full.dtype == np.float32
    np.testing.assert_array_equal(layouts.rows(w, ids), full[ids])


def test_layout_arrays_are_aligned_and_padded():
    w = layouts.pack("Q4_1", random_gguf_weight("Q4_1", 9, 64), 9, 64)
    assert w.kind == "q4_1" and w.meta["group"] == GROUP and w.meta["source"] == "Q4_1"
    assert w.arrays["qs"].shape == (2, 2, 4, GROUP, 4) and w.arrays["dm"].shape == (2, 2, 2, GROUP)
    assert all(a.ctypes.data % 64 == 0 for a in w.arrays.values())
    np.testing.assert_array_equal(w.arrays["qs"][1, :, :, 1:], 0)     # rows 9..15 are padding
    np.testing.assert_array_equal(w.arrays["dm"][1, :, :, 1:], 0)


def test_pack_rejects_bad_tensors():
    raw = np.zeros((4, 20), np.uint8)
    huge = np.zeros((1, 18), np.uint8)
    huge[0, :2] = np.array([30000], np.float16).view(np.uint8)
    w = layouts.pack("Q4_1", raw, 4, 32)
    assert_refused([
        ("k = 48 must be a positive multiple of 32", lambda: layouts.pack("Q4_1", raw, 4, 48)),
        ("expected 4 rows of 40 bytes", lambda: layouts.pack("Q4_1", raw, 4, 64)),
        ("IQ4_NL is not supported", lambda: layouts.pack("IQ4_NL", raw, 4, 32)),
        ("too large", lambda: layouts.pack("Q4_0", huge, 1, 32)),
        ("ids: row indices must be integers in", lambda: layouts.rows(w, [4])),
    ])


def test_qgemm_rejects_bad_arguments(native, isa):
    m, n, k = 3, 10, 64
    w = layouts.pack("Q4_1", np.zeros((n, 40), np.uint8), n, k)
    qs, d, s = buffers.zeros((m, k), np.int8), buffers.zeros((m, 2)), buffers.zeros((m, 2))
    out = buffers.zeros((m, n))

    def qgemm(*args, **kwargs):
        native.qgemm(*args, isa=isa, **kwargs)

    assert_refused([
        ("qs: expected dtype int8", lambda: qgemm(buffers.zeros((m, k), np.uint8), d, s, w, out)),
        ("qs: k = 40 must be a multiple of 32", lambda: qgemm(buffers.zeros((m, 40), np.int8), d, s, w, out)),
        ("d: expected shape", lambda: qgemm(qs, buffers.zeros((m, 3)), s, w, out)),
        ("s: data must be 4-byte aligned",
         lambda: qgemm(qs, d, buffers.zeros(2 * m + 1).view(np.uint8)[2:2 + 8 * m].view(np.float32).reshape(m, 2),
                       w, out)),
        ("w.qs: data must be 32-byte aligned",
         lambda: qgemm(qs, d, s, dataclasses.replace(w, arrays=dict(w.arrays, qs=misaligned(w.arrays["qs"]))), out)),
        ("out: expected shape", lambda: qgemm(qs, d, s, w, buffers.zeros((m, n + 1)))),
        ("out: array must be C-contiguous", lambda: qgemm(qs, d, s, w, buffers.zeros((m, 2 * n))[:, ::2])),
        ("w: expected a PackedWeight", lambda: qgemm(qs, d, s, np.zeros((n, k), np.float32), out)),
        ("w: qgemm needs a weight of kind q4_1, q8_0", lambda: qgemm(qs, d, s, PackedWeight("f32", n, k), out)),
        ("w: has k = 64 but the activations have k = 32",
         lambda: qgemm(buffers.zeros((m, 32), np.int8), buffers.zeros((m, 1)), buffers.zeros((m, 1)), w, out)),
        ("w.dm: expected a numpy array",
         lambda: qgemm(qs, d, s, dataclasses.replace(w, arrays=dict(qs=w.arrays["qs"])), out)),
        ("w.qs: expected shape", lambda: qgemm(qs, d, s, dataclasses.replace(w, n=17), buffers.zeros((m, 17)))),
        (r"rows: n0 must be a multiple of 8 \(the row group\), got 4", lambda: qgemm(qs, d, s, w, out, rows=(4, 8))),
        (r"rows: expected 0 <= n0 < n1 <= 10, got \(8, 11\)", lambda: qgemm(qs, d, s, w, out, rows=(8, 11))),
        (r"rows: expected 0 <= n0 < n1 <= 10, got \(8, 8\)", lambda: qgemm(qs, d, s, w, out, rows=(8, 8))),
        ("rows: expected a pair", lambda: qgemm(qs, d, s, w, out, rows=8)),
        (r"rows\[1\]: expected an integer, got 7.5", lambda: qgemm(qs, d, s, w, out, rows=(0, 7.5))),
    ])
    qgemm(qs, d, s, w, out)                   # and the process is fine
    np.testing.assert_array_equal(out, 0)


@given(st.data(), st.sampled_from(["Q4_1", "Q8_0"]), st.integers(2, 20), st.integers(1, 40), st.sampled_from([32, 96]))
def test_qgemm_on_row_slices(native, ref, isa, data, type_name, m, n, k):
    """Activations and outputs need only element alignment: the last token's row of a prefill
    feeds the LM head without a copy."""
    w = drawn_weight(data.draw, type_name, n, k)
    assert_on_row_slices(native, ref, isa, data.draw, w, m, lambda qs, d: magnitude_bound(qs, d, w))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [8, 17, 24, 40])
def test_qgemm_reads_nothing_past_the_weight(native, ref, isa, type_name, n):
    """The last row groups end at an unreadable page (a stray read would crash): the AVX-512
    kernel pairs a lone last group with itself, not with the bytes after it. (k = 64 makes
    every weight array a multiple of 32 bytes, so its copy starts aligned.)"""
    k = 64
    w = layouts.pack(type_name, random_gguf_weight(type_name, n, k), n, k)
    assert_reads_nothing_past_the_weight(native, ref, isa, w, 5, n, lambda qs, d: magnitude_bound(qs, d, w))


def test_qgemm_rejects_an_unknown_or_unavailable_isa(native, monkeypatch):
    from llambda.runtime.native import quant as n_quant
    m, n, k = 4, 16, 32
    w = layouts.pack("Q4_1", random_gguf_weight("Q4_1", n, k), n, k)
    qs, d, s, out = zero_operands(m, n, k)
    with pytest.raises(ValueError, match="isa: expected one of avx2.*got 'avx1024'"):
        native.qgemm(qs, d, s, w, out, isa="avx1024")
    monkeypatch.setattr(n_quant, "qgemm_isas", lambda kind=None: ("avx2",))     # a CPU without AVX-512 VNNI
    with pytest.raises(ValueError, match="isa: expected one of avx2 .*got 'avx512'"):
        native.qgemm(qs, d, s, w, out, isa="avx512")
    native.qgemm(qs, d, s, w, out, isa="avx2")


@pytest.mark.parametrize("cap, m, expected", [(None, 16, "avx512"), (None, 2, "avx2"), (None, 3, "avx512"),
                                              ("avx2", 16, "avx2"), ("avx512", 4, "avx512")])
def test_qgemm_chooses_the_widest_variant_that_pays(native, monkeypatch, cap, m, expected):
    runnable(expected)
    n, k = 16, 32
    w = layouts.pack("Q8_0", random_gguf_weight("Q8_0", n, k), n, k)
    qs, d, s, out = zero_operands(m, n, k)
    with widest_isa_chosen_under(monkeypatch, cap) as n_quant:
        symbol, _ = n_quant.qgemm_call(qs, d, s, w, out)
        assert symbol.endswith(f"__{expected}")
    with widest_isa_chosen_under(monkeypatch, "sse2") as n_quant:
        with pytest.raises(ValueError, match="LLAMBDA_ISA: expected one of avx2, avx512, got 'sse2'"):
            n_quant.qgemm_call(qs, d, s, w, out)


