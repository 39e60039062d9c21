"""Shared by the bindings: typed kernel lookup, array addresses, split arguments.

A binding's ``<op>_call`` validates and returns ``(symbol, args)``; the op
itself is ``kernel(symbol)(*args)``. Decode runs hundreds of tiny kernels per
token, so what a valid call costs in Python matters: each array's address is
computed once (``checked_address``) and reused for the alignment check and the
kernel argument.
"""
import ctypes
import functools

import numpy as np

from .. import library
from .. import validate as v


@functools.lru_cache(maxsize=None)
def kernel(op_symbol):
    return library.load("avx2").fn(op_symbol)


def address(array):
    """The address of ``array``'s first element, as an int.

    ``array.ctypes.data`` builds a helper object and a ctypes pointer (~0.45 us
    with numpy 2.4, more than half of what an array check costs; numpy's
    ``__array_interface__`` builds a dict and is no cheaper). Viewing a
    writable, contiguous buffer as a ctypes char takes ~0.2 us; anything else
    (read-only weights, views with strides, empty arrays) takes the general path."""
    flags = array.flags
    if flags.writeable and flags.c_contiguous and array.size:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


def checked_address(name, array, dtype, shape=None, *, align=32, writable=False, ndim=None):
    """``validate.array``'s checks, then the array's address (checked for ``align``)."""
    v.array(name, array, dtype, shape, align=0, writable=writable, ndim=ndim)
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
