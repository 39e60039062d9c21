"""Embedding rows beyond the vocabulary (issue 7 part 3).

Qwen files pad the embedding past their tokens (151,936 rows for about 151,665
tokens); converters from Hugging Face list the extra rows as ``[PAD<id>]``
tokens, and a file may also simply have more rows than tokens. Those ids are
never sampled (evaluate gives them -inf) and so never reach the detokenizer;
``logits`` still returns every row, as llama.cpp does.
"""
from pathlib import Path

import gguf
import numpy as np
import pytest

import llambda
from llambda.api import vocabulary_size
import vocab_fixtures
from synth_arch import write_random_model

SIZES = dict(arch="qwen2", n_layer=1, dim=32, n_head=2, n_kv_head=1, ffn_dim=48, n_ctx=128)


def test_vocabulary_size_drops_trailing_pad_fillers():
    tokens = ["a", "b", "[PAD7]", "c", "[PAD4]", "[PAD5]"]
    assert vocabulary_size(tokens, rows=6) == 4          # only the trailing run, named by its own id
    assert vocabulary_size(tokens, rows=9) == 4
    assert vocabulary_size(["a", "b", "c"], rows=5) == 3    # rows past the token list
    assert vocabulary_size(["a", "b", "c"], rows=2) == 2
    assert vocabulary_size(["a", "[PAD0]"], rows=2) == 2    # "[PAD0]" at 1 is a real token


# (gguf's reader takes seconds per 100k-token vocabulary: one small one here; qwen2's
# vocabulary file gives 151,646 of 151,936 the same way)
@pytest.mark.parametrize("name, expected", [("phi-3", 32011)])
def test_vocabulary_size_of_real_vocabularies(name, expected):
    path = vocab_fixtures.vocab_path(name)          # llama.cpp's own file, fetched into the cache
    tokens = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert vocabulary_size(tokens, rows=len(tokens)) == expected


@pytest.fixture(scope="module", params=["padding_tokens", "unlisted_rows"])
def padded_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("padded") / f"{request.param}.gguf"
    write_random_model(path, seed=2, vocab_size=320, **{request.param: 24}, **SIZES)
    with llambda.load(path, n_ctx=128, progress=False) as model:
        yield model


def test_padded_rows_are_counted_out(padded_model):
    assert padded_model.config.vocab_size == 320
    assert padded_model.n_vocab == 296
    ids = padded_model.tokenize("hello there")
    assert padded_model.logits(ids).shape == (len(ids), 320)          # every row, unmasked
    logits = padded_model.evaluate(ids)
    assert logits.shape == (320,)
    assert np.isneginf(logits[296:]).all() and np.isfinite(logits[:296]).all()


def test_padded_ids_are_never_sampled(padded_model, monkeypatch):
    """Even when the padding rows would win by far, generation stays inside the vocabulary."""
    forward = padded_model.net.forward

    def padding_wins(ids, pos0, all_logits=False):
        logits = forward(ids, pos0, all_logits)
        logits[..., 296:] += 1000.0
        return logits

    monkeypatch.setattr(padded_model.net, "forward", padding_wins)
    for temperature in (0.0, 1.0):
        stats = llambda.serving.generation.Stats()
        text = "".join(padded_model.generate("hi", max_tokens=12, temperature=temperature, top_k=0,
                                             top_p=1.0, min_p=0.0, seed=1, stats=stats, ignore_eos=True))
        assert stats.ids and max(stats.ids) < 296
        assert "[PAD" not in text
