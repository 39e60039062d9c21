"""Embedding lookup: the kernel against runtime.layouts.rows, bit for bit.

Tolerance: none. Both sides widen exact int8 / nibble and f16 values to f32
and round one multiply (q8_0) or a multiply then an add (q4_1) the same way.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import nan_buffer
from llambda.runtime import buffers, layouts
from llambda.runtime.native import embed as native_embed
from llambda.runtime.native._lib import kernel
from llambda.runtime.pool import WorkerPool
from llambda.runtime.recorder import PlanRecorder

KS = (32, 64, 576, 2048)
NS = (1, 7, 8, 9, 100)
MS = (1, 3, 17)
from llambda.codegen.contract import BLOCK
Q4_TYPES = ("Q4_0", "Q4_1")


def f16_scales(rng, shape, scale):
    """f16 block scales with zeros, negatives, and large and tiny magnitudes."""
    d = rng.standard_normal(shape) * scale
    d[rng.random(shape) < 0.1] = 0.0
    return d.astype(np.float16)


def gguf_raw(rng, gguf_type, n, k, scale):
    """A random GGUF tensor of ``gguf_type`` as raw bytes [n, row bytes]."""
    kb = k // BLOCK
    if gguf_type == "Q8_0":
        quants = rng.integers(-128, 128, (n, kb, BLOCK)).astype(np.int8).view(np.uint8)
        fields = f16_scales(rng, (n, kb, 1), scale)
    else:
        quants = rng.integers(0, 256, (n, kb, BLOCK // 2)).astype(np.uint8)
        fields = f16_scales(rng, (n, kb, 2 if gguf_type == "Q4_1" else 1), scale)
    return np.concatenate([fields.view(np.uint8), quants], axis=-1).reshape(n, -1)


def packed_weight(rng, gguf_type, n, k, scale=1.0):
    return layouts.pack(gguf_type, gguf_raw(rng, gguf_type, n, k, scale), n, k)


def id_buffer(values):
    ids = buffers.empty((len(values),), np.int32)
    ids[:] = values
    return ids


def assert_same_bits(got, want):
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@given(st.data(), st.sampled_from(("Q8_0",) + Q4_TYPES), st.sampled_from(KS), st.sampled_from(NS),
       st.sampled_from(MS), st.sampled_from([1e-6, 1e-3, 1.0, 300.0]))
def test_embed_matches_layout_rows(native, ref, data, gguf_type, k, n, m, scale):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    w = packed_weight(rng, gguf_type, n, k, scale)
    ids = id_buffer(rng.integers(0, n, m))
    want = layouts.rows(w, ids)
    for backend in (native, ref):
        out = nan_buffer((m, k))
        backend.embed(w, ids, out)
        assert_same_bits(out, want)


@pytest.mark.parametrize("gguf_type", ("Q8_0", "Q4_1"))
def test_a_recorded_call_reads_the_ids_at_run_time(gguf_type):
    rng = np.random.default_rng(1)
    n, k, m = 100, 576, 3
    w = packed_weight(rng, gguf_type, n, k)
    ids = id_buffer([0, 0, 0])
    out = nan_buffer((m, k))
    symbol, args = native_embed.embed_call(w, ids, out)
    for values in ([5, 99, 8], [7, 7, 0], [42, 1, 63]):
        ids[:] = values
        kernel(symbol)(*args)
        assert_same_bits(out, layouts.rows(w, values))


@pytest.mark.parametrize("m", (3, 17))
def test_a_recorded_plan_reads_the_ids_at_run_time(m):
    rng = np.random.default_rng(2)
    n, k = 100, 64
    w = packed_weight(rng, "Q8_0", n, k)
    ids = id_buffer(np.zeros(m, np.int32))
    out = nan_buffer((m, k))
    from llambda.runtime import get_backend
    recorder = PlanRecorder(2, 16, get_backend("avx2"))
    recorder.embed(w, ids, out)
    plan = recorder.finish().plan
    with WorkerPool(2) as pool:
        for _ in range(3):
            ids[:] = rng.integers(0, n, m)
            out[...] = np.nan
            plan.run(pool)
            assert_same_bits(out, layouts.rows(w, ids))


def test_split_rows_match_the_whole_call(native):
    rng = np.random.default_rng(3)
    w = packed_weight(rng, "Q4_1", 9, 64)
    ids = id_buffer(rng.integers(0, 9, 17))
    want = nan_buffer((17, 64))
    native.embed(w, ids, want)
    got = nan_buffer((17, 64))
    for rows in ((0, 5), (5, 6), (6, 17)):
        symbol, args = native_embed.embed_call(w, ids, got, rows=rows)
        kernel(symbol)(*args)
    assert_same_bits(got, want)


def test_embed_rejects_bad_arguments(native):
    rng = np.random.default_rng(4)
    n, k, m = 9, 64, 3
    w = packed_weight(rng, "Q8_0", n, k)
    ids, out = id_buffer([0, 8, 3]), nan_buffer((m, k))
    f32 = layouts.pack("F32", rng.standard_normal((n, k)).astype(np.float32), n, k)
    with pytest.raises(ValueError, match="w: embed has kernels for kinds q4_1, q8_0, got kind 'f32'"):
        native.embed(f32, ids, out)
    with pytest.raises(ValueError, match="w: expected a PackedWeight"):
        native.embed(w.arrays["qs"], ids, out)
    with pytest.raises(ValueError, match="ids: expected dtype int32"):
        native.embed(w, ids.astype(np.int64), out)
    with pytest.raises(ValueError, match="ids: expected 1 dimensions"):
        native.embed(w, ids.reshape(1, m), out)
    with pytest.raises(ValueError, match=r"ids: expected row indices in \[0, 9\), got 0..9"):
        native.embed(w, id_buffer([0, 9, 1]), out)
    with pytest.raises(ValueError, match=r"ids: expected row indices in \[0, 9\), got -1..8"):
        native.embed(w, id_buffer([-1, 8, 1]), out)
    with pytest.raises(ValueError, match="ids: data must be 4-byte aligned"):
        raw = buffers.empty((16,), np.int32)
        native.embed(w, raw.view(np.uint8)[2:14].view(np.int32), out)
    with pytest.raises(ValueError, match="out: expected dtype float32"):
        native.embed(w, ids, nan_buffer((m, k), np.float64))
    with pytest.raises(ValueError, match="out: expected shape"):
        native.embed(w, ids, nan_buffer((m, k + 32)))
    with pytest.raises(ValueError, match="out: data must be 32-byte aligned"):
        native.embed(w, ids, nan_buffer((m * k + 1,))[1:].reshape(m, k))
    with pytest.raises(ValueError, match="out: array must be C-contiguous"):
        native.embed(w, ids, nan_buffer((m, 2 * k))[:, ::2])
    with pytest.raises(ValueError, match="out: array is read-only"):
        read_only = nan_buffer((m, k))
        read_only.flags.writeable = False
        native.embed(w, ids, read_only)
    with pytest.raises(ValueError, match="w.qs: expected shape"):
        native.embed(layouts.PackedWeight("q8_0", n + 8, k, w.arrays, w.meta), ids, out)
    with pytest.raises(ValueError, match="w.d: expected dtype float16"):
        native.embed(layouts.PackedWeight("q8_0", n, k, dict(w.arrays, d=w.arrays["d"].view(np.uint16)),
                                          w.meta), ids, out)
    with pytest.raises(ValueError, match=r"rows: expected 0 <= r0 < r1 <= 3"):
        native_embed.embed_call(w, ids, out, rows=(1, 4))
    out_and_ids = nan_buffer((m, k))
    out_and_ids.view(np.int32)[0, :m] = 0
    with pytest.raises(ValueError, match="out: overlaps ids"):
        native.embed(w, out_and_ids.view(np.int32)[0, :m], out_and_ids)
    native.embed(w, ids, out)                      # the process survived and still works
    assert_same_bits(out, layouts.rows(w, ids))
