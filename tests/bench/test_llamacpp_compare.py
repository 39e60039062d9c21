"""The real-file checks of llambda.bench.llamacpp_compare, without llama.cpp: a stand-in
for llama-cpp-python's Llama that answers with llambda's own logits (optionally
bent) shows that each check passes when it should and fails when it should."""
from types import SimpleNamespace

import numpy as np
import pytest

import llambda
from llambda.errors import UserError
from llambda.bench.llamacpp_compare import compare_prompt, format_report, kl_divergence
from synth import PRESETS, write_random_llama

PROMPT = "The cat sat on the mat and then"


class FakeLlama:
    """The part of llama_cpp.Llama that compare_prompt uses, backed by a llambda model."""

    def __init__(self, model, n_ctx, bend=None, extra_id=None):
        self.model, self.bend, self.extra_id = model, bend, extra_id
        self.scores = np.zeros((n_ctx, model.config.vocab_size), dtype=np.float32)
        self.ids = []

    @property
    def n_tokens(self):
        return len(self.ids)

    def tokenize(self, data, add_bos=True, special=False):
        ids = self.model.tokenize(data.decode(), add_special=add_bos, parse_special=special)
        return ids + [self.extra_id] if self.extra_id is not None else ids

    def reset(self):
        self.ids = []

    def eval(self, ids):
        self.ids += list(ids)
        logits = self.model.logits(self.ids)
        if self.bend is not None:
            logits = self.bend(logits)
        self.scores[:len(self.ids)] = logits


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cmp") / "tiny.gguf"
    write_random_llama(path, tensor_type="F32", seed=5, n_ctx=128, **PRESETS["tiny"])
    with llambda.load(path, n_ctx=128, progress=False) as m:
        yield m


def _pair(model, **fake):
    return SimpleNamespace(model=model, llm=FakeLlama(model, 128, **fake), n_ctx=128)


def test_identical_logits_pass(model):
    report = compare_prompt(_pair(model), PROMPT, steps=6)
    assert report.ok, report.failures
    assert len(report.steps) == 6
    assert all(s.ours == s.token and s.kl < 1e-9 for s in report.steps)
    assert "PASS" in format_report(report, model.detokenize)


def test_different_token_ids_fail(model):
    report = compare_prompt(_pair(model, extra_id=5), PROMPT, steps=2)
    assert any("token ids (special)" in f for f in report.failures)
    assert any("token ids (plain)" in f for f in report.failures)


def test_a_flipped_clear_argmax_fails_and_a_near_tie_does_not(model):
    def swap_top2(logits):
        # llama.cpp's "top-2" becomes our top-1 at every row: margins stay the same.
        out = logits.copy()
        order = np.argsort(out, axis=-1)
        rows = np.arange(len(out))
        top1, top2 = order[:, -1], order[:, -2]
        out[rows, top1], out[rows, top2] = logits[rows, top2], logits[rows, top1]
        return out

    strict = compare_prompt(_pair(model, bend=swap_top2), PROMPT, steps=4, margin=0.0, kl_max=1e9)
    assert any("argmax differs" in f for f in strict.failures)
    lenient = compare_prompt(_pair(model, bend=swap_top2), PROMPT, steps=4, margin=1e9, kl_max=1e9)
    assert lenient.ok, lenient.failures


def test_kl_at_the_prompt_end_is_bounded(model):
    def noisy(logits):
        return logits + np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32) * 3
    report = compare_prompt(_pair(model, bend=noisy), PROMPT, steps=1, margin=1e9)
    assert report.kl_prompt_end > 0.05
    assert any("KL" in f for f in report.failures)


def test_kl_divergence():
    p = np.array([[0.0, 1.0, 2.0]])
    assert kl_divergence(p, p)[0] == pytest.approx(0.0, abs=1e-12)
    q = np.array([[2.0, 1.0, 0.0]])
    pp = np.exp(p) / np.exp(p).sum()
    qq = np.exp(q) / np.exp(q).sum()
    assert kl_divergence(p, q)[0] == pytest.approx(float((pp * np.log(pp / qq)).sum()))


def test_bad_steps_and_empty_prompt(model):
    with pytest.raises(UserError, match="--steps"):
        compare_prompt(_pair(model), PROMPT, steps=0)
    with pytest.raises(UserError, match="no tokens"):
        compare_prompt(_pair(model), "", steps=1)
