"""Map a model's weights into the page tables ahead of the first step, on another core.

A fresh mapping of the weight file has no page-table entries: the first step takes a
minor fault every few pages of the whole file (it reads every weight), in the middle of
the first token. ``madvise(MADV_POPULATE_READ)`` makes the same entries in one call, and
through ctypes that call leaves the GIL free, so a thread started once the tokenizer is
built (llambda/api.py: its build's transient memory is gone by then and does not add to
the peak) does it while the main thread builds the model. The pages
come from the page cache as the faults would have taken them (nothing is copied, the
resident memory is what the first token makes resident anyway). Best effort: a kernel
without MADV_POPULATE_READ (before Linux 5.14), or any error, leaves the faults to the
first step, as before.
"""
import ctypes
import mmap
import threading

from .buffers import ZeroPages, mapping_of

MADV_POPULATE_READ = 22


def populate_async(arrays):
    """Start populating the page tables of ``arrays``, those of them that are views of a
    file mapping (anonymous memory is left alone: populating it would make it resident);
    returns the thread, or None when there is nothing to do."""
    spans = []
    for a in arrays:
        base = mapping_of(a)
        if isinstance(base, mmap.mmap) and not isinstance(base, ZeroPages) and a.nbytes:
            start = a.__array_interface__["data"][0]
            page = start // mmap.PAGESIZE * mmap.PAGESIZE
            spans.append((page, start + a.nbytes - page))
    if not spans:
        return None
    spans.sort()
    merged = [list(spans[0])]
    for start, length in spans[1:]:           # neighbouring tensors: one call
        last = merged[-1]
        if start <= last[0] + last[1] + mmap.PAGESIZE:
            last[1] = max(last[1], start + length - last[0])
        else:
            merged.append([start, length])
    thread = threading.Thread(target=_populate, args=(merged,), name="llambda-prefault", daemon=True)
    thread.start()
    return thread


def _populate(spans):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        for address, length in spans:      # a mapping starts on a page
            madvise(address, length, MADV_POPULATE_READ)
    except (OSError, AttributeError):
        pass
