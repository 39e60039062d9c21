#!/usr/bin/env python3
"""Fuzz llambda with hostile files, text and templates: anything but a clean result or a
one-line error is a failure, and its case is written to a folder.

    tools/fuzz.py --minutes 20                 # a campaign; failures go to fuzz-failures/
    tools/fuzz.py --cases 200 --seed 7         # a fixed number of cases
    tools/fuzz.py --replay fuzz-failures/x     # run one saved case again, in this process
    tools/fuzz.py --http --cases 60 --seed 3    # hostile HTTP to llambda serve (tools/fuzz_http.py)

Cases (each drawn from (seed, index), so a run is reproducible):

- ``gguf``: a small real GGUF (written by synth, or a real file's header) with its
  header or tensor table mutated: counts, key and string lengths, value types, array
  counts, metadata values, tensor dims, types and offsets set to edge values, tensor bytes
  changed, bits flipped, the file cut. Then its tokenizer alone, ``convert``, and ``info``,
  ``verify`` and load-and-generate what came out.
- ``llb``: a converted llambda file with its JSON header edited (config values, tensor
  entries, layouts, tokenizer fields, the chat template) and its header checksum made
  right again (so the deeper checks are reached), or bytes flipped, or the file cut. Then
  ``info``, ``verify``, load, generate and chat.
- ``text``: random strings and bytes-as-text to the tokenizer (encode and decode) and
  random ids to decode.
- ``template``: random Jinja templates built from a grammar of statements and
  expressions, rendered with random conversations.
- ``cli``: random ``llambda run`` command lines (option values at their edges) through
  ``cli.main``: one line on stderr at most, besides statistics and warnings.

Each case runs in a forked child (a crash kills only it) under a memory limit and a
time limit. A case passes when every step either succeeds or raises one of the errors
the CLI prints as one line (UserError, ValueError, OSError) with a message of one line.
A signal, a hang, another exception or a multi-line message fails it.
"""
import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))        # the random-model makers (tests/synth.py)
CASE_SECONDS = 60            # a case taking longer is a hang
CASE_MEMORY = 6 << 30        # address space of a case's process (RLIMIT_AS)
KINDS = ("gguf", "llb", "text", "template", "cli")


# ---------------------------------------------------------------- seeds: the files mutated

def make_seeds(directory, real=None):
    """Small valid files to mutate: synthetic GGUFs of two shapes, the fixture models of the
    other architectures in K-quant and Q5 types (issue 39), and their conversions, and the
    header (with the tensor data cut off) of ``real``, a real GGUF, when given."""
    from llambda.model import convert
    from fixture_models import write_fixture_model
    from synth import write_random_llama
    directory = Path(directory)
    ggufs = []
    for i, (tensor_type, vocab) in enumerate((("Q4_1", 300), ("Q8_0", 320))):
        path = directory / f"seed{i}.gguf"
        write_random_llama(path, n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64, vocab_size=vocab,
                           tensor_type=tensor_type, n_ctx=64, seed=i)
        ggufs.append(path)
    for arch, tensor_type in (("gemma3", "Q4_K"), ("qwen2", "Q2_K"), ("qwen3", "Q6_K"), ("phi3", "Q5_1")):
        ggufs.append(write_fixture_model(directory / f"seed-{arch}-{tensor_type}.gguf", arch, tensor_type))
    llbs = [convert.convert(path, path.with_suffix(".llb"), progress=False) for path in ggufs]
    with contextlib.suppress(OSError):
        if real is not None and real.exists():
            header = directory / "real-header.gguf"
            with open(real, "rb") as f:
                header.write_bytes(f.read(4 << 20))     # the key/value and tensor tables, no weights
            ggufs.append(header)
    return ggufs, llbs


# ---------------------------------------------------------------- GGUF structure

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data):
    """Offsets of the GGUF's structural integers: [(offset, size, what)]."""
    fields = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "kv count")]
    try:
        n_tensors, n_kv = _U64.unpack_from(data, 8)[0], _U64.unpack_from(data, 16)[0]
        pos = 24
        for _ in range(min(n_kv, 10000)):
            fields.append((pos, 8, "key length"))
            length = _U64.unpack_from(data, pos)[0]
            key = bytes(data[pos + 8:pos + 8 + min(length, 200)]).decode("utf-8", "replace")
            pos += 8 + length
            fields.append((pos, 4, "value type"))
            value_type = _U32.unpack_from(data, pos)[0]
            pos += 4
            if value_type in _SCALAR_SIZES:         # the value itself: head counts, lengths, ids, eps...
                fields.append((pos, _SCALAR_SIZES[value_type], f"value of {key}"))
            pos = _skip_value(data, pos, value_type, fields)
        for _ in range(min(n_tensors, 10000)):
            fields.append((pos, 8, "tensor name length"))
            pos += 8 + _U64.unpack_from(data, pos)[0]
            fields.append((pos, 4, "n_dims"))
            n_dims = _U32.unpack_from(data, pos)[0]
            pos += 4
            for _ in range(min(n_dims, 8)):
                fields.append((pos, 8, "dim"))
                pos += 8
            fields.append((pos, 4, "tensor type"))
            fields.append((pos + 4, 8, "tensor offset"))
            pos += 12
        fields.append((pos, 0, "tensor data"))     # where the tables end
    except struct.error:
        pass
    return [f for f in fields if f[0] + f[1] <= len(data)]


def _skip_value(data, pos, value_type, fields):
    if value_type in _SCALAR_SIZES:
        return pos + _SCALAR_SIZES[value_type]
    if value_type == 8:
        fields.append((pos, 8, "string length"))
        return pos + 8 + _U64.unpack_from(data, pos)[0]
    if value_type == 9:
        fields.append((pos, 4, "array item type"))
        item_type = _U32.unpack_from(data, pos)[0]
        fields.append((pos + 4, 8, "array count"))
        count = _U64.unpack_from(data, pos + 4)[0]
        pos += 12
        if item_type in _SCALAR_SIZES:
            return pos + _SCALAR_SIZES[item_type] * count
        for i in range(count):
            if i < 3 or i % 97 == 0:         # some of the elements' lengths
                pos = _skip_value(data, pos, item_type, fields)
            else:
                pos = _skip_value(data, pos, item_type, [])
        return pos
    raise struct.error(f"value type {value_type}")


_EDGE = (0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 1023, 4096, 65535, 2**31 - 1, 2**31, 2**32 - 1,
         2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1)


def mutate_gguf(data, rng):
    data = bytearray(data)
    fields = gguf_fields(data)
    data_start = next((offset for offset, _, what in fields if what == "tensor data"), None)
    fields = [f for f in fields if f[1]]
    values = [f for f in fields if f[2].startswith("value of")]
    description = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        choice = rng.random()
        if choice < 0.3 and values:         # a metadata value: the file stays well formed
            offset, size, what = rng.choice(values)
            old = bytes(data[offset:offset + size])
            new = rng.choice((bytes(size), b"\xff" * size, rng.randbytes(size),
                              ((int.from_bytes(old, "little") + rng.choice((1, -1, 2))) % (1 << (8 * size)))
                              .to_bytes(size, "little"),
                              b"\x00\x00\xc0\x7f"[:size] if size == 4 else rng.randbytes(size)))
            data[offset:offset + size] = new
            description.append(f"{what} at {offset}: {old.hex()} -> {new.hex()}")
        elif choice < 0.45 and data_start is not None and data_start < len(data):    # tensor bytes
            for _ in range(rng.randint(1, 32)):
                at = rng.randrange(data_start, len(data))
                data[at] = rng.choice((0xFF, 0x7F, 0x00, data[at] ^ (1 << rng.randrange(8))))
            description.append("tensor bytes changed")
        elif choice < 0.75 and fields:
            offset, size, what = rng.choice(fields)
            old = int.from_bytes(data[offset:offset + size], "little")
            value = rng.choice((rng.choice(_EDGE), old + rng.choice((-1, 1, 2, -2, 16)), rng.getrandbits(size * 8)))
            value %= 1 << (size * 8)
            data[offset:offset + size] = value.to_bytes(size, "little")
            description.append(f"{what} at {offset}: {old} -> {value}")
        elif choice < 0.9:
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(len(data)) if rng.random() < 0.5 else rng.randrange(min(len(data), 65536))
                data[at] ^= 1 << rng.randrange(8)
            description.append("flipped bits")
        else:
            cut = rng.randrange(len(data))
            del data[cut:]
            description.append(f"cut at {cut}")
    return bytes(data), "; ".join(description)


# ---------------------------------------------------------------- llambda file structure

_PREFIX = struct.Struct("<8sIIQ")


def read_llb_header(data):
    magic, version, crc, length = _PREFIX.unpack_from(data, 0)
    return json.loads(data[_PREFIX.size:_PREFIX.size + length].decode("utf-8", "surrogatepass")), length


def write_llb_header(data, header, old_length, fix_crc=True):
    """``data`` with its JSON header replaced (the arrays stay where they are when the new
    header fits in the old one's room; else the data start moves and offsets break)."""
    body = json.dumps(header, ensure_ascii=False).encode("utf-8", "surrogatepass")
    magic, version, crc, _ = _PREFIX.unpack_from(data, 0)
    room = old_length
    if len(body) < room:
        body = body + b" " * (room - len(body))          # JSON allows trailing spaces
    crc = zlib.crc32(body) if fix_crc else crc
    start = _PREFIX.size + old_length      # a longer header shifts the arrays: offsets break
    return _PREFIX.pack(magic, version, crc, len(body)) + body + data[start:]


_ODD_VALUES = (0, 1, -1, 2, 3, 7, 2**31, 2**63, 10**12, 1.5, -0.0, 1e308, "", "x", None, True, [], [1], {},
               "\ud800", 0.1)


def _odd(rng):
    return rng.choice(_ODD_VALUES)


def mutate_llb(data, rng):
    description = []
    choice = rng.random()
    if choice < 0.7:
        header, length = read_llb_header(data)
        for _ in range(rng.choice((1, 1, 2))):
            try:
                description.append(_edit_header(header, rng))
            except (TypeError, KeyError, AttributeError, IndexError, ValueError):
                description.append("an edit that did not apply (the header was already odd)")
        return write_llb_header(data, header, length, fix_crc=rng.random() < 0.9), "; ".join(description)
    data = bytearray(data)
    if choice < 0.85:
        _, length = read_llb_header(data)
        start = _PREFIX.size + length if rng.random() < 0.7 else 0      # mostly in the arrays
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(start, len(data))] ^= 1 << rng.randrange(8)
        return bytes(data), f"flipped bits from byte {start}"
    cut = rng.randrange(len(data))
    return bytes(data[:cut]), f"cut at {cut}"


def _edit_header(header, rng):
    metadata, tensors = header["metadata"], header["tensors"]
    target = rng.choice(("config", "config", "tensor", "tensor", "layout", "tokenizer", "tokenizer",
                         "template", "top", "vectors"))
    if target == "config":
        config = metadata["config"]
        key = rng.choice(sorted(config))
        old = config[key]
        if isinstance(old, list) and old and rng.random() < 0.5:
            old = list(old)
            old[rng.randrange(len(old))] = _odd(rng)
            config[key] = old
        elif isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.5:
            config[key] = old + rng.choice((-1, 1, old, -old, 64))
        elif rng.random() < 0.1:
            del config[key]
        else:
            config[key] = _odd(rng)
        return f"config {key} = {config.get(key, '<deleted>')!r:.60}"
    if target == "tensor" and tensors:
        entry = rng.choice(tensors)
        key = rng.choice(("name", "dtype", "shape", "offset", "nbytes", "crc32"))
        if key == "shape":
            value = rng.choice(([], [0], [1, 1], [entry["shape"][0] if entry["shape"] else 1],
                                list(reversed(entry["shape"])), [2**40, 2**40]))
        elif key == "dtype":
            value = rng.choice(("<f2", "<i8", "|b1", "|V8", "O", "<c8", ">f4", "bogus", 5))
        elif key == "offset":
            value = rng.choice((0, 1, 64, entry["offset"] + 64, 2**62, -64, entry["offset"] - 64))
        elif key == "name":
            value = rng.choice([t["name"] for t in tensors] + ["", "x", 5])
        else:
            value = _odd(rng)
        entry[key] = value
        return f"tensor {entry.get('name')!r:.40} {key} = {value!r:.40}"
    if target == "layout" and metadata.get("layouts"):
        name = rng.choice(sorted(metadata["layouts"]))
        layout = metadata["layouts"][name]
        key = rng.choice(("kind", "n", "k", "meta", "arrays"))
        value = {"kind": rng.choice(("q4_1", "f32", "bogus", "q8_0", "f16", 3)),
                 "n": rng.choice((0, 1, layout["n"] * 2, -1, 2**40)),
                 "k": rng.choice((0, 1, layout["k"] * 2, -1, 33)),
                 "meta": rng.choice(({}, None, {"x": 1}, [])),
                 "arrays": rng.choice(([], ["nope"], None, list(reversed(layout["arrays"]))))}[key]
        layout[key] = value
        return f"layout {name} {key} = {value!r:.40}"
    if target == "tokenizer":
        tok = metadata["tokenizer"]
        key = rng.choice(sorted(tok))
        old = tok[key]
        if isinstance(old, dict) and "array" in old:         # a long list stored as an array
            field = rng.choice(("array", "kind", "count"))
            old = dict(old)
            old[field] = rng.choice(("nope", "texts", "int32", "float32", "bogus", -1, 0, 1, 10**9, None,
                                     old.get("count", 0) + 1))
            tok[key] = old
            return f"tokenizer {key} reference {field} edited"
        if isinstance(old, list) and old:
            old = list(old)
            i = rng.randrange(len(old))
            old[i] = rng.choice(("", " ", "\ud800", "\udcff", None, 7, "Ġ", "<0xZZ>", "a b c", old[0]))
            if rng.random() < 0.2:
                old = old[:rng.randrange(len(old))]
            tok[key] = old
        else:
            tok[key] = rng.choice((-1, 0, 10**9, "llama", "gpt2", "bert", "t5", "gemma4", None, [], "bogus", True))
        return f"tokenizer {key} edited"
    if target == "template":
        metadata["tokenizer"]["tokenizer.chat_template"] = random_template(rng)
        return "chat template replaced"
    if target == "vectors":
        vectors = list(metadata.get("vectors", []))
        if vectors and rng.random() < 0.5:
            vectors.pop(rng.randrange(len(vectors)))
        else:
            vectors.append(rng.choice(("nope", "blk.0.attn_q.weight", "token_embd.weight")))
        metadata["vectors"] = vectors
        return "vectors edited"
    key = rng.choice(("format", "schema", "file_size", "config", "layouts", "vectors", "tokenizer"))
    if key == "file_size":
        header["file_size"] = rng.choice((0, 1, header["file_size"] + 64, 2**62))
    else:
        metadata[key] = _odd(rng)
    return f"{key} = odd"


# ---------------------------------------------------------------- text and templates

def random_text(rng):
    pieces = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.3:
            pieces.append("".join(chr(rng.randrange(32, 127)) for _ in range(rng.randint(1, 20))))
        elif kind < 0.5:
            pieces.append("".join(chr(rng.randrange(0x80, 0x3000)) for _ in range(rng.randint(1, 5))))
        elif kind < 0.53:
            pieces.append(chr(rng.choice((0xD800, 0xDFFF, 0xDC80, 0xDCFF, 0xFFFE, 0x10FFFF, 0, 0xFEFF))))
        elif kind < 0.7:
            pieces.append(rng.choice(("<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|endoftext|>", "\n\n",
                                      "   ", "\t", "▁", "Ġ", "<0x0A>", "[PAD5]")))
        elif kind < 0.73:
            pieces.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 12)))
                          .decode("utf-8", "surrogateescape"))
        else:
            pieces.append(" " * rng.randint(1, 300) if rng.random() < 0.1 else rng.choice(("a", "the ", "1234")))
    return "".join(pieces)


_EXPRESSIONS = ("messages", "messages[0]", "messages[0].content", "messages[-1]['role']", "m.content",
                "m.role", "loop.index", "bos_token", "eos_token", "add_generation_prompt", "none", "1 / 0",
                "'a' * 1000", "'a' * n", "n ** n", "range(n)", "range(10**9)", "messages|length",
                "messages|tojson", "m.content|trim", "m.content.split(' ')", "'%s' % m", "x.y.z",
                "raise_exception('no')", "strftime_now('%Y')", "ns.s", "ns.s ~ ns.s", "m['missing']",
                "messages|map(attribute='role')|join(',')", "m.content[::-1]", "(m.content * n)|length",
                "{}.items()", "[1,2][5]", "'x'.__class__", "m.__dict__", "lipsum(n)", "n", "(n * 1000)",
                "'abc'|center(n * 100000)", "'{:>99999}'.format(1)", "cycler", "namespace")
_STATEMENTS = ("{% for m in messages %}{0}{% endfor %}", "{% if {1} %}{0}{% else %}{0}{% endif %}",
               "{% set n = {1} %}{0}", "{% set ns = namespace(s='ab') %}{0}",
               "{% for i in range(n) %}{% set ns.s = ns.s ~ ns.s %}{0}{% endfor %}",
               "{% macro f(k) %}{{ f(k) }}{% endmacro %}{0}", "{% macro g(k) %}{0}{% endmacro %}{{ g(1) }}",
               "{% for i in range(n) %}{% for j in range(n) %}{0}{% endfor %}{% endfor %}",
               "{{ {1} }}{0}", "{% generation %}{0}{% endgeneration %}", "{% raw %}{{{% endraw %}{0}",
               "{% filter upper %}{0}{% endfilter %}", "{% break %}", "{% for x in {1} %}{{ x }}{0}{% endfor %}",
               "{% include 'x' %}", "{% extends 'x' %}", "{{ self }}", "{% call f(1) %}{0}{% endcall %}")


def random_template(rng, depth=0):
    if depth > 3 or rng.random() < 0.25:
        text = rng.choice(("", "x", "<|{{ m.role }}|>", "{{ " + rng.choice(_EXPRESSIONS) + " }}", "{%", "}}",
                           "{{ messages[0].content }}"))
        return text
    statement = rng.choice(_STATEMENTS)
    inner = random_template(rng, depth + 1)
    return statement.replace("{0}", inner).replace("{1}", rng.choice(_EXPRESSIONS))


def random_messages(rng):
    roles = ("system", "user", "assistant", "tool", "", "x" * 50)
    messages = []
    for _ in range(rng.randint(0, 4)):
        message = {"role": rng.choice(roles), "content": random_text(rng)}
        if rng.random() < 0.1:
            message["content"] = rng.choice((None, 5, [{"type": "text", "text": "hi"}], {"a": 1}))
        if rng.random() < 0.05:
            del message["role"]
        messages.append(message)
    return messages


# ---------------------------------------------------------------- running one case

class Case:
    """What to run: a kind, its (seed, index), and for file cases the mutated bytes."""

    def __init__(self, kind, seed, index, source=None, data=None, description=""):
        self.kind, self.seed, self.index = kind, seed, index
        self.source, self.data, self.description = source, data, description

    @property
    def name(self):
        return f"{self.kind}-{self.seed}-{self.index}"


def draw_case(seed, index, seeds):
    rng = random.Random(f"{seed}:{index}")
    kind = KINDS[index % len(KINDS)]
    ggufs, llbs = seeds
    if kind == "gguf":
        source = rng.choice(ggufs)
        data, description = mutate_gguf(source.read_bytes(), rng)
        return Case(kind, seed, index, source, data, description)
    if kind == "llb":
        source = rng.choice(llbs)
        data, description = mutate_llb(source.read_bytes(), rng)
        return Case(kind, seed, index, source, data, description)
    return Case(kind, seed, index, description=f"rng {seed}:{index}")


def _is_one_line_error(error):
    from llambda.errors import UserError
    return isinstance(error, (UserError, ValueError, OSError)) and "\n" not in str(error).strip()


def run_steps(case, workdir):
    """Run the case's steps in this process; returns a list of (step, outcome) and raises
    nothing but a failure (AssertionError with the traceback)."""
    from llambda.model import convert
    rng = random.Random(f"{case.seed}:{case.index}:run")
    outcomes = []

    def step(name, function):
        try:
            result = function()
            outcomes.append((name, "ok"))
            return result
        except Exception as error:      # noqa: BLE001 - classifying is the point
            if _is_one_line_error(error):
                outcomes.append((name, f"error: {error}"))
                return None
            raise AssertionError(f"step {name}: {type(error).__name__}: {error}\n{traceback.format_exc()}") from None

    if case.kind in ("gguf", "llb"):
        path = Path(workdir) / ("case.gguf" if case.kind == "gguf" else "case.llb")
        path.write_bytes(case.data)
        model_file = path
        if case.kind == "gguf":
            step("gguf tokenizer", lambda: _tokenize(path, rng))       # reads no tensor data
            model_file = step("convert", lambda: convert.convert(path, Path(workdir) / "out.llb", progress=False))
            if model_file is None:
                return outcomes
        step("info", lambda: convert.info(model_file))
        step("verify", lambda: convert.verify(model_file))
        step("tokenizer", lambda: _tokenize(model_file, rng))
        model = step("load", lambda: _load(model_file))
        if model is not None:
            step("generate", lambda: "".join(model.generate(random_text(rng) or "x", max_tokens=3, temperature=0.7,
                                                           seed=1, ignore_eos=True)))
            step("chat", lambda: "".join(model.chat(random_messages(rng) or [{"role": "user", "content": "hi"}],
                                                    max_tokens=2, seed=1)))
            model.close()
    elif case.kind == "text":
        tokenizer = _seed_tokenizer()
        for _ in range(20):
            text = random_text(rng)
            ids = step("encode", lambda: tokenizer.encode(text, add_special=rng.random() < 0.5,
                                                          parse_special=rng.random() < 0.5))
            if ids is not None:
                step("decode", lambda: tokenizer.decode(ids))
            bad = [rng.choice((0, 1, -1, tokenizer.vocab_size - 1, tokenizer.vocab_size, 10**12, rng.randrange(300)))
                   for _ in range(rng.randint(0, 6))]
            step("decode ids", lambda: tokenizer.decode(bad))
    elif case.kind == "cli":
        for _ in range(3):
            argv = random_command(rng, SEEDS[1][0])
            step(f"cli {' '.join(argv)[:200]}", lambda: _run_cli(argv, workdir))
    else:
        from llambda.chat.template import render_chat
        for _ in range(5):
            template = random_template(rng)
            step("render", lambda: render_chat(template, random_messages(rng), name="fuzz",
                                               add_generation_prompt=rng.random() < 0.5))
    return outcomes


_NUMBERS = ("0", "1", "-1", "2", "0.5", "nan", "inf", "-inf", "1e308", "-1e-308", "2147483648",
            "99999999999999999999", "", "x", "1.5", "0x10", "  3 ")


def random_command(rng, model):
    """A random ``llambda run`` command line on ``model``: option values at their edges."""
    argv = ["run", "--model", str(model), "--max-tokens", rng.choice(("1", "2", "0", "-1", "3"))]
    for option in rng.sample(("--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed",
                              "--ctx", "--threads", "--stop", "--prompt", "--max-tokens"), rng.randint(0, 4)):
        if option == "--prompt":
            argv += [option, random_text(rng) or "x"]
        elif option == "--stop":
            argv += [option, rng.choice(("", "a", " ", random_text(rng) or "z"))]
        elif option in ("--threads", "--ctx") and rng.random() < 0.7:
            argv += [option, rng.choice(("1", "2", "3", "4"))]
        else:
            argv += [option, rng.choice(_NUMBERS)]
    argv += rng.sample(["--json", "--echo", "--truncate", "--ignore-eos"], rng.randint(0, 2))
    return argv


def _run_cli(argv, workdir):
    """``llambda ARGV`` in this process; a CLI error must be one line on stderr (argparse's
    usage message for a malformed command line is its own standard form)."""
    import io
    from llambda import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as e:         # argparse: usage + one error line, status 2
            if e.code == 2 and err.getvalue().startswith("usage:"):
                return "usage"
            raise AssertionError(f"SystemExit {e.code}: {err.getvalue()[-2000:]}") from None
    lines = [line for line in err.getvalue().splitlines()
             if line.strip() and not line.startswith(("[llambda]", "llambda: warning"))]
    if status not in (0, 2) or len(lines) > 1 or "Traceback" in err.getvalue():
        raise AssertionError(f"status {status}, stderr:\n{err.getvalue()[-3000:]}")
    return status


def _load(path):
    import llambda
    return llambda.load(path, progress=False, threads=1)


def _tokenize(path, rng):
    import llambda
    tokenizer = llambda.load_tokenizer(path)
    text = random_text(rng).encode("utf-8", "replace").decode("utf-8")
    return tokenizer.decode(tokenizer.encode(text))


_TOKENIZER = None


def _seed_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from llambda.model import convert
        _TOKENIZER = convert.build_tokenizer(SEEDS[1][0], convert.tokenizer_metadata(SEEDS[1][0]))
    return _TOKENIZER


SEEDS = None
STEP_COUNTS = {}            # "kind:step:ok|error" -> how often, over the passing cases


def run_case_isolated(case, timeout=CASE_SECONDS):
    """Fork; the child runs the case with its output captured. Returns (ok, report)."""
    workdir = tempfile.mkdtemp(prefix="llambda-fuzz-")
    out_path = Path(workdir) / "child.out"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:            # the child
        os.close(read_end)
        status = 3
        try:
            resource.setrlimit(resource.RLIMIT_AS, (CASE_MEMORY, CASE_MEMORY))
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                outcomes = run_steps(case, workdir)
                report, status = json.dumps(outcomes), 0
            except AssertionError as failure:
                report, status = str(failure), 1
            except BaseException as failure:        # noqa: BLE001
                report, status = f"{type(failure).__name__}: {failure}\n{traceback.format_exc()}", 1
            os.write(write_end, report.encode("utf-8", "replace")[:1 << 20])
        finally:
            os._exit(status)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    chunks = []
    os.set_blocking(read_end, False)
    status = None
    while status is None:
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(read_end, 1 << 16)
            while chunk:
                chunks.append(chunk)
                chunk = os.read(read_end, 1 << 16)
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = raw
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "hang"
        else:
            time.sleep(0.01)
    with contextlib.suppress(OSError):
        chunk = os.read(read_end, 1 << 20)
        while chunk:
            chunks.append(chunk)
            chunk = os.read(read_end, 1 << 20)
    os.close(read_end)
    report = b"".join(chunks).decode("utf-8", "replace")
    output = out_path.read_text(errors="replace") if out_path.exists() else ""
    shutil.rmtree(workdir, ignore_errors=True)
    if status == "hang":
        return False, f"hang: no result after {timeout} s\n{output[-4000:]}"
    if os.WIFSIGNALED(status):
        return False, f"killed by signal {os.WTERMSIG(status)}\n{output[-4000:]}"
    code = os.WEXITSTATUS(status)
    if code != 0:
        return False, f"exit {code}: {report}\n--- output ---\n{output[-4000:]}"
    return True, report


def save_failure(case, report, folder):
    folder = Path(folder) / case.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.txt").write_text(f"{case.kind} case {case.seed}:{case.index}\n"
                                       f"source: {case.source}\nmutation: {case.description}\n\n{report}\n")
    if case.data is not None:
        (folder / ("case.gguf" if case.kind == "gguf" else "case.llb")).write_bytes(case.data)
    (folder / "case.json").write_text(json.dumps({"kind": case.kind, "seed": case.seed, "index": case.index,
                                                  "source": str(case.source), "description": case.description}))
    return folder


def campaign(seed=0, cases=None, minutes=None, folder="fuzz-failures", workdir=None, log=sys.stderr,
             timeout=CASE_SECONDS):
    """Run cases until ``cases`` ran or ``minutes`` passed; returns (tried, failures)."""
    global SEEDS
    own_dir = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="llambda-fuzz-seeds-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _share_kernel_library()
    real = _default_gguf()
    os.environ["LLAMBDA_CACHE_DIR"] = str(workdir / "cache")
    SEEDS = make_seeds(workdir, real)
    _seed_tokenizer()
    from llambda.runtime import get_backend
    get_backend()              # load the kernel library before forking, not in every child
    end = time.monotonic() + minutes * 60 if minutes else None
    tried, failures, index = 0, [], 0
    try:
        while (cases is None or tried < cases) and (end is None or time.monotonic() < end):
            try:
                case = draw_case(seed, index, SEEDS)
            except Exception:       # noqa: BLE001 - a mutator's own bug must not end the campaign
                print(f"mutator failed on {seed}:{index} (skipped):\n{traceback.format_exc()}", file=log, flush=True)
                index += 1
                continue
            index += 1
            ok, report = run_case_isolated(case, timeout=timeout)
            tried += 1
            if ok:
                for step, outcome in json.loads(report):
                    key = f"{case.kind}:{step.split()[0]}:{'ok' if outcome == 'ok' else 'error'}"
                    STEP_COUNTS[key] = STEP_COUNTS.get(key, 0) + 1
            if not ok:
                failures.append((case, report))
                where = save_failure(case, report, folder) if folder else None
                print(f"FAIL {case.name} ({case.description}) -> {where}\n  {report.splitlines()[0][:300]}",
                      file=log, flush=True)
            if tried % 50 == 0:
                print(f"{tried} cases, {len(failures)} failures", file=log, flush=True)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return tried, failures


def _default_gguf():
    """The default model's GGUF in the user's cache, if it was fetched."""
    from llambda.model import default_model
    from llambda.runtime import paths
    return paths.cache_dir() / "models" / default_model.FILE_NAME


def _share_kernel_library():
    """The campaign's private cache reuses the kernel library already built (no rebuild)."""
    from llambda.runtime import library
    if "LLAMBDA_KERNEL_DIR" not in os.environ:
        os.environ["LLAMBDA_KERNEL_DIR"] = str(library.ensure_built())


def replay(folder):
    """Run a saved case in this process (tracebacks shown), for debugging a failure."""
    global SEEDS
    folder = Path(folder)
    spec = json.loads((folder / "case.json").read_text())
    data_file = next((p for p in folder.iterdir() if p.name.startswith("case.") and p.suffix != ".json"), None)
    case = Case(spec["kind"], spec["seed"], spec["index"], spec["source"],
                data_file.read_bytes() if data_file else None, spec["description"])
    workdir = Path(tempfile.mkdtemp(prefix="llambda-replay-"))
    _share_kernel_library()
    os.environ["LLAMBDA_CACHE_DIR"] = str(workdir / "cache")
    SEEDS = make_seeds(workdir)
    print(run_steps(case, workdir))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, help="run for this long")
    parser.add_argument("--cases", type=int, help="run this many cases")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--out", default="fuzz-failures", help="folder for failing cases")
    parser.add_argument("--timeout", type=float, default=CASE_SECONDS, help="seconds before a case is a hang")
    parser.add_argument("--replay", metavar="FOLDER", help="run one saved case in this process")
    parser.add_argument("--http", action="store_true",
                        help="fuzz llambda serve over HTTP instead (tools/fuzz_http.py): its own server, or --url")
    parser.add_argument("--url", help="with --http: a llambda server already running on loopback")
    parser.add_argument("--read-timeout", type=float, help="with --url: the server's --read-timeout (slow cases)")
    parser.add_argument("--only", type=int, metavar="INDEX", help="with --http: run case INDEX of --seed alone")
    args = parser.parse_args(argv)
    if args.http:
        if args.minutes is None and args.cases is None and args.only is None:
            parser.error("give --minutes, --cases or --only")
        import fuzz_http
        return fuzz_http.main(args)
    if args.replay:
        replay(args.replay)
        return 0
    if args.minutes is None and args.cases is None:
        parser.error("give --minutes or --cases")
    print(f"fuzzing with seed {args.seed}", file=sys.stderr)
    tried, failures = campaign(seed=args.seed, cases=args.cases, minutes=args.minutes, folder=args.out,
                               timeout=args.timeout)
    print("steps reached: " + ", ".join(f"{key} {n}" for key, n in sorted(STEP_COUNTS.items())), file=sys.stderr)
    print(f"{tried} cases tried, {len(failures)} failures (seed {args.seed})"
          + (f"; cases in {args.out}/" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
