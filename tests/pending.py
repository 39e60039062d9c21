"""What main cannot run yet, and the branch each waits for: one table for the tests
that compare with llama.cpp (tests/test_llamacpp_referee.py, tests/test_real_files.py).

A case whose architecture or any tensor type is listed is marked xfail (not
strict). Delete a row when its branch merges.
"""
import pytest

PENDING = {
    "Q4_K": "Q4_K tensors (kq32 branch)",
    "Q5_K": "Q5_K tensors (kq32 branch)",
}


def pending_reason(names, table=None):
    """Why a case of these names (an architecture, tensor types) cannot pass yet, or None."""
    table = PENDING if table is None else table
    reasons = [table[name] for name in dict.fromkeys(names) if name in table]
    return "needs " + "; ".join(reasons) if reasons else None


def pending_marks(names, table=None):
    """[xfail mark] if any of `names` is pending, else []."""
    reason = pending_reason(names, table)
    return [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
