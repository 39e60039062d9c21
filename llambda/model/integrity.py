"""Damage found early: every converted file's checksums are verified once per machine,
and logits that are NaN say the file may be damaged.

A file's first load on a machine reads all of its bytes once (about the cost of
``llambda verify``) and leaves a stamp in ``<cache>/verified/``; later loads find the
stamp and read only the header. The stamp is keyed by the file's identity (real path,
device, inode, size, mtime), so a file replaced or touched is verified again. A file
that llambda converted itself gets its stamp when it is written: its checksums were
just computed from the very arrays written.

A byte that flips after the stamp was made (bit rot, an in-place edit that keeps the
mtime) is not caught here; NaN logits are, and name ``llambda verify``.
"""
import hashlib
import os
from pathlib import Path

import numpy as np

from llambda.runtime import paths, weightfile

from llambda.errors import UserError

STAMP_DIR = "verified"


def stamp_path(path):
    """Where the stamp that says ``path`` was verified lives (None if ``path`` is unreadable)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    identity = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    key = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return paths.cache_dir() / STAMP_DIR / key


def is_verified(path):
    stamp = stamp_path(path)
    return stamp is not None and stamp.exists()


def record_verified(path):
    """Leave the stamp that says ``path``'s checksums matched (best effort: a read-only
    cache only means verifying again next time)."""
    stamp = stamp_path(path)
    if stamp is None:
        return
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(f"{Path(path).resolve()}\n")
    except OSError:
        pass


def verify_once(weights_file, progress=False):
    """Check every checksum of a mapped WeightFile unless this machine already did."""
    path = weights_file.path
    if is_verified(path):
        return
    try:
        weights_file.verify(progress=progress)
    except weightfile.WeightFileError as e:
        raise UserError(f"{e}: convert the GGUF again (found on its first load on this machine; "
                        f"`llambda verify {path}` checks it)") from None
    record_verified(path)


def check_logits(logits, path):
    """A NaN in the logits: the weights (or the file) are damaged, not the prompt."""
    if np.isnan(logits).any():
        raise UserError(f"the model produced NaN logits: {path} may be damaged; "
                        f"run `llambda verify {path}` (and convert the GGUF again if it fails)")
    return logits
