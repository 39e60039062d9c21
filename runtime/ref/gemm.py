"""numpy references: the float linear layer C[m, n] = A[m, k] . W[n, k]^T."""
import numpy as np

from ..layout_float import dequantize

__all__ = ["gemm_f32", "gemm_f16", "matmul_nt"]


def gemm_f32(x, w, out, rows=None):
    n0, n1 = rows if rows is not None else (0, w.n)
    out[:, n0:n1] = x @ dequantize(w)[n0:n1].T


def gemm_f16(x, w, out, rows=None):
    gemm_f32(x, w, out, rows)


def matmul_nt(a, b, out):
    np.matmul(a, b.T, out=out)
