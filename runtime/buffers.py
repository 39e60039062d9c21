"""Aligned numpy buffers: every kernel operand starts on a 64-byte boundary.

The kernels require 32-byte alignment (aligned ymm loads); we give 64 so that
buffers handed to different threads never share a cache line at their start.
"""
import ctypes
import mmap
import queue
import threading

import numpy as np

ALIGNMENT = 64
# Zeros at least this large are anonymous mappings of their own: pages the kernel hands out
# zeroed and only when first touched. calloc gives that only while a block is above glibc's
# mmap threshold, which rises as large blocks are freed (to 32 MiB): past that, calloc takes
# heap memory and clears it, and a KV cache of many arenas then costs milliseconds at load.
MAPPED_ZEROS = 256 << 10
HUGE_PAGE = 2 << 20                 # PMD size on x86-64


def empty(shape, dtype=np.float32, align=ALIGNMENT):
    return _aligned(np.empty, shape, dtype, align)


def zeros(shape, dtype=np.float32, align=ALIGNMENT):
    """Zeros that cost nothing until written: a large block is fresh pages from the
    kernel (already zero, not yet resident), so a KV cache sized for the whole context
    only becomes memory where positions are stored."""
    return _aligned(_zeros, shape, dtype, align)


def zeros_growing(shape, dtype=np.float32):
    """Zeros for a cache that fills from its start (the KV cache: llambda/serving/kv_pool.py), in
    small pages, in a mapping of its own that starts on a HUGE_PAGE boundary, so that
    ``collapse_huge_pages`` can turn the parts it has filled into huge pages."""
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return zeros(shape, dtype)
    pages = ZeroPages(-1, nbytes + HUGE_PAGE)
    raw = np.frombuffer(pages, dtype=np.uint8)
    offset = (-raw.ctypes.data) % HUGE_PAGE        # huge pages are aligned to their size
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)    # Linux 6.1; Python's mmap names it from 3.13


def collapse_huge_pages(array, start, end):
    """Copy the small pages of each whole huge page within bytes [start, end) of a
    ``zeros_growing`` array into one huge page (MADV_COLLAPSE) and free them: the same bytes
    and the same resident memory, mapped by one TLB entry per 2 MiB instead of 512. A long
    context's decode step reads tens of MB of cache, and in small pages much of that time is
    page walks. Best effort: False where the array has no mapping of its own, or the kernel
    has no huge page free or no MADV_COLLAPSE."""
    base = mapping_of(array)
    at = array.ctypes.data
    first = -(-(at + max(start, 0)) // HUGE_PAGE) * HUGE_PAGE
    last = (at + min(end, array.nbytes)) // HUGE_PAGE * HUGE_PAGE
    if not isinstance(base, ZeroPages) or last <= first:
        return False
    # libc's madvise through ctypes, which lets go of the GIL (mmap.madvise keeps it): a
    # collapse can take tens of milliseconds (below), and other threads' Python goes on
    return _LIBC.madvise(first, last - first, MADV_COLLAPSE) == 0


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.madvise.restype = ctypes.c_int


class _Collapser:
    """One daemon thread that runs ``collapse_huge_pages`` for ``collapse_later``, in order.

    On a 2-vCPU VM one collapse took 5-70 ms once a process's threads had run on both
    cores, against 0.5 ms in a process of one thread (most likely the kernel draining each
    CPU's lists of newly faulted pages first); here only this thread waits for it. A queued
    request holds its array, so the mapping lives until the collapse is done."""

    def __init__(self):
        self._requests = queue.Queue()
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, array, start, end):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="llambda-huge-pages", daemon=True)
                self._thread.start()
        self._requests.put((array, start, end))

    def wait(self):
        """Return once every collapse asked for so far is done."""
        self._requests.join()

    def _serve(self):
        while True:
            array, start, end = self._requests.get()
            try:
                collapse_huge_pages(array, start, end)
            finally:
                del array
                self._requests.task_done()


_COLLAPSER = _Collapser()


def collapse_later(array, start, end):
    """``collapse_huge_pages(array, start, end)`` on a background thread (``_Collapser``): the
    caller does not wait, and the bytes read the same before, during and after."""
    _COLLAPSER.submit(array, start, end)


def wait_for_collapses():
    """Return once every ``collapse_later`` so far is done (tests, benchmarks)."""
    _COLLAPSER.wait()


class ZeroPages(mmap.mmap):
    """An anonymous private mapping of zeros (runtime/prefault.py tells it from a file's).
    Private, not shared: shared anonymous memory is shmem, which gets no transparent huge
    pages unless the machine enables them for shmem too."""

    def __new__(cls, fileno, length):
        return super().__new__(cls, fileno, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def mapping_of(array):
    """What ``array``'s memory belongs to under its views: an mmap (a weight file's, or
    ZeroPages) for a mapped array, else the bottom of its base chain (None for an array that
    owns its memory)."""
    base = array
    while isinstance(base, (np.ndarray, memoryview)):         # views, then frombuffer's memoryview
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return base


def _zeros(nbytes, dtype):
    if nbytes < MAPPED_ZEROS:
        return np.zeros(nbytes, dtype=dtype)
    # page-aligned, so aligned for any ALIGNMENT; the array keeps the mapping alive
    return np.frombuffer(ZeroPages(-1, nbytes), dtype=dtype)


def _aligned(allocate, shape, dtype, align):
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def full(shape, value, dtype=np.float32, align=ALIGNMENT):
    out = empty(shape, dtype, align)
    out[...] = value
    return out


def aligned_copy(array, dtype=None, align=ALIGNMENT):
    array = np.asarray(array, dtype=dtype)
    out = empty(array.shape, array.dtype, align)
    out[...] = array
    return out


def is_aligned(array, align=32):
    return array.ctypes.data % align == 0
