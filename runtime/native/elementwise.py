"""Bindings: elementwise and row-wise FP32 kernels.

Elementwise ops take arrays of any shape (same shape for every operand).
Row-wise ops (rmsnorm, softmax) work on the last axis, one kernel call for all
rows. An output may be the very same array as an input (in place); an output
that partly overlaps an input is refused, since the kernels would read values
they already overwrote.

Every op has an ``<op>_call`` twin that validates the same way and returns
``(kernel symbol, args)`` in the kernel's C argument order (pointers and sizes
as ints, float arguments as floats) instead of calling: what a plan
(runtime/plan.py) records. Its split argument restricts the call to one
thread's share: ``span=(i0, i1)``, an element range of the flattened arrays,
for the elementwise ops (i0 a multiple of 16, so threads never write the same
64-byte line); ``rows=(r0, r1)`` for the row-wise ops, add_bias and RoPE (tokens). The ``_call`` functions are not in
``__all__``: the backend namespaces hold the ops only.
"""
import numpy as np

from .. import validate as v
from ..ref.elementwise import ROPE_STYLES, rope_tables
from ._lib import address, checked_address, index_range, kernel

__all__ = ["add", "scale", "exp", "silu_mul", "gelu_mul", "add_bias", "rmsnorm", "softmax", "rope", "rope_tables"]

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
FLOAT_BYTES = 4
# Span starts are multiples of 16 floats: 64 bytes, one cache line of a 64-byte aligned buffer.
SPAN_MULTIPLE = 16
_SPAN_WHY = " (16 floats, a 64-byte cache line)"


def _output(name, out, shape, inputs, disjoint=()):
    """Check ``out`` like an input, writable, and either identical to or disjoint from each
    of ``inputs``, and disjoint from each of ``disjoint`` (inputs read again after out is written).
    Returns its address."""
    out_at = checked_address(name, out, F32, shape, writable=True)
    for input_name, array in inputs:
        if array is out or not np.may_share_memory(array, out):
            continue
        if address(array) != out_at or array.shape != out.shape:
            raise ValueError(f"{name}: overlaps {input_name} without being the same array "
                             "(in place needs out to be exactly the input)")
    for input_name, array in disjoint:
        if np.may_share_memory(array, out):
            raise ValueError(f"{name}: overlaps {input_name}, which the kernel reads throughout")
    return out_at


def _rows(name, x):
    """Validate a row-wise input; returns (its address, rows, row length)."""
    x_at = checked_address(name, x, F32)
    if x.ndim < 1:
        raise ValueError(f"{name}: expected at least one dimension, got a scalar")
    return x_at, x.size // x.shape[-1], x.shape[-1]


def _span(span, n):
    return index_range("span", span, n, labels=("i0", "i1"), multiple=SPAN_MULTIPLE, why=_SPAN_WHY)


def _row_range(rows, n):
    return index_range("rows", rows, n, labels=("r0", "r1"))


def _check_positions(positions, n_ctx, what):
    """Every position in [0, n_ctx) (``what`` names the rows they index)."""
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= n_ctx:
        raise ValueError(f"positions: expected values in [0, {n_ctx}) ({what}), got {low}..{high}")


def _stream_call(symbol, inputs, out, span, floats=()):
    """An elementwise op's call: checks the f32 ``inputs`` ((name, array), all of the first's
    shape), then the ``floats`` ((name, value), finite), then ``out`` (each input identical to
    it or disjoint) and ``span``; returns (symbol, args): the inputs and out at the span's
    first element, the floats between them, and the span's length."""
    return _stream_calls(symbol, inputs, out, [span], floats)[0]


def _stream_calls(symbol, inputs, out, spans, floats=()):
    """``_stream_call`` for each span of ``spans``, the arrays checked once."""
    (first_name, first), *others = inputs
    addresses = [checked_address(first_name, first, F32)]
    addresses += [checked_address(name, array, F32, first.shape) for name, array in others]
    values = [v.finite_float(name, value) for name, value in floats]
    out_at = _output("out", out, first.shape, inputs)
    calls = []
    for span in spans:
        i0, i1 = _span(span, first.size)
        skip = FLOAT_BYTES * i0
        calls.append((symbol, [at + skip for at in addresses] + values + [out_at + skip, i1 - i0]))
    return calls


def _row_call(symbol, x, out, rows, vectors=(), scalars=()):
    """A row-wise op's call over the rows of x [..., n]: checks x, then the ``vectors``
    ((name, array), each [n] and read by every row, so out may not overlap them), then the
    ``scalars`` (functions returning a checked float: they run in this order), then ``out``
    (x itself or disjoint) and ``rows``; returns (symbol, args): x, the vectors, out, the
    row count, n and the scalars."""
    return _row_calls(symbol, x, out, [rows], vectors, scalars)[0]


def _row_calls(symbol, x, out, row_ranges, vectors=(), scalars=()):
    """``_row_call`` for each range of ``row_ranges``, the arrays checked once."""
    x_at, n_rows, n = _rows("x", x)
    addresses = [checked_address(name, array, F32, (n,)) for name, array in vectors]
    values = [check() for check in scalars]
    out_at = _output("out", out, x.shape, [("x", x)], disjoint=vectors)
    calls = []
    for rows in row_ranges:
        r0, r1 = _row_range(rows, n_rows)
        skip = FLOAT_BYTES * n * r0
        calls.append((symbol, [x_at + skip] + addresses + [out_at + skip, r1 - r0, n] + values))
    return calls


def _positive(name, value):
    value = v.finite_float(name, value)
    if value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    return value


# --------------------------------------------------------------------------- elementwise

def add(a, b, out):
    """out = a + b."""
    symbol, args = add_call(a, b, out)
    kernel(symbol)(*args)


def add_call(a, b, out, span=None):
    return _stream_call("llb_add_f32__avx2", [("a", a), ("b", b)], out, span)


def add_calls(a, b, out, spans):
    """One ``add_call`` per span, the arrays checked once (a plan's chunks of one op)."""
    return _stream_calls("llb_add_f32__avx2", [("a", a), ("b", b)], out, spans)


def scale(x, s, out):
    """out = x * s (s a Python float, rounded to float32)."""
    symbol, args = scale_call(x, s, out)
    kernel(symbol)(*args)


def scale_call(x, s, out, span=None):
    return _stream_call("llb_scale_f32__avx2", [("x", x)], out, span, floats=[("s", s)])


def scale_calls(x, s, out, spans):
    return _stream_calls("llb_scale_f32__avx2", [("x", x)], out, spans, floats=[("s", s)])


def exp(x, out):
    """out = exp(x); below ~-87 gives 0, above ~88.72 gives inf (see codegen/vmath.py)."""
    symbol, args = exp_call(x, out)
    kernel(symbol)(*args)


def exp_call(x, out, span=None):
    return _stream_call("llb_exp_f32__avx2", [("x", x)], out, span)


def silu_mul(gate, up, out):
    """out = gate / (1 + exp(-gate)) * up: SwiGLU's SiLU(gate) * up."""
    symbol, args = silu_mul_call(gate, up, out)
    kernel(symbol)(*args)


def silu_mul_call(gate, up, out, span=None):
    return _stream_call("llb_silu_mul_f32__avx2", [("gate", gate), ("up", up)], out, span)


def silu_mul_calls(gate, up, out, spans):
    return _stream_calls("llb_silu_mul_f32__avx2", [("gate", gate), ("up", up)], out, spans)


def gelu_mul(gate, up, out):
    """out = gelu_tanh(gate) * up: GeGLU's GELU (tanh approximation) of gate, times up.

    gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); any finite or
    infinite gate gives a finite-or-inf result, never NaN (see codegen/elementwise.py)."""
    symbol, args = gelu_mul_call(gate, up, out)
    kernel(symbol)(*args)


def gelu_mul_call(gate, up, out, span=None):
    return _stream_call("llb_gelu_mul_f32__avx2", [("gate", gate), ("up", up)], out, span)


def gelu_mul_calls(gate, up, out, spans):
    return _stream_calls("llb_gelu_mul_f32__avx2", [("gate", gate), ("up", up)], out, spans)


# --------------------------------------------------------------------------- row-wise

def add_bias(x, bias, out):
    """out[i] = x[i] + bias for every row i of x [..., n]; bias is [n]; out may be x."""
    symbol, args = add_bias_call(x, bias, out)
    kernel(symbol)(*args)


def add_bias_call(x, bias, out, rows=None):
    return _row_call("llb_add_bias_f32__avx2", x, out, rows, vectors=[("bias", bias)])


def add_bias_calls(x, bias, out, row_ranges):
    return _row_calls("llb_add_bias_f32__avx2", x, out, row_ranges, vectors=[("bias", bias)])


def rmsnorm(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for every row i of x [..., d]; w is [d]."""
    symbol, args = rmsnorm_call(x, w, eps, out)
    kernel(symbol)(*args)


def rmsnorm_call(x, w, eps, out, rows=None):
    return _row_call("llb_rmsnorm_f32__avx2", x, out, rows, vectors=[("w", w)],
                     scalars=[lambda: _positive("eps", eps)])


def rmsnorm_calls(x, w, eps, out, row_ranges):
    return _row_calls("llb_rmsnorm_f32__avx2", x, out, row_ranges, vectors=[("w", w)],
                      scalars=[lambda: _positive("eps", eps)])


def softmax(x, out):
    """Row-wise softmax over the last axis of x, max-subtracted; out may be x. -inf gives 0."""
    symbol, args = softmax_call(x, out)
    kernel(symbol)(*args)


def softmax_call(x, out, rows=None):
    return _row_call("llb_softmax_f32__avx2", x, out, rows)


def rope(x, positions, cos, sin, style, out):
    """Rotary embedding of x [m, n_heads, head_dim] at positions [m], tables from rope_tables.

    out = x*cos[pos] + partner(x)*sin[pos], partner by ``style``; out may be x."""
    symbol, args = rope_call(x, positions, cos, sin, style, out)
    kernel(symbol)(*args)


def rope_call(x, positions, cos, sin, style, out, rows=None):
    """``rows=(t0, t1)``: tokens t0..t1-1 of x. The kernel reads the positions from
    memory when it runs, so a plan may rewrite them between runs; it must keep
    them within the tables (they are checked here, once)."""
    return rope_calls(x, positions, cos, sin, style, out, [rows])[0]


def rope_calls(x, positions, cos, sin, style, out, row_ranges):
    """One ``rope_call`` per range of ``row_ranges``, the arrays checked once."""
    if style not in ROPE_STYLES:
        raise ValueError(f"style: expected one of {ROPE_STYLES}, got {style!r}")
    x_at = checked_address("x", x, F32, ndim=3)
    m, n_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim (last dimension) must be even, got {head_dim}")
    positions_at = checked_address("positions", positions, I32, (m,), align=4)
    cos_at = checked_address("cos", cos, F32, (None, head_dim))
    sin_at = checked_address("sin", sin, F32, cos.shape)
    _check_positions(positions, cos.shape[0], "the tables' rows")
    out_at = _output("out", out, x.shape, [("x", x)], disjoint=[("cos", cos), ("sin", sin)])
    calls = []
    for rows in row_ranges:
        t0, t1 = _row_range(rows, m)
        skip = FLOAT_BYTES * n_heads * head_dim * t0
        calls.append((f"llb_rope_{style}_f32__avx2", [x_at + skip, positions_at + 4 * t0, cos_at, sin_at,
                                                      out_at + skip, t1 - t0, n_heads, head_dim]))
    return calls
