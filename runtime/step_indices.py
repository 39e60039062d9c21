"""``check_step_indices``: the guarantees the paged kernels trust, checked in Python.

The paged ops (runtime/ref/paged.py, runtime/native/paged.py) read positions, row_seq and
block tables from memory when a plan runs, so their bindings cannot check them; the caller
(llambda/serving/kv_pool.py) keeps them in range. This helper says whether it did, for debug runs
and tests: cheap (numpy over the step's rows), never on the hot path.
"""
import numpy as np

from ..codegen.contract import KV_BLOCK

__all__ = ["check_step_indices"]


def check_step_indices(positions, row_seq, tables, m, n_blocks, *, window=0, max_keys=None):
    """Raise ValueError unless rows 0..m-1 of a step index valid arena blocks: row_seq[i] names
    a table, positions[i] fits it (< max_blocks * KV_BLOCK, and < max_keys when given: the
    scratch's bound), and every block the row's keys live in (all keys j <= p, or the last
    ``window`` when window > 0) is in [0, n_blocks). Returns None."""
    positions = np.asarray(positions)[:m].astype(np.int64)
    row_seq = np.asarray(row_seq)[:m].astype(np.int64)
    tables = np.asarray(tables)
    if positions.shape != (m,) or row_seq.shape != (m,):
        raise ValueError(f"positions, row_seq: expected at least m={m} entries, got {positions.shape[0]} "
                         f"and {row_seq.shape[0]}")
    if tables.ndim != 2:
        raise ValueError(f"tables: expected [n_tables, max_blocks], got shape {tables.shape}")
    n_tables, max_blocks = tables.shape
    limit = max_blocks * KV_BLOCK if max_keys is None else min(max_blocks * KV_BLOCK, max_keys)
    for i in range(m):
        p, seq = positions[i], row_seq[i]
        if not 0 <= seq < n_tables:
            raise ValueError(f"row_seq[{i}] = {seq}: not a table (n_tables = {n_tables})")
        if not 0 <= p < limit:
            raise ValueError(f"positions[{i}] = {p}: expected 0 <= position < {limit} "
                             f"(max_blocks = {max_blocks} of {KV_BLOCK}"
                             f"{'' if max_keys is None else f', max_keys = {max_keys}'})")
        first = max(0, p - window + 1) if window else 0
        blocks = tables[seq, first // KV_BLOCK:p // KV_BLOCK + 1].astype(np.int64)
        bad = (blocks < 0) | (blocks >= n_blocks)
        if bad.any():
            j = first // KV_BLOCK + int(np.argmax(bad))
            raise ValueError(f"tables[{seq}, {j}] = {tables[seq, j]}: row {i} (position {p}) reads that block, "
                             f"expected 0 <= block < n_blocks = {n_blocks}")
