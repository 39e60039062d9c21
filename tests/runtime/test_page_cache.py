"""A written weight file is cached, and mapped, in 2 MiB pages (runtime/page_cache.py).

The kernel decides whether it can: the product assertion runs only where a plain
experiment, made here without llambda's code, shows that this file system and kernel
put a file read back through an MADV_HUGEPAGE mapping in huge folios."""
import mmap
import os

import numpy as np
import pytest

from helpers import smaps_bytes
from llambda.runtime import page_cache, weightfile

SIZE = 8 << 20
TENSOR = 128 << 10


def _pmd_mapped(mapping):
    """Bytes of ``mapping`` (an mmap of a file) that this process maps with huge page-table
    entries: its FilePmdMapped line in /proc/self/smaps."""
    start = np.frombuffer(mapping, np.uint8).ctypes.data
    mapped = smaps_bytes("FilePmdMapped:", [(start, start + len(mapping))])
    assert mapped is not None, f"no mapping holds {start:#x} in /proc/self/smaps"
    return mapped


def _touch(mapping):
    view = np.frombuffer(mapping, np.uint8)
    return int(view[::mmap.PAGESIZE].sum())


@pytest.fixture(scope="module")
def huge_folios_here(tmp_path_factory):
    """Whether this file system gives a file read through an MADV_HUGEPAGE mapping huge folios."""
    path = tmp_path_factory.mktemp("probe") / "probe.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                return False
            _touch(m)
            return _pmd_mapped(m) > 0


def test_a_written_weight_file_is_mapped_in_huge_pages(tmp_path, huge_folios_here):
    if not huge_folios_here:
        pytest.skip("this kernel or file system keeps file pages in 4 KiB folios")
    # tensors of a model's sizes, written one by one: the writes alone leave small folios
    arrays = {f"w{i}": np.full(TENSOR // 4, i, np.float32) for i in range(SIZE // TENSOR)}
    path = weightfile.write(tmp_path / "w.llb", {}, arrays)
    weights = weightfile.WeightFile(path)
    _touch(weights._mapping)
    # at least half of the file in 2 MiB entries (its first and last partial huge pages
    # may stay small)
    assert _pmd_mapped(weights._mapping) >= SIZE // 2
    for name, a in arrays.items():
        np.testing.assert_array_equal(weights[name], a)


def test_recache_is_best_effort(tmp_path):
    assert page_cache.recache(tmp_path / "missing.llb") is False
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 4096)
    assert page_cache.recache(small) is False          # under one huge page: left alone
    big = tmp_path / "big.bin"
    big.write_bytes(b"y" * (page_cache.HUGE_PAGE + 1))
    assert page_cache.recache(big) is True
    assert big.read_bytes() == b"y" * (page_cache.HUGE_PAGE + 1)
