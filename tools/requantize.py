#!/usr/bin/env python3
"""Re-quantize a GGUF with llama.cpp's own quantizer (needs llama-cpp-python).

    .venv/bin/python tools/requantize.py SRC.gguf DST.gguf TYPE [--threads N] [--pure]
    .venv/bin/python tools/requantize.py ~/.cache/llambda/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        smollm2-135m-Q4_K_M.gguf Q4_K_M

(tests/fetched_files.py makes the test suite's variants this way, into the cache.)

TYPE is a llama.cpp file type (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K, Q5_1, ...:
the LLAMA_FTYPE_MOSTLY_* names). Re-quantizing an already quantized file is
allowed (allow_requantize): the values are dequantized and quantized again, which
is what the SmolLM2 K-quant test files are, since only the Q4_1 model is on PyPI.
llama.cpp picks per-tensor types as its `llama-quantize` does (a Q4_K_M file
mixes Q4_K, Q6_K and fallbacks such as Q5_0 for rows that are not multiples of
256); --pure makes every tensor TYPE's base type. The output is written to a temp
name and renamed, so an interrupted run leaves no half file.
"""
import argparse
import os
import sys
from pathlib import Path


def ftypes(llama_cpp) -> dict:
    prefix = "LLAMA_FTYPE_MOSTLY_"
    return {name[len(prefix):]: getattr(llama_cpp, name) for name in dir(llama_cpp)
            if name.startswith(prefix)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("type", help="llama.cpp file type, e.g. Q4_K_M")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pure", action="store_true", help="no per-tensor type mixing")
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("requantize: llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    known = ftypes(llama_cpp)
    kind = args.type.upper()
    if kind not in known:
        print(f"requantize: unknown type {args.type!r}; one of {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    if not args.src.is_file():
        print(f"requantize: {args.src}: no such file", file=sys.stderr)
        return 2
    if args.dst.resolve() == args.src.resolve():
        print(f"requantize: {args.dst}: the output would overwrite the input", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = known[kind]
    params.nthread = args.threads
    params.allow_requantize = True
    params.pure = args.pure
    tmp = args.dst.with_name(f".{args.dst.name}.{os.getpid()}.tmp")
    try:
        status = llama_cpp.llama_model_quantize(str(args.src).encode(), str(tmp).encode(), params)
        if status != 0:
            print(f"requantize: llama.cpp failed (status {status}) on {args.src}", file=sys.stderr)
            return 1
        os.replace(tmp, args.dst)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"{args.dst}: {kind}, {args.dst.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
