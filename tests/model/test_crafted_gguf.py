"""Crafted GGUFs of the new kinds (issue 39): K-quant and Q5 tensors of the wrong size or with
NaN/inf scales, gemma3/qwen2/qwen3/phi3 files with missing or duplicate tensors, heads that do
not divide the width, a sliding window of 0, absurd RoPE parameters, huge vocabularies.

Each one, converted with the CLI, ends with exit status 2 and one line naming the file and the
field at fault, and allocates nothing large before the check (peak traced memory)."""
import math
import struct
import tracemalloc

import pytest
from gguf import GGUFValueType

from crafted_gguf import array_count, craft, with_scale
from fixture_models import write_fixture_model
from llambda import cli

QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
ARCHS = ("gemma3", "qwen2", "qwen3", "phi3")
PEAK_BYTES = 64 << 20           # the fixtures are ~1 MB: nothing near this is needed to refuse one

F32, U32, I32, U64, STR = (GGUFValueType.FLOAT32, GGUFValueType.UINT32, GGUFValueType.INT32,
                           GGUFValueType.UINT64, GGUFValueType.STRING)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crafted-sources")
    made = {}

    def get(arch, type_name):
        if (arch, type_name) not in made:
            made[arch, type_name] = write_fixture_model(folder / f"{arch}-{type_name}.gguf", arch, type_name)
        return made[arch, type_name]
    return get


def _dims(arch):
    from fixture_models import ARCHS as SHAPES
    return SHAPES[arch]


def _cases():
    """name -> (arch, type, craft arguments, the field the line must name)."""
    cases = {}
    for q in QUANTS:
        block = 256 if q.endswith("_K") else 32
        dim, ffn = _dims("llama")["dim"], _dims("llama")["ffn_dim"]
        cases[f"{q} NaN scale"] = ("llama", q, dict(edit={"blk.0.attn_q.weight": with_scale(q, math.nan)}),
                                   "blk.0.attn_q.weight")
        cases[f"{q} inf scale"] = ("llama", q, dict(edit={"blk.1.ffn_up.weight": with_scale(q, math.inf, 3)}),
                                   "blk.1.ffn_up.weight")
        cases[f"{q} -inf scale"] = ("llama", q, dict(edit={"output.weight": with_scale(q, -math.inf, 5)}),
                                    "output.weight")
        # rows that are not whole blocks, the config agreeing (the FFN width is the row length)
        cases[f"{q} rows not whole blocks"] = (
            "llama", q, dict(keys={"llama.feed_forward_length": ffn + block // 2},
                             shapes={"blk.0.ffn_down.weight": (dim, ffn + block // 2)}),
            "blk.0.ffn_down.weight")
        # a table that declares more rows than the bytes written: it runs into the next tensor
        cases[f"{q} declared larger than its bytes"] = (
            "llama", q, dict(shapes={"blk.0.attn_k.weight": (4 * _dims("llama")["n_kv_head"] * 32, dim)}),
            "blk.0.attn_k.weight")
        cases[f"{q} cut short"] = ("llama", q, dict(cut=-4096), "runs past the end")
    for arch in ARCHS:
        special = {"gemma3": "blk.0.post_attention_norm.weight", "qwen2": "blk.0.attn_q.bias",
                   "qwen3": "blk.1.attn_k_norm.weight", "phi3": "blk.1.attn_qkv.weight"}[arch]
        # phi3's fused attn_qkv is missing as its parts
        named = special.replace("qkv", "q") if arch == "phi3" else special
        cases[f"{arch} missing {special}"] = (arch, "Q8_0", dict(drop_tensors=[special]), named)
        cases[f"{arch} missing output_norm"] = (arch, "Q8_0", dict(drop_tensors=["output_norm.weight"]),
                                                "output_norm.weight")
        cases[f"{arch} duplicate {special}"] = (arch, "Q8_0", dict(duplicate=[special]), special)
        cases[f"{arch} duplicate token_embd"] = (arch, "Q8_0", dict(duplicate=["token_embd.weight"]),
                                                 "token_embd.weight")
        d = _dims(arch)
        # heads that do not divide the width (no key_length to say otherwise)
        cases[f"{arch} heads do not divide the width"] = (
            arch, "F16", dict(keys={f"{arch}.attention.head_count": 3 if d["dim"] % 3 else 5,
                                    f"{arch}.attention.head_count_kv": 1},
                              drop_keys=[f"{arch}.attention.key_length", f"{arch}.attention.value_length"]),
            f"{arch}.attention.head_count")
        cases[f"{arch} KV heads do not divide the heads"] = (
            arch, "F16", dict(keys={f"{arch}.attention.head_count_kv": d["n_head"] + 1}),
            f"{arch}.attention.head_count_kv")
        cases[f"{arch} zero heads"] = (arch, "F16", dict(keys={f"{arch}.attention.head_count": 0}),
                                       f"{arch}.attention.head_count")
        for key, value in (("rope.freq_base", 0.0), ("rope.freq_base", -1.0), ("rope.freq_base", math.nan),
                           ("rope.freq_base", math.inf), ("rope.freq_base_swa", -math.inf),
                           ("rope.scaling.factor", math.nan), ("rope.scaling.factor", math.inf),
                           ("rope.scaling.factor", -2.0), ("rope.dimension_count", 7),
                           ("rope.dimension_count", 2**31), ("rope.dimension_count", 0),
                           ("rope.scaling.attn_factor", math.nan), ("rope.scaling.attn_factor", 0.0),
                           ("rope.scaling.original_context_length", 0),
                           ("attention.layer_norm_rms_epsilon", math.nan),
                           ("attention.layer_norm_rms_epsilon", math.inf),
                           ("attention.layer_norm_rms_epsilon", 0.0), ("final_logit_softcapping", math.nan)):
            typed = (value, F32) if isinstance(value, float) else (value, U32 if value < 2**32 else U64)
            extra = {f"{arch}.rope.scaling.type": ("yarn", STR)} if "scaling" in key else {}
            if "scaling" in key and key != "rope.scaling.factor":
                extra[f"{arch}.rope.scaling.factor"] = (4.0, F32)
            cases[f"{arch} {key} = {value}"] = (arch, "F16", dict(keys={f"{arch}.{key}": typed, **extra}),
                                                f"{arch}.{key}")
        cases[f"{arch} huge vocabulary"] = (
            arch, "F16", dict(shapes={"token_embd.weight": (2**40, d["dim"])}), "token_embd.weight")
    for arch, item, key in (("qwen3", STR, "tokenizer.ggml.tokens"), ("gemma3", I32, "tokenizer.ggml.token_type"),
                            ("phi3", STR, "tokenizer.ggml.merges")):
        cases[f"{arch} huge {key}"] = (arch, "F16", dict(patch=[array_count(key, item, 2**40)]), key)
    # found by the fuzz campaign: a key length past its key reads bytes (a newline too) as the name
    key = b"general.file_type"
    cases["a key length past its key"] = (
        "qwen2", "Q2_K", dict(patch=[(struct.pack("<Q", len(key)) + key, struct.pack("<Q", len(key) + 15))]),
        "general.file_type")
    cases["gemma3 sliding window 0"] = ("gemma3", "F16", dict(keys={"gemma3.attention.sliding_window": 0}),
                                        "gemma3.attention.sliding_window")
    cases["gemma3 sliding window -1"] = ("gemma3", "F16",
                                         dict(keys={"gemma3.attention.sliding_window": (-1, I32)}),
                                         "gemma3.attention.sliding_window")
    cases["gemma3 rope.freq_base_swa = nan"] = (
        "gemma3", "F16", dict(keys={"gemma3.rope.freq_base_swa": (math.nan, F32)}), "gemma3.rope.freq_base_swa")
    cases["gemma3 final_logit_softcapping = inf"] = (
        "gemma3", "F16", dict(keys={"gemma3.final_logit_softcapping": (math.inf, F32)}),
        "gemma3.final_logit_softcapping")
    cases["qwen2 tokenizer longer than the embedding"] = (
        "qwen2", "F16", dict(shapes={"token_embd.weight": (100, _dims("qwen2")["dim"])}), "token_embd.weight")
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", CASES)
def test_a_crafted_gguf_is_one_line_naming_the_file_and_field(name, fixtures, tmp_path, capsys):
    arch, type_name, arguments, field = CASES[name]
    source = fixtures(arch, type_name)
    if isinstance(arguments.get("cut"), int) and arguments["cut"] < 0:
        arguments = dict(arguments, cut=source.stat().st_size + arguments["cut"])
    crafted = craft(source, tmp_path / "crafted.gguf", **arguments)
    capsys.readouterr()
    tracemalloc.start()
    try:
        status = cli.main(["convert", str(crafted), "-o", str(tmp_path / "out.llb"), "--quiet"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert str(crafted) in lines[0], f"the line does not name the file: {lines[0]}"
    assert field in lines[0], f"the line does not name {field}: {lines[0]}"
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB allocated before the refusal"
    assert not (tmp_path / "out.llb").exists()


def test_the_crafted_sources_convert(fixtures, tmp_path):
    """The files the cases start from are good: each case's fault is the craft's own."""
    for arch, type_name in {(a, t) for a, t, _, _ in CASES.values()}:
        copy = craft(fixtures(arch, type_name), tmp_path / f"{arch}-{type_name}.gguf")
        assert cli.main(["convert", str(copy), "-o", str(tmp_path / "out.llb"), "--quiet"]) == 0, (arch, type_name)
