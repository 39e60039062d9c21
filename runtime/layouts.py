"""Weight layouts: GGUF tensors repacked once into what the kernels read fastest.

A ``PackedWeight`` is a matrix ``W[n, k]`` (n output rows, k inputs; GGUF's
``ne = [k, n]``) stored as a few named, 64-byte-aligned numpy arrays whose
meaning depends on ``kind``:

    kind    arrays (see layout_quant.py / layout_float.py for the exact order)
    q4_1    qs (nibbles, 8 rows interleaved 4 bytes at a time), dm (f16 scales, mins)
            -- Q4_0 (as m = -8d) and Q4_1 weights
    q8_0    qs (int8, 8 rows interleaved 4 bytes at a time), d (f16 scales) -- Q8_0 weights
    q5_0    qs (five-bit quants packed 20 bytes a block, 8 rows interleaved), d -- Q5_0 weights
    q5_1    qs (as q5_0), dm (f16 scales, mins)                      -- Q5_1 weights
    q6_k    qs (6-bit, 3 planes a sub-block), sc (int8), d (f16 per 256)  -- Q6_K weights
    q3_k    qs (3-bit, 3 planes), sc (int8 sc - 32), d (f16 per 256)     -- Q3_K weights
    q2_k    qs (2-bit, 2 planes), sm (scale | min << 4), dm (f16 per 256) -- Q2_K weights
            (layout_kquant16.py)
    q4_k    qs (nibbles as q4_1), scales (per super-block: f16 d, -dmin, u8 block scales, mins)
            -- Q4_K weights (layout_kquant.py)
    q5_k    qs (nibbles as q4_1, then the high bits), scales (as q4_k) -- Q5_K weights
    f32     panels of f32                                            -- F32 weights
    f16     panels of f16                                            -- F16 weights
    bf16    panels of bf16 bits (uint16), widened exactly by the GEMM -- BF16 weights
    bf16_pairs  panels of (even, odd) k pairs of bf16 bits, for vdpbf16ps -- BF16 weights
            where runtime/bf16_math.py chooses it (layout_bf16.py)

The weight file stores exactly these arrays, so loading is mapping them.
``pack`` / ``dequantize`` / ``rows`` dispatch on kind to the module that owns
the layout; each registers itself in ``LAYOUTS``.
"""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PackedWeight:
    kind: str
    n: int
    k: int
    arrays: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)     # small layout parameters (ints/strings), JSON-able

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.arrays.values())


@dataclass
class Layout:
    """How one weight kind is packed and read back (numpy, conversion and test time)."""
    kind: str
    source_types: tuple       # GGUF type names packed into this kind, e.g. ("Q4_0", "Q4_1")
    pack: callable            # (gguf_type_name, raw ndarray as gguf gives it, n, k) -> PackedWeight
    dequantize: callable      # (PackedWeight) -> f32 [n, k]
    rows: callable            # (PackedWeight, ids int array) -> f32 [len(ids), k]


LAYOUTS = {}          # kind -> Layout
_BY_SOURCE = {}       # GGUF type name -> the Layout it packs into unless told otherwise


def register(layout, default=True):
    """``default``: the layout its source types pack into when ``pack`` names no kind (a
    layout that is only chosen, as bf16_pairs, is registered with default=False)."""
    LAYOUTS[layout.kind] = layout
    for t in layout.source_types:
        if default or t not in _BY_SOURCE:
            _BY_SOURCE[t] = layout


def _load_layouts():
    from . import layout_quant, layout_float, layout_q5, layout_kquant, layout_kquant16, layout_bf16  # noqa: F401  (each calls register)


def supported_types():
    _load_layouts()
    return sorted(_BY_SOURCE)


def pack(gguf_type, raw, n, k, kind=None):
    """Repack one GGUF tensor (``raw`` as ``gguf.GGUFReader`` returns its data) into a PackedWeight,
    of ``kind`` when given (one of the kinds that type packs into), else of the type's default kind."""
    _load_layouts()
    layout = _BY_SOURCE.get(gguf_type)
    if layout is None:
        raise ValueError(f"tensor type {gguf_type} is not supported (supported: {', '.join(sorted(_BY_SOURCE))})")
    if kind is not None:
        chosen = LAYOUTS.get(kind)
        if chosen is None or gguf_type not in chosen.source_types:
            able = sorted(name for name, other in LAYOUTS.items() if gguf_type in other.source_types)
            raise ValueError(f"tensor type {gguf_type} does not pack into kind {kind!r} (it packs into {', '.join(able)})")
        layout = chosen
    return layout.pack(gguf_type, raw, n, k)


def dequantize(w):
    _load_layouts()
    return LAYOUTS[w.kind].dequantize(w)


def rows(w, ids):
    _load_layouts()
    return LAYOUTS[w.kind].rows(w, np.asarray(ids))
