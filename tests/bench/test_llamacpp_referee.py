"""llama.cpp as the independent referee, without llama.cpp installed.

tools/record_llamacpp_logits.py ran llama.cpp (llama-cpp-python 0.3.36, one
thread, flash attention, F32 K/V cache) on every fixture model of
tests/fixture_models.py and stored its logits in tests/fixtures/llamacpp/.
Here each model is regenerated from its seed, the sha256 of its content checked
against the recorded one (a generator change must come with a new recording), and llambda's
fast path and the numpy reference forward are compared with llama.cpp.

Tolerances, relative to the spread of llama.cpp's logits (max - min over the
recorded positions: 12-50 on these models):
- F32: max |dlogit| <= 0.1% of the spread. Both sides multiply in f32 (llama.cpp
  keeps F32 activations for F32 weights, and the K/V cache is F32 here), but
  llama.cpp's flash attention and its GELU (an f16 table) round on the way;
  measured: at most 0.05% (gemma3).
- F16: max |dlogit| <= 0.2% of the spread: llama.cpp also rounds the activations
  to f16 before multiplying F16 weights, llambda does not; measured: <= 0.06%.
- Quantized: llama.cpp quantizes activations (Q8_0/Q8_1 blocks of 32 for the
  32-blocks, Q8_K super-blocks of 256 for K-quants) and the reference forward
  does not, while llambda uses Q8 blocks of 32 with its own rounding. We require
  max |dlogit| <= 5% of the spread, the same top-1 token wherever llama.cpp's
  top-2 margin is at least 2% of the spread (random models have near ties: one
  llama Q5_K position has a margin of 0.007), and KL(llama.cpp || ours) <= 0.02
  nats averaged over the positions (as tests/model/test_model.py does against the
  reference). Measured on llama: the reference is within 0.3-2.6% of the spread
  and KL <= 0.0033; the fast path within 0.5-0.7% (Q8_0, Q4_0, Q4_1).
"""
from __future__ import annotations

import numpy as np
import pytest

import llambda
from llambda.model import convert
from llambda.bench.llamacpp_compare import kl_divergence
from fixture_models import ARCHS, TYPES, content_sha256, fixture_spec, sha256_of, write_fixture_model
from llamacpp_fixtures import Recording
from reference_forward import reference_logits

FLOAT_TYPES = ("F32", "F16")

CASES = [pytest.param(arch, type_name, id=f"{arch}-{type_name}") for arch in ARCHS for type_name in TYPES]


_models: dict = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("referee")


def _fixture(arch, type_name, model_dir):
    """(recording, GGUF path, llb path) for one combination, generated once per module."""
    key = (arch, type_name)
    if key not in _models:
        recording = Recording(f"{arch}-{type_name}", how=f"--set referee --arch {arch} --type {type_name} ")
        gguf_path = write_fixture_model(model_dir / f"{arch}-{type_name}.gguf", arch, type_name,
                                        recording.params["seed"])
        _models[key] = (recording, gguf_path, model_dir / f"{arch}-{type_name}.llb")
    return _models[key]


def compare(ours, theirs, clear_margin=0.02):
    """Agreement of our logits with llama.cpp's: max |d| (absolute and / spread), top-1
    agreement over all positions and over those whose top-2 margin is clear
    (>= clear_margin * spread), mean KL(llama.cpp || ours)."""
    kl = float(kl_divergence(theirs, ours).mean())
    spread = theirs.max() - theirs.min()
    top2 = np.sort(theirs, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= clear_margin * spread
    agree = ours.argmax(-1) == theirs.argmax(-1)
    return dict(max_abs=float(np.abs(ours - theirs).max()),
                rel=float(np.abs(ours - theirs).max() / spread),
                top1=float(agree.mean()), top1_clear=float(agree[clear].mean()) if clear.any() else 1.0,
                kl=kl)


def check_against_llamacpp(ours, recording, type_name, who):
    theirs = recording.logits
    assert ours.shape == theirs.shape, f"{who}: logits {ours.shape}, llama.cpp {theirs.shape}"
    assert np.isfinite(ours).all(), f"{who}: non-finite logits"
    stats = compare(ours, theirs)
    label = f"{who} vs llama.cpp ({type_name}): " + ", ".join(f"{k} {v:.4g}" for k, v in stats.items())
    if type_name in FLOAT_TYPES:
        assert stats["rel"] <= (1e-3 if type_name == "F32" else 2e-3), label
    else:
        assert stats["rel"] <= 0.05, label
        assert stats["top1_clear"] == 1.0, label
        assert stats["kl"] <= 0.02, label


@pytest.mark.parametrize("arch,type_name", CASES)
def test_fixture_model_is_the_recorded_one(arch, type_name, model_dir):
    """The generator still writes the model llama.cpp was run on: same parameters, same
    metadata and tensor bytes."""
    recording, gguf_path, _ = _fixture(arch, type_name, model_dir)
    now = fixture_spec(arch, type_name, recording.params["seed"]).as_dict()
    changed = sorted(k for k in now.keys() | recording.params.keys()
                     if now.get(k) != recording.params.get(k))
    assert not changed, f"{arch}-{type_name}: generator parameters changed since the recording: {changed}"
    # The content, not the file: another gguf version may lay the same model out differently.
    assert content_sha256(gguf_path) == recording.content_sha256, (
        f"{arch}-{type_name}: tests/fixture_models.py now writes a different model than the one "
        "llama.cpp's logits were recorded on; re-record with tools/record_llamacpp_logits.py")


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = sha256_of(write_fixture_model(tmp_path / "a.gguf", "qwen3", "Q4_K", seed=11))
    b = sha256_of(write_fixture_model(tmp_path / "b.gguf", "qwen3", "Q4_K", seed=11))
    c = sha256_of(write_fixture_model(tmp_path / "c.gguf", "qwen3", "Q4_K", seed=12))
    assert a == b != c


@pytest.mark.parametrize("arch,type_name", CASES)
def test_fast_path_matches_llamacpp(arch, type_name, model_dir):
    recording, gguf_path, llb_path = _fixture(arch, type_name, model_dir)
    if not llb_path.exists():
        convert.convert(gguf_path, llb_path, progress=False)
    with llambda.load(llb_path, n_ctx=64, progress=False) as model:
        logits = model.logits(recording.ids)
    check_against_llamacpp(logits[recording.positions], recording, type_name, "fast path")


@pytest.mark.parametrize("arch,type_name", CASES)
def test_fast_path_decode_matches_llamacpp(arch, type_name, model_dir):
    """Token by token through the KV cache (the decode plans, windowed attention over
    the cache) rather than one prefill."""
    recording, gguf_path, llb_path = _fixture(arch, type_name, model_dir)
    if not llb_path.exists():
        convert.convert(gguf_path, llb_path, progress=False)
    with llambda.load(llb_path, n_ctx=64, progress=False) as model:
        rows = [model.logits(recording.ids[:1])[0]]
        # evaluate() returns a view of the model's logits buffer: copy each row.
        rows += [np.array(model.evaluate(recording.ids[:n + 1])) for n in range(1, len(recording.ids))]
    logits = np.stack(rows)
    check_against_llamacpp(logits[recording.positions], recording, type_name, "fast path, decoding")


@pytest.mark.parametrize("arch,type_name", CASES)
def test_reference_forward_matches_llamacpp(arch, type_name, model_dir):
    recording, gguf_path, _ = _fixture(arch, type_name, model_dir)
    logits = reference_logits(str(gguf_path), recording.ids)
    check_against_llamacpp(logits[recording.positions], recording, type_name, "reference")
