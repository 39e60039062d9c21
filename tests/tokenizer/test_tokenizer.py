"""Tokenizer tests: ids compared exactly with llama.cpp's, recorded in tests/fixtures
by tools/record_tokenizer_fixtures.py; round trips fuzzed with hypothesis."""
import json
import os

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from llambda.errors import UserError
from llambda.tokenizer.vocab import Tokenizer, TokenType
from repo_paths import FIXTURES

FIXTURES = str(FIXTURES)


def tokenizer_metadata(gguf_path):
    """The tokenizer.* keys of a GGUF file as plain Python values."""
    from gguf import GGUFReader
    reader = GGUFReader(gguf_path)
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.")}


def load_fixture(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smollm_md(default_gguf):
    return tokenizer_metadata(default_gguf)


@pytest.fixture(scope="module")
def tok(smollm_md):
    return Tokenizer.from_gguf_metadata(smollm_md)


@pytest.fixture(scope="module")
def recorded():
    return load_fixture("smollm2_tokens.json")


def relabelled(md, variant):
    out = {key: value for key, value in md.items() if key not in variant["removed"]}
    out.update(variant["overrides"])
    return out


def mismatches(tokenizer, texts, expected, flag):
    """(text, ours, llama.cpp's) for every text whose ids differ."""
    found = []
    for text, reference in zip(texts, expected):
        ours = tokenizer.encode(text, add_special=flag, parse_special=flag)
        if ours != reference:
            found.append((text, ours, reference))
    return found


# ---------------------------------------------------------------------------
# Against llama.cpp
# ---------------------------------------------------------------------------

def test_fixture_matches_the_default_model(tok, recorded):
    import hashlib
    tokens = [tok.token_text(i) for i in range(tok.vocab_size)]
    digest = hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()
    assert digest == recorded["vocab_sha256"], "fixture recorded from another vocabulary"


@pytest.mark.parametrize("variant", ["smollm", "gpt-2", "llama-bpe", "qwen2"])
@pytest.mark.parametrize("flag", [True, False], ids=["special", "plain"])
def test_byte_level_ids_equal_llama_cpp(smollm_md, recorded, variant, flag):
    # The default model's vocabulary under each pre-tokenizer: the ids llama.cpp
    # produced for the same (relabelled) vocabulary, compared exactly.
    spec = recorded["variants"][variant]
    tokenizer = Tokenizer.from_gguf_metadata(relabelled(smollm_md, spec))
    expected = spec["ids"]["special" if flag else "plain"]
    assert mismatches(tokenizer, recorded["texts"], expected, flag) == []


@pytest.fixture(scope="module")
def spm_recorded():
    return load_fixture("sentencepiece_tokens.json")


@pytest.fixture(scope="module")
def spm_tok(spm_recorded):
    return Tokenizer.from_gguf_metadata(sentencepiece_md(spm_recorded))


def sentencepiece_md(fixture):
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": fixture["tokens"],
        "tokenizer.ggml.scores": fixture["scores"],
        "tokenizer.ggml.token_type": fixture["token_types"],
        "tokenizer.ggml.bos_token_id": fixture["bos_token_id"],
        "tokenizer.ggml.eos_token_id": fixture["eos_token_id"],
        "tokenizer.ggml.unknown_token_id": fixture["unknown_token_id"],
    }


@pytest.mark.parametrize("flag", [True, False], ids=["special", "plain"])
def test_sentencepiece_ids_equal_llama_cpp(spm_tok, spm_recorded, flag):
    expected = spm_recorded["ids"]["special" if flag else "plain"]
    assert mismatches(spm_tok, spm_recorded["texts"], expected, flag) == []


def test_a_sentencepiece_vocabulary_loads_without_the_cache(spm_recorded, tmp_path, monkeypatch):
    """The sentencepiece library merges by score: nothing is derived or kept per vocabulary."""
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path))
    tok = Tokenizer.from_gguf_metadata(sentencepiece_md(spm_recorded))
    assert mismatches(tok, spm_recorded["texts"], spm_recorded["ids"]["plain"], False) == []
    assert not (tmp_path / "tokenizers").exists()


def test_a_vocabulary_sentencepiece_refuses_is_one_error_naming_the_file(spm_recorded, monkeypatch):
    """Whatever the library still refuses (here: a model file it cannot parse) is a UserError
    naming the file and the library's reason, not a RuntimeError from inside it."""
    from llambda.model import convert
    from llambda.tokenizer import spm as spm_engine
    monkeypatch.setattr(spm_engine, "model_proto", lambda *args: b"not a model")
    with pytest.raises(UserError, match=r"model\.gguf: the tokenizer cannot be built \(ValueError: "
                                        r"sentencepiece refused the vocabulary"):
        convert.build_tokenizer("model.gguf", sentencepiece_md(spm_recorded))


def _spm(tokens, scores=None, types=None, unknown_id=None):
    from llambda.tokenizer.spm import SentencePieceEngine
    scores = [0.0] * len(tokens) if scores is None else scores
    types = [TokenType.NORMAL] * len(tokens) if types is None else types
    return SentencePieceEngine(tokens, np.asarray(scores, np.float32), types, unknown_id)


def test_sentencepiece_merges_the_best_score_then_the_leftmost_pair():
    """llama.cpp's order: the best-scoring concatenation first, equal scores leftmost first."""
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert _spm(tokens[:5], [0, 0, 0, 1, 2]).encode("abc").ids == [0, 4]         # "bc" scores higher
    assert _spm(tokens[:5], [0, 0, 0, 2, 1]).encode("abc").ids == [3, 2]
    assert _spm(tokens[:5], [0, 0, 0, 1, 1]).encode("abc").ids == [3, 2]         # a tie: the leftmost
    assert _spm(tokens, [0, 0, 0, 1, 2, 0]).encode("abc").ids == [5]             # then "a" + "bc"
    assert _spm(["a", "b", "ab", "ba"], [0, 0, 1, 1]).encode("aba").ids == [2, 0]


def test_sentencepiece_engine_takes_what_a_gguf_vocabulary_may_hold():
    """A repeated text merges to its last id; an empty text, a non-UTF-8 one and one holding a
    NUL (which the library refuses) never come out; a CONTROL or USER_DEFINED token's text
    merges like any other (as in llama.cpp); a character with no piece and no byte fallback
    is the file's unknown id, or nothing."""
    bad = "\udcff"                                                  # a surrogate escape: not UTF-8
    tokens = ["<unk>", "a", "b", "ab", "", bad, "ab", "<c>", "<", "c", ">", "<c", "a\0"]
    types = [TokenType.UNKNOWN, 1, 1, 1, 1, 1, 1, TokenType.CONTROL, 1, 1, 1, 1, 1]
    engine = _spm(tokens, [0, 0, 0, 1, 0, 0, 1, 3, 0, 0, 0, 2, 0], types, unknown_id=0)
    assert engine.encode("ab").ids == [6]
    assert engine.encode("<c>").ids == [7]
    assert engine.encode("aé").ids == [1, 0]
    assert engine.encode("a\0").ids == [1, 0]
    assert _spm(tokens[1:4]).encode("aéb").ids == [0, 1]             # no unknown id: dropped
    assert _spm(["<llambda:unknown>", "a"]).encode("aa").ids == [1, 1]


def test_sentencepiece_byte_fallback_needs_all_256_byte_tokens():
    """With every <0xXX> token, an unknown character is its UTF-8 bytes; short of one, a run
    of unknown characters is one unknown id (the library's way; llama.cpp has no answer
    there, it fails to find the byte token)."""
    tokens = ["<unk>", "a"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, 1] + [TokenType.BYTE] * 256
    full = _spm(tokens, types=types, unknown_id=0)
    assert full.encode("aé").ids == [1, 2 + 0xC3, 2 + 0xA9]
    short = _spm(tokens[:-1], types=types[:-1], unknown_id=0)
    assert short.encode("aé").ids == [1, 0]
    assert short.encode("aééa").ids == [1, 0, 1]


# Gemma 3's real vocabulary (262,144 SentencePiece tokens with byte fallback): too
# large to commit, so it is read from the model file, fetched into the cache
# (tests/fetched_files.py; LLAMBDA_GEMMA3_GGUF names another copy).

def gemma3_gguf():
    import fetched_files
    return os.environ.get("LLAMBDA_GEMMA3_GGUF") or str(fetched_files.gemma_gguf())


@pytest.fixture(scope="module")
def gemma3_tok():
    import llambda
    return llambda.load_tokenizer(gemma3_gguf())


@pytest.fixture(scope="module")
def gemma3_recorded():
    return load_fixture("gemma3_tokens.json")


def test_gemma3_fixture_matches_the_file(gemma3_tok, gemma3_recorded):
    import hashlib
    tokens = [gemma3_tok.token_text(i) for i in range(gemma3_tok.vocab_size)]
    digest = hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()
    assert digest == gemma3_recorded["vocab_sha256"], "fixture recorded from another vocabulary"


@pytest.mark.parametrize("flag", [True, False], ids=["special", "plain"])
def test_gemma3_ids_equal_llama_cpp(gemma3_tok, gemma3_recorded, flag):
    expected = gemma3_recorded["ids"]["special" if flag else "plain"]
    assert mismatches(gemma3_tok, gemma3_recorded["texts"], expected, flag) == []


def test_gemma3_special_tokens(gemma3_tok):
    assert gemma3_tok.eog_ids == {1, 106, 212}   # <eos>, <end_of_turn>, </s> (as llama.cpp)
    assert gemma3_tok.encode("Hi")[0] == gemma3_tok.bos_id == 2
    ids = gemma3_tok.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert gemma3_tok.decode(ids, skip_special=True) == "user\nHi"


@given(st.text(max_size=60))
def test_gemma3_decode_inverts_encode(gemma3_tok, text):
    # Byte fallback spells every character, so every text comes back, except a
    # literal U+2581, which is SentencePiece's space and decodes as one.
    assume("\u2581" not in text)
    assert gemma3_tok.decode(gemma3_tok.encode(text, add_special=False, parse_special=False)) == text


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def missing_bytes(tok):
    """Bytes the default vocabulary has no token for (bytes that never occurred in
    its training text, such as 0xF5..0xFF); llama.cpp drops them too."""
    single_bytes = {tok.token_bytes(i) for i in range(tok.vocab_size)}
    return {b for b in range(256) if bytes([b]) not in single_bytes}


def representable(missing_bytes, text):
    return not missing_bytes.intersection(text.encode("utf-8"))


@given(st.text(max_size=80))
def test_decode_inverts_encode(tok, missing_bytes, text):
    assume(representable(missing_bytes, text))
    assert tok.decode(tok.encode(text, add_special=False, parse_special=False)) == text
    assert tok.decode(tok.encode(text)) == text


@given(st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "user", "\n", " ", "é", "😀",
                                 "12", "<|im_", "end|>"]), max_size=12))
def test_decode_inverts_encode_around_special_tokens(tok, parts):
    text = "".join(parts)
    assert tok.decode(tok.encode(text)) == text


@given(st.text(max_size=60))
def test_sentencepiece_decode_inverts_encode(spm_tok, text):
    # SentencePiece writes spaces as U+2581, so a literal U+2581 in the text decodes as a
    # space (llama.cpp does the same): not a round trip by design
    assume("\u2581" not in text)
    ids = spm_tok.encode(text, add_special=False, parse_special=False)
    assert spm_tok.decode(ids) == text
    assert spm_tok.decode(spm_tok.encode(text, parse_special=False), skip_special=True) == text


@given(st.text(max_size=60))
def test_streaming_decoder_yields_whole_characters(tok, missing_bytes, text):
    assume(representable(missing_bytes, text))
    ids = tok.encode(text, add_special=False, parse_special=False)
    decoder = tok.streaming_decoder()
    pieces = [decoder.feed(token_id) for token_id in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text


def test_streaming_decoder_holds_back_a_split_character(tok):
    ids = tok.encode("👨‍👩‍👧", add_special=False)
    assert len(ids) > 3  # byte pieces of the emoji, not whole characters
    decoder = tok.streaming_decoder()
    pieces = [decoder.feed(token_id) for token_id in ids]
    assert "" in pieces
    assert "".join(pieces) == "👨‍👩‍👧"
    assert decoder.flush() == ""


def test_streaming_decoder_flushes_an_unfinished_character(tok):
    ids = tok.encode("😀", add_special=False)
    decoder = tok.streaming_decoder()
    assert decoder.feed(ids[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_sentencepiece_streaming_strips_the_added_space(spm_tok):
    ids = spm_tok.encode("Hello world")
    decoder = spm_tok.streaming_decoder(skip_special=True)
    assert "".join(decoder.feed(i) for i in ids) + decoder.flush() == "Hello world"


# ---------------------------------------------------------------------------
# Special tokens and flags
# ---------------------------------------------------------------------------

def test_default_model_ids_and_flags(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.token_text(tok.bos_id) == "<|im_start|>"
    assert tok.eos_id == 2 and tok.token_text(tok.eos_id) == "<|im_end|>"
    # <|endoftext|>, <|im_end|>, and <reponame>: a fill-in-the-middle marker llama.cpp
    # recognises by its text and lets end generation too.
    assert tok.eog_ids == {0, 2, 4}
    assert tok.encode("") == []  # the model does not ask for BOS


def test_parse_special_controls_special_tokens(tok):
    assert tok.encode("<|im_start|>user") == [1, 4093]
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert 1 not in plain
    assert tok.decode(plain) == "<|im_start|>user"


def test_skip_special_drops_control_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>assistant\nHi<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "assistant\nHi"


def test_add_bos_and_add_eos_are_honoured(smollm_md):
    md = dict(smollm_md, **{"tokenizer.ggml.add_bos_token": True,
                            "tokenizer.ggml.add_eos_token": True})
    tokenizer = Tokenizer.from_gguf_metadata(md)
    ids = tokenizer.encode("Hi")
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.encode("Hi", add_special=False) == ids[1:-1]


def test_user_defined_tokens_are_matched_even_without_parse_special(smollm_md):
    types = list(smollm_md["tokenizer.ggml.token_type"])
    types[5] = TokenType.USER_DEFINED  # <file_sep>
    tokenizer = Tokenizer.from_gguf_metadata(dict(smollm_md, **{"tokenizer.ggml.token_type": types}))
    assert tokenizer.encode("a<file_sep>b", parse_special=False)[1] == 5
    assert tokenizer.decode([5], skip_special=True) == "<file_sep>"


def test_eog_includes_end_of_turn_tokens_by_text(smollm_md):
    tokens = list(smollm_md["tokenizer.ggml.tokens"])
    tokens[7] = "<|eot_id|>"
    tokenizer = Tokenizer.from_gguf_metadata(dict(smollm_md, **{"tokenizer.ggml.tokens": tokens}))
    assert 7 in tokenizer.eog_ids


def test_encoding_is_fast_enough_for_long_prompts(tok):
    # No wall-clock assertion (shared machine); this keeps the long path exercised.
    text = "The quick brown fox, 123 jumps! 日本語 😀\n" * 400
    ids = tok.encode(text)
    assert len(ids) > 4000
    assert tok.decode(ids) == text


# ---------------------------------------------------------------------------
# Bad metadata
# ---------------------------------------------------------------------------

def test_unknown_pre_tokenizer_is_a_user_error_naming_it(smollm_md):
    with pytest.raises(UserError, match="'klingon'"):
        Tokenizer.from_gguf_metadata(dict(smollm_md, **{"tokenizer.ggml.pre": "klingon"}))


def test_unknown_tokenizer_model_is_a_user_error(smollm_md):
    with pytest.raises(UserError, match="'bert'"):
        Tokenizer.from_gguf_metadata(dict(smollm_md, **{"tokenizer.ggml.model": "bert"}))


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.merges", "tokenizer.ggml.pre"])
def test_missing_key_is_a_user_error_naming_it(smollm_md, key):
    md = {k: v for k, v in smollm_md.items() if k != key}
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        Tokenizer.from_gguf_metadata(md)


def test_encode_rejects_bytes(tok):
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


@pytest.mark.parametrize("bad_id", [-1, 49152])
def test_ids_outside_the_vocabulary_are_a_value_error(tok, bad_id):
    with pytest.raises(ValueError, match=str(bad_id)):
        tok.decode([5, bad_id])
    with pytest.raises(ValueError):
        tok.streaming_decoder().feed(bad_id)
    with pytest.raises(ValueError):
        tok.token_text(bad_id)
