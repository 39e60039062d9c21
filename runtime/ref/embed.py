"""numpy reference: embedding lookup, the layout's own dequantization of the selected rows."""
from .. import layouts

__all__ = ["embed"]


def embed(w, ids, out):
    """out[i, :] = W[ids[i], :] as f32, for ids int [m] and out f32 [m, k] (any weight kind)."""
    out[...] = layouts.rows(w, ids)
