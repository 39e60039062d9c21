"""Bindings: elementwise and row-wise FP32 kernels.

Elementwise ops take arrays of any shape (same shape for every operand).
Row-wise ops (rmsnorm, softmax) work on the last axis, one kernel call for all
rows. An output may be the very same array as an input (in place); an output
that partly overlaps an input is refused, since the kernels would read values
they already overwrote.
"""
import numpy as np

from .. import validate as v
from ..ref.elementwise import ROPE_STYLES, rope_tables
from ._lib import kernel

__all__ = ["add", "scale", "exp", "silu_mul", "rmsnorm", "softmax", "rope", "rope_tables"]


def _output(name, out, shape, inputs, disjoint=()):
    """Check ``out`` like an input, writable, and either identical to or disjoint from each
    of ``inputs``, and disjoint from each of ``disjoint`` (inputs read again after out is written)."""
    v.array(name, out, np.float32, shape, writable=True)
    for input_name, array in inputs:
        identical = array.ctypes.data == out.ctypes.data and array.shape == out.shape
        if not identical and np.may_share_memory(array, out):
            raise ValueError(f"{name}: overlaps {input_name} without being the same array "
                             "(in place needs out to be exactly the input)")
    for input_name, array in disjoint:
        if np.may_share_memory(array, out):
            raise ValueError(f"{name}: overlaps {input_name}, which the kernel reads throughout")
    return out


def _rows(name, x):
    """Validate a row-wise input; returns (rows, row length)."""
    v.array(name, x, np.float32)
    if x.ndim < 1:
        raise ValueError(f"{name}: expected at least one dimension, got a scalar")
    return x.size // x.shape[-1], x.shape[-1]


def add(a, b, out):
    v.array("a", a, np.float32)
    v.array("b", b, np.float32, a.shape)
    _output("out", out, a.shape, [("a", a), ("b", b)])
    kernel("llb_add_f32__avx2")(a.ctypes.data, b.ctypes.data, out.ctypes.data, a.size)


def scale(x, s, out):
    """out = x * s (s a Python float, rounded to float32)."""
    v.array("x", x, np.float32)
    s = v.finite_float("s", s)
    _output("out", out, x.shape, [("x", x)])
    kernel("llb_scale_f32__avx2")(x.ctypes.data, s, out.ctypes.data, x.size)


def exp(x, out):
    """out = exp(x); below ~-87 gives 0, above ~88.72 gives inf (see codegen/vmath.py)."""
    v.array("x", x, np.float32)
    _output("out", out, x.shape, [("x", x)])
    kernel("llb_exp_f32__avx2")(x.ctypes.data, out.ctypes.data, x.size)


def silu_mul(gate, up, out):
    """out = gate / (1 + exp(-gate)) * up: SwiGLU's SiLU(gate) * up."""
    v.array("gate", gate, np.float32)
    v.array("up", up, np.float32, gate.shape)
    _output("out", out, gate.shape, [("gate", gate), ("up", up)])
    kernel("llb_silu_mul_f32__avx2")(gate.ctypes.data, up.ctypes.data, out.ctypes.data, gate.size)


def rmsnorm(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for every row i of x [..., d]; w is [d]."""
    rows, d = _rows("x", x)
    v.array("w", w, np.float32, (d,))
    eps = v.finite_float("eps", eps)
    if eps <= 0:
        raise ValueError(f"eps: expected a number > 0, got {eps!r}")
    _output("out", out, x.shape, [("x", x)], disjoint=[("w", w)])
    kernel("llb_rmsnorm_f32__avx2")(x.ctypes.data, w.ctypes.data, out.ctypes.data, rows, d, eps)


def softmax(x, out):
    """Row-wise softmax over the last axis of x, max-subtracted; out may be x. -inf gives 0."""
    rows, n = _rows("x", x)
    _output("out", out, x.shape, [("x", x)])
    kernel("llb_softmax_f32__avx2")(x.ctypes.data, out.ctypes.data, rows, n)


def rope(x, positions, cos, sin, style, out):
    """Rotary embedding of x [m, n_heads, head_dim] at positions [m], tables from rope_tables.

    out = x*cos[pos] + partner(x)*sin[pos], partner by ``style``; out may be x."""
    if style not in ROPE_STYLES:
        raise ValueError(f"style: expected one of {ROPE_STYLES}, got {style!r}")
    v.array("x", x, np.float32, ndim=3)
    m, n_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim (last dimension) must be even, got {head_dim}")
    v.array("positions", positions, np.int32, (m,), align=4)
    v.array("cos", cos, np.float32, (None, head_dim))
    v.array("sin", sin, np.float32, cos.shape)
    n_ctx = cos.shape[0]
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= n_ctx:
        raise ValueError(f"positions: expected values in [0, {n_ctx}) (the tables' rows), "
                         f"got {low}..{high}")
    _output("out", out, x.shape, [("x", x)], disjoint=[("cos", cos), ("sin", sin)])
    symbol = f"llb_rope_{style}_f32__avx2"
    kernel(symbol)(x.ctypes.data, positions.ctypes.data, cos.ctypes.data, sin.ctypes.data,
                   out.ctypes.data, m, n_heads, head_dim)
