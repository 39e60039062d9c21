"""Backend selection: the AVX2 kernels, or the numpy references with the same API.

Both backends are namespaces of functions with identical signatures
(``add(a, b, out)``, ...), collected from the ``__all__`` of every module in
``runtime/native/`` and ``runtime/ref/``. Outputs are always passed in: the
model preallocates every buffer once.

``LLAMBDA_BACKEND=numpy|avx2`` chooses explicitly; by default the AVX2 backend
is used when the CPU can run it, the numpy one otherwise.
"""
import functools
import importlib
import os
import pkgutil
import types

from llambda.errors import UserError

from . import cpu


class BackendError(UserError, RuntimeError):
    """LLAMBDA_BACKEND names no backend this CPU runs: one line, not a traceback."""


def _collect(package_name, name, runs_plans):
    package = importlib.import_module(package_name)
    # runs_plans: the model records its ops into plans for the worker pool (native kernels),
    # rather than calling them one by one (the numpy references)
    ns = types.SimpleNamespace(name=name, runs_plans=runs_plans)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package_name}.{info.name}")
        for attr in getattr(module, "__all__", ()):
            if hasattr(ns, attr):
                raise BackendError(f"{package_name}: {attr} defined twice")
            setattr(ns, attr, getattr(module, attr))
    return ns


@functools.lru_cache(maxsize=None)
def get_backend(name=None):
    """The backend ``name`` (``"avx2"`` or ``"numpy"``), default from ``LLAMBDA_BACKEND``."""
    name = name or os.environ.get("LLAMBDA_BACKEND") or ("avx2" if cpu.supports("avx2") else "numpy")
    if name == "numpy":
        return _collect("llambda.runtime.ref", "numpy", runs_plans=False)
    if name == "avx2":
        missing = cpu.missing_flags("avx2")
        if missing:
            raise BackendError(f"LLAMBDA_BACKEND=avx2 but this CPU lacks {', '.join(missing)}; "
                               "use LLAMBDA_BACKEND=numpy")
        from . import library
        library.load("avx2")
        return _collect("llambda.runtime.native", "avx2", runs_plans=True)
    raise BackendError(f"LLAMBDA_BACKEND must be 'avx2' or 'numpy', got {name!r}")
