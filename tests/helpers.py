"""Test helpers shared by the kernel tests."""
import numpy as np
from hypothesis import strategies as st

from llambda.runtime import buffers


def nan_buffer(shape, dtype=np.float32):
    """An aligned output buffer pre-filled with NaN, so an unwritten element fails."""
    return buffers.full(shape, np.nan, dtype)


def sizes(tile, large=300):
    """Sizes hitting every edge of a tile: 1, tile-1, tile, tile+1, 2*tile+1, and some large."""
    edges = sorted({1, max(1, tile - 1), tile, tile + 1, 2 * tile + 1})
    return st.one_of(st.sampled_from(edges), st.integers(1, large))


def float_arrays(draw, shape, scale=None):
    """Values with zeros, negatives, large and tiny magnitudes mixed in."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = scale if scale is not None else draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    if x.size and draw(st.booleans()):
        mask = rng.random(shape) < 0.1
        x[mask] = 0.0
    return buffers.aligned_copy(x, np.float32)
