"""The weight file: exact round trips, aligned zero-copy views, atomic writes, and a
clear WeightFileError for every way a file can be wrong."""
import json
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llambda.runtime import weightfile
from llambda.runtime.weightfile import WeightFileError

DTYPES = [np.float32, np.float16, np.int8, np.uint8, np.int32, np.float64, np.bool_]


@st.composite
def array_sets(draw):
    """A few arrays of assorted dtypes and odd shapes (empty and 0-d included)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = {}
    for i in range(draw(st.integers(0, 6))):
        shape = tuple(draw(st.lists(st.integers(0, 37), min_size=0, max_size=3)))
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
        if dtype.kind == "b":
            raw &= 1
        arrays[draw(st.sampled_from(["w", "layer/qs", "ünï", "a b", ""])) + str(i)] = raw.view(dtype).reshape(shape)
    return arrays


@settings(max_examples=25)
@given(array_sets(), st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=8), max_size=3))
def test_round_trip_is_exact_aligned_and_read_only(arrays, metadata):
    with tempfile.TemporaryDirectory() as tmp:
        path = weightfile.write(Path(tmp) / "w.llb", metadata, arrays)
        loaded = weightfile.open_weights(path)
        assert loaded.metadata == metadata
        assert list(loaded) == list(arrays)
        for name, want in arrays.items():
            got = loaded[name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            # bit-exact, NaN payloads included: compare bytes, not values
            assert got.tobytes() == want.tobytes(), name
            assert got.ctypes.data % weightfile.ALIGNMENT == 0, name
            assert not got.flags.writeable
        loaded.verify()


def test_views_share_the_mapping_and_outlive_the_file_object(tmp_path):
    path = weightfile.write(tmp_path / "w.llb", {}, {"x": np.arange(1000, dtype=np.float32)})
    x = weightfile.open_weights(path)["x"]      # the WeightFile itself is dropped at once
    assert x.base is not None and not x.flags.owndata
    np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32))


def test_non_contiguous_and_scalar_arrays(tmp_path):
    strided = np.arange(60, dtype=np.float16).reshape(6, 10)[:, ::3]
    scalar = np.array(2.5, dtype=np.float32)
    loaded = weightfile.open_weights(weightfile.write(tmp_path / "w.llb", {}, {"s": strided, "c": scalar}))
    np.testing.assert_array_equal(loaded["s"], strided)
    assert loaded["c"].shape == () and loaded["c"] == 2.5


def test_rejects_arrays_that_are_not_plain_numbers(tmp_path):
    with pytest.raises(TypeError, match="'o'"):
        weightfile.write(tmp_path / "w.llb", {}, {"o": np.array([object()])})
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_goes_to_stderr(tmp_path, capsys):
    weightfile.write(tmp_path / "w.llb", {}, {"x": np.zeros(1000, np.uint8)}, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "w.llb" in err


# ---------------------------------------------------------------- atomicity

@pytest.mark.parametrize("interruption", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch, interruption):
    real_write = weightfile._write_arrays

    def write_half_then_fail(out, *args):
        out.write(b"\0" * 1000)
        raise interruption

    monkeypatch.setattr(weightfile, "_write_arrays", write_half_then_fail)
    with pytest.raises(type(interruption)):
        weightfile.write(tmp_path / "w.llb", {}, {"x": np.zeros(10**5, np.float32)})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(weightfile, "_write_arrays", real_write)


def test_failed_rewrite_keeps_the_old_file(tmp_path, monkeypatch):
    path = weightfile.write(tmp_path / "w.llb", {"v": 1}, {"x": np.ones(5, np.float32)})
    monkeypatch.setattr(weightfile, "_write_arrays", lambda *a: (_ for _ in ()).throw(OSError("full")))
    with pytest.raises(OSError):
        weightfile.write(path, {"v": 2}, {"x": np.zeros(5, np.float32)})
    assert weightfile.open_weights(path).metadata == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["w.llb"]


# ---------------------------------------------------------------- bad files

@pytest.fixture
def good_file(tmp_path):
    arrays = {"first": np.arange(100, dtype=np.float32), "second": np.arange(64, dtype=np.int8).reshape(8, 8)}
    return weightfile.write(tmp_path / "good.llb", {"note": "x" * 50}, arrays)


def _rewrite_header(path, change):
    """Apply ``change`` to the parsed header and store it back with a valid checksum.

    The new JSON is written compactly and padded with spaces to the old length, so
    the arrays stay where they were."""
    data = bytearray(path.read_bytes())
    magic, version, _, header_len = struct.unpack_from("<8sIIQ", data)
    header = json.loads(data[24:24 + header_len])
    change(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= header_len
    body = body.ljust(header_len)
    data[24:24 + header_len] = body
    struct.pack_into("<8sIIQ", data, 0, magic, version, zlib.crc32(body), header_len)
    path.write_bytes(bytes(data))


def _expect_error(path, match):
    with pytest.raises(WeightFileError, match=match) as caught:
        weightfile.open_weights(path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_missing_file_and_directory(tmp_path):
    _expect_error(tmp_path / "nope.llb", "no such file")
    _expect_error(tmp_path, "directory")


def test_empty_file_and_wrong_magic(tmp_path, good_file):
    empty = tmp_path / "empty.llb"
    empty.write_bytes(b"")
    _expect_error(empty, "empty")
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a model at all")
    _expect_error(text, "not a llambda file")
    data = bytearray(good_file.read_bytes())
    data[0] ^= 0xFF
    good_file.write_bytes(bytes(data))
    _expect_error(good_file, "not a llambda file")


def test_gguf_is_named_as_such(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(100))
    _expect_error(gguf, "GGUF file.*convert")
    assert weightfile.sniff(gguf) == "gguf"


def test_unknown_version(good_file):
    data = bytearray(good_file.read_bytes())
    struct.pack_into("<I", data, 8, 99)
    good_file.write_bytes(bytes(data))
    _expect_error(good_file, "format version 99 is not supported")


@pytest.mark.parametrize("keep", [3, 20, 100, -1])
def test_truncated_files(good_file, keep):
    data = good_file.read_bytes()
    good_file.write_bytes(data[:keep])
    _expect_error(good_file, "truncated")


def test_damaged_header_fails_its_checksum(good_file):
    data = bytearray(good_file.read_bytes())
    data[40] ^= 0x01
    good_file.write_bytes(bytes(data))
    _expect_error(good_file, "header checksum")


def test_bad_json(good_file):
    data = bytearray(good_file.read_bytes())
    header_len = struct.unpack_from("<Q", data, 16)[0]
    body = b"{not json".ljust(header_len)
    data[24:24 + header_len] = body
    struct.pack_into("<I", data, 12, zlib.crc32(body))
    good_file.write_bytes(bytes(data))
    _expect_error(good_file, "not valid JSON")


def _set_entry(index, **values):
    def change(header):
        header["tensors"][index].update(values)
    return change


def test_entry_outside_the_file(good_file):
    _rewrite_header(good_file, _set_entry(1, offset=10**6))
    _expect_error(good_file, "'second'.*outside the file")


def test_misaligned_entry(good_file):
    _rewrite_header(good_file, lambda h: h["tensors"][1].update(offset=h["tensors"][1]["offset"] + 4))
    _expect_error(good_file, "'second'.*not 64-byte aligned")


def test_entry_inside_the_header(good_file):
    _rewrite_header(good_file, _set_entry(0, offset=0))
    _expect_error(good_file, "'first'.*overlaps the header")


def test_overlapping_entries(good_file):
    _rewrite_header(good_file, lambda h: h["tensors"][1].update(offset=h["tensors"][0]["offset"]))
    _expect_error(good_file, "overlaps tensor 'first'")


def test_entry_size_must_match_its_shape(good_file):
    _rewrite_header(good_file, _set_entry(0, shape=[101]))
    _expect_error(good_file, "'first'.*do not match shape")


def test_entry_with_unusable_dtype(good_file):
    _rewrite_header(good_file, _set_entry(0, dtype="|O"))
    _expect_error(good_file, "'first'.*unsupported dtype")


def test_flipped_data_byte_names_the_tensor(good_file):
    loaded = weightfile.open_weights(good_file)
    offset = next(e.offset for e in loaded.entries if e.name == "second")
    del loaded
    data = bytearray(good_file.read_bytes())
    data[offset + 5] ^= 0x10
    good_file.write_bytes(bytes(data))
    damaged = weightfile.open_weights(good_file)     # opening stays cheap: no checksums
    with pytest.raises(WeightFileError, match="checksum mismatch in tensor second"):
        damaged.verify()
