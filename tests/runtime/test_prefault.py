"""runtime/prefault.py: the weights' page tables filled on another thread; anonymous memory
(the KV cache, activations) is never touched by it."""
import mmap

import numpy as np

from llambda.runtime import buffers, prefault


def _resident_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_file_mapping_is_populated_and_unchanged(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.arange(1 << 20, dtype=np.float32)            # 4 MiB
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapping, np.float32).reshape(1024, 1024)
    thread = prefault.populate_async([view[:512], view[512:]])
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    np.testing.assert_array_equal(view.ravel(), data)       # read-only: the bytes are the file's


def test_anonymous_memory_is_left_alone():
    before = _resident_kib()
    big = buffers.zeros((64 << 20) // 4)                    # 64 MiB of zero pages: not resident
    assert prefault.populate_async([big, np.zeros(3)]) is None
    assert _resident_kib() - before < 8 << 10
    assert prefault.populate_async([]) is None
