"""The paged KV cache's kernels (runtime/native/paged.py) against runtime/ref/paged.py.

Every step mixes sequences: 1..3 sequences whose blocks are a shuffled, non-contiguous
subset of the arena; rows (m 1..~20) each pick a sequence and a position, so decode rows
and prefill chunks share one call. Shapes: (n_head, n_kv) with groups of 1, 2, 3, 4 and
6 (every head tile, and a group split across tiles); head_dim 1, 7, 8, 9, 64, 65, 80, 256
(masked tails, whole chunks, both, Gemma 3's 256); sequence lengths 1, KV_BLOCK - 1 .. KV_BLOCK + 1 and
up to ~300 (many blocks, the P V key blocks of 64). Arena rows no row may read (past a
sequence's end, before every window, blocks of no sequence) are NaN, so a stray read
shows; out starts NaN, so an unwritten element shows.

Tolerance (attention), from the score error bound: a score error d changes every p_j by a
factor within exp(+-2d), so out moves by at most ~2d max|v|; float scores are dot products
of head_dim terms summed per lane (head_dim/8 FMAs) then over 8 lanes, times scale:
|d| <= (head_dim/8 + 5) u scale sum|q k|; exact (small-integer) scores, with a power-of-two
scale, have d = 0 (scores up to ~8000 then test the max-subtraction at full precision).
On top, 1e-5 max|v| for exp (< 1 ulp), the sums and 1/sum, and sum_j p_j v_j (random-walk
rounding).

float16 arenas (head_dim % 8 == 0): bit-identical to the f32 kernel on the rounded values,
stores rounded as numpy's astype; against the f64 reference on unrounded values the bound
adds the storage rounding, 2^-11 relative per element (test_f16_arena_long_context_tolerance).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import before_a_guard_page, float_arrays, misaligned, nan_buffer
from llambda.codegen.contract import KV_BLOCK, KV_SEGMENT
from llambda.runtime import buffers
from llambda.runtime.step_indices import check_step_indices

HEAD_CONFIGS = [(1, 1), (2, 1), (4, 2), (9, 3), (6, 1), (4, 1), (3, 3)]
HEAD_DIMS = [1, 7, 8, 9, 64, 65, 80, 256]
U = 2.0 ** -24
LENGTHS = st.one_of(st.sampled_from([1, 2, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK + 1]),
                    st.integers(1, 300))


def i32(values):
    return buffers.aligned_copy(np.asarray(values), np.int32)


class Step:
    """Sequences with shuffled block tables in one arena, and the rows of one step.

    ``keys[s]``, ``values[s]`` [n_kv, length_s, head_dim]: sequence s's cache; ``k_arena``,
    ``v_arena`` hold them at the table's blocks, NaN everywhere else (``poison`` marks what
    stays NaN: keys before ``first_read[s]`` too). Unused table entries point at a NaN block."""

    def __init__(self, rng, n_kv, head_dim, lengths, rows, window=0, spare_blocks=3, max_blocks=None):
        self.lengths, self.window = lengths, window
        needed = [-(-n // KV_BLOCK) for n in lengths]
        max_blocks = max_blocks or max(needed) + 1
        n_blocks = sum(needed) + spare_blocks + 1
        order = rng.permutation(n_blocks)
        self.poison_block = int(order[-1])
        tables = np.full((len(lengths), max_blocks), self.poison_block)
        at = 0
        for s, n in enumerate(needed):
            tables[s, :n] = order[at:at + n]
            at += n
        self.tables = i32(tables)
        self.positions = i32([p for _, p in rows])
        self.row_seq = i32([s for s, _ in rows])
        self.shape = (n_blocks, n_kv, KV_BLOCK, head_dim)
        self.first_read = [min([first_key(p, window) for s2, p in rows if s2 == s] or [0])
                           for s in range(len(lengths))]

    def arena(self, per_sequence):
        """An arena holding ``per_sequence[s]`` [n_kv, length_s, head_dim] at sequence s's keys
        from first_read[s] on (NaN elsewhere)."""
        arena = buffers.full(self.shape, np.nan)
        for s, values in enumerate(per_sequence):
            for j in range(self.first_read[s], self.lengths[s]):
                arena[self.tables[s, j // KV_BLOCK], :, j % KV_BLOCK] = values[:, j]
        return arena


def keyed(arena):
    """A key arena (runtime/ref/paged.py key_tiles) holding what ``arena``'s rows hold."""
    from llambda.runtime.ref.paged import key_tiles
    return buffers.aligned_copy(key_tiles(arena))


def first_key(position, window):
    return max(0, position - window + 1) if window else 0


def draw_rows(data, lengths, m):
    """m rows (sequence, position) over sequences of these lengths, often at a sequence's end."""
    rows = []
    for _ in range(m):
        s = data.draw(st.integers(0, len(lengths) - 1), label="row's sequence")
        p = data.draw(st.one_of(st.just(lengths[s] - 1), st.integers(0, lengths[s] - 1)), label="position")
        rows.append((s, p))
    return rows


def draw_step(data, window_too=False):
    n_head, n_kv = data.draw(st.sampled_from(HEAD_CONFIGS), label="heads")
    head_dim = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    n_seq = data.draw(st.integers(1, 3), label="sequences")
    lengths = [data.draw(LENGTHS, label="length") for _ in range(n_seq)]
    m = data.draw(st.one_of(st.sampled_from([1, 2, 7]), st.integers(1, 22)), label="m")
    rows = draw_rows(data, lengths, m)
    window = 0
    if window_too and data.draw(st.booleans(), label="windowed"):
        window = data.draw(st.one_of(st.sampled_from([1, 2, 3, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1]),
                                     st.integers(1, 100), st.integers(300, 2000)), label="window")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    step = Step(np.random.default_rng(seed), n_kv, head_dim, lengths, rows, window)
    return n_head, n_kv, head_dim, step


def draw_values(data, n_head, n_kv, head_dim, step):
    """q [m, n_head, head_dim], per-sequence keys and values, scale, exact: either float data at a
    drawn magnitude, or small integers and a power-of-two scale (scores float32 computes exactly)."""
    m = len(step.positions)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    exact = data.draw(st.booleans(), label="exact scores")
    if exact:
        q = rng.integers(-4, 5, (m, n_head, head_dim)).astype(np.float32)
        keys = [rng.integers(-4, 5, (n_kv, n, head_dim)).astype(np.float32) for n in step.lengths]
        scale = data.draw(st.sampled_from([1.0, 0.25, 8.0]), label="scale")
    else:
        magnitude = data.draw(st.sampled_from([1e-3, 0.1, 1.0, 5.0]), label="q, k magnitude")
        q = float_arrays(data.draw, (m, n_head, head_dim), scale=magnitude)
        keys = [float_arrays(data.draw, (n_kv, n, head_dim), scale=magnitude) for n in step.lengths]
        scale = data.draw(st.sampled_from([0.125, 1.0 / np.sqrt(head_dim), 1.0]), label="scale")
    v_magnitude = data.draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4]), label="v magnitude")
    values = [float_arrays(data.draw, (n_kv, n, head_dim), scale=v_magnitude) for n in step.lengths]
    return buffers.aligned_copy(q), keys, values, scale, exact


def tolerance(q, keys, values, step, scale, exact, group):
    m, n_head, head_dim = q.shape
    atol = np.empty((m, n_head, 1))
    for i in range(m):
        s, p = int(step.row_seq[i]), int(step.positions[i])
        seen = slice(first_key(p, step.window), p + 1)
        for h in range(n_head):
            k64 = keys[s][h // group, seen].astype(np.float64)
            v_max = np.abs(values[s][h // group, seen]).max()
            score_error = 0.0
            if not exact:
                score_error = (head_dim / 8 + 5) * U * abs(scale) * (np.abs(k64) @ np.abs(q[i, h])).max()
            atol[i, h] = v_max * (1e-5 + 2 * score_error)
    return atol


def draw_head_range(data, n):
    if data.draw(st.booleans(), label="all heads"):
        return None
    h0 = data.draw(st.integers(0, n - 1), label="h0")
    return h0, data.draw(st.integers(h0 + 1, n), label="h1")


def draw_isa(data, head_dim, dtype=None):
    """An attention variant this machine runs for head_dim and the arena dtype (avx2, the
    baseline, always)."""
    from llambda.runtime.native import paged as n_paged
    isas = [isa for isa in n_paged.attention_isas(dtype)
            if isa == "avx2" or n_paged.wide_head_dim(head_dim)]
    return data.draw(st.sampled_from(isas), label="isa")


def queries_seen(q, arena_type):
    """q as the kernels score it: q8_0 attention quantizes each head of it to a q8_0 row."""
    from llambda.runtime.ref.paged import quantized
    return buffers.aligned_copy(quantized(q)) if arena_type == "q8_0" else q


def scratch_for(native, step):
    return native.paged_attention_scratch(step.tables.shape[1] * KV_BLOCK)


# ---------------------------------------------------------------- attention_paged

@settings(max_examples=40)
@given(st.data())
def test_attention_paged_matches_reference(native, ref, data):
    n_head, n_kv, head_dim, step = draw_step(data, window_too=True)
    q, keys, values, scale, exact = draw_values(data, n_head, n_kv, head_dim, step)
    k_arena, v_arena = keyed(step.arena(keys)), step.arena(values)
    heads = draw_head_range(data, n_head)
    h0, h1 = heads if heads is not None else (0, n_head)
    check_step_indices(step.positions, step.row_seq, step.tables, len(q), k_arena.shape[0], window=step.window)

    want, got = np.full(q.shape, np.nan), nan_buffer(q.shape)
    ref.attention_paged(q, k_arena, v_arena, step.positions, step.row_seq, step.tables, scale, want,
                        ref.paged_attention_scratch(1), heads=heads, window=step.window)
    from llambda.runtime.native import paged as n_paged
    n_paged.attention_paged(q, k_arena, v_arena, step.positions, step.row_seq, step.tables, scale, got,
                            scratch_for(native, step), heads=heads, window=step.window,
                            isa=draw_isa(data, head_dim))

    atol = tolerance(q, keys, values, step, scale, exact, n_head // n_kv)
    error = np.abs(got[:, h0:h1].astype(np.float64) - want[:, h0:h1])
    assert not np.isnan(got[:, h0:h1]).any()
    assert (error <= atol[:, h0:h1]).all(), f"max error / tolerance {(error / atol[:, h0:h1]).max()}"
    assert np.isnan(got[:, :h0]).all() and np.isnan(got[:, h1:]).all()


@settings(max_examples=25)
@given(st.data())
def test_a_row_depends_only_on_its_own_query_and_keys(native, data):
    """Batch invariance: each row alone (m = 1), the rows in another order, and any split of
    the heads give the same bits as the whole step."""
    n_head, n_kv, head_dim, step = draw_step(data, window_too=True)
    q, keys, values, scale, _ = draw_values(data, n_head, n_kv, head_dim, step)
    k_arena, v_arena = keyed(step.arena(keys)), step.arena(values)
    scratch = scratch_for(native, step)
    m = len(q)

    def attend(q, positions, row_seq, heads=None, out=None):
        out = nan_buffer(q.shape) if out is None else out
        native.attention_paged(q, k_arena, v_arena, positions, row_seq, step.tables, scale, out, scratch,
                               heads=heads, window=step.window)
        return out

    whole = attend(q, step.positions, step.row_seq)
    for i in range(m):
        alone = attend(buffers.aligned_copy(q[i:i + 1]), i32(step.positions[i:i + 1]), i32(step.row_seq[i:i + 1]))
        np.testing.assert_array_equal(alone[0], whole[i])
    order = np.random.default_rng(m).permutation(m)
    shuffled = attend(buffers.aligned_copy(q[order]), i32(step.positions[order]), i32(step.row_seq[order]))
    np.testing.assert_array_equal(shuffled, whole[order])
    cut = data.draw(st.integers(1, n_head), label="head cut")
    by_heads = nan_buffer(q.shape)
    for heads in ((0, cut), (cut, n_head)):
        if heads[0] < heads[1]:
            attend(q, step.positions, step.row_seq, heads=heads, out=by_heads)
    np.testing.assert_array_equal(by_heads, whole)


@settings(max_examples=25)
@given(st.data())
def test_prompt_rows_in_pairs_give_each_row_alone(native, ref, data):
    """A prompt chunk: consecutive positions of one sequence, past a segment or two, so that
    the AVX-512 f32 and f16 kernels take its rows two at a time (codegen/paged/__init__.py "Rows in
    pairs": the segments both rows see whole together, then each row's later segments alone).
    Each row gives the bits it gives alone (m = 1, never paired), on either side of a segment
    end and with odd m (a row left alone), and the reference's values within the tolerance.
    Other sequences' rows between them break the pairs up."""
    n_head, n_kv = data.draw(st.sampled_from([(9, 3), (4, 2), (2, 1), (6, 1)]), label="heads")
    head_dim = data.draw(st.sampled_from([16, 64, 80, 256]), label="head_dim")
    length = data.draw(st.integers(KV_SEGMENT + 1, 3 * KV_SEGMENT + 40), label="length")
    m = data.draw(st.integers(2, 13), label="m")
    last = data.draw(st.integers(m - 1, length - 1), label="last position")
    rows = [(0, p) for p in range(last - m + 1, last + 1)]
    if data.draw(st.booleans(), label="another sequence's row inside"):
        rows.insert(data.draw(st.integers(0, m), label="where"), (1, 40))
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    step = Step(np.random.default_rng(seed), n_kv, head_dim, [length, 41], rows)
    q, keys, values, scale, exact = draw_values(data, n_head, n_kv, head_dim, step)
    arena_dtype = data.draw(st.sampled_from([np.float32, np.float16]), label="arena")
    if arena_dtype == np.float16:
        keys = [k.astype(np.float16).astype(np.float32) for k in keys]
        values = [v.astype(np.float16).astype(np.float32) for v in values]
    k_arena = buffers.aligned_copy(keyed(step.arena(keys)).astype(arena_dtype))
    v_arena = buffers.aligned_copy(step.arena(values).astype(arena_dtype))
    scratch = scratch_for(native, step)

    def attend(q, positions, row_seq):
        out = nan_buffer(q.shape)
        native.attention_paged(q, k_arena, v_arena, positions, row_seq, step.tables, scale, out, scratch)
        return out

    whole = attend(q, step.positions, step.row_seq)
    for i in range(len(q)):
        alone = attend(buffers.aligned_copy(q[i:i + 1]), i32(step.positions[i:i + 1]), i32(step.row_seq[i:i + 1]))
        np.testing.assert_array_equal(alone[0], whole[i])
    want = np.full(q.shape, np.nan)
    ref.attention_paged(q, k_arena, v_arena, step.positions, step.row_seq, step.tables, scale, want, None)
    atol = tolerance(q, keys, values, step, scale, exact, n_head // n_kv)
    assert (np.abs(whole.astype(np.float64) - want) <= atol).all()


@pytest.mark.parametrize("backend", ["native", "ref"])
@pytest.mark.parametrize("window", [0, 1, 2, 5, 16, 17, 100])
def test_paged_window_sees_exactly_the_last_keys(backend, window, request):
    """q = 0: every visible key equally likely; V one-hot by position shows which keys each
    row saw (p - window < j <= p), rows of two sequences interleaved."""
    be = request.getfixturevalue(backend)
    n = 40
    rng = np.random.default_rng(1)
    rows = [(0, 3), (1, 39), (0, 20), (1, 16), (0, 0), (1, 15)]
    step = Step(rng, 1, n, [25, n], rows)
    eye = np.eye(n, dtype=np.float32)[None]
    k_arena = keyed(step.arena([rng.standard_normal((1, 25, n)).astype(np.float32),
                                rng.standard_normal((1, n, n)).astype(np.float32)]))
    v_arena = step.arena([eye[:, :25], eye])
    q = buffers.zeros((len(rows), 2, n))
    out = nan_buffer(q.shape)
    be.attention_paged(q, k_arena, v_arena, step.positions, step.row_seq, step.tables, 0.5, out,
                       be.paged_attention_scratch(step.tables.shape[1] * KV_BLOCK), window=window)
    for i, (_, p) in enumerate(rows):
        j = np.arange(n)
        seen = (j <= p) & ((p - j < window) if window else True)
        np.testing.assert_allclose(out[i], np.broadcast_to(seen / seen.sum(), (2, n)), rtol=1e-6)


def test_paged_huge_scores_do_not_overflow(native):
    head_dim, n = 16, 40
    q = buffers.full((1, 2, head_dim), 100.0)
    k_values = np.zeros((1, n, head_dim), np.float32)
    k_values[0, :, 0] = np.arange(n) % 7                   # keys 6, 13, 20, 27, 34 tie for best
    v_values = np.arange(n * head_dim, dtype=np.float32).reshape(1, n, head_dim)
    step = Step(np.random.default_rng(2), 1, head_dim, [n], [(0, n - 1)])
    got = nan_buffer(q.shape)
    native.attention_paged(q, keyed(step.arena([k_values])), step.arena([v_values]), step.positions, step.row_seq,
                           step.tables, 1000.0, got, scratch_for(native, step))
    best = v_values[0, 6::7].mean(axis=0)
    np.testing.assert_allclose(got[0], np.stack([best, best]), rtol=1e-6)


def test_paged_scratch_is_the_same_size_in_both_backends(native, ref):
    for max_keys in (1, 15, 16, 17, 4096):
        assert native.paged_attention_scratch(max_keys).shape == ref.paged_attention_scratch(max_keys).shape


# ---------------------------------------------------------------- kv_store_paged

@settings(max_examples=40)
@given(st.data())
def test_kv_store_paged_matches_reference(native, ref, data):
    """Rows of several sequences, some sharing a slot (the later wins), any KV head range:
    the same bits as the reference, and nothing else of the arena touched."""
    _, n_kv, head_dim, step = draw_step(data)
    m = len(step.positions)
    src = float_arrays(data.draw, (m, n_kv, head_dim))
    heads = draw_head_range(data, n_kv)
    start = step.arena([np.zeros((n_kv, n, head_dim), np.float32) for n in step.lengths])
    want, got = start.copy(), buffers.aligned_copy(start)
    ref.kv_store_paged(src, step.positions, step.row_seq, step.tables, want, heads=heads)
    native.kv_store_paged(src, step.positions, step.row_seq, step.tables, got, heads=heads)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40)
@given(st.data())
def test_key_store_puts_each_row_in_its_tile_lane(native, ref, data):
    """keys=True, every arena type: the bytes the value store would write for a row (same
    rounding, same quants and scales), at the row's lane of its tile: the key arena read
    back as rows (key_rows) is the value store's arena, NaN poison elsewhere untouched."""
    from llambda.runtime.ref.paged import key_rows, key_tiles
    _, n_kv, head_dim, step = draw_step(data)
    arena_type = data.draw(st.sampled_from(["f32", "f16", "q8_0"]), label="arena type")
    if arena_type != "f32":
        head_dim = data.draw(st.sampled_from([32, 64, 96]), label="head_dim")
        step.shape = step.shape[:3] + (head_dim,)
    m = len(step.positions)
    src = float_arrays(data.draw, (m, n_kv, head_dim))
    heads = draw_head_range(data, n_kv)
    rows = step.arena([np.zeros((n_kv, n, head_dim), np.float32) for n in step.lengths])
    if arena_type == "f16":
        rows = as_f16(rows)
    elif arena_type == "q8_0":
        rows = as_q8(rows)
    args = (src, step.positions, step.row_seq, step.tables)
    want_rows = buffers.aligned_copy(rows)
    native.kv_store_paged(*args, want_rows, heads=heads)
    got, want = buffers.aligned_copy(key_tiles(rows, head_dim)), key_tiles(rows, head_dim)
    native.kv_store_paged(*args, got, heads=heads, keys=True)
    ref.kv_store_paged(*args, want, heads=heads, keys=True)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(key_rows(got, head_dim).view(np.uint8), want_rows.view(np.uint8))


# ---------------------------------------------------------------- a layer's view of the pool's buffer

def in_layer(arena, layers, layer, by_head=True):
    """(view, the other layers' bytes): ``arena`` as layer ``layer`` of a buffer of ``layers``
    layers, by_head as llambda/serving/kv_pool.py hands arenas out ([layer, KV head, block]: blocks
    a tile apart, KV heads n_blocks tiles), else [block, layer, KV head] (blocks layers *
    n_kv tiles apart, KV heads one); the other layers' bytes 0xff (NaN floats, NaN q8_0
    scales), so a stray read shows."""
    n_blocks, n_kv = arena.shape[:2]
    if by_head:
        buffer = buffers.empty((layers, n_kv, n_blocks) + arena.shape[2:], arena.dtype)
        view = buffer[layer].transpose(1, 0, 2, 3)
    else:
        buffer = buffers.empty((n_blocks, layers) + arena.shape[1:], arena.dtype)
        view = buffer[:, layer]
    buffer.view(np.uint8)[...] = 0xff
    view[...] = arena
    return view, lambda: np.delete(buffer, layer, axis=0 if by_head else 1).view(np.uint8)


@settings(max_examples=40)
@given(st.data())
def test_a_layer_view_of_the_pools_buffer_gives_the_contiguous_arenas_bits(native, data):
    """Every arena type and attention variant: attention over layer views gives the bits of
    the same arenas contiguous, and both stores write the contiguous arena's bytes into the
    view and not one byte of the other layers."""
    from llambda.runtime.ref.paged import key_tiles
    n_head, n_kv, head_dim, step = draw_step(data, window_too=True)
    arena_type = data.draw(st.sampled_from(["f32", "f16", "q8_0"]), label="arena type")
    if arena_type != "f32":
        head_dim = data.draw(st.sampled_from([32, 64]), label="head_dim")
        step.shape = step.shape[:3] + (head_dim,)
    typed = {"f32": buffers.aligned_copy, "f16": as_f16, "q8_0": as_q8}[arena_type]
    layers = data.draw(st.sampled_from([2, 3, 30]), label="layers")
    layer = data.draw(st.integers(0, layers - 1), label="layer")
    by_head = data.draw(st.booleans(), label="by KV head")
    q, keys, values, scale, _ = draw_values(data, n_head, n_kv, head_dim, step)
    k = buffers.aligned_copy(key_tiles(typed(step.arena(keys)), head_dim))
    v = typed(step.arena(values))
    (k_view, _), (v_view, _) = in_layer(k, layers, layer, by_head), in_layer(v, layers, layer, by_head)
    args = (step.positions, step.row_seq, step.tables, scale)
    isa = draw_isa(data, head_dim, k.dtype)
    from llambda.runtime.native import paged as n_paged
    want, got = nan_buffer(q.shape), nan_buffer(q.shape)
    n_paged.attention_paged(q, k, v, *args, want, scratch_for(native, step), window=step.window, isa=isa)
    n_paged.attention_paged(q, k_view, v_view, *args, got, scratch_for(native, step), window=step.window, isa=isa)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

    src = float_arrays(data.draw, (len(q), n_kv, head_dim))
    heads = draw_head_range(data, n_kv)
    for tiles in (False, True):
        start = typed(step.arena([np.zeros((n_kv, n, head_dim), np.float32) for n in step.lengths]))
        if tiles:
            start = key_tiles(start, head_dim)
        flat = buffers.aligned_copy(start)
        view, others_now = in_layer(start, layers, layer, by_head)
        others = others_now()
        native.kv_store_paged(src, *args[:3], flat, heads=heads, keys=tiles)
        native.kv_store_paged(src, *args[:3], view, heads=heads, keys=tiles)
        np.testing.assert_array_equal(view.view(np.uint8), flat.view(np.uint8))
        np.testing.assert_array_equal(others_now(), others)


# ---------------------------------------------------------------- gather_rows

@given(st.data())
def test_gather_rows_matches_reference(native, ref, data):
    m = data.draw(st.integers(1, 20), label="m")
    d = data.draw(st.one_of(st.sampled_from([1, 7, 8, 9, 576]), st.integers(1, 1000)), label="d")
    n = data.draw(st.integers(1, 2 * m), label="rows")
    rows = i32(data.draw(st.lists(st.integers(0, m - 1), min_size=n, max_size=n), label="which"))
    src = float_arrays(data.draw, (m, d))
    want, got = np.full((n, d), np.nan, np.float32), nan_buffer((n, d))
    ref.gather_rows(src, rows, want)
    native.gather_rows(src, rows, got)
    np.testing.assert_array_equal(got, want)


def test_gather_rows_parts_write_only_their_rows(native):
    from llambda.runtime.native.paged import gather_rows_call
    from llambda.runtime.native._lib import kernel
    src = buffers.aligned_copy(np.arange(5 * 9).reshape(5, 9), np.float32)
    rows = i32([4, 0, 0, 2])
    out = nan_buffer((4, 9))
    symbol, args = gather_rows_call(src, rows, out, part=(1, 3))
    kernel(symbol)(*args)
    np.testing.assert_array_equal(out[1:3], src[[0, 0]])
    assert np.isnan(out[0]).all() and np.isnan(out[3]).all()


# ---------------------------------------------------------------- nothing read or written out of bounds

@pytest.mark.parametrize("head_dim", [9, 64, 65])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_ops_touch_nothing_past_their_arrays(native, ref, head_dim, window):
    """Every array ends where an unreadable page begins; the last row's keys end in the
    arena's last block, last KV head, last row (a stray read or write past any array crashes)."""
    keep = []
    rng = np.random.default_rng(3)
    n_head, n_kv, n_blocks = 8, 2, 4            # sizes whose bytes are multiples of 32 (aligned copies)
    length = n_blocks * KV_BLOCK
    tables = i32(rng.permutation(n_blocks)[None])
    positions, row_seq = i32([length - 1, 3, length - 2, 17]), i32([0, 0, 0, 0])
    m = len(positions)
    k_arena = before_a_guard_page(rng.standard_normal((n_blocks, n_kv, KV_BLOCK, head_dim)).astype(np.float32), keep)
    v_arena = before_a_guard_page(rng.standard_normal((n_blocks, n_kv, KV_BLOCK, head_dim)).astype(np.float32), keep)
    q = before_a_guard_page(rng.standard_normal((m, n_head, head_dim)).astype(np.float32), keep)
    guarded = [before_a_guard_page(a, keep) for a in (positions, row_seq, tables)]
    out = before_a_guard_page(np.zeros((m, n_head, head_dim), np.float32), keep)
    scratch = before_a_guard_page(np.zeros(native.paged_attention_scratch(length).size, np.float32), keep)
    want = np.zeros(q.shape)
    ref.attention_paged(q, k_arena, v_arena, positions, row_seq, tables, 0.3, want, None, window=window)
    native.attention_paged(q, k_arena, v_arena, *guarded, 0.3, out, scratch, window=window)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    src = before_a_guard_page(rng.standard_normal((m, n_kv, head_dim)).astype(np.float32), keep)
    for keys in (False, True):
        arena = before_a_guard_page(np.zeros(k_arena.shape, np.float32), keep)
        expected = np.zeros(k_arena.shape, np.float32)
        ref.kv_store_paged(src, positions, row_seq, tables, expected, keys=keys)
        native.kv_store_paged(src, *guarded, arena, keys=keys)
        np.testing.assert_array_equal(arena, expected)

    flat = q.reshape(m, -1)
    rows = before_a_guard_page(i32([m - 1, 0]), keep)
    gathered = before_a_guard_page(np.zeros((2, flat.shape[1]), np.float32), keep)
    native.gather_rows(flat, rows, gathered)
    np.testing.assert_array_equal(gathered, flat[[m - 1, 0]])


@pytest.mark.parametrize("head_dim", [9, 64])
@pytest.mark.parametrize("seg_step", [2, 3])
def test_split_attention_reads_no_table_entry_past_the_row(native, head_dim, seg_step):
    """A split decode step's call attends every seg_step-th segment and looks up the blocks
    it prefetches, two blocks on, in the next segment it attends: rows that end one block
    into a segment, and a table that ends where an unreadable page begins, show that no
    lookup goes past the row's last block (a stray one crashes). The split gives the whole
    call's bits."""
    from llambda.runtime.native import paged as n_paged
    from llambda.runtime.native._lib import kernel
    keep = []
    rng = np.random.default_rng(5)
    n_head, n_kv = 8, 2
    n_blocks = 3 * KV_SEGMENT // KV_BLOCK + 2     # three segments and two blocks
    length = n_blocks * KV_BLOCK
    tables = before_a_guard_page(i32(rng.permutation(n_blocks)[None]), keep)
    positions = before_a_guard_page(i32([length - 1, KV_SEGMENT + 3, 2 * KV_SEGMENT + KV_BLOCK, length - 20]), keep)
    row_seq = before_a_guard_page(i32([0, 0, 0, 0]), keep)
    m = len(positions)
    k_arena = rng.standard_normal((n_blocks, n_kv, KV_BLOCK, head_dim)).astype(np.float32)
    v_arena = buffers.aligned_copy(rng.standard_normal(k_arena.shape).astype(np.float32))
    k_arena = buffers.aligned_copy(k_arena)
    q = buffers.aligned_copy(rng.standard_normal((m, n_head, head_dim)).astype(np.float32))
    scratch = native.paged_attention_scratch(length)
    whole = nan_buffer(q.shape)
    native.attention_paged(q, k_arena, v_arena, positions, row_seq, tables, 0.3, whole, scratch)
    partials = n_paged.attention_partials(m, n_head, head_dim, tables)
    for seg0 in range(seg_step):
        symbol, args = n_paged.attention_paged_call(q, k_arena, v_arena, positions, row_seq, tables, 0.3,
                                                    nan_buffer(q.shape), scratch, partials=partials,
                                                    segments=(seg0, seg_step))
        kernel(symbol)(*args)
    split = nan_buffer(q.shape)
    n_paged.attention_combine(partials, positions, tables, split)
    np.testing.assert_array_equal(split, whole)


# ---------------------------------------------------------------- bad arguments

def test_attention_paged_rejects_bad_arguments(native):
    m, n_head, n_kv, head_dim, n_blocks, max_blocks = 2, 4, 2, 9, 12, 3
    q, out = buffers.zeros((m, n_head, head_dim)), buffers.zeros((m, n_head, head_dim))
    k = buffers.zeros((n_blocks, n_kv, KV_BLOCK, head_dim))
    v = buffers.zeros((n_blocks, n_kv, KV_BLOCK, head_dim))
    positions, row_seq, tables = i32([3, 20]), i32([0, 1]), i32(np.arange(6).reshape(2, max_blocks))
    scratch = native.paged_attention_scratch(max_blocks * KV_BLOCK)

    def call(**changes):
        args = dict(q=q, k_arena=k, v_arena=v, positions=positions, row_seq=row_seq, tables=tables, scale=0.5,
                    out=out, scratch=scratch, heads=None, window=0)
        args.update(changes)
        native.attention_paged(**args)

    call()
    call(window=3)
    call(window=10**9)                                      # beyond any table: unlimited
    call(scratch=native.paged_attention_scratch(5), window=5)
    bad = [
        (dict(q=buffers.zeros((m, 3, head_dim)), out=buffers.zeros((m, 3, head_dim))),
         "k_arena: 2 KV heads do not divide q's 3 query heads"),
        (dict(k_arena=buffers.zeros((n_blocks, n_kv, KV_BLOCK, 8))), "k_arena: head_dim 8 differs"),
        (dict(k_arena=buffers.zeros((n_blocks, n_kv, 8, head_dim))), "k_arena: blocks of 8 rows"),
        (dict(k_arena=buffers.zeros((n_blocks, n_kv * KV_BLOCK, head_dim))), "k_arena: expected 4 dimensions"),
        (dict(v_arena=buffers.zeros((n_blocks + 1, n_kv, KV_BLOCK, head_dim))), "v_arena: expected shape"),
        (dict(k_arena=buffers.zeros(k.shape, np.float64)), "k_arena: expected dtype"),
        (dict(v_arena=buffers.zeros(k.shape, np.float16)), "v_arena: expected dtype float32"),
        (dict(q=buffers.zeros((m, n_head, head_dim), np.float64)), "q: expected dtype float32"),
        (dict(out=buffers.zeros((m, n_head, head_dim + 1))), "out: expected shape"),
        (dict(q=misaligned(q)), "q: data must be 32-byte aligned"),
        (dict(v_arena=buffers.zeros((n_blocks, n_kv, KV_BLOCK, 2 * head_dim))[..., ::2]),
         "v_arena: each \\(block, KV head\\) tile must be C-contiguous"),
        (dict(k_arena=buffers.zeros((n_kv, n_blocks, KV_BLOCK, head_dim)).transpose(1, 0, 2, 3),
              v_arena=buffers.zeros((n_kv, n_blocks, KV_BLOCK, head_dim)).transpose(1, 0, 2, 3)), None),
        (dict(k_arena=np.lib.stride_tricks.as_strided(k, strides=(k.strides[1],) + k.strides[1:]),
              v_arena=np.lib.stride_tricks.as_strided(v, strides=(k.strides[1],) + k.strides[1:])),
         "k_arena: tiles overlap: blocks 1 tiles apart and KV heads 1"),
        (dict(k_arena=np.lib.stride_tricks.as_strided(k, strides=(k.strides[1] * n_kv << 24,) + k.strides[1:]),
              v_arena=np.lib.stride_tricks.as_strided(v, strides=(k.strides[1] * n_kv << 24,) + k.strides[1:])),
         f"k_arena: blocks {n_kv << 24} tiles apart, at most {(1 << 24) - 1}"),
        (dict(k_arena=buffers.zeros((n_blocks, 3, n_kv, KV_BLOCK, head_dim))[:, 1],
              v_arena=buffers.zeros((n_blocks, 3, n_kv, KV_BLOCK, head_dim))[:, 1]), None),
        (dict(k_arena=buffers.zeros((n_blocks, 3, n_kv, KV_BLOCK, head_dim))[:, 1]),
         "v_arena: strides \\(.*\\) differ from k_arena's"),
        (dict(k_arena=buffers.zeros((n_blocks, 2 * n_kv + 1, KV_BLOCK, head_dim))[:, 1:3],
              v_arena=buffers.zeros((n_blocks, 2 * n_kv + 1, KV_BLOCK, head_dim))[:, 1:3]), None),
        (dict(k_arena=buffers.zeros((2 * n_blocks, n_kv, KV_BLOCK, head_dim))[::-2],
              v_arena=buffers.zeros((2 * n_blocks, n_kv, KV_BLOCK, head_dim))[::-2]),
         "k_arena: blocks -.* bytes apart, not a positive whole number of tiles"),
        (dict(k_arena=buffers.zeros((n_blocks, n_kv * KV_BLOCK * head_dim + 8))[:, :-8].reshape(
            n_blocks, n_kv, KV_BLOCK, head_dim)), "k_arena: blocks .* bytes apart, not a positive whole number"),
        (dict(positions=i32([3])), "positions: expected shape \\(2\\)"),
        (dict(positions=buffers.zeros(2, np.int64)), "positions: expected dtype int32"),
        (dict(row_seq=i32([0, 1, 1])), "row_seq: expected shape"),
        (dict(tables=i32(np.arange(6))), "tables: expected 2 dimensions"),
        (dict(tables=buffers.zeros((2, 3), np.uint32)), "tables: expected dtype int32"),
        (dict(scale=float("nan")), "scale: expected a finite number"),
        (dict(scale=1e39), "scale: 1e\\+39 overflows float32"),
        (dict(scratch=native.paged_attention_scratch(max_blocks * KV_BLOCK, head_dim=8)),
         "scratch: 1744 floats, need 1840 for rows seeing up to 48 keys"),
        (dict(scratch=buffers.zeros(800), window=17), "scratch: 800 floats, need 1840 for rows seeing up to 17"),
        (dict(scratch=buffers.zeros((3, 48))), "scratch: expected 1 dimensions"),
        (dict(heads=(2, 2)), "heads: expected 0 <= h0 < h1 <= n_head=4"),
        (dict(heads=3), "heads: expected a pair"),
        (dict(out=q), "out: overlaps q"),
        (dict(scratch=k.reshape(-1)), "scratch: overlaps k_arena"),
        (dict(out=k.reshape(-1)[:m * n_head * head_dim].reshape(m, n_head, head_dim)), "out: overlaps k_arena"),
        (dict(window=-1), "window: expected an integer >= 0"),
        (dict(window=2.0), "window: expected an integer >= 0"),
        (dict(window=True), "window: expected an integer >= 0"),
    ]
    for changes, message in bad:
        if message is None:                      # a layer's view of a buffer of several layers
            call(**changes)
            continue
        with pytest.raises(ValueError, match=message):
            call(**changes)
    read_only = buffers.zeros((m, n_head, head_dim))
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out: array is read-only"):
        call(out=read_only)
    call()


def test_kv_store_paged_and_gather_rows_reject_bad_arguments(native):
    m, n_kv, head_dim = 2, 2, 8
    src = buffers.zeros((m, n_kv, head_dim))
    arena = buffers.zeros((4, n_kv, KV_BLOCK, head_dim))
    positions, row_seq, tables = i32([0, 1]), i32([0, 0]), i32([[1, 2]])

    def store(**changes):
        args = dict(src=src, positions=positions, row_seq=row_seq, tables=tables, arena=arena, heads=None)
        args.update(changes)
        native.kv_store_paged(**args)

    store()
    store(heads=(1, 2))
    for changes, message in [
        (dict(arena=buffers.zeros((4, n_kv + 1, KV_BLOCK, head_dim))), "arena: expected shape"),
        (dict(arena=buffers.zeros((4, n_kv, KV_BLOCK - 1, head_dim))), "arena: expected shape"),
        (dict(arena=buffers.zeros(arena.shape, np.float64)), "arena: expected dtype"),
        (dict(src=buffers.zeros((m, n_kv, head_dim), np.float16)), "src: expected dtype float32"),
        (dict(positions=i32([0])), "positions: expected shape"),
        (dict(row_seq=buffers.zeros(2, np.int64)), "row_seq: expected dtype int32"),
        (dict(heads=(0, 3)), "heads: expected 0 <= h0 < h1 <= n_kv=2"),
        (dict(src=arena.reshape(-1)[:src.size].reshape(src.shape)), "arena: overlaps src"),
        (dict(keys=1), "keys: expected True or False, got 1"),
        (dict(keys=True, src=buffers.zeros((m, n_kv, 1032)),
              arena=buffers.zeros((4, n_kv, KV_BLOCK, 1032), np.float16)),
         "src: head_dim 1032 is above 1024, the most a float16 key arena stores"),
    ]:
        with pytest.raises(ValueError, match=message):
            store(**changes)
    store(keys=True)

    x, rows, out = buffers.zeros((3, 9)), i32([2, 0]), buffers.zeros((2, 9))
    native.gather_rows(x, rows, out)
    for args, message in [
        ((x, rows, buffers.zeros((2, 8))), "out: expected shape"),
        ((x, rows, buffers.zeros((3, 9))), "out: expected shape"),
        ((x, buffers.zeros(2, np.int64), out), "rows: expected dtype int32"),
        ((x.reshape(-1), rows, out), "src: expected 2 dimensions"),
        ((x, rows, x[:2]), "out: overlaps src"),
    ]:
        with pytest.raises(ValueError, match=message):
            native.gather_rows(*args)


def test_check_step_indices_names_the_bad_index():
    tables = i32([[3, 1, -1], [0, 2, 7]])
    check_step_indices(i32([31, 20]), i32([0, 1]), tables, 2, n_blocks=4)
    check_step_indices(i32([40, 0]), i32([1, 1]), i32([[0, 0, 0], [9, 9, 2]]), 1, n_blocks=4, window=5)
    for args, kwargs, message in [
        ((i32([32, 0]), i32([0, 0]), tables, 2, 4), {}, r"tables\[0, 2\] = -1: row 0 \(position 32\)"),
        ((i32([40, 0]), i32([1, 0]), tables, 1, 4), {}, r"tables\[1, 2\] = 7"),
        ((i32([3, 0]), i32([2, 0]), tables, 1, 4), {}, r"row_seq\[0\] = 2: not a table"),
        ((i32([48]), i32([1]), tables, 1, 4), {}, r"positions\[0\] = 48: expected 0 <= position < 48"),
        ((i32([-1]), i32([1]), tables, 1, 4), {}, r"positions\[0\] = -1"),
        ((i32([20]), i32([1]), tables, 1, 4), dict(max_keys=20), r"positions\[0\] = 20: .* max_keys = 20"),
        ((i32([20]), i32([1]), tables, 2, 4), {}, "at least m=2 entries"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_step_indices(*args, **kwargs)


# ---------------------------------------------------------------- recorded in a plan

@pytest.mark.parametrize("window", [0, 5])
def test_recorded_paged_step_follows_the_indices_in_memory(native, window):
    """One plan (kv_store_paged split by KV heads, attention_paged by query heads, gather_rows),
    recorded once on 2 threads, then run after rewriting positions, row_seq and the tables:
    every run gives the direct calls' bits, and no record is patched."""
    from llambda.runtime import get_backend
    from llambda.runtime.pool import WorkerPool
    from llambda.runtime.recorder import PlanRecorder
    rng = np.random.default_rng(4)
    m, n_head, n_kv, head_dim, n_blocks, max_blocks = 9, 9, 3, 64, 24, 6
    k_arena = buffers.aligned_copy(rng.standard_normal((n_blocks, n_kv, KV_BLOCK, head_dim)), np.float32)
    v_arena = buffers.aligned_copy(rng.standard_normal((n_blocks, n_kv, KV_BLOCK, head_dim)), np.float32)
    q = buffers.aligned_copy(rng.standard_normal((m, n_head, head_dim)), np.float32)
    k_new = buffers.aligned_copy(rng.standard_normal((m, n_kv, head_dim)), np.float32)
    positions, row_seq = buffers.zeros(m, np.int32), buffers.zeros(m, np.int32)
    tables = buffers.zeros((3, max_blocks), np.int32)
    rows = i32([m - 1, 0])
    out, picked = nan_buffer(q.shape), nan_buffer((2, n_head * head_dim))

    recorder = PlanRecorder(2, max_blocks * KV_BLOCK, get_backend("avx2"))
    recorder.kv_store_paged(k_new, positions, row_seq, tables, k_arena, keys=True)
    recorder.attention_paged(q, k_arena, v_arena, positions, row_seq, tables, 0.125, out, None, window=window)
    recorder.gather_rows(out.reshape(m, -1), rows, picked)
    recorder.finish()
    assert all(recorder.plan.records["chunks"][op, 0] >= 2 for op in range(2))   # both split (dynamic chunks)
    records = recorder.plan.records.copy()

    with WorkerPool(2) as pool:
        for trial in range(4):
            tables[...] = rng.permutation(n_blocks)[:3 * max_blocks].reshape(3, max_blocks)
            positions[...] = rng.integers(0, max_blocks * KV_BLOCK, m)
            row_seq[...] = rng.integers(0, 3, m)
            check_step_indices(positions, row_seq, tables, m, n_blocks)
            want_arena, want, want_picked = buffers.aligned_copy(k_arena), nan_buffer(q.shape), nan_buffer(picked.shape)
            native.kv_store_paged(k_new, positions, row_seq, tables, want_arena, keys=True)
            native.attention_paged(q, want_arena, v_arena, positions, row_seq, tables, 0.125, want,
                                   native.paged_attention_scratch(max_blocks * KV_BLOCK), window=window)
            native.gather_rows(want.reshape(m, -1), rows, want_picked)
            out[...] = np.nan
            recorder.plan.run(pool)
            np.testing.assert_array_equal(k_arena, want_arena)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(picked, want_picked)
    assert (recorder.plan.records == records).all()


# ---------------------------------------------------------------- float16 arenas

def as_f16(arena):
    return buffers.aligned_copy(arena, np.float16)


@settings(max_examples=25)
@given(st.data())
def test_f16_arena_is_the_f32_kernel_on_rounded_values(native, ref, data):
    """A float16 arena gives exactly the f32 kernel's bits over the same (rounded) values, and
    the reference's result on them within the f32 tolerance; kv_store_paged rounds as numpy."""
    n_head, n_kv, _, step = draw_step(data, window_too=True)
    head_dim = data.draw(st.sampled_from([8, 16, 64, 80]), label="head_dim")
    step.shape = step.shape[:3] + (head_dim,)
    q, keys, values, scale, exact = draw_values(data, n_head, n_kv, head_dim, step)
    keys = [k.astype(np.float16).astype(np.float32) for k in keys]
    values = [np.clip(v, -6e4, 6e4).astype(np.float16).astype(np.float32) for v in values]
    k32, v32 = keyed(step.arena(keys)), step.arena(values)
    k16, v16 = as_f16(k32), as_f16(v32)
    scratch = scratch_for(native, step)
    got16, got32, want = nan_buffer(q.shape), nan_buffer(q.shape), np.full(q.shape, np.nan)
    args = (step.positions, step.row_seq, step.tables, scale)
    native.attention_paged(q, k16, v16, *args, got16, scratch, window=step.window)
    native.attention_paged(q, k32, v32, *args, got32, scratch, window=step.window)
    ref.attention_paged(q, k16, v16, *args, want, None, window=step.window)
    np.testing.assert_array_equal(got16, got32)
    atol = tolerance(q, keys, values, step, scale, exact, n_head // n_kv)
    assert (np.abs(got16 - want) <= atol).all()

    m = len(q)
    src = float_arrays(data.draw, (m, n_kv, head_dim))
    heads = draw_head_range(data, n_kv)
    stored, expected = buffers.aligned_copy(k16), k16.copy()
    native.kv_store_paged(src, step.positions, step.row_seq, step.tables, stored, heads=heads)
    ref.kv_store_paged(src, step.positions, step.row_seq, step.tables, expected, heads=heads)
    np.testing.assert_array_equal(stored.view(np.uint16), expected.view(np.uint16))


def test_f16_rounding_matches_numpy_at_the_edges(native):
    """Ties, the largest half, overflow to inf, subnormals, signed zeros, NaN: the bits of
    numpy's astype(float16)."""
    edge = np.array([0.0, -0.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 65504.0, 65519.0, 65520.0, 1e6, -1e6,
                     2**-24, 2**-25, 3 * 2**-26, 2**-14 - 2**-25, np.inf, -np.inf, np.nan], np.float32)
    rng = np.random.default_rng(5)
    values = np.concatenate([edge, rng.standard_normal(64 - len(edge)).astype(np.float32) * 100])
    src = buffers.aligned_copy(values.reshape(8, 1, 8))
    step = Step(rng, 1, 8, [8], [(0, p) for p in range(8)])
    arena = buffers.zeros(step.shape, np.float16)
    native.kv_store_paged(src, step.positions, step.row_seq, step.tables, arena)
    stored = arena[step.tables[0, 0], 0, :8]
    with np.errstate(over="ignore"):
        want = values.reshape(8, 8).astype(np.float16)
    np.testing.assert_array_equal(stored.view(np.uint16), want.view(np.uint16))


def test_f16_arena_rejects_a_head_dim_off_the_chunk(native):
    step = Step(np.random.default_rng(7), 1, 12, [4], [(0, 3)])
    arena = buffers.zeros(step.shape, np.float16)
    q, out = buffers.zeros((1, 2, 12)), buffers.zeros((1, 2, 12))
    with pytest.raises(ValueError, match="k_arena: a float16 arena needs head_dim % 8 == 0, got head_dim 12"):
        native.attention_paged(q, arena, arena, step.positions, step.row_seq, step.tables, 1.0, out,
                               scratch_for(native, step))
    with pytest.raises(ValueError, match="arena: a float16 arena needs head_dim % 8 == 0"):
        native.kv_store_paged(buffers.zeros((1, 1, 12)), step.positions, step.row_seq, step.tables, arena)


def long_context(seed):
    """One sequence of 3000 keys in SmolLM2's shape (9 query / 3 KV heads, head_dim 64), rows at
    its end, in the middle and near its start: (n_head, n_kv, head_dim, keys, values, rows, step,
    q, scale)."""
    rng = np.random.default_rng(seed)
    n_head, n_kv, head_dim, length = 9, 3, 64, 3000
    keys = [rng.standard_normal((n_kv, length, head_dim)).astype(np.float32)]
    values = [rng.standard_normal((n_kv, length, head_dim)).astype(np.float32)]
    rows = [(0, length - 1), (0, 1234), (0, 15)]
    step = Step(rng, n_kv, head_dim, [length], rows)
    q = buffers.aligned_copy(rng.standard_normal((len(rows), n_head, head_dim)) * 2, np.float32)
    return n_head, n_kv, head_dim, keys, values, rows, step, q, head_dim ** -0.5


def test_f16_arena_long_context_tolerance(native, ref):
    """An f16 cache against the float64 reference on the *unrounded* f32 keys and values, 3000
    keys, SmolLM2's shape: storage rounds each element by <= 2^-11 relative, so a score moves
    by <= 2^-11 scale sum|q k| and out by <= 2 that max|v| + 2^-11 max|v| (+ the f32 bound)."""
    n_head, n_kv, head_dim, keys, values, rows, step, q, scale = long_context(6)
    k32, v32 = keyed(step.arena(keys)), step.arena(values)
    k16, v16 = as_f16(k32), as_f16(v32)
    got, want = nan_buffer(q.shape), np.full(q.shape, np.nan)
    native.attention_paged(q, k16, v16, step.positions, step.row_seq, step.tables, scale, got,
                           scratch_for(native, step))
    ref.attention_paged(q, k32, v32, step.positions, step.row_seq, step.tables, scale, want, None)
    f32_bound = tolerance(q, keys, values, step, scale, False, n_head // n_kv)
    for i, (_, p) in enumerate(rows):
        for h in range(n_head):
            k, v = keys[0][h // 3, :p + 1].astype(np.float64), values[0][h // 3, :p + 1]
            score_error = 2.0 ** -11 * scale * (np.abs(k) @ np.abs(q[i, h])).max()
            bound = np.abs(v).max() * (2 * score_error + 2.0 ** -11) + f32_bound[i, h]
            assert np.abs(got[i, h] - want[i, h]).max() <= bound


def check_ops_touch_nothing_past_their_arrays(native, ref, seed, head_dim, encode):
    """attention_paged and kv_store_paged on arrays that end at a guard page, arenas of
    ``encode(f32 values)``: a read or write past any of them faults."""
    keep = []
    rng = np.random.default_rng(seed)
    n_head, n_kv, n_blocks = 4, 2, 3
    tables = i32(rng.permutation(n_blocks)[None])
    positions, row_seq = i32([n_blocks * KV_BLOCK - 1, 5]), i32([0, 0])
    shape = (n_blocks, n_kv, KV_BLOCK, head_dim)
    from llambda.runtime.ref.paged import key_tiles
    k = before_a_guard_page(key_tiles(encode(rng.standard_normal(shape).astype(np.float32))), keep)
    v = before_a_guard_page(encode(rng.standard_normal(shape).astype(np.float32)), keep)
    q = before_a_guard_page(rng.standard_normal((2, n_head, head_dim)).astype(np.float32), keep)
    out = before_a_guard_page(np.zeros(q.shape, np.float32), keep)
    want = np.zeros(q.shape)
    ref.attention_paged(q, k, v, positions, row_seq, tables, 0.125, want, None)
    native.attention_paged(q, k, v, positions, row_seq, tables, 0.125, out,
                           native.paged_attention_scratch(n_blocks * KV_BLOCK))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    src = before_a_guard_page(rng.standard_normal((2, n_kv, head_dim)).astype(np.float32), keep)
    for keys in (False, True):
        arena = before_a_guard_page(np.zeros(k.shape, k.dtype), keep)
        expected = np.zeros(k.shape, k.dtype)
        ref.kv_store_paged(src, positions, row_seq, tables, expected, keys=keys)
        native.kv_store_paged(src, positions, row_seq, tables, arena, keys=keys)
        np.testing.assert_array_equal(arena, expected)


def test_f16_ops_touch_nothing_past_their_arrays(native, ref):
    check_ops_touch_nothing_past_their_arrays(native, ref, 8, 64, lambda x: x.astype(np.float16))


# ---------------------------------------------------------------- q8_0 arenas

def as_q8(arena):
    """The q8_0 arena of an f32 arena (NaN rows quantize to garbage: never read)."""
    from llambda.runtime.ref.paged import quantize_kv_q8
    with np.errstate(invalid="ignore"):
        return buffers.aligned_copy(quantize_kv_q8(arena))


def dequantized(arena, head_dim):
    from llambda.runtime.ref.paged import dequantize_kv_q8
    return buffers.aligned_copy(dequantize_kv_q8(arena, head_dim))


@settings(max_examples=40)
@given(st.data())
def test_q8_arena_scores_the_quantized_queries(native, ref, data):
    """Each q8_0 variant gives the reference's result on what it scores with (q quantized as
    a q8_0 row, the dequantized keys and values) within the f32 tolerance: a variant that
    scored the unquantized q would be off by about scale * |k| * max|q| / 254 per block of
    32. kv_store_paged quantizes byte for byte as the reference (quantize_kv_q8)."""
    n_head, n_kv, _, step = draw_step(data, window_too=True)
    head_dim = data.draw(st.sampled_from([32, 64, 96, 128, 256]), label="head_dim")
    step.shape = step.shape[:3] + (head_dim,)
    q, keys, values, scale, _ = draw_values(data, n_head, n_kv, head_dim, step)
    k8, v8 = as_q8(step.arena(keys)), as_q8(step.arena(values))
    k32, v32 = dequantized(k8, head_dim), dequantized(v8, head_dim)
    scratch = scratch_for(native, step)
    isa = draw_isa(data, head_dim, np.uint8)
    got, want = nan_buffer(q.shape), np.full(q.shape, np.nan)
    args = (step.positions, step.row_seq, step.tables, scale)
    from llambda.runtime.native import paged as n_paged
    n_paged.attention_paged(q, keyed(k8), v8, *args, got, scratch, window=step.window, isa=isa)
    ref.attention_paged(q, keyed(k8), v8, *args, want, None, window=step.window)
    seen_keys = [k32[step.tables[s, np.arange(n) // KV_BLOCK], :, np.arange(n) % KV_BLOCK].transpose(1, 0, 2)
                 for s, n in enumerate(step.lengths)]
    seen_values = [v32[step.tables[s, np.arange(n) // KV_BLOCK], :, np.arange(n) % KV_BLOCK].transpose(1, 0, 2)
                   for s, n in enumerate(step.lengths)]
    atol = tolerance(queries_seen(q, "q8_0"), seen_keys, seen_values, step, scale, False, n_head // n_kv)
    error = np.abs(got - want)
    assert (error <= atol).all(), f"{isa}: max error / tolerance {(error / atol).max()}"

    m = len(q)
    src = float_arrays(data.draw, (m, n_kv, head_dim))
    heads = draw_head_range(data, n_kv)
    stored, expected = buffers.aligned_copy(k8), k8.copy()
    native.kv_store_paged(src, step.positions, step.row_seq, step.tables, stored, heads=heads)
    ref.kv_store_paged(src, step.positions, step.row_seq, step.tables, expected, heads=heads)
    np.testing.assert_array_equal(stored, expected)


def q8_isas():
    from llambda.runtime.native import paged as n_paged
    return n_paged.attention_isas(np.uint8)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("head_dim", [32, 1024])
def test_q8_scores_at_the_edges(native, ref, head_dim, isa):
    """Both q8_0 variants on the quantization's edges, in q and in the keys: an all-zero block
    (d = 0), a block of one value, values landing on .5 after scaling, huge and tiny
    magnitudes, the extreme quants +-127 (VNNI's k + 128 is 1 and 255; AVX2's pair of
    products 2 * 127 * 127 stays below 2^15), and head_dim up to the queries' stack copy:
    the reference within the f32 tolerance."""
    from llambda.runtime.native import paged as n_paged
    if isa not in q8_isas():
        pytest.skip(f"this CPU or kernel library has no {isa} q8_0 attention")
    rng = np.random.default_rng(head_dim)
    n_kv, n_head, length = 1, 3, 40
    edges = [np.zeros(head_dim), np.full(head_dim, 3.0), np.arange(head_dim) % 64 - 31.5,
             rng.standard_normal(head_dim) * 1e3, rng.standard_normal(head_dim) * 1e-3,
             127.0 * np.sign(rng.standard_normal(head_dim))]
    keys = np.stack([edges[j % len(edges)] * (1 + 0.1 * j) for j in range(length)])[None].astype(np.float32)
    values = rng.standard_normal((n_kv, length, head_dim)).astype(np.float32)
    rows = [(0, p) for p in range(0, length, 7)]
    step = Step(rng, n_kv, head_dim, [length], rows)
    q = np.stack([[edges[(i + h) % len(edges)] for h in range(n_head)] for i in range(len(rows))])
    q = buffers.aligned_copy(q / np.abs(q).max(), np.float32)
    scale = 0.01
    k8, v8 = as_q8(step.arena([keys])), as_q8(step.arena([values]))
    got, want = nan_buffer(q.shape), np.full(q.shape, np.nan)
    scratch = native.paged_attention_scratch(step.tables.shape[1] * KV_BLOCK, head_dim)
    args = (step.positions, step.row_seq, step.tables, scale)
    n_paged.attention_paged(q, keyed(k8), v8, *args, got, scratch, isa=isa)
    ref.attention_paged(q, keyed(k8), v8, *args, want, None)
    k32, v32 = dequantize_rows(k8, step, head_dim), dequantize_rows(v8, step, head_dim)
    atol = tolerance(queries_seen(q, "q8_0"), [k32], [v32], step, scale, False, n_head)
    assert (np.abs(got - want) <= atol).all()


def dequantize_rows(arena, step, head_dim):
    """Sequence 0's rows of a q8_0 arena, dequantized: [n_kv, length, head_dim]."""
    n = step.lengths[0]
    rows = dequantized(arena, head_dim)[step.tables[0, np.arange(n) // KV_BLOCK], :, np.arange(n) % KV_BLOCK]
    return rows.transpose(1, 0, 2)


def test_without_vnni_a_q8_arena_gets_the_avx2_kernel(native, monkeypatch):
    """An AVX-512 CPU without AVX512_VNNI (Skylake-X) runs f16 on avx512 and q8_0 on avx2,
    and refuses avx512 for q8_0 by name."""
    from llambda.runtime import cpu
    from llambda.runtime.native import paged as n_paged
    if "avx512" not in n_paged.attention_isas():
        pytest.skip("this CPU or kernel library has no avx512 attention")
    flags = cpu.cpu_flags() - set(n_paged.Q8_WIDE_FLAGS)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.delenv("LLAMBDA_ISA", raising=False)              # no cap on the widest variant
    n_paged.attention_isas.cache_clear()
    try:
        assert n_paged.attention_isas(np.uint8) == ("avx2",)
        assert n_paged.attention_isa(64, dtype=np.uint8) == "avx2"
        assert n_paged.attention_isa(64, dtype=np.float16) == "avx512"
        with pytest.raises(ValueError, match="isa: expected one of avx2 .* for a q8_0 arena"):
            n_paged.attention_isa(64, "avx512", np.uint8)
    finally:
        n_paged.attention_isas.cache_clear()


def test_q8_attention_takes_head_dims_up_to_its_stack_copy(native):
    """Past MAX_Q8_QUERY_HEAD_DIM attention over a q8_0 arena is refused by name, on either
    variant (the key store stops there too); float arenas have no such limit."""
    from llambda.runtime.native import paged as n_paged
    limit = n_paged.MAX_Q8_QUERY_HEAD_DIM
    rng = np.random.default_rng(3)
    for head_dim in (limit, limit + 32):
        step = Step(rng, 1, head_dim, [20], [(0, 19)])
        k8 = as_q8(step.arena([rng.standard_normal((1, 20, head_dim)).astype(np.float32)]))
        q = buffers.aligned_copy(rng.standard_normal((1, 1, head_dim)), np.float32)
        out = nan_buffer(q.shape)
        scratch = native.paged_attention_scratch(step.tables.shape[1] * KV_BLOCK, head_dim)
        for isa in q8_isas():
            def call():
                n_paged.attention_paged(q, keyed(k8), k8, step.positions, step.row_seq, step.tables, 0.1,
                                        out, scratch, isa=isa)
            if head_dim == limit:
                call()
                assert np.isfinite(out).all()
            else:
                with pytest.raises(ValueError, match=f"k_arena: attention over a q8_0 arena needs head_dim <= {limit}"):
                    call()


def test_q8_store_edges(native, ref):
    """An all-zero block (d = 0), a block of one value, ties at .5 after scaling, huge and
    tiny magnitudes: the reference's bytes."""
    rng = np.random.default_rng(9)
    head_dim = 64
    rows = np.zeros((6, 1, head_dim), np.float32)
    rows[1, 0, :32] = 3.0
    rows[2, 0] = np.arange(head_dim) - 31.5                    # x / d lands on halves
    rows[3, 0] = rng.standard_normal(head_dim) * 1e30
    rows[4, 0] = rng.standard_normal(head_dim) * 1e-30
    rows[5, 0] = -127.0 * np.sign(rng.standard_normal(head_dim))
    src = buffers.aligned_copy(rows)
    step = Step(rng, 1, head_dim, [6], [(0, p) for p in range(6)])
    got = buffers.zeros(step.shape[:3] + (72,), np.uint8)
    want = got.copy()
    native.kv_store_paged(src, step.positions, step.row_seq, step.tables, got)
    ref.kv_store_paged(src, step.positions, step.row_seq, step.tables, want)
    np.testing.assert_array_equal(got, want)
    assert (got[step.tables[0, 0], 0, 0] == 0).all()           # zeros: quants and d = 0


def test_q8_arena_long_context_tolerance(native, ref):
    """A q8_0 cache against the float64 reference on the unquantized f32 keys, values and q,
    3000 keys, SmolLM2's shape, the variant the binding picks. Each element moves by <= d_b / 2
    (d_b = max|x| / 127 of its block of 32): a key's by dk/2 and q's by dq/2, so a score by
    <= scale (sum_i dk_i/2 (|q_i| + dq_i/2) + |k_i| dq_i/2) and out by <= 2 that max|v| +
    max d_v / 2."""
    from llambda.runtime.ref.paged import quantize_kv_q8
    n_head, n_kv, head_dim, keys, values, rows, step, q, scale = long_context(10)
    k8, v8 = as_q8(step.arena(keys)), as_q8(step.arena(values))
    got, want = nan_buffer(q.shape), np.full(q.shape, np.nan)
    native.attention_paged(q, keyed(k8), v8, step.positions, step.row_seq, step.tables, scale, got,
                           scratch_for(native, step))
    ref.attention_paged(q, keyed(step.arena(keys)), step.arena(values), step.positions, step.row_seq, step.tables, scale,
                        want, None)
    k_step = quantize_kv_q8(keys[0])[..., head_dim:].copy().view(np.float32)      # d per block [n_kv, length, 2]
    v_step = quantize_kv_q8(values[0])[..., head_dim:].copy().view(np.float32)
    q_step = quantize_kv_q8(q)[..., head_dim:].copy().view(np.float32)
    f32_bound = tolerance(q, keys, values, step, scale, False, n_head // n_kv)
    for i, (_, p) in enumerate(rows):
        for h in range(n_head):
            kv = h // 3
            dk = np.repeat(k_step[kv, :p + 1], 32, axis=-1)                         # [keys, head_dim]
            dq = np.repeat(q_step[i, h], 32)
            k = np.abs(keys[0][kv, :p + 1].astype(np.float64))
            score_error = scale * (dk / 2 @ (np.abs(q[i, h]) + dq / 2) + k @ (dq / 2)).max()
            v_max = np.abs(values[0][kv, :p + 1]).max()
            bound = 2 * score_error * v_max + v_step[kv, :p + 1].max() / 2 + f32_bound[i, h]
            assert np.abs(got[i, h] - want[i, h]).max() <= bound


def test_q8_ops_touch_nothing_past_their_arrays(native, ref):
    check_ops_touch_nothing_past_their_arrays(native, ref, 11, 96, as_q8)


def test_q8_arena_rejects_bad_shapes(native):
    step = Step(np.random.default_rng(12), 1, 48, [4], [(0, 3)])
    q, out = buffers.zeros((1, 2, 48)), buffers.zeros((1, 2, 48))
    arena = buffers.zeros(step.shape[:3] + (54,), np.uint8)
    with pytest.raises(ValueError, match="k_arena: a q8_0 \\(uint8\\) arena needs head_dim % 32 == 0, got head_dim 48"):
        native.attention_paged(q, arena, arena, step.positions, step.row_seq, step.tables, 1.0, out,
                               scratch_for(native, step))
    q, out = buffers.zeros((1, 2, 64)), buffers.zeros((1, 2, 64))
    wrong = buffers.zeros(step.shape[:3] + (64,), np.uint8)
    with pytest.raises(ValueError, match="k_arena: rows of 64 bytes, q8_0 rows of q's head_dim 64 have 72"):
        native.attention_paged(q, wrong, wrong, step.positions, step.row_seq, step.tables, 1.0, out,
                               scratch_for(native, step))
    with pytest.raises(ValueError, match="arena: expected shape"):
        native.kv_store_paged(buffers.zeros((1, 1, 64)), step.positions, step.row_seq, step.tables, wrong)


# ---------------------------------------------------------------- split over key segments

LONG_LENGTHS = st.one_of(st.sampled_from([KV_SEGMENT - 1, KV_SEGMENT, KV_SEGMENT + 1, 2 * KV_SEGMENT + 1]),
                         st.integers(1, 4 * KV_SEGMENT + 40))


def draw_long_step(data, arena_type):
    n_head, n_kv = data.draw(st.sampled_from(HEAD_CONFIGS), label="heads")
    head_dim = data.draw(st.sampled_from({"f32": [1, 9, 16, 64, 65], "f16": [8, 16, 64], "q8_0": [32, 64, 96]}[arena_type]),
                         label="head_dim")
    n_seq = data.draw(st.integers(1, 2), label="sequences")
    lengths = [data.draw(LONG_LENGTHS, label="length") for _ in range(n_seq)]
    m = data.draw(st.integers(1, 5), label="m")
    rows = draw_rows(data, lengths, m)
    window = 0
    if data.draw(st.booleans(), label="windowed"):
        window = data.draw(st.one_of(st.sampled_from([1, KV_SEGMENT - 1, KV_SEGMENT, KV_SEGMENT + 1]),
                                     st.integers(1, 700)), label="window")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    step = Step(np.random.default_rng(seed), n_kv, head_dim, lengths, rows, window,
                max_blocks=data.draw(st.sampled_from([None, 80]), label="max_blocks"))
    return n_head, n_kv, head_dim, step


def stored(arena, arena_type, head_dim):
    """The arena as the kernels read it, and the values they see (rounded as stored)."""
    from llambda.runtime.ref.paged import dequantize_kv_q8, quantize_kv_q8
    if arena_type == "f16":
        arena16 = buffers.aligned_copy(arena.astype(np.float16))
        return arena16, arena16.astype(np.float32)
    if arena_type == "q8_0":
        q8 = buffers.aligned_copy(quantize_kv_q8(np.nan_to_num(arena)))
        seen = dequantize_kv_q8(q8, head_dim)
        seen[np.isnan(arena)] = np.nan
        return q8, seen
    return arena, arena


@settings(max_examples=30)
@given(st.data(), st.sampled_from(["f32", "f16", "q8_0"]))
def test_split_over_segments_gives_the_whole_rows_bits(native, ref, data, arena_type):
    """Either attention variant (avx2, avx512 where the CPU has it). Long contexts (several KV_SEGMENT segments, windows across their boundaries): any split
    of the segments between calls (seg0 mod step), any head split, then the combine, gives the
    whole call's bits; a row alone gives the same bits; both are within the reference's
    tolerance (on the values as stored)."""
    from llambda.runtime.native import paged as n_paged
    from llambda.runtime.native._lib import kernel
    n_head, n_kv, head_dim, step = draw_long_step(data, arena_type)
    q, keys, values, scale, exact = draw_values(data, n_head, n_kv, head_dim, step)
    exact = exact and arena_type != "q8_0"             # dequantized small integers are not integers
    k_arena, k_rows = stored(step.arena(keys), arena_type, head_dim)
    k_arena, k_seen = keyed(k_arena), keyed(k_rows)
    v_arena, v_seen = stored(step.arena(values), arena_type, head_dim)
    scratch = scratch_for(native, step)
    m = len(q)
    isa = draw_isa(data, head_dim, k_arena.dtype)

    whole = nan_buffer(q.shape)
    n_paged.attention_paged(q, k_arena, v_arena, step.positions, step.row_seq, step.tables, scale, whole, scratch,
                            window=step.window, isa=isa)
    want = np.full(q.shape, np.nan)
    q_seen = queries_seen(q, arena_type)
    ref.attention_paged(q_seen, k_seen, v_seen, step.positions, step.row_seq, step.tables, scale, want,
                        None, window=step.window)
    seen_keys = [k_rows[step.tables[s, np.arange(n) // KV_BLOCK], :, np.arange(n) % KV_BLOCK].transpose(1, 0, 2)
                 for s, n in enumerate(step.lengths)]
    seen_values = [v_seen[step.tables[s, np.arange(n) // KV_BLOCK], :, np.arange(n) % KV_BLOCK].transpose(1, 0, 2)
                   for s, n in enumerate(step.lengths)]
    atol = tolerance(q_seen, seen_keys, seen_values, step, scale, exact, n_head // n_kv)
    assert not np.isnan(whole).any()
    error = np.abs(whole.astype(np.float64) - want)
    assert (error <= atol).all(), f"max error / tolerance {(error / atol).max()}"

    partials = n_paged.attention_partials(m, n_head, head_dim, step.tables)
    partials[:] = np.nan
    seg_step = data.draw(st.integers(1, 6), label="segment step")
    cut = data.draw(st.integers(1, n_head), label="head cut")
    for heads in ((0, cut), (cut, n_head)):
        if heads[0] < heads[1]:
            for seg0 in range(seg_step):
                symbol, args = n_paged.attention_paged_call(
                    q, k_arena, v_arena, step.positions, step.row_seq, step.tables, scale, nan_buffer(q.shape),
                    scratch, heads=heads, window=step.window, partials=partials, segments=(seg0, seg_step), isa=isa)
                kernel(symbol)(*args)
    split = nan_buffer(q.shape)
    n_paged.attention_combine(partials, step.positions, step.tables, split, window=step.window)
    np.testing.assert_array_equal(split, whole)
    for i in range(m):
        alone = nan_buffer((1,) + q.shape[1:])
        n_paged.attention_paged(buffers.aligned_copy(q[i:i + 1]), k_arena, v_arena, i32(step.positions[i:i + 1]),
                                i32(step.row_seq[i:i + 1]), step.tables, scale, alone, scratch, window=step.window,
                                isa=isa)
        np.testing.assert_array_equal(alone[0], whole[i])
    if m > 1:                                          # a chunk of rows
        r = data.draw(st.integers(1, m - 1), label="row cut")
        by_rows = nan_buffer(q.shape)
        for rows in ((0, r), (r, m)):
            symbol, args = n_paged.attention_paged_call(q, k_arena, v_arena, step.positions, step.row_seq,
                                                        step.tables, scale, by_rows, scratch, window=step.window,
                                                        rows=rows, isa=isa)
            kernel(symbol)(*args)
        np.testing.assert_array_equal(by_rows, whole)
