"""Rows per step: float models prefill 256 rows a step, quantized ones 128 (llambda/model/forward.py)."""
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from llambda.model.forward import DEFAULT_BATCH, FLOAT_BATCH, default_batch
from llambda.runtime import layouts


def _packed(kind, n=32, k=64):
    w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.1
    raw = {"F32": w, "F16": w.astype(np.float16)}.get(kind)
    if raw is None:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return layouts.pack(kind, raw, n, k)


def _layers(*kinds_per_layer):
    """Blocks with a norm vector (never counted) and one projection weight per kind."""
    return [SimpleNamespace(attn_norm=np.ones(64, np.float32), bias={},
                            **{f"w{i}": _packed(kind) for i, kind in enumerate(kinds)})
            for kinds in kinds_per_layer]


@pytest.mark.parametrize("kinds, rows", [
    ((("F16", "F16"), ("F16", "F16")), FLOAT_BATCH),
    ((("F32",), ("BF16",)), FLOAT_BATCH),
    ((("Q4_1", "Q4_1"),), DEFAULT_BATCH),
    # one quantized projection makes a quantized model: its GEMMs keep the smaller step
    ((("F16", "F16"), ("F16", "Q8_0")), DEFAULT_BATCH),
    ((), DEFAULT_BATCH),
])
def test_default_batch_by_weight_kinds(kinds, rows):
    assert default_batch(_layers(*kinds)) == rows
    assert FLOAT_BATCH > DEFAULT_BATCH


@pytest.mark.parametrize("tensor_type, rows", [("F16", FLOAT_BATCH), ("Q8_0", DEFAULT_BATCH)])
def test_loaded_model_steps_and_chunked_prefill(tmp_path, tensor_type, rows):
    """A loaded model takes its kinds' step; a prompt longer than one step prefills in
    steps of that many rows and gives the bits of the last row of the all-rows forward."""
    import llambda
    from synth_arch import write_random_model
    path = write_random_model(tmp_path / f"m-{tensor_type}.gguf", seed=3, tensor_type=tensor_type,
                              vocab_size=320, n_ctx=1024)
    ids = np.random.default_rng(1).integers(0, 320, rows + 37).tolist()
    with llambda.load(path, n_ctx=1024, progress=False) as model:
        assert model.net.max_batch == rows
        last = model.evaluate(ids)
        full = model.logits(ids)
    np.testing.assert_array_equal(last[:320], full[-1][:320])
