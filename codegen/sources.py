"""What the build knows from the generators' source alone, without importing them (or PeachPy).

* which modules are kernel families (a module or package of codegen/ that defines ``emit``),
  the ISAs each emits for (``ISAS``) and the parts it cuts its kernels into (``PARTS``);
* which codegen modules a family imports, transitively (``from .x import``, ``from . import x``);
* the key of one job's object: the sources it is built from, its ISA and part, PeachPy's
  version. A changed generator changes the keys of its own objects and of the families that
  import it, nobody else's.

Both literals are read with ``ast.literal_eval``, so they must be literals.
"""
import ast
import hashlib
from pathlib import Path
from typing import NamedTuple

PACKAGING = "wheel_hook"            # setuptools commands for the wheel: emit nothing, not in any key
# The build's own modules: they emit nothing. job.py is in every job's key (it encodes the objects).
NOT_FAMILIES = {"build", "common", "job", "sources", PACKAGING}
JOB_RUNNER = "job"


class Family(NamedTuple):
    name: str
    isas: tuple                     # ISAs it emits for
    parts: dict                     # isa -> part names, one build job each (isa absent: one job)


def module_files(here, name):
    """The source files of codegen module ``name``: its .py, or every .py of its package."""
    here = Path(here)
    package = here / name
    if (package / "__init__.py").is_file():
        return sorted(package.glob("*.py"))
    return [here / f"{name}.py"]


def module_names(here):
    """Every codegen module and package, by name (private ones and the wheel hook aside)."""
    here = Path(here)
    names = {p.stem for p in here.glob("*.py")}
    names |= {p.parent.name for p in here.glob("*/__init__.py")}
    return sorted(n for n in names if not n.startswith("_") and n != PACKAGING)


def _top_level(here, name):
    """The ``__init__.py`` or module file whose top level names a family's emit, ISAS, PARTS."""
    package = Path(here) / name / "__init__.py"
    return package if package.is_file() else Path(here) / f"{name}.py"


def read_family(here, name):
    """``name``'s Family, or None when it defines no top-level ``emit``."""
    tree = ast.parse(_top_level(here, name).read_bytes())
    if not any(isinstance(node, ast.FunctionDef) and node.name == "emit" for node in tree.body):
        return None
    literals = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("ISAS", "PARTS"):
                literals[node.targets[0].id] = ast.literal_eval(node.value)
    return Family(name, tuple(literals.get("ISAS", ("avx2",))), literals.get("PARTS", {}))


def families(here):
    """Every kernel family of codegen/ ``here``, by name."""
    found = (read_family(here, name) for name in module_names(here) if name not in NOT_FAMILIES)
    return [family for family in found if family is not None]


def _imported_modules(path, in_package):
    """The codegen modules one file imports (names, maybe not modules: the caller checks).

    ``in_package``: the file is inside a family package, so codegen/ is two dots up and one
    dot is the package itself (not another module's source)."""
    top = 2 if in_package else 1
    names = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if not isinstance(node, ast.ImportFrom) or node.level != top:
            continue
        if node.module:
            names.add(node.module.split(".")[0])
        else:
            names.update(alias.name for alias in node.names)
    return names


def imports(here, name):
    """The codegen modules ``name`` imports directly (itself aside)."""
    here = Path(here)
    in_package = (here / name / "__init__.py").is_file()
    known = set(module_names(here)) | set(NOT_FAMILIES)
    found = set()
    for path in module_files(here, name):
        found |= _imported_modules(path, in_package)
    return {n for n in found if n in known and n != name}


def closure(here, name):
    """``name`` and every codegen module it imports, transitively."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(imports(here, current) - seen)
    return sorted(seen)


def _hash_files(digest, here, names):
    for name in names:
        for path in module_files(here, name):
            digest.update(path.relative_to(here).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())


def job_key(here, family, isa, part, peachpy):
    """The key of the object job (family, isa, part) gives with PeachPy version ``peachpy``."""
    digest = hashlib.sha256()
    _hash_files(digest, Path(here), sorted(set(closure(here, family)) | {JOB_RUNNER}))
    digest.update(f"\0{isa}\0{part or ''}\0{peachpy or ''}".encode())
    return digest.hexdigest()[:16]


def library_key(here, family_names, peachpy):
    """The key of the library built from the families ``family_names``: every generator file."""
    here = Path(here)
    digest = hashlib.sha256()
    digest.update(",".join(family_names).encode())
    _hash_files(digest, here, module_names(here))             # every generator file
    if peachpy:
        digest.update(peachpy.encode())
    return digest.hexdigest()[:16]
