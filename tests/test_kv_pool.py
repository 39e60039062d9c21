"""The paged KV cache's bookkeeping (llambda/kv_pool.py): blocks, tables, sharing, eviction."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llambda.codegen.contract import KV_BLOCK
from llambda.kv_pool import TRASH_BLOCK, KVPool

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
