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


def library_dir():
    override = os.environ.get("LLAMBDA_KERNEL_DIR")
    if override:
        return Path(override)
    return cache_dir() / "kernels" / current_source_key()


# How many (file stamps -> key) pairs the memo keeps: one per checkout that shares the cache.
_MEMO_ENTRIES = 32


def current_source_key():
    """``codegen.build.source_key()`` of the generators as they are on disk, remembered
    by the files' stamps (path, size, mtime, inode) in ``<cache>/kernels/source-keys.json``.

    Hashing every generator and asking importlib.metadata for PeachPy's version is a
    noticeable part of start-up; a stat of each file is not. A generator that changes
    gets a new stamp, so its key is computed again (as ``make`` decides from mtimes)."""
    stamp = _generator_stamp()
    memo_path = cache_dir() / "kernels" / "source-keys.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    key = memo.get(stamp)
    if isinstance(key, str):
        return key
    from llambda.codegen.build import source_key
    key = source_key()
    memo.pop(stamp, None)
    memo[stamp] = key                                   # newest last: the oldest are dropped first
    _write_memo(memo_path, dict(list(memo.items())[-_MEMO_ENTRIES:]))
    return key


def _generator_stamp():
    """What ``source_key`` reads, as one line per file: the generators' stamps, the
    LLAMBDA_FAMILIES restriction, and the stamp of PeachPy's package (its version).
    Kept as text, not hashed: hashlib would load OpenSSL for this alone."""
    import importlib.util
    from llambda import codegen
    here = Path(codegen.__file__).resolve().parent
    lines = [f"families={os.environ.get('LLAMBDA_FAMILIES', '')}"]
    paths = sorted(here.glob("*.py"))
    spec = importlib.util.find_spec("peachpy")
    if spec is not None and spec.origin:
        paths.append(Path(spec.origin))
    for path in paths:
        st = path.stat()
        lines.append(f"{path} {st.st_size} {st.st_mtime_ns} {st.st_ino}")
    return "\n".join(lines)


def _write_memo(path, memo):
    """Best effort, atomically: a lost update or an unwritable cache only means hashing again."""
    import tempfile
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            json.dump(memo, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


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
