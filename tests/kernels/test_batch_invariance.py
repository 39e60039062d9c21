"""Batch invariance of the quantized-weight kernels (DESIGN.md "Many sequences").

A row's qgemm output is bit-identical whatever else shares its batch: whatever m,
its position in a register tile (a full one or any remainder), the ISA variant the
binding picks for that m (AVX-512 from AVX512_MIN_ROWS rows, or isa= explicitly),
and the column range a thread computes. Its activation quantization (quantize_q8)
and an embedding lookup of its token do not depend on the batch either. This is
what lets prefill and decode give the same logits for the same position, and a
served request the same tokens alone or beside others.
"""
import numpy as np
from hypothesis import given, strategies as st

from helpers import float_arrays, q8_activations, qgemm_on, random_gguf_weight
from llambda.codegen.contract import GROUP, QGEMM_KIND_TILES
from llambda.runtime import buffers, layouts
from llambda.runtime.kinds import embed_kinds, quantized_kinds
from llambda.runtime.native import quant as n_quant
from llambda.runtime.ref import kquants, kquants16

# GGUF types whose packed kind is a quantized kind (Q4_0 packs as q4_1, m = -8 d)
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
SUPER_BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
# row counts of the register tiles: AVX2 6 (3 for the 16-weight K-quants), AVX-512 16 then 8
# (q4_1 and q8_0: 16, then one tile of the rows left; test_every_row_count_gives_each_row_its_bits)
TILE_ROWS = sorted({6, 8, 16, 32, *(int(t["avx2"].split("x")[0]) for t in QGEMM_KIND_TILES.values())})
TILE_EDGES = sorted({e for t in TILE_ROWS for e in (t - 1, t, t + 1)} | {1, 2, 3, 4, 5})
m_sizes = st.sampled_from(TILE_EDGES) | st.integers(1, 40)


def test_every_quantized_kind_is_covered():
    assert {layouts.pack(t, raw_weight(t, 8, 256, 0, 1.0), 8, 256).kind for t in TYPES} == set(quantized_kinds())


def raw_weight(type_name, n, k, seed, magnitude):
    rng = np.random.default_rng(seed)
    if type_name in ("Q4_K", "Q5_K"):
        return kquants.random_blocks(type_name, n, k, rng, magnitude)
    if type_name in SUPER_BLOCK_TYPES:
        return kquants16.random_blocks(type_name, n, k, rng, magnitude)
    return random_gguf_weight(type_name, n, k, seed, magnitude)


def quantized(native, x):
    return q8_activations(native, buffers.aligned_copy(x))


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@given(st.data(), st.sampled_from(TYPES), m_sizes, m_sizes, st.integers(1, 40))
def test_a_row_does_not_depend_on_its_batch(native, data, type_name, m, other_m, n):
    """Row by row, bit for bit, on every ISA this CPU runs (and the binding's own pick):
    a batch of m rows equals each row computed alone (m = 1, on the AVX2 baseline), and a
    row placed at another position of a different batch of other_m rows equals it too."""
    blocks = data.draw(st.integers(1, 4)) * (8 if type_name in SUPER_BLOCK_TYPES else data.draw(st.integers(1, 3)))
    k = 32 * blocks
    magnitude = data.draw(st.sampled_from([1e-3, 1.0, 300.0]))
    w = layouts.pack(type_name, raw_weight(type_name, n, k, data.draw(st.integers(0, 2**32 - 1)), magnitude), n, k)
    x = float_arrays(data.draw, (m, k))
    qs, d, s = quantized(native, x)
    # the row's quantization is the same alone as in the batch (quantize_q8 works block by block)
    lone = [quantized(native, x[i:i + 1]) for i in range(m)]
    for i, (lqs, ld, ls) in enumerate(lone):
        np.testing.assert_array_equal(lqs[0], qs[i])
        np.testing.assert_array_equal(bits(ld[0]), bits(d[i]))
        np.testing.assert_array_equal(bits(ls[0]), bits(s[i]))
    alone = np.concatenate([qgemm_on(native, "avx2", *a, w) for a in lone])
    assert not np.isnan(alone).any()

    # the same row at position j of another batch (other rows drawn afresh)
    row, j = data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, other_m - 1))
    y = np.array(float_arrays(data.draw, (other_m, k)))
    y[j] = x[row]
    oqs, od, os_ = quantized(native, y)

    isas = n_quant.qgemm_isas(w.kind) + (None,)
    for isa in isas:
        label = f"{type_name} isa={isa or 'chosen'} m={m}"
        batch = np.empty((m, n), np.float32)
        native.qgemm(qs, d, s, w, batch, isa=isa)
        np.testing.assert_array_equal(bits(batch), bits(alone), err_msg=f"{label}: batch vs rows alone")
        single = np.empty((1, n), np.float32)
        native.qgemm(qs[row:row + 1], d[row:row + 1], s[row:row + 1], w, single, isa=isa)
        np.testing.assert_array_equal(bits(single[0]), bits(alone[row]), err_msg=f"{label}: m = 1")
        other = np.empty((other_m, n), np.float32)
        native.qgemm(oqs, od, os_, w, other, isa=isa)
        np.testing.assert_array_equal(bits(other[j]), bits(alone[row]),
                                      err_msg=f"{label}: row {row} at {j} of {other_m}")
        # a thread's column range (plans split the columns at multiples of 8)
        n0 = GROUP * data.draw(st.integers(0, (n - 1) // GROUP))
        n1 = data.draw(st.integers(n0 + 1, n))
        part = np.full((m, n), np.nan, np.float32)
        native.qgemm(qs, d, s, w, part, rows=(n0, n1), isa=isa)
        np.testing.assert_array_equal(bits(part[:, n0:n1]), bits(alone[:, n0:n1]),
                                      err_msg=f"{label}: columns {n0}..{n1}")


def test_every_row_count_gives_each_row_its_bits(native):
    """q4_1 and q8_0 have an AVX-512 tile for every row count (codegen/qgemm.py KIND_TILINGS):
    for each m up to 33 rows (two 16-row tiles and one more), the first m rows of a batch
    equal those rows computed one at a time on AVX2; at k = 4096 q4_1 takes 8-row tiles."""
    n = 25                                      # two group pairs and a lone last group
    for type_name, k in (("Q4_1", 96), ("Q4_1", 4096), ("Q8_0", 96)):
        w = layouts.pack(type_name, raw_weight(type_name, n, k, k, 1.0), n, k)
        x = np.random.default_rng(k).standard_normal((33, k)).astype(np.float32)
        alone = np.concatenate([qgemm_on(native, "avx2", *quantized(native, x[i:i + 1]), w) for i in range(33)])
        for isa in n_quant.qgemm_isas(w.kind) + (None,):
            for m in range(1, 34):
                batch = np.empty((m, n), np.float32)
                native.qgemm(*quantized(native, x[:m]), w, batch, isa=isa)
                np.testing.assert_array_equal(bits(batch), bits(alone[:m]),
                                              err_msg=f"{type_name} k={k} isa={isa or 'chosen'} m={m}")


@given(st.data(), st.sampled_from(sorted(embed_kinds())), m_sizes, st.integers(1, 40))
def test_an_embedded_token_does_not_depend_on_its_batch(native, data, kind, m, n):
    """The embed kernels give each token's row the same bits alone as in a batch."""
    k = 32 * data.draw(st.integers(1, 6))
    type_name = kind.upper()
    w = layouts.pack(type_name, raw_weight(type_name, n, k, data.draw(st.integers(0, 2**32 - 1)), 1.0), n, k)
    ids = buffers.aligned_copy(np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m)),
                                        np.int32), np.int32)
    batch = buffers.empty((m, k))
    native.embed(w, ids, batch)
    for i in range(m):
        alone = buffers.empty((1, k))
        native.embed(w, ids[i:i + 1], alone)
        np.testing.assert_array_equal(bits(alone[0]), bits(batch[i]))
