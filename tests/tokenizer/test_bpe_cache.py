"""The BPE models kept in the user cache (llambda.tokenizer.bpe_cache): a vocabulary read back
from its saved files tokenizes exactly as when built, and a damaged, foreign or
unwritable entry only means building again."""
import pytest

import llambda
from llambda.tokenizer import bpe_cache
from llambda.tokenizer import vocab as tk

import vocab_fixtures


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path))
    return tmp_path / "tokenizers"


def _entries(cache):
    return sorted(p.name for p in cache.glob("bpe-*")) if cache.exists() else []


class _NoBuilding:
    """Stands in for tokenizers.models inside llambda.tokenizer.vocab: building a BPE fails."""
    def __getattr__(self, name):
        raise AssertionError(f"built the BPE model (models.{name}) although it was cached")


def _vocab(name):
    try:
        return vocab_fixtures.vocab_path(name)
    except vocab_fixtures.Unavailable as reason:
        pytest.skip(str(reason))


@pytest.mark.parametrize("name", ["gpt-2", "starcoder", "falcon", "deepseek-coder"])
def test_a_cached_vocabulary_tokenizes_as_the_built_one(name, cache, monkeypatch):
    path = _vocab(name)
    built = llambda.load_tokenizer(path)
    assert len(_entries(cache)) == 1
    monkeypatch.setattr(tk, "models", _NoBuilding())
    cached = llambda.load_tokenizer(path)
    for text, want in vocab_fixtures.cases(name):
        assert cached.encode(text, add_special=False) == built.encode(text, add_special=False) == want, text


def test_a_sentencepiece_vocabulary_leaves_no_entry(cache):
    """Llama 2's SentencePiece vocabulary goes to the sentencepiece library: no entry, its ids."""
    tok = llambda.load_tokenizer(_vocab("llama-spm"))
    assert _entries(cache) == []
    for text, want in vocab_fixtures.cases("llama-spm")[:50]:
        assert tok.encode(text, add_special=False) == want, text


def test_a_damaged_entry_is_built_and_written_again(cache):
    path = _vocab("gpt-2")
    llambda.load_tokenizer(path)
    (entry,) = cache.glob("bpe-*")
    (entry / bpe_cache.MERGES_FILE).write_text("this is not a merges file\n")
    again = llambda.load_tokenizer(path)
    assert again.encode("Hello world") == llambda.load_tokenizer(path).encode("Hello world")
    assert (entry / bpe_cache.MERGES_FILE).read_text() != "this is not a merges file\n"


def test_foreign_files_under_the_key_are_not_used(cache, monkeypatch):
    """Files of another vocabulary under this one's key fail the spot check."""
    gpt2, starcoder = _vocab("gpt-2"), _vocab("starcoder")
    llambda.load_tokenizer(starcoder)
    (foreign,) = cache.glob("bpe-*")
    want = llambda.load_tokenizer(gpt2).encode("Hello world")       # its own entry now
    own = next(p for p in cache.glob("bpe-*") if p != foreign)
    for name in (bpe_cache.VOCAB_FILE, bpe_cache.MERGES_FILE):
        (own / name).write_bytes((foreign / name).read_bytes())
    assert llambda.load_tokenizer(gpt2).encode("Hello world") == want


def test_rules_merges_txt_cannot_hold_are_not_saved(cache):
    tokens = ["a", "b", "a b", "ab", "a bb", "bb"]
    model = tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("a", "b"), ("b", "b")])
    bpe_cache.store("k1", model, [("a", "b"), ("b", "b")])
    assert _entries(cache) == ["bpe-k1"]
    for bad in ([("a b", "b")], [("a", "")], [("a\n", "b")], [("#version", "b")], [("a", "b\r")]):
        bpe_cache.store("k2", model, bad)
        assert _entries(cache) == ["bpe-k1"], bad


def test_the_key_covers_tokens_rules_and_options():
    base = bpe_cache.key("merges", ["a", "b", "ab"], ["a b"], {})
    assert bpe_cache.key("merges", ["a", "b", "ab"], ["a b"], {}) == base
    assert bpe_cache.key("merges", ["a", "b", "abc"], ["a b"], {}) != base
    assert bpe_cache.key("merges", ["a", "b", "ab"], ["b a"], {}) != base
    assert bpe_cache.key("merges", ["a", "b", "ab"], ["a b"], {"ignore_merges": True}) != base
    assert bpe_cache.key("sentencepiece", ["a", "b", "ab"], b"\0" * 12, {}) != base
    assert bpe_cache.key("merges", ["a", "b ab"], ["a b"], {}) != bpe_cache.key("merges", ["a b", "ab"], ["a b"], {})


def test_an_unwritable_cache_still_tokenizes(tmp_path, monkeypatch):
    path = _vocab("gpt-2")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(blocker))      # a file: nothing can go under it
    tok = llambda.load_tokenizer(path)
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
