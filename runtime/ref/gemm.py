"""numpy references: the float linear layer C[m, n] = A[m, k] . W[n, k]^T."""
import numpy as np

from ..layout_float import dequantize

__all__ = ["gemm_f32", "gemm_f16", "gemm_bf16", "matmul_nt"]


def gemm_f32(x, w, out, rows=None):
    """In float64, rounded once to float32: how BLAS blocks a product depends on m, and at
    float32 that would make a row's result depend on its batch (the engine's invariance)."""
    n0, n1 = rows if rows is not None else (0, w.n)
    out[:, n0:n1] = x.astype(np.float64) @ dequantize(w)[n0:n1].astype(np.float64).T


def gemm_f16(x, w, out, rows=None):
    gemm_f32(x, w, out, rows)


def gemm_bf16(x, w, out, rows=None):
    gemm_f32(x, w, out, rows)


def matmul_nt(a, b, out):
    np.matmul(a, b.T, out=out)
