"""Keep a weight file's pages in the page cache as huge (2 MiB) folios.

Decode reads every weight once per token, about a hundred MB on the default model. Mapped
in 4 KiB pages that is tens of thousands of TLB misses a token, each a page walk (two
nested ones in a virtual machine). A file whose page cache holds 2 MiB folios is mapped
one page-table entry per folio, by every process that maps it, with no work at load.

How the kernel fills the page cache decides the folio size: a file just written holds
the small folios the writes made, and pages read back by a mapping advised
``MADV_HUGEPAGE`` come in PMD-sized folios where the file system supports large folios
(Linux 6.x ext4, xfs, btrfs). So:

- ``advise(mapping)``: every mapping of a weight file asks for huge folios, so whatever
  the kernel reads in for it (a first load, or after eviction) comes in 2 MiB folios;
- ``recache(path)``: after writing a weight file, its page cache is dropped (it is on
  disk and clean: ``weightfile.write`` fsyncs it) and read back through such a mapping.
  That costs one read of the file from disk, once, where it is written (conversion).

Both are best effort: a kernel or file system without large folios keeps 4 KiB pages and
everything works as before. Pages another process has mapped are not dropped.
"""
import mmap
import os

from .buffers import HUGE_PAGE
from .prefault import MADV_POPULATE_READ


def advise(mapping):
    """Ask for ``mapping``'s (a file mmap) pages in huge folios; True if the kernel took it."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (AttributeError, OSError, ValueError):
        return False


def recache(path):
    """Drop ``path``'s page cache and read it back in huge folios (files of at least one huge
    page only). Returns True when it ran to the end."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HUGE_PAGE:
                return False
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
                if not advise(mapping):
                    return False
                try:
                    mapping.madvise(MADV_POPULATE_READ)
                except OSError:                  # before Linux 5.14: fault every page in
                    for at in range(0, size, mmap.PAGESIZE):
                        mapping[at]
        return True
    except (AttributeError, OSError, ValueError):
        return False

