"""A lazy reader of GGUF files: the key/value table, the tensor table, tensor data views.

``gguf.GGUFReader`` builds a numpy view for every element of every array when
it opens a file, which for a 262,144-token vocabulary takes seconds before the
first question can be asked. This reader walks the same layout once with
``struct`` (array elements are only skipped over), decodes a value when it is
asked for, and maps tensor data on demand, with the ``gguf`` package's own
type tables. So a conversion can look at the architecture and the tensor types
before it pays for the vocabulary, and a tokenizer can be read without touching
tensor data.

Tensor data views have the shapes ``GGUFReader`` gives them (float types as
their numpy dtype, quantized types as uint8 rows of blocks), so code written
against one takes the other.
"""
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llambda.runtime import faults

from llambda.errors import UserError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value types (the spec's numbering, as gguf.GGUFValueType has it).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, \
    _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_DTYPES = {
    _UINT8: np.dtype("<u1"), _INT8: np.dtype("<i1"), _UINT16: np.dtype("<u2"),
    _INT16: np.dtype("<i2"), _UINT32: np.dtype("<u4"), _INT32: np.dtype("<i4"),
    _FLOAT32: np.dtype("<f4"), _BOOL: np.dtype("u1"), _UINT64: np.dtype("<u8"),
    _INT64: np.dtype("<i8"), _FLOAT64: np.dtype("<f8"),
}

# Float and integer tensor types GGUFReader hands over in their own dtype; every
# other (block-quantized) type comes as uint8.
_TENSOR_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _shown(name):
    """A key or tensor name for a message: as it is when printable, else its repr (a damaged
    name may hold any bytes, a newline too, and a message is one line)."""
    return name if name.isprintable() else repr(name)


@dataclass(frozen=True)
class _Entry:
    """Where one key's value lies: its type, and for arrays the element type and count."""
    value_type: int
    offset: int
    item_type: int = None
    count: int = None


@dataclass
class GGUFTensor:
    """One row of the tensor table. ``shape`` lists dimensions fastest first (GGUF's ne)."""
    name: str
    tensor_type: object       # gguf.GGMLQuantizationType
    shape: tuple
    data_offset: int          # absolute, in the file
    _file: "GGUFFile"

    @property
    def data(self):
        """The tensor's bytes as GGUFReader shows them (a read-only view of the mapping)."""
        return self._file._tensor_data(self)


class GGUFFile:
    """The tables of one GGUF file; values are decoded when asked for."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                import mmap
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise UserError(f"{self.path}: no such file") from None
        except (OSError, ValueError) as e:   # ValueError: an empty file cannot be mapped
            raise UserError(f"{self.path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        faults.guard(self._buf, self.path)     # a SIGBUS in it (file changed under it) names the file
        self._array = None
        try:
            self._read_tables()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
            # OverflowError: a length or count past any file size (a damaged length field)
            raise UserError(f"{self.path}: damaged or truncated GGUF ({type(e).__name__}: {e})") from None

    # -- the tables ------------------------------------------------------------

    def _read_tables(self):
        buf = self._buf
        if buf[:4] != _MAGIC:
            raise UserError(f"{self.path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise UserError(f"{self.path}: a big-endian GGUF, which llambda does not read")
        if version < 2:
            raise UserError(f"{self.path}: GGUF version {version} predates the supported 2 and 3")
        self.version = version
        pos = 24
        self._entries = {}
        for _ in range(n_kv):
            key, pos = self._string_at(pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            try:
                entry, pos = self._skip_value(value_type, pos)
            except (struct.error, ValueError, OverflowError) as e:
                raise ValueError(f"key {_shown(key)}: {e}") from None
            if key in self._entries:        # as llama.cpp's gguf_init: which one would be meant?
                raise UserError(f"{self.path}: key {_shown(key)} appears twice in the GGUF")
            self._entries[key] = entry
        tensors = []
        for _ in range(n_tensors):
            name, pos = self._string_at(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            raw_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            tensors.append((name, raw_type, shape, offset))
        alignment = self.value("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1:
            raise UserError(f"{self.path}: general.alignment = {alignment!r} is not a positive integer")
        data_start = -(-pos // alignment) * alignment
        self.tensors = [self._tensor(name, raw_type, shape, data_start + offset)
                        for name, raw_type, shape, offset in tensors]
        seen = set()
        for tensor in self.tensors:       # as llama.cpp's gguf_init: which one would be meant?
            if tensor.name in seen:
                raise UserError(f"{self.path}: tensor {_shown(tensor.name)} appears twice in the tensor table")
            seen.add(tensor.name)

    def check_tensors(self):
        """Every tensor whole blocks per row and inside the file, from the table alone, before
        any data is looked at (sizes in Python integers, which a crafted shape cannot
        overflow). Not done on opening: a tokenizer can be read from a file cut after its
        tables."""
        from gguf import GGML_QUANT_SIZES
        for tensor in self.tensors:
            block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
            row = tensor.shape[0] if tensor.shape else 1
            if row % block:
                raise UserError(f"{self.path}: tensor {_shown(tensor.name)} has rows of {row} values, not whole "
                                f"{tensor.tensor_type.name} blocks of {block}")
            n_elements = 1
            for d in tensor.shape:
                n_elements *= d
            if tensor.data_offset + n_elements // block * block_bytes > len(self._buf):
                raise UserError(f"{self.path}: tensor {_shown(tensor.name)} ({' x '.join(map(str, tensor.shape[::-1]))} "
                                f"{tensor.tensor_type.name}) runs past the end of the file")

    def _tensor(self, name, raw_type, shape, offset):
        from gguf import GGMLQuantizationType
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise UserError(f"{self.path}: tensor {name} has unknown type number {raw_type}") from None
        return GGUFTensor(name, tensor_type, tuple(int(d) for d in shape), offset, self)

    def _string_at(self, pos):
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        end = pos + 8 + n
        if end > len(self._buf):
            raise ValueError(f"a string runs past the end of the file at byte {pos}")
        return self._buf[pos + 8:end].decode("utf-8", "surrogateescape"), end

    def _skip_value(self, value_type, pos):
        """(where the value is, the position after it), without decoding arrays."""
        if value_type == _STRING:
            (n,) = struct.unpack_from("<Q", self._buf, pos)
            return _Entry(value_type, pos), pos + 8 + n
        if value_type in _SCALAR_DTYPES:
            return _Entry(value_type, pos), pos + _SCALAR_DTYPES[value_type].itemsize
        if value_type != _ARRAY:
            raise ValueError(f"unknown value type {value_type} at byte {pos}")
        item_type, count = struct.unpack_from("<IQ", self._buf, pos)
        start = pos + 12
        if item_type in _SCALAR_DTYPES:
            end = start + count * _SCALAR_DTYPES[item_type].itemsize
        elif item_type == _STRING:
            end, unpack, buf = start, struct.Struct("<Q").unpack_from, self._buf
            for _ in range(count):           # the one loop over every token text
                end += 8 + unpack(buf, end)[0]
        else:
            end = start
            for _ in range(count):
                _, end = self._skip_value(item_type, end)
        if end > len(self._buf):
            raise ValueError(f"an array runs past the end of the file at byte {pos}")
        return _Entry(value_type, start, item_type, count), end

    # -- values ----------------------------------------------------------------

    def keys(self):
        return list(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def array_length(self, key):
        """Element count of an array value (None if absent or not an array), without decoding it."""
        entry = self._entries.get(key)
        return entry.count if entry is not None and entry.value_type == _ARRAY else None

    def value(self, key, default=None):
        """A key's value as plain Python (str, int, float, bool, lists of those)."""
        entry = self._entries.get(key)
        if entry is None:
            return default
        return self._decode(entry.value_type, entry.offset, entry.item_type, entry.count)

    def metadata(self, keep=lambda key: True):
        """{key: value} of every key ``keep`` accepts (the GGUF.* header fields are not keys)."""
        return {key: self.value(key) for key in self._entries if keep(key)}

    def _decode(self, value_type, pos, item_type=None, count=None):
        buf = self._buf
        if value_type == _STRING:
            return self._string_at(pos)[0]
        if value_type == _BOOL:
            return bool(buf[pos])
        if value_type in _SCALAR_DTYPES:
            return np.frombuffer(buf, _SCALAR_DTYPES[value_type], 1, pos)[0].item()
        if item_type in _SCALAR_DTYPES:
            values = np.frombuffer(buf, _SCALAR_DTYPES[item_type], count, pos)
            return values.astype(bool).tolist() if item_type == _BOOL else values.tolist()
        if item_type == _STRING:
            unpack, out = struct.Struct("<Q").unpack_from, []
            for _ in range(count):
                n = unpack(buf, pos)[0]
                out.append(buf[pos + 8:pos + 8 + n])
                pos += 8 + n
            try:
                return [b.decode("utf-8") for b in out]
            except UnicodeDecodeError:
                # Some vocabularies hold raw byte tokens that are not UTF-8: keep
                # their bytes recoverable as surrogate escapes instead of failing.
                return [b.decode("utf-8", "surrogateescape") for b in out]
        values = []
        for _ in range(count):
            entry, end = self._skip_value(item_type, pos)
            values.append(self._decode(entry.value_type, entry.offset, entry.item_type, entry.count))
            pos = end
        return values

    # -- tensor data -----------------------------------------------------------

    def _tensor_data(self, tensor):
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import quant_shape_to_byte_shape
        if self._array is None:
            self._array = np.frombuffer(self._buf, dtype=np.uint8)
        n_elements = 1
        for d in tensor.shape:            # Python integers: a crafted shape cannot overflow them
            n_elements *= d
        np_shape = tuple(reversed(tensor.shape))
        type_name = tensor.tensor_type.name
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        n_bytes = n_elements * block_bytes // block
        end = tensor.data_offset + n_bytes
        if end > len(self._array):
            raise UserError(f"{self.path}: tensor {tensor.name} runs past the end of the file")
        raw = self._array[tensor.data_offset:end]
        if type_name in _TENSOR_DTYPES:
            return raw.view(_TENSOR_DTYPES[type_name]).reshape(np_shape)
        return raw.reshape(quant_shape_to_byte_shape(np_shape, tensor.tensor_type))
