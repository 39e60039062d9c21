"""Aligned numpy buffers: every kernel operand starts on a 64-byte boundary.

The kernels require 32-byte alignment (aligned ymm loads); we give 64 so that
buffers handed to different threads never share a cache line at their start.
"""
import numpy as np

ALIGNMENT = 64


def empty(shape, dtype=np.float32, align=ALIGNMENT):
    return _aligned(np.empty, shape, dtype, align)


def zeros(shape, dtype=np.float32, align=ALIGNMENT):
    """Zeros that cost nothing until written: numpy's zeros is calloc, which takes a
    large block as fresh pages from the kernel (already zero, not yet resident), so a
    KV cache sized for the whole context only becomes memory where positions are stored."""
    return _aligned(np.zeros, shape, dtype, align)


def _aligned(allocate, shape, dtype, align):
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def full(shape, value, dtype=np.float32, align=ALIGNMENT):
    out = empty(shape, dtype, align)
    out[...] = value
    return out


def aligned_copy(array, dtype=None, align=ALIGNMENT):
    array = np.asarray(array, dtype=dtype)
    out = empty(array.shape, array.dtype, align)
    out[...] = array
    return out


def is_aligned(array, align=32):
    return array.ctypes.data % align == 0
