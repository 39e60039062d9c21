"""Where llambda keeps what it builds and downloads: the user's cache directory."""
import os
from pathlib import Path

CACHE_ENV = "LLAMBDA_CACHE_DIR"


def cache_dir():
    """``$LLAMBDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/llambda``, else ``~/.cache/llambda``."""
    explicit = os.environ.get("LLAMBDA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llambda"


def cache_subdir(name):
    """``<cache>/<name>``, created if missing; a UserError that names the cache directory
    and the variable that moves it when it cannot be."""
    root = cache_dir()
    directory = root / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        from llambda.errors import UserError
        raise UserError(f"cache directory {root}: cannot use {directory} ({e.strerror or e}); "
                        f"set {CACHE_ENV} to a writable directory") from None
    return directory
