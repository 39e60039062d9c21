"""Crafted GGUFs: a valid file rewritten with one thing wrong (issue 39's hostile files).

    craft(src, dst, keys={"gemma3.attention.sliding_window": 0}, drop_tensors=["blk.0.attn_q.weight"])

``src`` is read with gguf's own reader and written again with its writer, with

* ``keys``: key -> value, or (value, gguf.GGUFValueType) to give the type (set or replaced);
* ``drop_keys``, ``drop_tensors``: left out;
* ``duplicate``: tensor names written a second time (the writer refuses a duplicate name, so the
  copy is written under a name of the same length and its name bytes patched afterwards);
* ``edit``: tensor name -> function of its data (a numpy copy: uint8 blocks for quantized types)
  returning the bytes to write in its place;
* ``shapes``: tensor name -> the shape (numpy order) the tensor table declares, whatever its
  bytes hold;
* ``cut``: the file's length after writing (a tensor running past the end);
* ``patch``: (bytes, replacement) pairs: the replacement is written over the file from the
  first occurrence of the bytes on (it may be longer than they are).

The tensor table declares ``shapes`` and the byte counts as given: nothing here checks that
they agree, which is the point.
"""
import struct
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType


def _typed(value):
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        return value
    if isinstance(value, bool):
        return value, GGUFValueType.BOOL
    if isinstance(value, int):
        return value, (GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64)
    if isinstance(value, float):
        return value, GGUFValueType.FLOAT32
    if isinstance(value, str):
        return value, GGUFValueType.STRING
    raise TypeError(f"give the GGUF type of {value!r}")


def _placeholder(name):
    """A name of the same length as ``name`` that no tensor has."""
    return name[:-1] + ("#" if name[-1] != "#" else "%")


def craft(src, dst, *, keys=None, drop_keys=(), drop_tensors=(), duplicate=(), edit=None, shapes=None,
          cut=None, patch=()):
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    keys = dict(keys or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in keys:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    for name, value in keys.items():
        writer.add_key_value(name, *_typed(value))
    edit, shapes = edit or {}, shapes or {}
    written = []
    for tensor in reader.tensors:
        if tensor.name in drop_tensors:
            continue
        data = np.array(tensor.data)
        if tensor.name in edit:
            data = np.ascontiguousarray(edit[tensor.name](data))
        shape = shapes.get(tensor.name, tuple(int(d) for d in reversed(tensor.shape)))
        copies = [tensor.name] + ([_placeholder(tensor.name)] if tensor.name in duplicate else [])
        for name in copies:
            # a float dtype keeps ``shape`` as the element shape the table declares
            writer.add_tensor_info(name, shape, np.dtype(np.float32), data.nbytes, raw_dtype=tensor.tensor_type)
            written.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in written:
        writer.write_tensor_data(data)
    writer.close()
    dst = Path(dst)
    patch = [(_placeholder(name).encode(), name.encode()) for name in duplicate] + list(patch)
    if patch:
        raw = bytearray(dst.read_bytes())
        for old, new in patch:
            at = raw.index(old)
            raw[at:at + len(new)] = new         # written over the bytes from there on
        dst.write_bytes(bytes(raw))
    if cut is not None:
        with open(dst, "r+b") as f:
            f.truncate(cut)
    return dst


def scales_at(type_name):
    """Byte offsets of the f16 scale(s) in one block of ``type_name`` (ggml-common.h): the
    super-block scale d (and dmin) of the K-quants, the block scale d (and m) of Q5_0/Q5_1."""
    return {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
            "Q5_0": (0,), "Q5_1": (0, 2), "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,)}[type_name]


def with_scale(type_name, value, block=0):
    """An ``edit`` that sets the first scale of block ``block`` (of the whole tensor) to the
    f16 ``value`` (nan, inf)."""
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]

    def apply(data):
        flat = data.reshape(-1).copy()
        at = block * block_bytes + scales_at(type_name)[0]
        flat[at:at + 2] = np.array([value], np.float16).view(np.uint8)
        return flat.reshape(data.shape)
    return apply


def array_count(key, item_type, count):
    """A ``patch`` that sets the element count of the array ``key`` (of ``item_type``)."""
    head = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<II", GGUFValueType.ARRAY, item_type)
    return head, head + struct.pack("<Q", count)
