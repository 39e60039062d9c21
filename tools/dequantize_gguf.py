#!/usr/bin/env python3
"""Copy a GGUF with some tensor types dequantized to F32 (gguf-py's dequantizer).

    python tools/dequantize_gguf.py model-q4_k_m.gguf -o model-f32.gguf --types Q4_K Q5_0 Q6_K

Lets a file whose quantization llambda cannot load yet run on llambda and on
llama.cpp alike, to compare the two on identical weights. Metadata is copied
as is (general.file_type too); tensors of other types are copied byte for byte.
"""
import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from llambda.gguf.writer import TensorInfo, add_entries, field_entries, write_gguf


def dequantized_copy(source, target, types):
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path=None, arch=arch)
    add_entries(writer, field_entries(reader, lambda key: not key.startswith("GGUF.")
                                      and key != "general.architecture"))
    infos, arrays = [], []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))          # numpy order
        if t.tensor_type.name in types:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
            infos.append(TensorInfo(t.name, shape, np.dtype(np.float32), data.nbytes))
        else:
            data = t.data
            raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
            infos.append(TensorInfo(t.name, data.shape, data.dtype, data.nbytes, raw_dtype=raw))
        arrays.append(data)
    return write_gguf(target, writer, infos, arrays)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--types", nargs="+", required=True, help="GGML type names to dequantize")
    args = parser.parse_args(argv)
    print(dequantized_copy(args.source, args.output, set(args.types)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
