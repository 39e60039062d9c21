"""The kernel library: find the current build in the cache, build it if stale, load it.

The library lives in ``<cache>/kernels/<source key>/`` beside ``manifest.json``.
The key hashes the generators, so a changed generator means a new directory
and a rebuild; an unchanged one means loading only (no PeachPy import).
ctypes signatures come from the manifest, i.e. from what the build emitted.
"""
import ctypes
import functools
import json
import os
from pathlib import Path

from llambda.errors import UserError

from . import cpu
from .paths import cache_dir

_CTYPES = {
    "size_t": ctypes.c_size_t,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "float": ctypes.c_float,
}


class KernelLibraryError(UserError, RuntimeError):
    """The kernel library cannot be built or loaded: one line, not a traceback."""


def library_dir():
    from llambda.codegen.build import source_key
    override = os.environ.get("LLAMBDA_KERNEL_DIR")
    if override:
        return Path(override)
    return cache_dir() / "kernels" / source_key()


def ensure_built(verbose=False):
    """Return the directory of a current library, building it if needed."""
    from llambda.codegen.build import LIBRARY_NAME, build
    directory = library_dir()
    if (directory / LIBRARY_NAME).exists():
        return directory
    try:
        import peachpy  # noqa: F401
    except ImportError:
        raise KernelLibraryError(
            f"the kernel library {directory / LIBRARY_NAME} is not built and PeachPy is not importable "
            "to build it; install Debian's python3-peachpy (apt-get install python3-peachpy) and use a "
            "Python that sees it (run 'make kernels' in the llambda checkout)") from None
    if verbose:
        print(f"building kernel library in {directory}", flush=True)
    build(directory)
    return directory


class KernelLibrary:
    """The loaded shared library: ``lib.fn(symbol)`` gives a typed ctypes function."""

    def __init__(self, directory):
        from llambda.codegen.build import LIBRARY_NAME, MANIFEST_NAME
        self.directory = Path(directory)
        self.path = self.directory / LIBRARY_NAME
        self.manifest = {k["symbol"]: k for k in json.loads((self.directory / MANIFEST_NAME).read_text())}
        self.cdll = ctypes.CDLL(str(self.path))

    def fn(self, symbol):
        entry = self.manifest.get(symbol)
        if entry is None:
            raise KernelLibraryError(f"kernel {symbol} is not in {self.path}")
        f = getattr(self.cdll, symbol)
        f.argtypes = [_CTYPES.get(ctype, ctypes.c_void_p) for _, ctype in entry["args"]]
        f.restype = None
        return f


@functools.lru_cache(maxsize=None)
def load(isa="avx2"):
    """Load (building first if stale) the kernel library, after the CPU gate."""
    missing = cpu.missing_flags(isa)
    if missing:
        raise KernelLibraryError(
            f"this CPU lacks {', '.join(missing)} needed by the {isa} kernels; "
            "use LLAMBDA_BACKEND=numpy for the (slow) numpy reference backend")
    return KernelLibrary(ensure_built())
