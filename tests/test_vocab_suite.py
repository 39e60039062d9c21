"""llama.cpp's own tokenizer test suite (tests/vocab_fixtures.py): every case of every
LLM vocabulary it ships, encoded by llambda.load_tokenizer, must give llama.cpp's ids."""
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
