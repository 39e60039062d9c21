"""The one build driver: every kernel family -> one ELF object -> one shared library.

    key = source_key()          # hash of the generators (+ PeachPy version)
    build(directory)            # writes libllambda.so, manifest.json and source_key.json there

``source_key`` needs no PeachPy, so the runtime can tell whether its cached
library is current without importing the generators. ``build`` writes into a
temporary directory and renames it into place: two processes building at once
both end with a complete library, never a half-written one.
"""
import hashlib
import importlib
import sys
import json
import os
import pkgutil
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARY_NAME = "libllambda.so"
MANIFEST_NAME = "manifest.json"
KEY_NAME = "source_key.json"        # {"key": ..., "peachpy": the version that built it}
PACKAGING = "wheel_hook"            # setuptools commands for the wheel: emit nothing, not in the key
NOT_FAMILIES = {"build", "common", PACKAGING}


def family_names():
    """Every module in this package that defines ``emit`` is a kernel family.

    ``LLAMBDA_FAMILIES=a,b`` restricts the build to those (a developer working
    on one family need not build the others)."""
    names = sorted(m.name for m in pkgutil.iter_modules([str(HERE)])
                   if m.name not in NOT_FAMILIES and not m.name.startswith("_"))
    only = os.environ.get("LLAMBDA_FAMILIES")
    if only:
        names = [n for n in names if n in only.split(",")]
    return names


def peachpy_version():
    """The installed PeachPy's version, or None (a runtime without PeachPy)."""
    try:
        from importlib.metadata import version
        return version("peachpy")
    except Exception:
        return None


def source_key(peachpy=None):
    """Identifies the library the current generators produce with PeachPy version ``peachpy``
    (default: the installed one). A packaged library records the version that built it, so
    a runtime without PeachPy can still tell whether it matches the generators beside it."""
    digest = hashlib.sha256()
    digest.update(",".join(family_names()).encode())
    for path in sorted(HERE.glob("*.py")):
        if path.stem == PACKAGING:
            continue
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    peachpy = peachpy or peachpy_version()
    if peachpy:
        digest.update(peachpy.encode())
    return digest.hexdigest()[:16]


RECURSION_LIMIT = 20000


def emit_all(isas=("avx2", "avx512")):
    """Import every family and collect its kernels (PeachPy functions, not yet encoded).

    A family emits for the ISAs it lists in ``ISAS`` (default: the AVX2 baseline only)."""
    # PeachPy's liveness analysis recurses once per basic block along a path: the larger
    # kernels (paged attention on f16/q8_0 arenas) need more frames than Python's default
    # leaves when the build runs deep inside a caller (llambda run -> load -> build).
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    kernels = []
    for name in family_names():
        module = importlib.import_module(f"{__package__}.{name}")
        if not hasattr(module, "emit"):
            continue
        for isa in isas:
            if isa in getattr(module, "ISAS", ("avx2",)):
                kernels.extend(module.emit(isa))
    seen = set()
    for k in kernels:
        if k.symbol in seen:
            raise RuntimeError(f"kernel symbol emitted twice: {k.symbol}")
        seen.add(k.symbol)
    return kernels


def link(functions, obj, library):
    """Assemble PeachPy ``functions`` into the ELF object ``obj`` and link it as the shared
    library ``library``; returns them finalized for the System V ABI."""
    from peachpy.x86_64 import abi as peachpy_abi
    import peachpy.writer

    system_v = peachpy_abi.system_v_x86_64_abi
    finalized = []
    with peachpy.writer.ELFWriter(str(obj), system_v) as writer:
        for function in functions:
            finalized.append(function.finalize(system_v))
            writer.add_function(finalized[-1])
    subprocess.run(["ld", "-shared", "-z", "noexecstack", "-o", str(library), str(obj)], check=True)
    return finalized


def build(directory, isas=("avx2", "avx512")):
    """Generate, assemble and link the kernel library into ``directory``.

    Returns the manifest (a list of dicts, one per kernel)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=directory.parent))
    try:
        kernels = emit_all(isas)
        finalized = link([k.function for k in kernels], tmp / "kernels.o", tmp / LIBRARY_NAME)
        manifest = [dict(symbol=k.symbol, family=k.family, isa=k.isa, tile=k.tile,
                         args=[list(a) for a in k.args], code_bytes=len(f.encode().code_section.content))
                    for k, f in zip(kernels, finalized)]
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
        (tmp / KEY_NAME).write_text(json.dumps({"key": source_key(), "peachpy": peachpy_version()}))
        try:
            os.rename(tmp, directory)
        except OSError:
            if not (directory / LIBRARY_NAME).exists():
                raise
            shutil.rmtree(tmp)      # somebody else finished the same build first
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
