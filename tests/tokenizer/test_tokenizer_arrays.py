"""The tokenizer's long lists stored as arrays of the model file (llambda/tokenizer/arrays.py):
a conversion's header holds references, a load gives the GGUF's lists back verbatim, and a
damaged reference is one UserError naming the file and the key."""
import warnings

import gguf
import numpy as np
import pytest

from llambda.model import convert
import synth
from llambda.tokenizer import arrays as ta
from llambda.errors import UserError
from llambda.runtime import weightfile

N = ta.MIN_ITEMS
TOKENS, TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"


def test_long_lists_become_arrays_and_come_back_verbatim():
    md = {TOKENS: (["", "a", "Ġthe", "\udcff", "日本", "\ud800x", " \n"] * N)[:N + 5],
          TYPES: [1, 3, -5, 2**31 - 1, -2**31] * N,
          "tokenizer.ggml.scores": [float(x) for x in np.linspace(-1e4, 3, N, dtype=np.float32)],
          "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": 1}
    kept, arrays = ta.split(md)
    for key in (TOKENS, TYPES, "tokenizer.ggml.scores"):
        assert kept[key] == {"array": f"tokenizer/{key}", "kind": ta._kind(md[key]), "count": len(md[key])}
    assert [kept[key]["kind"] for key in (TOKENS, TYPES, "tokenizer.ggml.scores")] == ["texts", "int32", "float32"]
    assert kept["tokenizer.ggml.model"] == "gpt2" and kept["tokenizer.ggml.bos_token_id"] == 1
    back = ta.expand(kept, arrays, "m.llb")
    assert back == md
    assert all(type(a) is type(b) for key in md if isinstance(md[key], list) for a, b in zip(back[key], md[key]))


@pytest.mark.parametrize("items", [
    ["a"] * (N - 1),                      # short: not worth an array
    ["a\0b"] + ["a"] * N,                 # a NUL: joined texts would not split back
    [True, False] * N,                    # bools are no int32
    [0.1] * N,                            # not exactly an f32
    [1e39] * N,                           # past f32's range (and no overflow warning)
    [float("nan")] * N,                   # NaN equals nothing
    [1, "a"] * N,                         # mixed
    [2**31] + [0] * N,                    # past int32
    [[1]] * N,                            # nested
])
def test_other_lists_stay_in_the_header(items):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept, arrays = ta.split({"tokenizer.x": items})
    assert kept == {"tokenizer.x": items} and arrays == {}


def _refs():
    kept, arrays = ta.split({TOKENS: ["x"] * N, TYPES: [1] * N})
    return {key: dict(ref) for key, ref in kept.items()}, arrays


@pytest.mark.parametrize("key, damage, message", [
    (TOKENS, lambda k, a: k[TOKENS].update(count=N + 1), f"holds {N} texts, the header says {N + 1}"),
    (TOKENS, lambda k, a: k[TOKENS].update(count=0), f"holds {N} texts, the header says 0"),
    (TYPES, lambda k, a: k[TYPES].update(count=N - 1), f"holds {N} items, the header says {N - 1}"),
    (TOKENS, lambda k, a: k[TOKENS].update(kind="bogus"), "is not {array, kind, count}"),
    (TOKENS, lambda k, a: k[TOKENS].update(count=True), "is not {array, kind, count}"),
    (TOKENS, lambda k, a: k[TOKENS].update(array="nope"), "the file has no array 'nope'"),
    (TOKENS, lambda k, a: a.update({f"tokenizer/{TOKENS}": np.array([0xff, 0xfe], np.uint8)}), "is not UTF-8"),
    (TYPES, lambda k, a: a.update({f"tokenizer/{TYPES}": np.ones(N, np.int64)}), "not 1-D int32"),
    (TOKENS, lambda k, a: a.update({f"tokenizer/{TOKENS}": np.zeros((2, 2), np.uint8)}), "not 1-D uint8"),
])
def test_a_damaged_reference_is_one_error_naming_the_file_and_key(key, damage, message):
    kept, arrays = _refs()
    damage(kept, arrays)
    with pytest.raises(UserError) as error:
        ta.expand(kept, arrays, "m.llb")
    text = str(error.value)
    assert text.startswith(f"m.llb: {key}: ") and message in text and "convert the GGUF again" in text


def test_a_conversion_keeps_the_vocabulary_as_arrays_and_loads_it_verbatim(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    source = synth.write_random_llama(tmp_path / "m.gguf", **{**synth.PRESETS["tiny"], "vocab_size": 2 * N})
    out = convert.convert(source, tmp_path / "m.llb", progress=False)
    header = weightfile.open_weights(out).metadata["tokenizer"]
    assert header[TOKENS] == {"array": f"tokenizer/{TOKENS}", "kind": "texts", "count": 2 * N}
    assert header[TYPES]["kind"] == "int32"

    _, tokenizer_md, _ = convert.load_model_file(out)
    fields = gguf.GGUFReader(source).fields
    for key in (k for k in fields if k.startswith("tokenizer.")):
        assert tokenizer_md[key] == fields[key].contents(), key
    assert convert.tokenizer_metadata(out)[TOKENS] == tokenizer_md[TOKENS]
    assert f"tokens           {2 * N}" in convert.info(out)

    w = weightfile.open_weights(out)           # a forged header whose reference lies about its array
    metadata = dict(w.metadata)
    metadata["tokenizer"] = {**metadata["tokenizer"], TOKENS: {**header[TOKENS], "count": 5}}
    forged = weightfile.write(tmp_path / "forged.llb", metadata, {name: np.array(w[name]) for name in w})
    with pytest.raises(UserError, match=rf"forged\.llb: {TOKENS}: .*the header says 5: convert the GGUF again"):
        convert.load_model_file(forged, verify=False)
