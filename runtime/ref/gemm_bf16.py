"""numpy reference: the BF16 linear layer (bf16 activations and weights, f32 sums) and the
rounding of its activations to bf16."""
from ..layout_bf16 import dequantize, from_bf16, to_bf16

__all__ = ["gemm_bf16_pairs", "round_bf16"]


def gemm_bf16_pairs(xb, w, out, rows=None):
    n0, n1 = rows if rows is not None else (0, w.n)
    out[:, n0:n1] = from_bf16(xb, w.k) @ dequantize(w)[n0:n1].T


def round_bf16(x, xb, rows=None):
    r0, r1 = rows if rows is not None else (0, x.shape[0])
    to_bf16(x[r0:r1], xb[r0:r1])
