"""Shared by the bindings: typed kernel lookup, array addresses, split arguments.

A binding's ``<op>_call`` validates and returns ``(symbol, args)``; the op
itself is ``kernel(symbol)(*args)``. Decode runs hundreds of tiny kernels per
token, so what a valid call costs in Python matters: each array's address is
computed once (``checked_address``) and reused for the alignment check and the
kernel argument.
"""
import functools

import numpy as np

from .. import library
from .. import validate as v


@functools.lru_cache(maxsize=None)
def kernel(op_symbol):
    return library.load("avx2").fn(op_symbol)


# The address of an array's first element, cheaper than ``array.ctypes.data``
# (see validate.address, which the array checks share).
address = v.address


def checked_address(name, array, dtype, shape=None, *, align=32, writable=False, ndim=None, contiguous=True):
    """``validate.array``'s checks, then the array's address (checked for ``align``)."""
    v.array(name, array, dtype, shape, align=0, writable=writable, ndim=ndim, contiguous=contiguous)
    at = address(array)
    if align and at % align:
        raise ValueError(f"{name}: data must be {align}-byte aligned "
                         f"(address ends in {at % align:#x} mod {align}); "
                         f"allocate it with llambda.runtime.buffers")
    return at


def index_range(name, value, n, *, labels=("start", "stop"), limit=None, multiple=1, why=""):
    """``(start, stop)`` from a split argument such as ``rows=(r0, r1)``, or ``(0, n)`` for None.

    A split is a non-empty range of integers within ``[0, n)`` whose start is a
    multiple of ``multiple`` (``why`` says what that keeps apart). ``labels``
    name the two ends and ``limit`` the bound in messages (default ``n``)."""
    if value is None:
        return 0, n
    first, last = labels
    try:
        start, stop = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair ({first}, {last}), got {value!r}") from None
    for index, end in enumerate((start, stop)):
        if isinstance(end, bool) or not isinstance(end, (int, np.integer)):
            raise ValueError(f"{name}[{index}]: expected an integer, got {end!r}")
    start, stop = int(start), int(stop)
    if not 0 <= start < stop <= n:
        raise ValueError(f"{name}: expected 0 <= {first} < {last} <= {limit or n}, got {value!r}")
    if start % multiple:
        raise ValueError(f"{name}: {first} must be a multiple of {multiple}{why}, got {start}")
    return start, stop
