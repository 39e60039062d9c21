"""Where llambda keeps what it builds and downloads: the user's cache directory."""
import os
from pathlib import Path


def cache_dir():
    """``$LLAMBDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/llambda``, else ``~/.cache/llambda``."""
    explicit = os.environ.get("LLAMBDA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llambda"
