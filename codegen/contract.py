"""The contract between the kernels and the runtime: sizes, layouts and names both sides rely on.

PeachPy-free (numpy only), so ``runtime/`` imports it at run time without
importing the generators. A change here changes the library's source key
(codegen/build.py hashes every module of this folder), so kernels and
bindings never disagree about a size.
"""
import numpy as np

# -- quantized weights (runtime/layout_quant.py packs them, codegen/qgemm.py reads them)
BLOCK = 32           # weights per quantization block (GGUF's QK4_0 = QK8_0 = 32), activations too
SUPER_BLOCK = 256    # weights per K-quant super-block (GGUF's QK_K)
GROUP = 8            # weight rows interleaved together = f32 lanes of one ymm output vector
CHUNK = 4            # quant bytes of one row per 32-byte load of a group

# -- float weights (runtime/layout_float.py packs them, codegen/gemm.py reads them)
PANEL = 16           # weight rows per panel: two ymm of f32 columns

# -- plans (runtime/plan.py writes records, codegen/executor.py walks them)
RECORD_BYTES = 128
FN_OFFSET = 0
FLOAT_ARGS_OFFSET = 8
BARRIER_OFFSET = 16
INT_ARGS_OFFSET = 24
MAX_INT_ARGS = 13
MAX_FLOAT_ARGS = 2
STAMP_WORDS = 2      # per op and thread: kernel returned, released

# -- the arrays of each packed quantized kind, after the leading [row groups, blocks] axes:
#    (array name, dtype, trailing shape). Both the packer and the kernels' strides follow it.
QUANT_ARRAYS = {
    "q4_1": (("qs", np.uint8, (BLOCK // 2 // CHUNK, GROUP, CHUNK)),      # nibbles, 4 chunks
             ("dm", np.float16, (2, GROUP))),                            # d then m of each row
    "q8_0": (("qs", np.int8, (BLOCK // CHUNK, GROUP, CHUNK)),            # int8, 8 chunks
             ("d", np.float16, (GROUP,))),
}


def quant_array_bytes(kind):
    """Bytes of each array of ``kind`` per block of one row group, in QUANT_ARRAYS order."""
    return tuple(int(np.dtype(dtype).itemsize * np.prod(tail)) for _, dtype, tail in QUANT_ARRAYS[kind])


def symbol(op, types, tile, isa):
    """``llb_<op>_<types>_<tile>__<isa>``: what a symbol is, readable from ``nm``."""
    parts = ["llb", op]
    if types:
        parts.append(types)
    if tile:
        parts.append(tile)
    return "_".join(parts) + "__" + isa


def qgemm_symbol(kind, tile, isa):
    return symbol("qgemm", f"{kind}_q8", tile, isa)


def embed_symbol(kind, isa="avx2"):
    return symbol("embed", kind, "", isa)
