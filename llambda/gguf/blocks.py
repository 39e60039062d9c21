"""Where each GGUF block type keeps its f16 scales (ggml-common.h), to find the blocks whose
scale is NaN or infinite before a conversion repacks them: such a block makes every dot
product over its row NaN, which would surface only as NaN logits at generation time.

    first_bad_scale("Q4_K", raw) -> (block index, value) or None

Checking reads 2 or 4 bytes a block, one row of blocks at a time, and copies no tensor.
"""
import numpy as np

# byte offsets of the f16 scale fields inside one block
SCALE_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
_CHUNK_BLOCKS = 1 << 16         # blocks looked at per step (a few hundred kB of scales)


def first_bad_scale(type_name, raw):
    """(index of the first block whose scale is NaN or infinite, that value), or None; for a
    type without f16 block scales, None. ``raw``: the tensor's bytes as the GGUF reader
    gives them (uint8 rows of blocks)."""
    offsets = SCALE_OFFSETS.get(type_name)
    if offsets is None:
        return None
    import gguf
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    blocks = np.asarray(raw).reshape(-1, block_bytes)
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        chunk = blocks[start:start + _CHUNK_BLOCKS]
        for offset in offsets:
            scales = np.ascontiguousarray(chunk[:, offset:offset + 2]).view(np.float16).reshape(-1)
            bad = np.flatnonzero(~np.isfinite(scales))
            if bad.size:
                return start + int(bad[0]), float(scales[bad[0]])
    return None
