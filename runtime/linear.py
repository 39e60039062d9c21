"""The linear layer ``out = x . W^T`` for any packed weight kind, on one backend.

Which op multiplies a kind, and with what activations, comes from the traits
table (runtime/kinds.py). Quantized kinds multiply int8-quantized activations:
``Linear.load(x)`` remembers the activations and quantizes them at most once,
on the first quantized weight that needs them, so Q, K and V (or gate and up)
share one quantization. Kind bf16_pairs multiplies them rounded to bf16, rounded
once the same way. The other float kinds take x as is.
"""
import numpy as np

from . import buffers
from ..codegen.contract import BLOCK as QUANT_BLOCK
from .kinds import traits
from .layout_bf16 import k_pairs


class Linear:
    def __init__(self, backend, max_m, max_k):
        self.backend = backend
        blocks = max_m * -(-max_k // QUANT_BLOCK)
        self._qs = buffers.empty(blocks * QUANT_BLOCK, np.int8)
        self._d = buffers.empty(blocks, np.float32)
        self._s = buffers.empty(blocks, np.float32)
        # bf16 activations: an anonymous mapping, so a model without bf16_pairs weights never
        # touches (or pays for) its pages
        self._xb = buffers.empty(max_m * 2 * k_pairs(max_k), np.uint16)
        self._x = None
        self._act = None
        self._rounded_x = None

    def on(self, backend):
        """The same layer (same quantization buffers) sending its ops to ``backend``,
        e.g. a runtime.recorder.PlanRecorder."""
        twin = Linear.__new__(Linear)
        twin.__dict__.update(self.__dict__)
        twin.backend = backend
        twin._x = twin._act = twin._rounded_x = None
        return twin

    def load(self, x):
        """Set the activations [m, k] the next ``apply`` calls multiply."""
        self._x = x
        self._act = None
        self._rounded_x = None

    def _quantized(self):
        if self._act is None:
            m, k = self._x.shape
            nb = k // QUANT_BLOCK
            qs = self._qs[:m * k].reshape(m, k)
            d = self._d[:m * nb].reshape(m, nb)
            s = self._s[:m * nb].reshape(m, nb)
            self.backend.quantize_q8(self._x, qs, d, s)
            self._act = (qs, d, s)
        return self._act

    def _rounded(self):
        if self._rounded_x is None:
            m, k = self._x.shape
            xb = self._xb[:m * 2 * k_pairs(k)].reshape(m, 2 * k_pairs(k))
            self.backend.round_bf16(self._x, xb)
            self._rounded_x = (xb,)
        return self._rounded_x

    def apply(self, w, out):
        """out[m, n] = x[m, k] . W[n, k]^T for the loaded x."""
        t = traits(w.kind)
        if t.activation == "q8":
            activations = self._quantized()
        elif t.activation == "bf16":
            activations = self._rounded()
        else:
            activations = (self._x,)
        getattr(self.backend, t.linear)(*activations, w, out)

    def __call__(self, x, w, out):
        self.load(x)
        self.apply(w, out)
