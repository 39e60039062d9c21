"""Bindings: int8 activation quantization and quantized-weight GEMM (codegen/quant.py, codegen/qgemm.py).

``quantize_q8_call`` / ``qgemm_call`` validate like the bindings and return
``(kernel symbol, integer arguments)`` instead of calling: what a plan
(runtime/plan.py) records for a worker thread, e.g. one ``rows`` range each.
"""
import numpy as np

from .. import validate as v
from ..layouts import PackedWeight
from ._lib import index_range, kernel

__all__ = ["quantize_q8", "qgemm"]

BLOCK = 32
GROUP = 8
QGEMM_TILE = "6x8"
ELEMENT_ALIGN = 4
# per kind: (name and dtype of the quant array, name of the f16 scale array, scale rows per block)
WEIGHT_ARRAYS = {"q4_1": (("qs", np.uint8), "dm", 2), "q8_0": (("qs", np.int8), "d", 1)}


def _block_count(name, k):
    if k % BLOCK:
        raise ValueError(f"{name}: k = {k} must be a multiple of {BLOCK} (quantization blocks)")
    return k // BLOCK


def quantize_q8(x, qs, d, s):
    """x f32 [m, k] -> qs int8 [m, k], d and s f32 [m, k/32] (GGUF Q8_0 blocks, s = d * sum(q))."""
    symbol, args = quantize_q8_call(x, qs, d, s)
    kernel(symbol)(*args)


def quantize_q8_call(x, qs, d, s):
    v.array("x", x, np.float32, ndim=2)
    m, k = x.shape
    kb = _block_count("x", k)
    v.array("qs", qs, np.int8, (m, k), writable=True)
    v.array("d", d, np.float32, (m, kb), writable=True)
    v.array("s", s, np.float32, (m, kb), writable=True)
    return "llb_quantize_q8_f32_32__avx2", [x.ctypes.data, qs.ctypes.data, d.ctypes.data, s.ctypes.data, m * kb]


def _check_weight(w, k):
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w: expected a PackedWeight, got {type(w).__name__}")
    if w.kind not in WEIGHT_ARRAYS:
        raise ValueError(f"w: qgemm needs a q4_1 or q8_0 weight, got kind {w.kind!r}")
    if w.k != k:
        raise ValueError(f"w: has k = {w.k} but the activations have k = {k}")
    if w.meta.get("group", GROUP) != GROUP:
        raise ValueError(f"w: packed with row groups of {w.meta.get('group')}, the kernels need {GROUP}")
    (quant_name, quant_dtype), scale_name, fields = WEIGHT_ARRAYS[w.kind]
    groups, kb = -(-w.n // GROUP), k // BLOCK
    quant_tail = (BLOCK // 2 // 4, GROUP, 4) if w.kind == "q4_1" else (BLOCK // 4, GROUP, 4)
    scale_tail = (fields, GROUP) if fields > 1 else (GROUP,)
    quants = v.array(f"w.{quant_name}", w.arrays.get(quant_name), quant_dtype, (groups, kb) + quant_tail)
    scales = v.array(f"w.{scale_name}", w.arrays.get(scale_name), np.float16, (groups, kb) + scale_tail)
    return quants, scales


def qgemm(qs, d, s, w, out, rows=None):
    """out[m, n0:n1] = dequant(qs, d) [m, k] . dequant(w)[n0:n1, k]^T; ``rows=(n0, n1)`` (n0 % 8 == 0).

    qs, d, s are quantize_q8's output (qs in [-127, 127]), or row slices of it; w a q4_1
    or q8_0 PackedWeight; out f32 [m, n]. Columns outside n0..n1 are not touched."""
    symbol, args = qgemm_call(qs, d, s, w, out, rows)
    kernel(symbol)(*args)


def qgemm_call(qs, d, s, w, out, rows=None):
    # The kernel broadcasts activations and stores outputs unaligned, so row slices of
    # them (e.g. the last token's row for the LM head) work; the weights need 32 bytes.
    v.array("qs", qs, np.int8, ndim=2, align=ELEMENT_ALIGN)
    m, k = qs.shape
    kb = _block_count("qs", k)
    v.array("d", d, np.float32, (m, kb), align=ELEMENT_ALIGN)
    v.array("s", s, np.float32, (m, kb), align=ELEMENT_ALIGN)
    quants, scales = _check_weight(w, k)
    v.array("out", out, np.float32, (m, w.n), writable=True, align=ELEMENT_ALIGN)
    n0, n1 = index_range("rows", rows, w.n, labels=("n0", "n1"), multiple=GROUP, why=" (the row group)")
    group0 = n0 // GROUP
    return f"llb_qgemm_{w.kind}_q8_{QGEMM_TILE}__avx2", [
        quants[group0].ctypes.data, scales[group0].ctypes.data, qs.ctypes.data, d.ctypes.data,
        s.ctypes.data, out.ctypes.data + 4 * n0, m, n1 - n0, kb, w.n]
