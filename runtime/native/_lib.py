"""Shared by the bindings: typed kernel lookup, cached per symbol."""
import functools

from .. import library


@functools.lru_cache(maxsize=None)
def kernel(op_symbol):
    return library.load("avx2").fn(op_symbol)
