"""The float linear layer (gemm_f32 / gemm_f16 / matmul_nt) and its weight layouts.

Tolerance for every product against the float64 reference: each output is a
sum of k products accumulated in f32 by FMA (one chain in k order, in every
kernel variant; numpy's own order for the reference), so

    |got - exact| <= (k + 4) * eps32 * sum_k |x||w|        (eps32 = 2^-23)

which is twice the classic k * u bound (u = 2^-24) for margin; it scales
with the magnitudes, so the huge and tiny inputs are held to the same
relative standard.

Batch invariance (DESIGN.md "Many sequences") is checked bit for bit: a row's
result is the same whatever m is, wherever the row sits, however the product
is blocked or split by columns, and on every kernel variant (ISA).
"""
import contextlib

import gguf
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import assert_refused, float_arrays, nan_buffer
from llambda.runtime import buffers, layouts
from llambda.runtime import layout_float
from llambda.runtime.layouts import PackedWeight
import llambda.runtime.native.gemm as native_gemm

EPS32 = float(np.finfo(np.float32).eps)
PANEL = layout_float.PANEL_ROWS
F16_MAX = 60000.0

# the kernels' tiles: 6 (AVX2) and 8 (AVX-512) rows; column blocks of 32 and 48, panels of 16;
# k unrolled by 4
m_sizes = st.one_of(st.sampled_from([1, 5, 6, 7, 8, 9, 13, 17]), st.integers(1, 100))
n_sizes = st.one_of(st.sampled_from([1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 95, 96, 97]), st.integers(1, 200))
k_sizes = st.one_of(st.sampled_from([1, 3, 4, 5, 7, 8, 9, 31]), st.integers(1, 600))
gguf_types = st.sampled_from(["F32", "BF16", "F16"])
gemm_isas = st.sampled_from(native_gemm.gemm_isas())


def gguf_raw(gguf_type, matrix):
    """``matrix`` as gguf.GGUFReader would hand it over for ``gguf_type``."""
    if gguf_type == "F16":
        return np.clip(matrix, -F16_MAX, F16_MAX).astype(np.float16)
    if gguf_type == "BF16":
        return gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.BF16)
    return matrix.astype(np.float32)


def gemm_for(backend, kind):
    return getattr(backend, f"gemm_{kind}")


def assert_close_to_exact(got, x, weights, what):
    exact = x.astype(np.float64) @ weights.astype(np.float64).T
    bound = (x.shape[1] + 4) * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(weights.astype(np.float64)).T)
    error = np.abs(got - exact)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (f"{what}: |err| {error[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                    f"(got {got[worst]!r}, exact {exact[worst]!r})")


@contextlib.contextmanager
def blocking(k_block, m_block):
    """Force the binding's cache blocking small, so tiny sizes take the k-block
    (accumulate into out) and m-block paths that real sizes take."""
    saved = native_gemm.K_BLOCK, native_gemm.M_BLOCK
    native_gemm.K_BLOCK, native_gemm.M_BLOCK = k_block, m_block
    try:
        yield
    finally:
        native_gemm.K_BLOCK, native_gemm.M_BLOCK = saved


def column_range(draw, n):
    """None (all columns) or (n0, n1) with n0 a panel start."""
    if draw(st.booleans()):
        return None
    n0 = PANEL * draw(st.integers(0, (n - 1) // PANEL))
    return n0, draw(st.integers(n0 + 1, n))


@given(st.data(), m_sizes, n_sizes, k_sizes, gguf_types, gemm_isas)
def test_gemm_matches_exact_product(native, ref, data, m, n, k, gguf_type, isa):
    x = float_arrays(data.draw, (m, k))
    w = layout_float.pack(gguf_type, gguf_raw(gguf_type, float_arrays(data.draw, (n, k))), n, k)
    weights = layout_float.dequantize(w)
    columns = column_range(data.draw, n)
    n0, n1 = columns or (0, n)
    k_block, m_block = data.draw(st.sampled_from([(native_gemm.K_BLOCK, native_gemm.M_BLOCK), (8, 6), (5, 13)]))
    for backend, variant in ((native, {"isa": isa}), (ref, {})):
        out = nan_buffer((m, n))
        with blocking(k_block, m_block):
            gemm_for(backend, w.kind)(x, w, out, rows=columns, **variant)
        assert_close_to_exact(out[:, n0:n1], x, weights[n0:n1], f"{backend.name} {w.kind} {variant}")
        assert np.isnan(out[:, :n0]).all() and np.isnan(out[:, n1:]).all(), \
            f"{backend.name} {variant}: wrote outside columns {n0}..{n1 - 1}"


def assert_same_bits(got, want, what):
    same = got.view(np.uint32) == want.view(np.uint32)
    if not same.all():
        row, col = np.argwhere(~same)[0]
        raise AssertionError(f"{what}: {int((~same).sum())} outputs differ, first at row {row} column {col}: "
                             f"{got[row, col]!r} != {want[row, col]!r}")


@given(st.data(), st.integers(2, 40), n_sizes, st.one_of(k_sizes, st.integers(600, 1200)), gguf_types)
def test_gemm_rows_are_batch_invariant(native, data, m, n, k, gguf_type):
    """Every row of an m-row product is bit-identical to the same row computed alone (m = 1,
    the decode path), at another position among other rows, blocked into k and m blocks,
    split by columns, and on every kernel variant."""
    x = float_arrays(data.draw, (m, k))
    w = layout_float.pack(gguf_type, gguf_raw(gguf_type, float_arrays(data.draw, (n, k))), n, k)
    gemm = gemm_for(native, w.kind)
    alone = np.stack([one_row(gemm, x, i, w, "avx2") for i in range(m)])
    perm = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).permutation(m)
    shuffled = buffers.aligned_copy(x[perm])
    split = PANEL * data.draw(st.integers(0, (n - 1) // PANEL))
    for isa in native_gemm.gemm_isas():
        for k_block, m_block in ((native_gemm.K_BLOCK, native_gemm.M_BLOCK), (8, 6), (5, 13)):
            with blocking(k_block, m_block):
                out = nan_buffer((m, n))
                gemm(x, w, out, isa=isa)
                assert_same_bits(out, alone, f"{w.kind} {isa} m={m} blocks {k_block}x{m_block}")
                out = nan_buffer((m, n))
                gemm(shuffled, w, out, isa=isa)
                assert_same_bits(out, alone[perm], f"{w.kind} {isa} rows permuted")
                out = nan_buffer((m, n))
                if split:
                    gemm(x, w, out, rows=(0, split), isa=isa)
                gemm(x, w, out, rows=(split, n), isa=isa)
                assert_same_bits(out, alone, f"{w.kind} {isa} columns split at {split}")
        row = data.draw(st.integers(0, m - 1))
        assert_same_bits(one_row(gemm, x, row, w, isa)[None], alone[row:row + 1], f"{w.kind} {isa} m=1")


@settings(max_examples=12, deadline=None)
@given(st.data(), st.sampled_from(["F16", "F32", "BF16"]))
def test_gemm_k_chunks_are_invariant_and_exact(native, ref, data, gguf_type):
    """The AVX-512 kernel from CONVERT_MIN_ROWS rows on runs each column block CHUNK_K k
    steps at a time (f16: widened into a stack buffer once a chunk): k on either side of a
    chunk boundary gives the exact product within the module's bound, and every row the
    same bits as alone on AVX2 (m = 1)."""
    from llambda.codegen.gemm import CHUNK_K, CONVERT_MIN_ROWS
    m = data.draw(st.sampled_from([CONVERT_MIN_ROWS, CONVERT_MIN_ROWS + 1, CONVERT_MIN_ROWS + 7, 49]))
    n = data.draw(st.sampled_from([48, 49, 95, 97, 144]))
    k = data.draw(st.sampled_from([CHUNK_K - 1, CHUNK_K, CHUNK_K + 1, 2 * CHUNK_K + 5]))
    x = float_arrays(data.draw, (m, k))
    w = layout_float.pack(gguf_type, gguf_raw(gguf_type, float_arrays(data.draw, (n, k))), n, k)
    gemm = gemm_for(native, w.kind)
    for isa in native_gemm.gemm_isas():
        out = nan_buffer((m, n))
        gemm(x, w, out, isa=isa)
        assert_close_to_exact(out, x, layout_float.dequantize(w), f"{w.kind} {isa} m={m} k={k}")
        rows = sorted({0, m - 1, data.draw(st.integers(0, m - 1))})
        for i in rows:
            assert_same_bits(out[i], one_row(gemm, x, i, w, "avx2"), f"{w.kind} {isa} row {i} of {m}, k={k}")


@given(st.data(), m_sizes, n_sizes, st.one_of(k_sizes, st.integers(1000, 1100)))
def test_bf16_weights_give_the_bits_of_their_f32_widening(native, data, m, n, k):
    """Kind "bf16" keeps the 16 bits and widens them in the kernel: every output has the bits
    the same weights packed as f32 give, on every kernel variant (so on every CPU)."""
    x = float_arrays(data.draw, (m, k))
    raw = gguf_raw("BF16", float_arrays(data.draw, (n, k)))
    wb = layout_float.pack("BF16", raw, n, k)
    w32 = layout_float.pack("F32", layout_float.dequantize(wb), n, k)
    want = nan_buffer((m, n))
    native.gemm_f32(x, w32, want, isa="avx2")
    for isa in native_gemm.gemm_isas():
        got = nan_buffer((m, n))
        native.gemm_bf16(x, wb, got, isa=isa)
        assert_same_bits(got, want, f"bf16 {isa} m={m} n={n} k={k}")


def one_row(gemm, x, i, w, isa):
    """Row i of x . W^T computed alone (m = 1; the binding wants 32-byte aligned rows)."""
    out = nan_buffer((1, w.n))
    gemm(buffers.aligned_copy(x[i:i + 1]), w, out, isa=isa)
    return out[0]


def test_default_variant_is_one_of_the_tested(native):
    for m in (1, 2, 5, 8, 64, 1000):
        assert native_gemm.gemm_isa(m) in native_gemm.gemm_isas()
    assert native_gemm.gemm_isas()[0] == "avx2"
    with pytest.raises(ValueError, match="isa: expected one of"):
        native_gemm.gemm_isa(1, "sse2")


@given(st.data(), m_sizes, n_sizes, k_sizes)
def test_matmul_nt_matches_exact_product(native, ref, data, m, n, k):
    a = float_arrays(data.draw, (m, k))
    b = float_arrays(data.draw, (n, k))
    for backend in (native, ref):
        out = nan_buffer((m, n))
        backend.matmul_nt(a, b, out)
        assert_close_to_exact(out, a, b, backend.name)


def test_gemm_handles_special_values(native):
    """Zero rows/columns give exact zeros; an inf in x spreads to exactly the outputs it touches."""
    m, n, k = 7, 19, 9
    x = buffers.zeros((m, k))
    x[1] = 1.0
    x[3, 4] = np.inf
    weights = np.arange(n * k, dtype=np.float32).reshape(n, k) + 1
    out = nan_buffer((m, n))
    native.gemm_f32(x, layout_float.pack("F32", weights, n, k), out)
    np.testing.assert_array_equal(out[[0, 2, 4, 5, 6]], 0.0)
    np.testing.assert_array_equal(out[1], weights.sum(axis=1))
    assert np.isposinf(out[3]).all()


# ---- layouts: bytes in, bytes out -----------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    """F32, F16 and BF16 tensors of awkward shapes, written and read back by the gguf package."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("gguf") / "float.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for n, k in [(1, 1), (17, 9), (16, 33), (40, 8)]:
        matrix = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-6, 4, (n, k))).astype(np.float32)
        matrix[0, 0] = 0.0
        matrix.flat[-1] = -0.0
        writer.add_tensor(f"f32_{n}x{k}", matrix)
        writer.add_tensor(f"f16_{n}x{k}", matrix.astype(np.float16))
        writer.add_tensor(f"bf16_{n}x{k}", gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.BF16),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path)).tensors


def test_pack_then_dequantize_is_gguf_dequantize_bit_for_bit(gguf_tensors):
    for tensor in gguf_tensors:
        k, n = (int(d) for d in tensor.shape)
        w = layout_float.pack(tensor.tensor_type.name, tensor.data, n, k)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(n, k)
        got = layout_float.dequantize(w)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=tensor.name)
        ids = np.array([n - 1, 0, n // 2, n - 1])
        np.testing.assert_array_equal(layout_float.rows(w, ids).view(np.uint32),
                                      expected[ids].view(np.uint32), err_msg=tensor.name)


def test_panels_are_aligned_k_major_and_zero_padded(gguf_tensors):
    tensor = next(t for t in gguf_tensors if t.name == "f16_17x9")
    w = layout_float.pack("F16", tensor.data, 17, 9)
    panels = w.arrays["panels"]
    assert (w.kind, panels.dtype, panels.shape) == ("f16", np.float16, (2, 9, PANEL))
    assert panels.ctypes.data % buffers.ALIGNMENT == 0
    np.testing.assert_array_equal(panels[1, :, 0], tensor.data[16])
    assert not panels[1, :, 1:].any()
    assert layouts.LAYOUTS["f32"].source_types == ("F32",)
    assert layouts.LAYOUTS["f16"].source_types == ("F16",)
    assert layouts.LAYOUTS["bf16"].source_types == ("BF16",)
    wb = layout_float.pack("BF16", gguf.quants.quantize(tensor.data.astype(np.float32), gguf.GGMLQuantizationType.BF16),
                           17, 9)
    assert (wb.kind, wb.arrays["panels"].dtype, wb.arrays["panels"].shape) == ("bf16", np.uint16, (2, 9, PANEL))


def test_pack_rejects_bad_tensors():
    w = layout_float.pack("F32", np.ones((3, 2), np.float32), 3, 2)
    assert_refused([
        ("expected float32 data", lambda: layout_float.pack("F32", np.zeros((2, 3), np.float64), 2, 3)),
        (r"do not make a \[2, 4\] matrix", lambda: layout_float.pack("F16", np.zeros((2, 3), np.float16), 2, 4)),
        ("expected uint8 data", lambda: layout_float.pack("BF16", np.zeros((2, 3), np.uint16), 2, 3)),
        ("cannot pack GGUF type Q4_0", lambda: layout_float.pack("Q4_0", np.zeros((2, 18), np.uint8), 2, 32)),
        ("ids: out of range", lambda: layout_float.rows(w, [3])),
    ])


def test_gemm_rejects_bad_arguments(native):
    m, n, k = 3, 20, 8
    w32 = layout_float.pack("F32", np.ones((n, k), np.float32), n, k)
    w16 = layout_float.pack("F16", np.ones((n, k), np.float16), n, k)
    x, out = buffers.zeros((m, k)), buffers.zeros((m, n))
    bad_calls = [
        ("x: expected dtype float32", lambda: native.gemm_f32(buffers.zeros((m, k), np.float64), w32, out)),
        ("x: expected shape", lambda: native.gemm_f32(buffers.zeros((m, k + 1)), w32, out)),
        ("x: data must be 32-byte aligned", lambda: native.gemm_f32(buffers.zeros(m * k + 1)[1:].reshape(m, k),
                                                                     w32, out)),
        ("out: expected shape", lambda: native.gemm_f32(x, w32, buffers.zeros((m, n - 1)))),
        ("out: array must be C-contiguous", lambda: native.gemm_f32(x, w32, buffers.zeros((n, m)).T)),
        ("out: array is read-only", lambda: native.gemm_f32(x, w32, read_only(buffers.zeros((m, n))))),
        ("w: expected a PackedWeight of kind 'f16'", lambda: native.gemm_f16(x, w32, out)),
        ("w: expected a PackedWeight of kind 'f32'", lambda: native.gemm_f32(x, w16, out)),
        ("w: expected a PackedWeight of kind 'bf16'", lambda: native.gemm_bf16(x, w16, out)),
        ("w: expected a PackedWeight", lambda: native.gemm_f32(x, np.ones((n, k), np.float32), out)),
        ("w.panels: expected shape", lambda: native.gemm_f32(x, PackedWeight("f32", n + 16, k, w32.arrays), out)),
        ("w.panels: expected a numpy array", lambda: native.gemm_f32(x, PackedWeight("f32", n, k, {}), out)),
        ("rows: n0 must be a multiple of 16", lambda: native.gemm_f32(x, w32, out, rows=(8, 20))),
        (r"rows: expected 0 <= n0 < n1 <= 20", lambda: native.gemm_f32(x, w32, out, rows=(16, 21))),
        (r"rows: expected 0 <= n0 < n1 <= 20", lambda: native.gemm_f32(x, w32, out, rows=(16, 16))),
        ("rows: expected a pair", lambda: native.gemm_f32(x, w32, out, rows=16)),
        (r"rows\[1\]: expected an integer", lambda: native.gemm_f32(x, w32, out, rows=(0, 4.0))),
        ("b: expected dtype float32", lambda: native.matmul_nt(x, np.ones((n, k)), out)),
        ("a: expected shape", lambda: native.matmul_nt(x, np.ones((n, k + 1), np.float32), out)),
    ]
    assert_refused(bad_calls)
    native.gemm_f32(x, w32, out)          # the process survived and the kernel still works
    np.testing.assert_array_equal(out, 0.0)


def read_only(array):
    array.flags.writeable = False
    return array
