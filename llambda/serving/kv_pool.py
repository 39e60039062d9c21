"""The paged KV cache: one preallocated arena of fixed-size blocks that every sequence shares.

Per layer the arena holds K and V as ``[n_blocks, n_kv_head, KV_BLOCK, head_dim]``; block b
of every layer belongs to the same sequence, so one block table per sequence (a row of
``tables``) serves all layers. The ops that read it are defined in runtime/ref/paged.py.
Each layer's K (and V) arena is a view of one buffer ``[n_layer, n_kv_head, n_blocks, ...]``
that keeps each (layer, KV head)'s blocks together: free blocks are handed out lowest first
(a heap, also after sequences have come and gone), so a sequence's tiles of one KV head in
one layer are one run in address order, which the attention kernel reads in order and the
prefetchers follow (a buffer holding block b of every layer together, as before, left runs
of one tile; docs/perf-journal/2026-12-06-2356-kv-cache-by-kv-head.md). Each 2 MiB of the buffers whose blocks have all been written is collapsed
into a huge page (``filled``, then ``collapse_filled`` once the engine has had nothing to run
for a while): fewer page walks, though with this layout only a pool whose blocks in use
outnumber a huge page's tiles fills whole ones.
A collapse is not free, though: with the pool's threads on both cores of a 2-vCPU VM one
took 5-70 ms (0.5 ms in a process of one thread), stalling or slowing the steps around it
(docs/architecture.md, "The KV cache in 2 MiB pages"); so none runs while sequences run. Resident memory stays what was written: a short context stays in small pages.

Blocks are handed out from a free list. A block whose KV_BLOCK positions are all computed
is *sealed*: it gets a key, a digest of its tokens chained to the key of the block before
it, so equal keys mean equal token prefixes (hence equal K/V: every kernel is batch
invariant). A new sequence whose prompt starts with sealed blocks shares them instead of
computing them again. Sealed blocks are reference counted; when the last sequence using
one ends, it stays cached on an LRU list and is evicted (reused) only when the free list is
empty, so a block in use is never evicted.

Block 0 is never handed out: table entries past a sequence's end and the padding rows of
a step point at it, and whatever they write there is never read by a real row.
"""
import hashlib
import heapq
from collections import OrderedDict

import numpy as np

from llambda.runtime import buffers
from llambda.runtime.buffers import HUGE_PAGE
from llambda.codegen.contract import KV_BLOCK, KV_Q8_BLOCK, kv_q8_row_bytes

TRASH_BLOCK = 0
# What a K or V row of the cache is stored as: the attention kernels read each type directly
# (runtime/ref/paged.py). f16 halves what a decode step reads at long contexts; q8_0 (int8
# quants, an f32 scale per 32) takes it to about a quarter.
KV_TYPES = ("f32", "f16", "q8_0")
DEFAULT_KV_TYPE = "f16"


def check_kv_type(kv_type, head_dim):
    """The KV type to use: ``kv_type`` (None: the default) if head_dim allows it. The default
    falls back to f32 where head_dim % 8 != 0 (the f16 kernels convert 8 values at a time);
    asking for a type the head width rules out is an error."""
    if kv_type is None:
        return DEFAULT_KV_TYPE if head_dim % 8 == 0 else "f32"
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type: expected one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    need = {"f32": 1, "f16": 8, "q8_0": KV_Q8_BLOCK}[kv_type]
    if head_dim % need:
        raise ValueError(f"kv_type: {kv_type} needs head_dim to be a multiple of {need}; this model's is {head_dim}")
    return kv_type


def _row(kv_type, head_dim):
    """(dtype, trailing row length) of one arena row."""
    if kv_type == "q8_0":
        return np.uint8, kv_q8_row_bytes(head_dim)
    return (np.float16 if kv_type == "f16" else np.float32), head_dim


class KVPool:
    def __init__(self, config, n_blocks, max_tables, max_ctx, kv_type="f32"):
        c = config
        if n_blocks < 2:
            raise ValueError(f"n_blocks: the KV pool needs at least 2 blocks, got {n_blocks}")
        self.n_blocks = n_blocks
        self.kv_type = kv_type = check_kv_type(kv_type, c.head_dim)
        self.max_blocks = -(-max_ctx // KV_BLOCK)           # blocks per sequence at most
        dtype, row = _row(kv_type, c.head_dim)
        by_head = (c.n_layer, c.n_kv_head, n_blocks, KV_BLOCK, row)
        self._k_blocks = buffers.zeros_growing(by_head, dtype)
        self._v_blocks = buffers.zeros_growing(by_head, dtype)
        # layer l's arena [n_blocks, n_kv_head, KV_BLOCK, row]: tiles 1 apart from block to
        # block, n_blocks from KV head to KV head (the kernels take both strides)
        self.k = [self._k_blocks[layer].transpose(1, 0, 2, 3) for layer in range(c.n_layer)]
        self.v = [self._v_blocks[layer].transpose(1, 0, 2, 3) for layer in range(c.n_layer)]
        self._written = np.zeros(n_blocks, bool)            # every position of the block stored
        self._written[TRASH_BLOCK] = True                   # padding rows store there every step
        self._filled_pages = []                             # whole huge pages not collapsed yet
        self._tile_bytes = self._k_blocks[0, 0, 0].nbytes   # KV_BLOCK rows of one KV head
        # where each (layer, KV head)'s run of tiles starts in the buffers (K's and V's alike)
        self._runs_at = np.arange(c.n_layer * c.n_kv_head, dtype=np.int64) * n_blocks * self._tile_bytes
        self._page_blocks_left = self._unwritten_blocks_per_page(self._k_blocks.nbytes)
        self.nbytes = n_blocks * self.block_bytes(c, kv_type)
        # one block table per running sequence, and a spare one (all TRASH) for padding rows
        self.tables = buffers.zeros((max_tables + 1, self.max_blocks), np.int32)
        self.pad_table = max_tables
        self._free_tables = list(range(max_tables - 1, -1, -1))
        self._free = list(range(TRASH_BLOCK + 1, n_blocks))    # a heap: the lowest first
        self._refs = np.zeros(n_blocks, np.int64)
        self._key_of = {}                 # sealed block -> key
        self._block_of = {}               # key -> sealed block
        self._idle = OrderedDict()        # sealed blocks no sequence uses, least recently used first

    # -- accounting -------------------------------------------------------------
    @property
    def blocks_in_use(self):
        """Blocks some sequence holds (cached idle blocks and block 0 not counted)."""
        return self.n_blocks - 1 - len(self._free) - len(self._idle)

    @property
    def available(self):
        return len(self._free) + len(self._idle)

    @property
    def tables_available(self):
        return len(self._free_tables)

    @staticmethod
    def block_bytes(config, kv_type="f32"):
        """Bytes of one block: K and V of KV_BLOCK positions in every layer."""
        dtype, row = _row(check_kv_type(kv_type, config.head_dim), config.head_dim)
        return 2 * config.n_layer * config.n_kv_head * KV_BLOCK * row * np.dtype(dtype).itemsize

    @staticmethod
    def blocks_for(n_positions):
        return -(-n_positions // KV_BLOCK)

    # -- sequences --------------------------------------------------------------
    def open(self, tokens, reserve):
        """A table row and blocks for a sequence whose first positions hold ``tokens``, with room
        for ``reserve`` positions in all: ``(table, blocks, keys, cached_tokens)``, the leading
        blocks shared from the cache where their tokens match (never the block of the last
        token: its logits must be computed). None when the pool cannot hold it now."""
        need = self.blocks_for(reserve)
        if need > self.max_blocks or not self._free_tables:
            return None
        shared, keys, key = [], [], b""
        for b in range((len(tokens) - 1) // KV_BLOCK):
            key = block_key(key, tokens[b * KV_BLOCK:(b + 1) * KV_BLOCK])
            block = self._block_of.get(key)
            if block is None:
                break
            shared.append(block)
            keys.append(key)
        fresh = need - len(shared)
        idle_shared = sum(1 for b in shared if b in self._idle)
        if fresh > self.available - idle_shared:
            return None
        for block in shared:
            self._idle.pop(block, None)
            self._refs[block] += 1
        blocks = shared + [self._take() for _ in range(fresh)]
        table = self._free_tables.pop()
        self.tables[table, :] = TRASH_BLOCK
        self.tables[table, :len(blocks)] = blocks
        return table, blocks, keys, len(shared) * KV_BLOCK

    def seal(self, blocks, keys, tokens, computed=None):
        """Give every block whose positions the first ``computed`` (default all) of ``tokens``
        fill a key, extending ``keys`` (one per sealed block so far); a block whose key
        another block already holds stays private."""
        computed = len(tokens) if computed is None else computed
        while (len(keys) + 1) * KV_BLOCK <= computed:
            b = len(keys)
            key = block_key(keys[-1] if keys else b"", tokens[b * KV_BLOCK:(b + 1) * KV_BLOCK])
            keys.append(key)
            block = blocks[b]
            self.filled([block])
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def close(self, table, blocks):
        """Give back a sequence's table row and blocks: sealed ones stay cached, idle."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                heapq.heappush(self._free, block)
        self.tables[table, :] = TRASH_BLOCK
        self._free_tables.append(table)

    def _unwritten_blocks_per_page(self, nbytes):
        """For each whole huge page of a buffer of ``nbytes`` (K's and V's are alike), how many
        distinct blocks its tiles belong to are not written yet (block 0 is): tile t of the
        buffer is block t % n_blocks, and a page holds consecutive tiles."""
        tile, n = self._tile_bytes, self.n_blocks
        pages = nbytes // HUGE_PAGE                      # zeros_growing: from a huge page's start
        start = np.arange(pages, dtype=np.int64) * HUGE_PAGE
        lo, hi = start // tile, (start + HUGE_PAGE - 1) // tile + 1      # the tiles a page touches
        blocks = np.minimum(hi - lo, n)
        holds_trash = (hi - lo >= n) | (-(-lo // n) * n < hi)            # a tile t with t % n == 0
        return blocks - holds_trash

    def filled(self, blocks):
        """Note that every position of ``blocks`` has been stored (``seal`` does, for the
        engine's sequences): each huge page of the buffers whose blocks are now all written
        waits for ``collapse_filled``, once."""
        new = sorted({b for b in blocks if not self._written[b]})
        if not new:
            return
        self._written[new] = True
        left = self._page_blocks_left
        if not len(left):
            return
        tile = self._tile_bytes
        for block in new:
            first = self._runs_at + block * tile                         # the block's tile in each run
            touched = np.unique(np.concatenate([first // HUGE_PAGE, (first + tile - 1) // HUGE_PAGE]))
            touched = touched[touched < len(left)]
            left[touched] -= 1
            self._filled_pages.extend(int(p) for p in touched[left[touched] == 0])

    @property
    def has_filled_pages(self):
        """Whether ``collapse_filled`` has pages to hand over."""
        return bool(self._filled_pages)

    def collapse_filled(self):
        """Collapse each whole huge page of K and V that ``filled`` found written, on the
        background thread of ``buffers.collapse_later`` (nothing waits for it). The engine
        calls this when it has had nothing to run for a while; returns how many pages were
        handed over."""
        pages, self._filled_pages = self._filled_pages, []
        for page in pages:
            for buffer in (self._k_blocks, self._v_blocks):
                buffers.collapse_later(buffer, page * HUGE_PAGE, (page + 1) * HUGE_PAGE)
        return len(pages)

    def _take(self):
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._idle.popitem(last=False)       # evict the least recently used
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block


def block_key(previous, tokens):
    """The key of a block of ``tokens`` following the block keyed ``previous`` (b"" for the first)."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(np.asarray(tokens, np.int32).tobytes())
    return digest.digest()
