"""The linear layer ``out = x . W^T`` for any packed weight kind, on one backend.

Quantized weights (``q4_1``, ``q8_0``) multiply int8-quantized activations:
``Linear.load(x)`` remembers the activations and quantizes them at most once,
on the first quantized weight that needs them, so Q, K and V (or gate and up)
share one quantization. Float weights (``f32``, ``f16``) take x as is.
"""
import numpy as np

from . import buffers

QUANT_BLOCK = 32
QUANT_KINDS = ("q4_1", "q8_0")


class Linear:
    def __init__(self, backend, max_m, max_k):
        self.backend = backend
        blocks = max_m * -(-max_k // QUANT_BLOCK)
        self._qs = buffers.empty(blocks * QUANT_BLOCK, np.int8)
        self._d = buffers.empty(blocks, np.float32)
        self._s = buffers.empty(blocks, np.float32)
        self._x = None
        self._act = None

    def on(self, backend):
        """The same layer (same quantization buffers) sending its ops to ``backend``,
        e.g. a runtime.recorder.PlanRecorder."""
        twin = Linear.__new__(Linear)
        twin.__dict__.update(self.__dict__)
        twin.backend = backend
        twin._x = twin._act = None
        return twin

    def load(self, x):
        """Set the activations [m, k] the next ``apply`` calls multiply."""
        self._x = x
        self._act = None

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

    def apply(self, w, out):
        """out[m, n] = x[m, k] . W[n, k]^T for the loaded x."""
        if w.kind in QUANT_KINDS:
            qs, d, s = self._quantized()
            self.backend.qgemm(qs, d, s, w, out)
        elif w.kind == "f32":
            self.backend.gemm_f32(self._x, w, out)
        elif w.kind == "f16":
            self.backend.gemm_f16(self._x, w, out)
        else:
            raise ValueError(f"weight kind {w.kind!r} has no linear kernel")

    def __call__(self, x, w, out):
        self.load(x)
        self.apply(w, out)
