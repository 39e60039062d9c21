"""The paged KV cache's bookkeeping (llambda/serving/kv_pool.py): blocks, tables, sharing, eviction."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import smaps_bytes
from llambda.codegen.contract import KV_BLOCK
from llambda.serving.kv_pool import TRASH_BLOCK, KVPool

B = KV_BLOCK
CONFIG = SimpleNamespace(n_layer=1, n_kv_head=1, head_dim=8)


def pool(n_blocks=20, tables=4, ctx=8 * B):
    return KVPool(CONFIG, n_blocks, tables, ctx)


def test_a_sequence_gets_distinct_blocks_and_never_the_trash_block():
    p = pool()
    table, blocks, keys, cached = p.open(list(range(40)), 40)
    assert len(blocks) == 3 and TRASH_BLOCK not in blocks and len(set(blocks)) == 3
    assert cached == 0 and keys == []
    assert list(p.tables[table, :3]) == blocks and not p.tables[table, 3:].any()
    assert p.blocks_in_use == 3


def test_sealed_blocks_are_shared_by_a_later_prompt_with_the_same_start():
    p = pool()
    tokens = list(range(3 * B + 5))
    table, blocks, keys, _ = p.open(tokens, len(tokens))
    p.seal(blocks, keys, tokens)
    assert len(keys) == 3
    t2, blocks2, keys2, cached = p.open(tokens[:2 * B] + [999] * 10, 2 * B + 10)
    assert cached == 2 * B and blocks2[:2] == blocks[:2] and blocks2[2] not in blocks
    assert keys2 == keys[:2]
    # the last token's block is never shared: its logits must be computed
    t3, blocks3, _, cached3 = p.open(tokens[:2 * B], 2 * B)
    assert cached3 == B and blocks3[0] == blocks[0] and blocks3[1] != blocks[1]


def test_different_tokens_earlier_in_the_prompt_share_nothing():
    p = pool()
    tokens = list(range(3 * B))
    table, blocks, keys, _ = p.open(tokens, len(tokens))
    p.seal(blocks, keys, tokens)
    other = [7] + tokens[1:]
    assert p.open(other, len(other))[3] == 0


def test_closed_sealed_blocks_stay_cached_until_evicted_least_recently_used_first():
    p = pool(n_blocks=7, tables=3)           # 6 usable blocks
    a = list(range(2 * B + 1))
    ta, ba, ka, _ = p.open(a, len(a))
    p.seal(ba, ka, a)
    p.close(ta, ba)
    assert p.blocks_in_use == 0 and p.available == 6
    _, _, _, cached = p.open(a, len(a))               # reuses both sealed blocks
    assert cached == 2 * B


def test_eviction_never_takes_a_block_in_use():
    p = pool(n_blocks=5, tables=3)           # 4 usable blocks
    a = list(range(2 * B + 1))
    ta, ba, ka, _ = p.open(a, len(a))        # 3 blocks
    p.seal(ba, ka, a)
    assert p.open(list(range(100, 100 + 2 * B)), 2 * B) is None      # needs 2, 1 free
    p.close(ta, ba)                          # 2 sealed idle + 2 free
    tb, bb, _, _ = p.open(list(range(100, 100 + 4 * B)), 4 * B)       # evicts both idle blocks
    assert len(bb) == 4 and p.available == 0
    assert p.open(a, len(a)) is None


def test_free_blocks_are_handed_out_lowest_first_after_sequences_come_and_go():
    """A sequence's fresh blocks are the lowest free ones, in ascending order, also after other
    sequences have closed: its tiles of one KV head then lie in address order, which the
    attention kernel reads fastest (docs/perf-journal/2026-12-06-2356-kv-cache-by-kv-head.md)."""
    p = pool(n_blocks=30)
    a, a_blocks, _, _ = p.open(list(range(5 * B)), 5 * B)
    b, b_blocks, _, _ = p.open(list(range(100, 100 + 5 * B)), 5 * B)
    assert a_blocks == [1, 2, 3, 4, 5] and b_blocks == [6, 7, 8, 9, 10]
    p.close(a, a_blocks)                       # never sealed: free again
    _, c_blocks, _, _ = p.open(list(range(200, 200 + 7 * B)), 7 * B)
    assert c_blocks == [1, 2, 3, 4, 5, 11, 12]
    p.close(b, b_blocks[::-1])
    _, d_blocks, _, _ = p.open(list(range(300, 300 + 3 * B)), 3 * B)
    assert d_blocks == [6, 7, 8]


def test_a_request_larger_than_a_table_is_refused():
    p = pool(ctx=2 * B)
    assert p.open([1], 3 * B) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5 * B), st.booleans()), min_size=1, max_size=30))
def test_random_open_seal_close_keeps_the_books(ops):
    """Whatever the order, a block is never held by two unrelated sequences at once, counts
    add up, and closing everything leaves every block available."""
    p = pool(n_blocks=24, tables=4, ctx=6 * B)
    live = []
    for prefix, length, close_one in ops:
        tokens = [prefix] * B + list(range(length))
        if close_one and live:
            table, blocks = live.pop(0)
            p.close(table, blocks)
            continue
        opened = p.open(tokens, len(tokens))
        if opened is None:
            continue
        table, blocks, keys, cached = opened
        p.seal(blocks, keys, tokens)
        live.append((table, blocks))
        held = [b for _, bl in live for b in bl]
        private = [b for b in held if b not in p._key_of]
        assert len(private) == len(set(private))
        assert TRASH_BLOCK not in held
        for b in set(held):
            assert p._refs[b] == held.count(b)
    for table, blocks in live:
        p.close(table, blocks)
    assert p.blocks_in_use == 0 and p.available == 23 and p.tables_available == 4
    assert not p.tables.any()


def resident_huge_bytes(*arrays):
    """AnonHugePages of the mappings that hold ``arrays`` (K's and V's buffers may share one)."""
    return smaps_bytes("AnonHugePages:", [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays])


def test_a_layers_arena_keeps_each_kv_heads_blocks_together():
    """Each layer's arena is a view of one buffer [layer, KV head, block], so a KV head's
    blocks in use (handed out lowest first) are one run of tiles the kernel reads in order."""
    config = SimpleNamespace(n_layer=3, n_kv_head=2, head_dim=64)
    for kv_type in ("f32", "f16", "q8_0"):
        p = KVPool(config, 10, 2, 8 * B, kv_type=kv_type)
        tile = p.k[0][0, 0].nbytes
        for arenas in (p.k, p.v):
            first = arenas[0][0, 0].ctypes.data
            for layer, arena in enumerate(arenas):
                assert arena.shape[:2] == (10, 2) and arena.strides[:2] == (tile, 10 * tile)
                for h in range(2):
                    for b in (0, 4, 9):
                        assert arena[b, h].ctypes.data == first + ((layer * 2 + h) * 10 + b) * tile
        _, blocks, _, _ = p.open(list(range(5 * B)), 5 * B)
        assert blocks == [1, 2, 3, 4, 5]


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_huge_page_is_filled_once_when_every_block_with_a_tile_in_it_is_written(data):
    """``filled`` hands each whole huge page of the buffers over exactly once, as soon as
    every block one of its tiles belongs to has been written, whatever the order: the
    same pages as counting them from scratch."""
    from llambda.runtime.buffers import HUGE_PAGE
    kv_type = data.draw(st.sampled_from(["f32", "f16", "q8_0"]), label="kv_type")
    config = SimpleNamespace(n_layer=data.draw(st.integers(1, 4), label="layers"),
                             n_kv_head=data.draw(st.integers(1, 3), label="kv heads"), head_dim=64)
    n_blocks = data.draw(st.integers(2, 1200), label="blocks")
    p = KVPool(config, n_blocks, 2, 8 * B, kv_type=kv_type)
    tile = p.k[0][0, 0].nbytes
    tiles = config.n_layer * config.n_kv_head * n_blocks
    order = data.draw(st.permutations(range(1, n_blocks)), label="order")
    cut = sorted(data.draw(st.lists(st.integers(0, len(order)), max_size=4), label="calls"))
    handed = []
    for lo, hi in zip([0] + cut, cut + [len(order)]):
        p.filled(order[lo:hi])
        handed += p._filled_pages
        p._filled_pages = []
        written = {TRASH_BLOCK, *order[:hi]}
        want = [page for page in range(tiles * tile // HUGE_PAGE)
                if {t % n_blocks for t in range(page * HUGE_PAGE // tile,
                                                ((page + 1) * HUGE_PAGE - 1) // tile + 1)} <= written]
        assert sorted(handed) == want


def skip_unless_collapsing_works():
    """Skip where this kernel cannot collapse a written huge page of a zeros_growing array."""
    from llambda.runtime.buffers import HUGE_PAGE, collapse_huge_pages, zeros_growing
    skip_without_huge_pages()
    probe = zeros_growing((2 * HUGE_PAGE,), np.uint8)
    probe[::4096] = 1
    if not collapse_huge_pages(probe, 0, HUGE_PAGE) or not resident_huge_bytes(probe):
        pytest.skip("the kernel collapses nothing here (no MADV_COLLAPSE, or no free huge page)")


def skip_without_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off on this machine")
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")


def test_collapsing_makes_the_whole_huge_pages_of_a_range_huge_and_keeps_the_bytes():
    """buffers.zeros_growing is small pages; collapse_huge_pages(a, start, end) makes each whole
    huge page within [start, end) one huge page, no other, with the same bytes."""
    from llambda.runtime.buffers import HUGE_PAGE, collapse_huge_pages, zeros_growing
    skip_without_huge_pages()
    cache = zeros_growing((5 * HUGE_PAGE,), np.uint8)
    assert cache.ctypes.data % HUGE_PAGE == 0
    cache[::4096] = np.arange(len(cache[::4096])) % 251
    want = cache.copy()
    assert resident_huge_bytes(cache) == 0
    if not collapse_huge_pages(cache, HUGE_PAGE - 1, 4 * HUGE_PAGE - 1):     # pages 1 and 2
        pytest.skip("the kernel collapsed nothing (no MADV_COLLAPSE, or no free huge page)")
    assert resident_huge_bytes(cache) == 2 * HUGE_PAGE
    np.testing.assert_array_equal(cache, want)
    assert not collapse_huge_pages(np.zeros(HUGE_PAGE, np.uint8), 0, HUGE_PAGE)   # no mapping of its own


def test_the_pool_collapses_only_huge_pages_whose_blocks_are_all_written():
    """A page of the buffers holds tiles of many blocks (a KV head's blocks are one run), and
    is collapsed once every one of them has been written (sealed): with 400 blocks of 4 KiB
    tiles a page holds every block's tile, so none is collapsed until all are written, then
    the four whole pages of K and of V are, with nothing resident that was not written."""
    from llambda.runtime.buffers import HUGE_PAGE, wait_for_collapses
    skip_unless_collapsing_works()
    config = SimpleNamespace(n_layer=3, n_kv_head=2, head_dim=64)
    p = KVPool(config, 400, 2, 400 * B)                       # f32: 4 KiB a tile, 9.6 MB

    def write(tokens):
        table, blocks, keys, _ = p.open(tokens, len(tokens))
        for layer in range(config.n_layer):
            p.k[layer][blocks] = 1.0
            p.v[layer][blocks] = 1.0
        p.seal(blocks, keys, tokens)
        p.close(table, blocks)              # sealed: cached, not handed out again
        p.collapse_filled()                 # as the engine does when it has nothing to run
        wait_for_collapses()                # (on a background thread)
        return blocks

    write(list(range(5 * B)))
    write(list(range(1000, 1000 + 200 * B)))                 # blocks 6..205
    assert resident_huge_bytes(p.k[0], p.v[0]) == 0
    blocks = write(list(range(10_000, 10_000 + 194 * B)))   # blocks 206..399: every block written
    assert resident_huge_bytes(p.k[0], p.v[0]) == 2 * 4 * HUGE_PAGE      # K's and V's whole pages
    assert max(blocks) == 399 and (p.k[2][1:400] == 1.0).all()


def test_the_pool_collapses_on_a_thread_of_its_own_and_the_bytes_stay(monkeypatch):
    """Sealing collapses nothing, and collapse_filled never waits for a collapse (one can take
    tens of ms, docs/perf-journal/2026-12-06-0630-collapses-top-p-conversions.md): each runs on the background thread, in the order asked, and the
    pages read the same bytes after it."""
    import threading
    from llambda.runtime import buffers
    skip_unless_collapsing_works()
    release, asked = threading.Event(), []
    real = buffers.collapse_huge_pages

    def slow_collapse(array, start, end):
        asked.append((threading.current_thread(), start))
        assert release.wait(10)
        return real(array, start, end)

    monkeypatch.setattr(buffers, "collapse_huge_pages", slow_collapse)
    config = SimpleNamespace(n_layer=3, n_kv_head=2, head_dim=64)
    p = KVPool(config, 400, 2, 400 * B)
    tokens = list(range(399 * B))                  # every block: the 4 whole pages of K and V
    table, blocks, keys, _ = p.open(tokens, len(tokens))
    rng = np.random.default_rng(0)
    for layer in range(config.n_layer):
        p.k[layer][blocks] = rng.standard_normal(p.k[layer][blocks].shape, dtype=np.float32)
        p.v[layer][blocks] = rng.standard_normal(p.v[layer][blocks].shape, dtype=np.float32)
    want_k, want_v = p.k[1][blocks].copy(), p.v[2][blocks].copy()
    p.seal(blocks, keys, tokens)
    assert asked == [] and resident_huge_bytes(p.k[0], p.v[0]) == 0   # sealing collapses nothing
    assert p.collapse_filled() == 4                # returns with the collapses held back
    assert p.collapse_filled() == 0                # each page once
    release.set()
    buffers.wait_for_collapses()
    assert len(asked) == 8 and {t for t, _ in asked} != {threading.current_thread()}
    assert [start for _, start in asked] == sorted(start for _, start in asked)
    np.testing.assert_array_equal(p.k[1][blocks], want_k)
    np.testing.assert_array_equal(p.v[2][blocks], want_v)
    assert resident_huge_bytes(p.k[0], p.v[0]) == 2 * 4 * buffers.HUGE_PAGE
