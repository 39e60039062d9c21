"""llambda's weight file: named numpy arrays, memory-mapped straight into kernels.

Layout on disk (all integers little-endian)::

    offset 0   magic        8 bytes   b"LLAMBDA\\0"
           8   version      u32       FORMAT_VERSION
          12   header_crc   u32       zlib.crc32 of the JSON header bytes
          16   header_len   u64       length of the JSON header in bytes
          24   header       JSON      {"metadata": {...}, "file_size": int, "tensors": [entry, ...]}
               padding      zeros up to the first 64-byte boundary
               arrays       each at an absolute offset that is a multiple of ALIGNMENT

A tensor entry is ``{"name", "dtype", "shape", "offset", "nbytes", "crc32"}``.
Offsets are absolute, so reading an array is one ``np.frombuffer`` on the
mapping: the file is mapped read-only and nothing is copied, which makes load
time the header parse. A mapping starts on a page boundary, so a 64-byte
aligned offset gives a 64-byte aligned array (the kernels need 32).

This module knows arrays, not models: what the metadata means is up to the
caller (see llambda/model/convert.py).
"""
import json
import mmap
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import atomic, faults, page_cache

MAGIC = b"LLAMBDA\0"
GGUF_MAGIC = b"GGUF"
FORMAT_VERSION = 1
ALIGNMENT = 64

_PREFIX = struct.Struct("<8sIIQ")       # magic, version, header_crc, header_len
_WRITE_CHUNK = 16 << 20                 # bytes per write(): the progress bar's granularity
_ARRAY_KINDS = "biuf"                   # bool, signed, unsigned, float: plain numbers only


class WeightFileError(ValueError):
    """A weight file that cannot be used; the message names the file and the problem."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self):      # survives pickling (errors cross process boundaries in the benchmark)
        return type(self), (self.path, self.problem)


@dataclass(frozen=True)
class TensorEntry:
    """Where one array lives in the file."""
    name: str
    dtype: np.dtype
    shape: tuple
    offset: int
    nbytes: int
    crc32: int

    def to_json(self):
        return {"name": self.name, "dtype": self.dtype.str, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes, "crc32": self.crc32}


# ---------------------------------------------------------------- writing

def write(path, metadata, arrays, progress=None, check=None):
    """Write ``arrays`` (name -> ndarray) and a JSON-able ``metadata`` dict to ``path``.

    Atomic and read-only (runtime/atomic.py): the data goes to an unnamed file that
    gets its name once whole and fsync'ed; on any error, Ctrl-C or kill, ``path`` is
    left as it was and nothing is left behind. ``check(path_to_open)`` may refuse the
    finished file before it is named. ``progress=True`` shows a tqdm bar on stderr.
    Returns ``path`` as a Path.
    """
    path = Path(path)
    arrays = {str(name): _plain_array(name, a) for name, a in arrays.items()}
    header, entries = _layout(metadata, arrays)
    with atomic.create(path, check=check) as out:
        out.write(header)
        _write_arrays(out, arrays, entries, progress, path.name)
    page_cache.recache(path)     # so that loads map it in 2 MiB pages (runtime/page_cache.py)
    return path


def _plain_array(name, array):
    array = np.asarray(array)
    if not array.flags.c_contiguous:      # (np.ascontiguousarray would turn a 0-d array into 1-d)
        array = array.copy(order="C")
    if array.dtype.kind not in _ARRAY_KINDS or array.dtype.fields is not None:
        raise TypeError(f"array {name!r}: dtype {array.dtype} cannot be stored (plain numbers only)")
    return array


def _align(n):
    return -(-n // ALIGNMENT) * ALIGNMENT


def _layout(metadata, arrays):
    """Place every array and build the header bytes (prefix + JSON + padding).

    The offsets are written inside the header, so the header's length depends
    on them and they depend on its length: grow the reserved space until the
    header fits in front of the first array (two rounds in practice).
    """
    checksums = {name: zlib.crc32(_bytes_of(a)) for name, a in arrays.items()}
    data_start = _align(_PREFIX.size + 1)
    while True:
        entries, end = [], data_start
        for name, a in arrays.items():
            entries.append(TensorEntry(name, a.dtype, tuple(int(d) for d in a.shape), end,
                                       int(a.nbytes), checksums[name]))
            end = _align(end + a.nbytes)
        body = json.dumps({"metadata": metadata, "file_size": end,
                           "tensors": [e.to_json() for e in entries]},
                          ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass")
        header_end = _PREFIX.size + len(body)
        if header_end <= data_start:
            break
        data_start = _align(header_end)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(body), len(body))
    return (prefix + body).ljust(data_start, b"\0"), entries


def _bytes_of(array):
    """A C-contiguous array's bytes as a flat memoryview, without a copy."""
    return memoryview(array.reshape(-1).view(np.uint8))


def _write_arrays(out, arrays, entries, progress, label):
    total = sum(e.nbytes for e in entries)
    bar = _progress_bar(progress, total, f"writing {label}")
    try:
        for entry in entries:
            out.write(b"\0" * (entry.offset - out.tell()))
            data = _bytes_of(arrays[entry.name])
            for start in range(0, len(data), _WRITE_CHUNK):
                chunk = data[start:start + _WRITE_CHUNK]
                out.write(chunk)
                bar.update(len(chunk))
        out.write(b"\0" * (_align(out.tell()) - out.tell()))
    finally:
        bar.close()


def _progress_bar(progress, total, description):
    from tqdm import tqdm
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, leave=False)


# ---------------------------------------------------------------- reading

def sniff(path):
    """``"llambda"``, ``"gguf"`` or ``None`` from the first bytes of ``path`` (OSError if unreadable)."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC))
    if start == MAGIC:
        return "llambda"
    if start.startswith(GGUF_MAGIC):
        return "gguf"
    return None


def open_weights(path):
    """Map ``path`` read-only and check its header; raises WeightFileError if it is not usable."""
    return WeightFile(path)


class WeightFile(Mapping):
    """A mapped weight file: a read-only mapping ``name -> ndarray`` (zero-copy views).

    ``metadata`` is the dict given to ``write``; ``entries`` the tensor table.
    The arrays stay valid as long as they are referenced, whatever happens to
    this object: each one keeps the mapping alive.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._mapping = _map(self.path)
        header, header_end = _parse_header(self.path, self._mapping)
        self.version = FORMAT_VERSION
        self.metadata = header["metadata"]
        self.file_size = header["file_size"]
        self.entries = _parse_entries(self.path, header["tensors"], header_end, self.file_size)
        self._arrays = {e.name: self._view(e) for e in self.entries}

    def _view(self, entry):
        count = entry.nbytes // entry.dtype.itemsize
        flat = np.frombuffer(self._mapping, dtype=entry.dtype, count=count, offset=entry.offset)
        return flat.reshape(entry.shape)

    def __getitem__(self, name):
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)

    def __repr__(self):
        return f"<WeightFile {self.path} ({len(self)} arrays, {self.file_size} bytes)>"

    def verify(self, progress=None):
        """Check every array's checksum; raise WeightFileError naming the damaged ones."""
        bar = _progress_bar(progress, sum(e.nbytes for e in self.entries), f"verifying {self.path.name}")
        damaged = []
        try:
            for e in self.entries:
                if zlib.crc32(memoryview(self._mapping)[e.offset:e.offset + e.nbytes]) != e.crc32:
                    damaged.append(e.name)
                bar.update(e.nbytes)
        finally:
            bar.close()
        if damaged:
            shown = ", ".join(damaged[:10]) + (f" and {len(damaged) - 10} more" if len(damaged) > 10 else "")
            raise WeightFileError(self.path, f"checksum mismatch in tensor {shown} (the file is damaged)")


def _map(path):
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = f.read(_PREFIX.size)
            _check_prefix(path, start, size)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        page_cache.advise(mapping)        # what faults read in from disk comes in huge folios
        faults.guard(mapping, path)       # a SIGBUS in it (file changed under it) names the file
        return mapping
    except FileNotFoundError:
        raise WeightFileError(path, "no such file") from None
    except IsADirectoryError:
        raise WeightFileError(path, "is a directory, not a weight file") from None
    except OSError as e:
        raise WeightFileError(path, f"cannot read the file ({e.strerror or e})") from None


def _check_prefix(path, start, size):
    if size == 0:
        raise WeightFileError(path, "empty file (0 bytes), not a llambda file")
    if start[:len(MAGIC)] != MAGIC:
        if start.startswith(GGUF_MAGIC):
            raise WeightFileError(path, "this is a GGUF file, not a llambda file: convert it first "
                                        "(llambda converts a GGUF given as the model automatically)")
        if len(start) < len(MAGIC) and MAGIC.startswith(start):
            raise WeightFileError(path, f"truncated: only {size} bytes")
        raise WeightFileError(path, "not a llambda file (wrong magic bytes)")
    if len(start) < _PREFIX.size:
        raise WeightFileError(path, f"truncated: only {size} bytes")
    _, version, _, header_len = _PREFIX.unpack(start)
    if version != FORMAT_VERSION:
        raise WeightFileError(path, f"format version {version} is not supported "
                                    f"(this llambda reads version {FORMAT_VERSION}): convert the model again")
    if _PREFIX.size + header_len > size:
        raise WeightFileError(path, f"truncated: the header needs {_PREFIX.size + header_len} bytes, "
                                    f"the file has {size}")


def _parse_header(path, mapping):
    _, _, header_crc, header_len = _PREFIX.unpack_from(mapping, 0)
    body = mapping[_PREFIX.size:_PREFIX.size + header_len]
    if zlib.crc32(body) != header_crc:
        raise WeightFileError(path, "header checksum mismatch (the file is damaged)")
    try:
        header = json.loads(body.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightFileError(path, f"header is not valid JSON ({e})") from None
    if not (isinstance(header, dict) and isinstance(header.get("metadata"), dict)
            and isinstance(header.get("tensors"), list) and _is_int(header.get("file_size"))):
        raise WeightFileError(path, "header lacks metadata, tensors or file_size")
    if len(mapping) < header["file_size"]:
        raise WeightFileError(path, f"truncated: {len(mapping)} bytes of {header['file_size']}")
    return header, _PREFIX.size + header_len


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entries(path, table, header_end, file_size):
    entries, seen = [], set()
    for raw in table:
        entry = _parse_entry(path, raw)
        if entry.name in seen:
            raise WeightFileError(path, f"tensor {entry.name!r} is listed twice")
        seen.add(entry.name)
        entries.append(entry)
    _check_placement(path, entries, header_end, file_size)
    return entries


def _parse_entry(path, raw):
    try:
        name = raw["name"]
        dtype = np.dtype(raw["dtype"])
        shape = tuple(raw["shape"])
        offset, nbytes, crc = raw["offset"], raw["nbytes"], raw["crc32"]
    except (KeyError, TypeError, ValueError) as e:
        raise WeightFileError(path, f"bad tensor-table entry {raw!r:.200} ({e})") from None
    if not isinstance(name, str):
        raise WeightFileError(path, f"bad tensor-table entry {raw!r:.200} (name is not a string)")
    if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
        raise WeightFileError(path, f"tensor {name!r}: unsupported dtype {raw['dtype']!r}")
    if not all(_is_int(v) and v >= 0 for v in (*shape, offset, nbytes, crc)):
        raise WeightFileError(path, f"tensor {name!r}: shape, offset, nbytes and crc32 must be "
                                    f"non-negative integers")
    if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise WeightFileError(path, f"tensor {name!r}: {nbytes} bytes do not match shape {shape} of {dtype}")
    return TensorEntry(name, dtype, shape, offset, nbytes, crc)


def _check_placement(path, entries, header_end, file_size):
    """Every array must lie after the header, inside the file, aligned, and not overlap another."""
    previous_end, previous_name = header_end, "the header"
    for e in sorted(entries, key=lambda e: e.offset):
        if e.offset % ALIGNMENT:
            raise WeightFileError(path, f"tensor {e.name!r}: offset {e.offset} is not {ALIGNMENT}-byte aligned")
        if e.offset + e.nbytes > file_size:
            raise WeightFileError(path, f"tensor {e.name!r}: bytes {e.offset}..{e.offset + e.nbytes} "
                                        f"point outside the file ({file_size} bytes)")
        if e.offset < previous_end:
            raise WeightFileError(path, f"tensor {e.name!r}: offset {e.offset} overlaps {previous_name}")
        previous_end, previous_name = e.offset + e.nbytes, f"tensor {e.name!r}"
