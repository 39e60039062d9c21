"""What start-up does not do: touch memory it has only reserved, or hash the kernel
generators when they have not changed."""
import json

import numpy as np
import pytest

from llambda.runtime import buffers, library


# -- buffers.zeros: zero, aligned, and not resident until written ------------------

@pytest.mark.parametrize("shape", [1, 7, (3, 5), (2, 1 << 20)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8])
def test_zeros_are_zero_and_aligned(shape, dtype):
    out = buffers.zeros(shape, dtype)
    assert out.dtype == dtype and out.shape == ((shape,) if np.isscalar(shape) else shape)
    assert out.ctypes.data % buffers.ALIGNMENT == 0
    assert not out.any()


def test_zeros_reused_memory_is_zero():
    # small blocks come back from the allocator's free lists: calloc must clear them
    for _ in range(50):
        junk = buffers.empty(1000)
        junk[...] = np.nan
        del junk
        assert not buffers.zeros(1000).any()


def _resident_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    pytest.skip("no /proc/self/status")


def test_large_zeros_take_no_memory_until_written():
    """A KV cache sized for the whole context costs only the positions stored."""
    before = _resident_kib()
    cache = buffers.zeros((64 << 20) // 4)          # 64 MiB
    grown = _resident_kib() - before
    cache[:1024] = 1.0                              # one page or two
    assert grown < 8 << 10, f"64 MiB of zeros made {grown} KiB resident"
    assert cache[1024:].max() == 0


# -- the kernel library's key, remembered by the generators' stamps ----------------

@pytest.fixture
def memo_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LLAMBDA_KERNEL_DIR", raising=False)
    return tmp_path / "kernels" / "source-keys.json"


def test_source_key_is_remembered(memo_cache, monkeypatch):
    from llambda.codegen import build
    key = build.source_key()
    assert library.current_source_key() == key
    assert list(json.loads(memo_cache.read_text()).values()) == [key]

    def no_hashing():
        raise AssertionError("hashed the generators although none changed")
    monkeypatch.setattr(build, "source_key", no_hashing)
    assert library.current_source_key() == key
    assert library.library_dir().name == key


def test_changed_stamp_hashes_again(memo_cache, monkeypatch):
    from llambda.codegen import build
    library.current_source_key()
    calls = []
    monkeypatch.setattr(build, "source_key", lambda: calls.append(1) or "f" * 16)
    monkeypatch.setenv("LLAMBDA_FAMILIES", "elementwise")     # source_key reads it: a new stamp
    assert library.current_source_key() == "f" * 16 and calls == [1]
    assert len(json.loads(memo_cache.read_text())) == 2


def test_a_generator_edit_changes_the_stamp(tmp_path, monkeypatch):
    from llambda import codegen
    fake = tmp_path / "codegen"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "family.py").write_text("A = 1\n")
    monkeypatch.setattr(codegen, "__file__", str(fake / "__init__.py"))
    first = library._generator_stamp()
    assert library._generator_stamp() == first
    (fake / "family.py").write_text("A = 22\n")
    assert library._generator_stamp() != first


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"x": 3}'])
def test_damaged_memo_is_rebuilt(memo_cache, content):
    from llambda.codegen import build
    memo_cache.parent.mkdir(parents=True)
    memo_cache.write_text(content)
    assert library.current_source_key() == build.source_key()
    assert build.source_key() in json.loads(memo_cache.read_text()).values()


def test_memo_is_bounded(memo_cache, monkeypatch):
    memo_cache.parent.mkdir(parents=True)
    memo_cache.write_text(json.dumps({f"stamp{i}": "0" * 16 for i in range(200)}))
    library.current_source_key()
    memo = json.loads(memo_cache.read_text())
    assert len(memo) == library._MEMO_ENTRIES and library._generator_stamp() in memo


def test_unwritable_cache_still_gives_the_key(tmp_path, monkeypatch):
    from llambda.codegen import build
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(blocker))      # a file: nothing can go under it
    assert library.current_source_key() == build.source_key()
