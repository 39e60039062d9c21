"""Bindings: elementwise and row-wise FP32 kernels."""
import numpy as np

from .. import validate as v
from ._lib import kernel

__all__ = ["add"]


def add(a, b, out):
    v.array("a", a, np.float32)
    v.array("b", b, np.float32, a.shape)
    v.array("out", out, np.float32, a.shape, writable=True)
    kernel("llb_add_f32__avx2")(a.ctypes.data, b.ctypes.data, out.ctypes.data, a.size)
