"""llambda.runtime: buffers, formats and kernels -- not models.

``get_backend()`` returns the kernel backend chosen by ``LLAMBDA_BACKEND``
(``avx2`` or ``numpy``; default: ``avx2`` when the CPU has AVX2+FMA+F16C).
"""
from .backend import get_backend, BackendError  # noqa: F401
