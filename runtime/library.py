"""The kernel library: find the current build, build it if stale, load it.

Where it comes from, first match wins:

1. ``$LLAMBDA_KERNEL_DIR`` (built there if missing);
2. the library a wheel ships in ``llambda/runtime/kernels/``, when its recorded source
   key is the key of the generators installed beside it;
3. ``<kernels>/<source key>/``, built there with PeachPy and ``ld`` if missing, where
   ``<kernels>`` is ``<checkout>/build/kernels`` when llambda runs from a writable checkout
   (the folder holding codegen/ and pyproject.toml), else ``<cache>/kernels``. A checkout's
   library is the checkout's, not the model cache's: a new ``LLAMBDA_CACHE_DIR`` rebuilds
   nothing. The build's per-family objects are kept in ``<kernels>/objects`` (a changed
   generator rebuilds its own objects only; a killed build resumes), and only the newest
   KEEP_LIBRARIES libraries of older keys are kept beside the current one.

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

from llambda.errors import UserError

from . import cpu, faults
from .paths import cache_dir

_CTYPES = {
    "size_t": ctypes.c_size_t,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "float": ctypes.c_float,
}


class KernelLibraryError(UserError, RuntimeError):
    """The kernel library cannot be built or loaded: one line, not a traceback."""


# Where a wheel puts the library it ships (codegen/wheel_hook.py builds it there).
PACKAGED_DIR = Path(__file__).resolve().parent / "kernels"


KEEP_LIBRARIES = 3                  # libraries of other keys kept: switching branches back is quick


def checkout_dir():
    """The llambda checkout these generators are in (holding codegen/ and pyproject.toml),
    when it is writable; None for an installed llambda."""
    from llambda import codegen
    root = Path(codegen.__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "codegen").is_dir() and os.access(root, os.W_OK):
        return root
    return None


def kernels_root():
    """Where built libraries live, one directory per source key, and the objects they are
    linked from: the checkout's build/kernels, else the user cache's kernels/."""
    checkout = checkout_dir()
    return checkout / "build" / "kernels" if checkout is not None else cache_dir() / "kernels"


def objects_dir():
    """The build's object cache (objects are keyed by their sources: any build may share it)."""
    return kernels_root() / "objects"


def library_dir():
    """The directory of the library the current generators give (or the override)."""
    override = os.environ.get("LLAMBDA_KERNEL_DIR")
    if override:
        return Path(override)
    return kernels_root() / current_source_key()


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
    paths = sorted(here.glob("*.py")) + sorted(here.glob("*/*.py"))     # family packages too
    try:
        spec = importlib.util.find_spec("peachpy")
    except ValueError:              # imported without a spec, or blocked (sys.modules entry None)
        spec = None
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
    from llambda.codegen.build import LIBRARY_NAME
    if not os.environ.get("LLAMBDA_KERNEL_DIR"):
        key = packaged_key()
        if key is not None:
            return Location(PACKAGED_DIR, "packaged", key)
    directory = library_dir()
    return Location(directory, "built" if (directory / LIBRARY_NAME).exists() else "unbuilt",
                    current_source_key())


def ensure_built(verbose=False, jobs=None):
    """Return the directory of a current library, building it if needed (``jobs`` build
    processes at a time; default: one per CPU this process may use)."""
    from llambda.codegen import build as builder
    from llambda.codegen.build import LIBRARY_NAME
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
    objects = objects_dir()
    builder.build(directory, objects=objects, jobs=jobs, verbose=verbose)
    builder.prune(objects, KEEP_LIBRARIES)
    if not os.environ.get("LLAMBDA_KERNEL_DIR"):
        prune_libraries(directory.parent, directory)
    return directory


def prune_libraries(root, current):
    """Remove the libraries of other source keys in ``root`` beyond the KEEP_LIBRARIES newest,
    and the temporary directories of builds killed an hour or more ago; never ``current``."""
    import shutil
    import time
    libraries = [p for p in root.iterdir() if p.is_dir() and p != current and _is_key(p.name)]
    libraries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    stale = libraries[KEEP_LIBRARIES:]
    hour_ago = time.time() - 3600
    stale += [p for p in root.glob(".build-*") if p.is_dir() and p.stat().st_mtime < hour_ago]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def _is_key(name):
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


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
    kernels = KernelLibrary(ensure_built())
    faults.arm(kernels)         # the SIGBUS handler ships in the library: installed if not yet
    return kernels
