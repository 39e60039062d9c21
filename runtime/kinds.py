"""What each packed weight kind needs, in one table (the idea of ggml's ``type_traits_cpu``).

A ``PackedWeight``'s kind (runtime/layouts.py) decides three things that used
to be if/elif ladders in the model and the bindings:

- ``activation``: what the linear op multiplies it with. ``"q8"``: activations
  quantized once per input to int8 blocks of 32 with their f32 scale and
  scaled sum (``quantize_q8``), shared by every weight that reads the same
  input; ``"f32"``: the activations as they are.
- ``linear``: the backend op computing ``out = x . W^T`` (every backend has it).
- ``embed``: whether an in-plan embedding-lookup kernel reads this kind
  (codegen/embed.py); otherwise the model looks token rows up with
  ``layouts.rows`` before the plan runs.

The packed arrays of the quantized kinds (names, dtypes, shapes) are part of
the kernels' contract and live in ``codegen/contract.py``.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class KindTraits:
    kind: str
    activation: str       # "q8", "bf16" or "f32"
    linear: str           # backend op name: op(activations..., w, out)
    embed: bool = False   # an embed kernel reads this kind inside a plan


TRAITS = {t.kind: t for t in (
    KindTraits("q4_1", activation="q8", linear="qgemm", embed=True),
    KindTraits("q8_0", activation="q8", linear="qgemm", embed=True),
    KindTraits("q5_0", activation="q8", linear="qgemm"),
    KindTraits("q5_1", activation="q8", linear="qgemm"),
    KindTraits("q6_k", activation="q8", linear="qgemm"),
    KindTraits("q3_k", activation="q8", linear="qgemm"),
    KindTraits("q2_k", activation="q8", linear="qgemm"),
    KindTraits("q4_k", activation="q8", linear="qgemm"),
    KindTraits("q5_k", activation="q8", linear="qgemm"),
    KindTraits("f32", activation="f32", linear="gemm_f32"),
    KindTraits("f16", activation="f32", linear="gemm_f16"),
    KindTraits("bf16", activation="f32", linear="gemm_bf16"),
    KindTraits("bf16_pairs", activation="bf16", linear="gemm_bf16_pairs"),
)}


def traits(kind):
    """The KindTraits of ``kind``; a clear error for a kind nothing can multiply."""
    found = TRAITS.get(kind)
    if found is None:
        raise ValueError(f"weight kind {kind!r} has no kernels (known kinds: {', '.join(TRAITS)})")
    return found


def quantized_kinds():
    return tuple(k for k, t in TRAITS.items() if t.activation == "q8")


def embed_kinds():
    return tuple(k for k, t in TRAITS.items() if t.embed)
