"""The kernel library: find the current build, build it if stale, load it.

Where it comes from, first match wins:

1. ``$LLAMBDA_KERNEL_DIR`` (built there if missing);
2. the library a wheel ships in ``llambda/runtime/kernels/``, when its recorded source
   key is the key of the generators installed beside it;
3. ``<cache>/kernels/<source key>/``, built there with PeachPy and ``ld`` if missing.

The key hashes the generators, so a changed generator (a development checkout)
means a new directory and a rebuild; an unchanged one means loading only: the
first two never import PeachPy or call the linker. ctypes signatures come from
the manifest, i.e. from what the build emitted.
"""
import ctypes
import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

from . import cpu
from .paths import cache_dir

_CTYPES = {
    "size_t": ctypes.c_size_t,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "float": ctypes.c_float,
}


class KernelLibraryError(RuntimeError):
    pass


# Where a wheel puts the library it ships (codegen/wheel_hook.py builds it there).
PACKAGED_DIR = Path(__file__).resolve().parent / "kernels"


def library_dir():
    """The cache directory of the library the current generators give (or the override)."""
    from llambda.codegen.build import source_key
    override = os.environ.get("LLAMBDA_KERNEL_DIR")
    if override:
        return Path(override)
    return cache_dir() / "kernels" / source_key()


def packaged_key():
    """The source key the packaged library was built from, when it matches the installed
    generators (recomputed with the PeachPy version that built it: none is needed here);
    None when there is no packaged library or it was built from other generators."""
    from llambda.codegen.build import KEY_NAME, LIBRARY_NAME, source_key
    try:
        built = json.loads((PACKAGED_DIR / KEY_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not (PACKAGED_DIR / LIBRARY_NAME).exists():
        return None
    key = built.get("key")
    return key if key == source_key(peachpy=built.get("peachpy")) else None


class Location(NamedTuple):
    directory: Path
    origin: str         # "packaged", "built" (in the cache or the override) or "unbuilt"
    key: str


def locate():
    """Where the library is (or will be built), without building or importing PeachPy."""
    from llambda.codegen.build import LIBRARY_NAME, source_key
    if not os.environ.get("LLAMBDA_KERNEL_DIR"):
        key = packaged_key()
        if key is not None:
            return Location(PACKAGED_DIR, "packaged", key)
    directory = library_dir()
    return Location(directory, "built" if (directory / LIBRARY_NAME).exists() else "unbuilt", source_key())


def ensure_built(verbose=False):
    """Return the directory of a current library, building it if needed."""
    from llambda.codegen.build import LIBRARY_NAME, build
    where = locate()
    if where.origin != "unbuilt":
        return where.directory
    directory = where.directory
    try:
        import peachpy  # noqa: F401
    except ImportError:
        shipped = (f"the packaged library in {PACKAGED_DIR} was built from other generators, "
                   if PACKAGED_DIR.exists() else "")
        raise KernelLibraryError(
            f"the kernel library {directory / LIBRARY_NAME} is not built, {shipped}and PeachPy is not "
            "importable to build it; install llambda from its wheel (make wheel), or install Debian's "
            "python3-peachpy (apt-get install python3-peachpy) and use a Python that sees it "
            "(run 'make kernels' in the llambda checkout)") from None
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
