"""llama.cpp's own tokenizer test suite (tests/vocab_fixtures.py): every case of every
LLM vocabulary it ships, encoded by llambda.load_tokenizer, must give llama.cpp's ids,
plain (the suite's .out files), and on more texts with and without special tokens
(recorded from llama.cpp)."""
import pytest

import llambda
from llambda.errors import UserError

import vocab_fixtures

_loaded = {}


def tokenizer(name):
    if name not in _loaded:
        try:
            path = vocab_fixtures.vocab_path(name)
        except vocab_fixtures.Unavailable as e:
            pytest.skip(f"ggml-vocab-{name}.gguf is not here and cannot be fetched: {e}")
        _loaded.clear()            # one large vocabulary in memory at a time
        _loaded[name] = llambda.load_tokenizer(path)
    return _loaded[name]


@pytest.mark.parametrize("name", vocab_fixtures.NAMES)
def test_every_case_equals_llama_cpp(name):
    tok = tokenizer(name)
    wrong = []
    for text, expected in vocab_fixtures.cases(name):
        ids = tok.encode(text, add_special=False, parse_special=False)
        if ids != expected:
            wrong.append((text, ids, expected))
    assert wrong == [], f"{len(wrong)} of {len(vocab_fixtures.cases(name))} cases differ"


@pytest.fixture(scope="module")
def recorded():
    import json
    return json.loads((vocab_fixtures.HERE / "llama_cpp_ids.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("flag", [True, False], ids=["special", "plain"])
@pytest.mark.parametrize("name", vocab_fixtures.NAMES)
def test_more_texts_and_special_tokens_equal_llama_cpp(name, flag, recorded):
    # The suite's texts, texts made of each vocabulary's own special tokens and
    # some 350 tricky texts (scripts, marks, digits, whitespace runs, code, random
    # code points), with and without special tokens, as llama.cpp encoded them
    # (tools/record_tokenizer_fixtures.py --vocab-dir).
    tok = tokenizer(name)
    entry = recorded["vocabularies"][name]
    texts = entry["texts"] + recorded["shared_texts"]
    expected = entry["ids"]["special" if flag else "plain"]
    assert len(expected) == len(texts)
    wrong = []
    for text, want in zip(texts, expected):
        ids = tok.encode(text, add_special=flag, parse_special=flag)
        if ids != want:
            wrong.append((text, ids, want))
    assert wrong == []


@pytest.mark.parametrize("name", vocab_fixtures.NAMES)
def test_decoding_llama_cpp_ids_gives_the_text_back(name):
    # Decoding is llambda's own (the .out files hold ids only).
    tok = tokenizer(name)
    wrong = [(text, tok.decode(expected)) for text, expected in vocab_fixtures.cases(name)
             if tok.decode(expected) != text]
    assert wrong == []


def test_bert_vocabulary_is_refused_by_name(tmp_path):
    import gguf
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]", "hello"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="'bert'.*embedding or encoder model"):
        llambda.load_tokenizer(path)
