"""PlanRecorder ops give the same bits as the direct kernel calls they record.

The ops the gemma3 / qwen2 / qwen3 blocks add: scale (the embedding times sqrt(dim)),
add_bias (Q/K/V biases, in place), rmsnorm per head (Q/K norms on q viewed as
[m * n_head, head_dim]), gelu_mul (GeGLU) and paged attention with a sliding window.
Sizes are large enough that every op is split across the
threads (the test checks that it was), and odd enough that the splits are uneven.
"""
import numpy as np
import pytest

from helpers import nan_buffer
from llambda.codegen.contract import KV_BLOCK
from llambda.runtime import buffers, get_backend
from llambda.runtime.native.gemm_bf16 import bf16_supported
from llambda.runtime.pool import WorkerPool
from llambda.runtime.recorder import PlanRecorder

N_CTX = 40


def random(rng, shape, scale=1.0):
    return buffers.aligned_copy(rng.standard_normal(shape) * scale, np.float32)


def record(n_threads, build):
    recorder = PlanRecorder(n_threads, N_CTX, get_backend("avx2"))
    build(recorder)
    return recorder.finish()


def threads_used(plan, op):
    """How many threads op ``op`` can keep busy: its chunks (a dynamic op, at most one
    thread each), or its threads with a kernel (a static one)."""
    chunks = int(plan.records["chunks"][op, 0])
    return chunks if chunks else int((plan.records["fn"][op] != 0).sum())


def split_across(plan, op, n_threads):
    used = threads_used(plan, op)
    return used == 1 if n_threads == 1 else used >= n_threads


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2) as p:
        yield p


@pytest.mark.parametrize("n_threads", [1, 2])
def test_elementwise_ops_match_direct_calls(native, n_threads):
    rng = np.random.default_rng(0)
    m, n = 9, 1000 + 3                       # 9 rows, 9027 elements: both split across threads
    x, gate, up = random(rng, (m, n), 30.0), random(rng, (m, n), 4.0), random(rng, (m, n))
    bias = random(rng, n)
    scaled, biased, gelu = nan_buffer((m, n)), buffers.aligned_copy(x), nan_buffer((m, n))

    def build(rec):
        rec.scale(x, np.sqrt(640.0), scaled)
        rec.add_bias(biased, bias, biased)               # in place, as the model adds Q/K/V biases
        rec.gelu_mul(gate, up, gelu)

    recorder = record(n_threads, build)
    with WorkerPool(n_threads) as own_pool:
        recorder.plan.run(own_pool)
    for op in range(3):
        assert split_across(recorder.plan, op, n_threads)
    want_scaled, want_biased, want_gelu = nan_buffer((m, n)), nan_buffer((m, n)), nan_buffer((m, n))
    native.scale(x, np.sqrt(640.0), want_scaled)
    native.add_bias(x, bias, want_biased)
    native.gelu_mul(gate, up, want_gelu)
    np.testing.assert_array_equal(scaled, want_scaled)
    np.testing.assert_array_equal(biased, want_biased)
    np.testing.assert_array_equal(gelu, want_gelu)


def test_per_head_rmsnorm_matches_direct_call(native, pool):
    """q [m, n_head * head_dim] normalised per head in place through a reshaped view."""
    rng = np.random.default_rng(1)
    m, n_head, head_dim = 3, 4, 256
    q = random(rng, (m, n_head * head_dim), 10.0)
    w = random(rng, head_dim)
    want = nan_buffer(q.shape)
    native.rmsnorm(q.reshape(m * n_head, head_dim), w, 1e-6, want.reshape(m * n_head, head_dim))
    recorder = record(2, lambda rec: rec.rmsnorm(q.reshape(m * n_head, head_dim), w, 1e-6,
                                                 q.reshape(m * n_head, head_dim)))
    assert split_across(recorder.plan, 0, 2)             # 12 rows split by rows
    recorder.plan.run(pool)
    np.testing.assert_array_equal(q, want)


def test_recorded_attention_heads_subset(native, pool):
    """heads=(h0, h1) records only those heads (split across the threads); the others stay untouched."""
    rng = np.random.default_rng(3)
    n_blocks = -(-N_CTX // KV_BLOCK)
    k_arena, v_arena = random(rng, (n_blocks, 2, KV_BLOCK, 64)), random(rng, (n_blocks, 2, KV_BLOCK, 64))
    tables = buffers.aligned_copy(rng.permutation(n_blocks).astype(np.int32)[None, :])
    positions = buffers.aligned_copy(np.array([10, 11, 12], np.int32))
    row_seq = buffers.zeros(3, np.int32)
    q = random(rng, (3, 8, 64))
    out, want = nan_buffer(q.shape), nan_buffer(q.shape)
    recorder = record(2, lambda rec: rec.attention_paged(q, k_arena, v_arena, positions, row_seq, tables, 0.125,
                                                         out, None, heads=(2, 7), window=4))
    assert split_across(recorder.plan, 0, 2)
    assert recorder.ops[0].window == 4                    # the profiler costs the op by it
    recorder.plan.run(pool)
    native.attention_paged(q, k_arena, v_arena, positions, row_seq, tables, 0.125, want,
                           native.paged_attention_scratch(N_CTX), heads=(2, 7), window=4)
    np.testing.assert_array_equal(out, want)
    assert np.isnan(out[:, :2]).all() and np.isnan(out[:, 7:]).all()


def test_recorder_ops_validate_before_recording():
    recorder = PlanRecorder(2, N_CTX, get_backend("avx2"))
    x, out = buffers.zeros((2, 16)), buffers.zeros((2, 16))
    with pytest.raises(ValueError, match="bias: expected shape"):
        recorder.add_bias(x, buffers.zeros(15), out)
    with pytest.raises(ValueError, match="s: expected a finite number"):
        recorder.scale(x, float("inf"), out)
    with pytest.raises(ValueError, match="up: expected shape"):
        recorder.gelu_mul(x, buffers.zeros(16), out)
    q = buffers.zeros((1, 4, 8))
    arena = buffers.zeros((4, 1, KV_BLOCK, 8))
    idx, tables = buffers.zeros(1, np.int32), buffers.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="window: expected an integer >= 0"):
        recorder.attention_paged(q, arena, arena, idx, idx, tables, 1.0, buffers.zeros((1, 4, 8)), None, window=-2)
    with pytest.raises(ValueError, match="heads: expected 0 <= h0 < h1 <= n_head=4"):
        recorder.attention_paged(q, arena, arena, idx, idx, tables, 1.0, buffers.zeros((1, 4, 8)), None,
                                 heads=(3, 5))
    assert recorder.plan.n_ops == 0



def test_calls_for_many_ranges_are_the_single_calls():
    """The *_calls helpers the recorder cuts chunks with validate once and give, range by
    range, exactly what the single *_call gives."""
    from llambda.runtime.native import elementwise as e, quant as q
    rng = np.random.default_rng(5)
    m, n = 5, 96
    x, y, out, w = random(rng, (m, n)), random(rng, (m, n)), nan_buffer((m, n)), random(rng, n)
    spans, rows = [(0, 32), (32, 48), (48, m * n)], [(0, 2), (2, 3), (3, m)]
    cases = [(lambda r: e.add_call(x, y, out, span=r), lambda rs: e.add_calls(x, y, out, rs), spans),
             (lambda r: e.scale_call(x, 2.0, out, span=r), lambda rs: e.scale_calls(x, 2.0, out, rs), spans),
             (lambda r: e.silu_mul_call(x, y, out, span=r), lambda rs: e.silu_mul_calls(x, y, out, rs), spans),
             (lambda r: e.gelu_mul_call(x, y, out, span=r), lambda rs: e.gelu_mul_calls(x, y, out, rs), spans),
             (lambda r: e.add_bias_call(x, w, out, rows=r), lambda rs: e.add_bias_calls(x, w, out, rs), rows),
             (lambda r: e.rmsnorm_call(x, w, 1e-5, out, rows=r), lambda rs: e.rmsnorm_calls(x, w, 1e-5, out, rs),
              rows)]
    qs, d, s = buffers.zeros((m, n), np.int8), buffers.zeros((m, n // 32)), buffers.zeros((m, n // 32))
    cases.append((lambda r: q.quantize_q8_call(x, qs, d, s, rows=r), lambda rs: q.quantize_q8_calls(x, qs, d, s, rs),
                  rows))
    for single, many, ranges in cases:
        assert many(ranges) == [single(r) for r in ranges]
    with pytest.raises(ValueError, match="span"):
        e.add_calls(x, y, out, [(0, 32), (8, 16)])          # a start off the cache line


def attention_chunk_heads(plan, op=0):
    """The (h0, h1) of each chunk of the attention op ``op`` (its packed ``heads`` argument)."""
    from llambda.codegen.paged import ATTENTION_SIGNATURE
    ints = [name for name, c_type in ATTENTION_SIGNATURE if c_type != "float"]     # the records' int_args
    at = ints.index("heads")
    return [(int(r["int_args"][at]) & 0xFFFFFFFF, int(r["int_args"][at]) >> 32) for r in plan.chunk_records(op)]


@pytest.mark.parametrize("arena_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("whole_heads", [False, True])
def test_recorded_attention_long_context_split_over_segments(native, pool, arena_type, window, whole_heads):
    """Long contexts (several KV_SEGMENT segments): a decode-sized step (split over heads and
    segments, then the combine op) and a prefill chunk (split over rows and heads, each call
    combining its own rows) give each row the bits of the direct call, row alone or in the chunk,
    whatever the threads claimed. A ``whole_heads`` recorder splits a decode step's attention
    by segments alone, every chunk all the heads, where the tables hold enough segments for
    the threads (not within the window of 300 keys: two segments)."""
    from llambda.codegen.contract import KV_SEGMENT
    from llambda.runtime.ref.paged import quantize_kv_q8
    rng = np.random.default_rng(4)
    n_ctx = 3 * KV_SEGMENT + 40
    n_blocks = -(-n_ctx // KV_BLOCK)
    n_head, n_kv, hd = 9, 3, 64

    def arena():
        values = rng.standard_normal((n_blocks, n_kv, KV_BLOCK, hd)).astype(np.float32)
        if arena_type == "f16":
            return buffers.aligned_copy(values.astype(np.float16))
        if arena_type == "q8_0":
            return buffers.aligned_copy(quantize_kv_q8(values))
        return buffers.aligned_copy(values)
    k_arena, v_arena = arena(), arena()
    tables = buffers.aligned_copy(rng.permutation(n_blocks).astype(np.int32)[None, :])
    scratch = native.paged_attention_scratch(n_ctx)
    chunk_positions = np.arange(n_ctx - 20, n_ctx, dtype=np.int32)
    q_chunk = random(rng, (len(chunk_positions), n_head, hd))
    want = nan_buffer(q_chunk.shape)
    native.attention_paged(q_chunk, k_arena, v_arena, buffers.aligned_copy(chunk_positions),
                           buffers.zeros(len(chunk_positions), np.int32), tables, 0.125, want, scratch, window=window)
    for rows in ((19, 20), (3, 5), (0, 20)):              # decode steps of 1 and 2 rows, the prefill chunk
        m = rows[1] - rows[0]
        q = buffers.aligned_copy(q_chunk[rows[0]:rows[1]])
        positions = buffers.aligned_copy(chunk_positions[rows[0]:rows[1]])
        out = nan_buffer(q.shape)
        recorder = PlanRecorder(2, n_ctx, get_backend("avx2"), whole_heads=whole_heads)
        recorder.attention_paged(q, k_arena, v_arena, positions, buffers.zeros(m, np.int32), tables, 0.125, out,
                                 None, window=window)
        recorder.finish()
        names = [op.name for op in recorder.ops]
        assert names == (["attention", "attention_combine"] if m <= 4 else ["attention"])
        assert split_across(recorder.plan, 0, 2)
        every_head = set(attention_chunk_heads(recorder.plan)) == {(0, n_head)}
        assert every_head == (whole_heads and m <= 4 and window == 0)
        for _ in range(2):
            out[:] = np.nan
            recorder.plan.run(pool)
            np.testing.assert_array_equal(out, want[rows[0]:rows[1]])


@pytest.mark.skipif(not bf16_supported(), reason="this CPU lacks avx512_bf16")
def test_recorded_bf16_rounding_and_product_match_direct_calls(native, pool):
    """round_bf16 (split by rows) then gemm_bf16_pairs (split by columns): the direct calls' bits."""
    from llambda.runtime import layout_bf16
    from llambda.runtime.native import gemm_bf16
    rng = np.random.default_rng(4)
    m, n, k = 37, 3 * 48 + 16 + 5, 577                  # odd k: the pad column; a partial panel
    x = random(rng, (m, k))
    raw = (random(rng, (n, k)).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2 * k)
    w = layout_bf16.pack("BF16", raw, n, k)
    xb = buffers.full((m, 2 * layout_bf16.k_pairs(k)), 0x7FC1, np.uint16)
    out = nan_buffer((m, n))

    def build(rec):
        rec.round_bf16(x, xb)
        rec.gemm_bf16_pairs(xb, w, out)

    recorder = record(2, build)
    assert split_across(recorder.plan, 0, 2) and split_across(recorder.plan, 1, 2)
    recorder.plan.run(pool)
    want_xb = layout_bf16.to_bf16(x)
    want = nan_buffer((m, n))
    gemm_bf16.gemm_bf16_pairs(want_xb, w, want)
    np.testing.assert_array_equal(xb, want_xb)
    np.testing.assert_array_equal(out, want)
