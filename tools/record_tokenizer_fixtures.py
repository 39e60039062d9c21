"""Record llama.cpp's token ids for tricky texts: the reference tests/tokenizer/test_tokenizer.py
compares llambda's tokenizer against.

llama.cpp is reached through llama-cpp-python, which does not belong in the
project's venv; run this with a throwaway one:

    python3 -m venv /tmp/tokref
    /tmp/tokref/bin/pip install llama-cpp-python gguf numpy
    /tmp/tokref/bin/python tools/record_tokenizer_fixtures.py SmolLM2-135M-Instruct.Q4_1.gguf

Besides the model's own pre-tokenizer ("smollm"), the same vocabulary is
re-labelled with the other pre-tokenizers llambda knows ("gpt-2", "llama-bpe",
"qwen2") in vocabulary-only GGUF copies, so each regex is checked against
llama.cpp without downloading those models. A SentencePiece vocabulary is
derived from it the same way (see `sentencepiece_vocab`).

Real vocabularies whose files are too large to commit are recorded from the
file itself, and their tests run when the file is present:

    /tmp/tokref/bin/python tools/record_tokenizer_fixtures.py --gemma3 gemma-3-270m-q4_k_m.gguf

writes tests/fixtures/gemma3_tokens.json (Gemma 3's 262,144-token SentencePiece
vocabulary with byte fallback) without touching the SmolLM fixtures.

llama.cpp's own tokenizer suite (ggml-vocab-*.gguf with .inp/.out) covers plain
encoding of 46 texts only; with --vocab-dir (its models/ directory) the same
vocabularies are also recorded with and without add_special and parse_special,
on their test texts, on texts made of each vocabulary's own special tokens and
on the texts above, into tests/fixtures/vocab/llama_cpp_ids.json.
"""
import argparse
import hashlib
import json
import os
import random
import sys
import tempfile

import gguf
import llama_cpp

# ---------------------------------------------------------------------------
# What to tokenize
# ---------------------------------------------------------------------------

HAND_PICKED_TEXTS = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n \n", "\t\t  \t",
    "Hello", " Hello", "Hello ", "  Hello  ", "Hello world", "Hello, world!", "HELLO World",
    "hello\nworld", "hello\n\nworld", "hello\r\nworld", "hello \n world", "a  b   c    d",
    "1", "12", "123", "1234", "1234567", " 1234567", "3.14159", "1,000,000", "x=12+34",
    "v1.2.3", "2024-01-01", "0x1F", "1e-10", "-42", "$100",
    "don't", "it's", "we're", "I've", "I'm", "you'll", "he'd", "DON'T", "IT'S", "We'Re",
    "'s", "' s", "rock 'n' roll", "''quoted''", "\"double\"", "l'été",
    "café", "naïve", "Ångström", "Straße", "résumé", "Cañón", "Œuvre", "İstanbul",
    "e\u0301", "a\u0300\u0301\u0302", "Ελληνικά", "Привет, мир!", "שלום", "مرحبا بالعالم",
    "नमस्ते", "日本語のテキスト", "中文字符测试", "한국어 텍스트", "ไทย", "ქართული",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇩🇪", "I ❤️ Python 🐍!", "©®™", "½ ² ³ ⅞", "Ⅻ ⅻ",
    "٠١٢٣", "१२३", "１２３", "𝟙𝟚𝟛",
    "\u00a0", "a\u00a0b", "a\u2003b", "a\u3000b", "a\u200bb", "a\u2028b", "\x0b\x0c", "a\x85b",
    "\x00", "\x01\x02\x1f\x7f", "tab\tseparated\tvalues",
    # Bytes the default vocabulary has no token for: dropped, by llama.cpp too.
    "\x04\x06\x13", "\U00040000", "a\U000F0000b",
    "def f(x):\n    return x ** 2\n",
    "if (a && b) { return c[i]; }\n",
    "    indented\n        more\n\tand tab",
    "<html><body class=\"x\">Hi</body></html>",
    "SELECT * FROM t WHERE id = 42;",
    "https://example.com/path?q=1&r=two#frag",
    "...!!!???", "---", "***bold***", "__init__", "a_b_c", "CamelCaseWord", "snake_case_word",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user", "<|im_end|>", "<|endoftext|>", "<|im_start|><|im_end|>",
    "a<|im_start|>b", " <|im_start|> ", "<|im_start", "im_start|>", "<|im_start|><|im_start|>",
    "<repo_name>x<file_sep>y", "<reponame><filename>", "<jupyter_code>print(1)",
    "<s>", "</s>", "<unk>", "<0x0A>",
]


# Gemma's vocabulary: whole runs of spaces, newlines and tabs, HTML tags and
# <start_of_turn> are tokens of their own; byte fallback spells the rest.
GEMMA_TEXTS = [
    "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user", "<end_of_turn>", "<start_of_turn>", "<pad><eos><unk><mask>",
    "<unused0><unused6241>", "[multimodal]", "<start_of_image>", "<bos>Hello", "Hello<eos>",
    "a  b", "a   b", "a" + " " * 31 + "b", "a" + " " * 40 + "b", " " * 33, "  leading", "trailing  ",
    "a\tb", "a\t\t\tb", "\t" * 35, "a\n\nb", "\n" * 40, " \n \n ", "\n\n  \n",
    "<table><tr><td>1</td></tr></table>", "<h1>Title</h1>", "<b>bold</b> <i>it</i>",
    "▁", "▁▁hello", "hello▁world", "\u2581 \u2581",
    "\U00020000\U0002A700", "\U000E0041", "\uFFFF", "\U0010FFFD", "𓀀𓀁", "🫠🫶🏻",
    "def main():\n\tif x:\n\t\treturn  1\n",
]


def long_text():
    """Some two thousand tokens of mixed prose, code and numbers."""
    paragraph = (
        "The quick brown fox jumps over the lazy dog. In 1999, 23 foxes did it 4567 times!\n"
        "    for i in range(10):\n        print(f\"{i:03d}\")  # don't panic\n"
        "Ça coûte 12,50 € — naïve café résumé. 東京は日本の首都です。 😀👍🏽\n\n"
    )
    return paragraph * 12


def random_texts(count=120, seed=1234):
    """Short random strings mixing scripts, digits, marks, spaces and symbols."""
    pool = ("abcxyzABCXYZ0123456789 ''\"-_.,;:!?()[]{}<>/\\|@#$%^&*+=~`"
            "\t\n\r\u00a0\u2003\u3000\u200b\u2028\x0b\x0c\x85"
            "éèêëñüöçßøåæœİıÆØÅ\u0301\u0300\u0308"
            "αβγΩДЖжяשלוםمرحبनमस्ते日本語中文한국어ไทย"
            "٠١٢٣١٢३४５６²³½⅞Ⅻ𝟙"
            "😀👍🏽👨‍👩‍👧🇫🇷❤️©®™€£¥•…—–")
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.randint(1, 24)
        texts.append("".join(rng.choice(pool) for _ in range(length)))
    return texts


def random_code_points(count=60, seed=99):
    """Strings of arbitrary assigned-looking code points (no surrogates), with spaces."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(1, 12)):
            cp = rng.choice([rng.randint(0x20, 0x2FF), rng.randint(0x370, 0x1FFF),
                             rng.randint(0x2000, 0x2BFF), rng.randint(0x3000, 0x9FFF),
                             rng.randint(0xAC00, 0xD7A3), rng.randint(0xF900, 0xFFFD),
                             rng.randint(0x1F300, 0x1FAFF), 0x20])
            chars.append(chr(cp))
        texts.append("".join(chars))
    return texts


def all_texts():
    return HAND_PICKED_TEXTS + [long_text()] + random_texts() + random_code_points()


# ---------------------------------------------------------------------------
# Vocabulary-only GGUF copies
# ---------------------------------------------------------------------------


def read_metadata(path):
    """{key: (value, [types])} of every metadata field."""
    reader = gguf.GGUFReader(path)
    return {key: (field.contents(), field.types) for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def write_vocab_only(path, metadata):
    writer = gguf.GGUFWriter(path, arch=metadata["general.architecture"][0])
    for key, (value, types) in metadata.items():
        if key == "general.architecture":
            continue
        sub_type = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def relabelled(metadata, overrides, removed):
    out = {key: entry for key, entry in metadata.items() if key not in removed}
    for key, value in overrides.items():
        out[key] = (value, [gguf.GGUFValueType.STRING])
    return out


def sentencepiece_vocab(metadata, size=6000):
    """A SentencePiece-style vocabulary derived from a byte-level one.

    <unk>, <s>, </s>, the 256 byte tokens, then the first `size` byte-level tokens
    turned back into text ("Ġ" -> "▁"), scored by rank; every character of a
    piece is also a piece, as SentencePiece's own vocabularies have.
    """
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    char_to_byte = {}
    moved = 0
    for b in range(256):  # GPT-2's byte -> stand-in character map, inverted
        if b in printable:
            char_to_byte[chr(b)] = b
        else:
            char_to_byte[chr(256 + moved)] = b
            moved += 1

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    source_tokens, source_types = metadata["tokenizer.ggml.tokens"][0], \
        metadata["tokenizer.ggml.token_type"][0]
    for rank, (text, kind) in enumerate(zip(source_tokens[:size], source_types[:size])):
        if kind != 1:
            continue
        try:
            piece = bytes(char_to_byte[c] for c in text).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if "\x00" in piece:  # llama.cpp reads token texts as C strings
            continue
        piece = piece.replace(" ", "▁")
        for candidate in [*piece, piece]:
            if candidate not in seen:
                seen.add(candidate)
                tokens.append(candidate)
                types.append(1)
                scores.append(-float(rank) - (0.5 if candidate != piece else 0.0))
    return tokens, scores, types


def sentencepiece_metadata(base, tokens, scores, types):
    T = gguf.GGUFValueType
    keep = {key: entry for key, entry in base.items() if not key.startswith("tokenizer.")}
    keep.update({
        "tokenizer.ggml.model": ("llama", [T.STRING]),
        "tokenizer.ggml.tokens": (tokens, [T.ARRAY, T.STRING]),
        "tokenizer.ggml.scores": (scores, [T.ARRAY, T.FLOAT32]),
        "tokenizer.ggml.token_type": (types, [T.ARRAY, T.INT32]),
        "tokenizer.ggml.bos_token_id": (1, [T.UINT32]),
        "tokenizer.ggml.eos_token_id": (2, [T.UINT32]),
        "tokenizer.ggml.unknown_token_id": (0, [T.UINT32]),
    })
    return keep


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------


def record(path, texts):
    """{"special": ids with add_special and parse_special, "plain": ids with neither},
    each a list aligned with `texts`."""
    model = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)

    def ids_of(text, flag):
        return list(model.tokenize(text.encode("utf-8"), add_bos=flag, special=flag))
    return {"special": [ids_of(text, True) for text in texts],
            "plain": [ids_of(text, False) for text in texts]}


BYTE_LEVEL_VARIANTS = {
    # name: (metadata overrides, keys removed)
    "smollm": ({}, []),
    "gpt-2": ({"tokenizer.ggml.pre": "gpt-2"}, []),
    # Without add_bos_token llama.cpp's llama-bpe default (add BOS) shows.
    "llama-bpe": ({"tokenizer.ggml.pre": "llama-bpe"}, ["tokenizer.ggml.add_bos_token"]),
    "qwen2": ({"tokenizer.ggml.pre": "qwen2"}, []),
}


def vocab_digest(tokens):
    return hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()


def record_real_vocabulary(path, texts, out_path):
    """ids llama.cpp gives ``texts`` with the vocabulary of the GGUF at ``path``."""
    metadata = read_metadata(path)
    payload = {"source": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp), vocab_only tokenize",
               "gguf": os.path.basename(path),
               "vocab_sha256": vocab_digest(metadata["tokenizer.ggml.tokens"][0]),
               "texts": texts, "ids": record(path, texts)}
    write_fixture(out_path, payload)
    print(f"{os.path.basename(path)}: {len(texts)} texts recorded", file=sys.stderr)


def special_texts(metadata, seed=7):
    """Texts mixing a vocabulary's control and user-defined tokens with words."""
    tokens = metadata["tokenizer.ggml.tokens"][0]
    types = metadata.get("tokenizer.ggml.token_type", ([1] * len(tokens), None))[0]
    special = [t for t, kind in zip(tokens, types) if kind in (3, 4) and t]
    rng = random.Random(seed)
    picked = special[:6] + rng.sample(special, min(6, len(special)))
    texts = [f"{t}Hello world" for t in picked[:4]]
    texts += [f" {a} x{b}\n{c} " for a, b, c in zip(picked[::3], picked[1::3], picked[2::3])]
    texts.append("".join(picked))
    return texts


def record_vocab_suite(vocab_dir, names, out_path):
    """Each vocabulary's suite texts, texts of its own special tokens and the texts
    above, with and without special tokens."""
    separator = "\n__ggml_vocab_test__\n"
    payload = {"source": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp), vocab_only "
                         "tokenize", "shared_texts": all_texts() + GEMMA_TEXTS, "vocabularies": {}}
    for name in names:
        path = os.path.join(vocab_dir, f"ggml-vocab-{name}.gguf")
        with open(path + ".inp", encoding="utf-8") as f:
            own = [t for t in f.read().split(separator) if t]
        own += special_texts(read_metadata(path))
        payload["vocabularies"][name] = {"texts": own,
                                         "ids": record(path, own + payload["shared_texts"])}
        print(f"{name}: {len(own)} + {len(payload['shared_texts'])} texts recorded", file=sys.stderr)
    write_fixture(out_path, payload)


def write_fixture(path, payload):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", help="the default model's GGUF (SmolLM2-135M-Instruct)")
    parser.add_argument("--gemma3", metavar="GGUF", help="also record Gemma 3's vocabulary from this file")
    parser.add_argument("--vocab-dir", metavar="DIR",
                        help="llama.cpp's models/ directory: record its vocabularies with special tokens")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "..",
                                                          "tests", "fixtures"))
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.gemma3:
        record_real_vocabulary(args.gemma3, all_texts() + GEMMA_TEXTS,
                               os.path.join(args.out_dir, "gemma3_tokens.json"))
    if args.vocab_dir:
        names = sorted(json.load(open(os.path.join(args.out_dir, "vocab", "vocabularies.json")))
                       ["vocabularies"])
        record_vocab_suite(args.vocab_dir, names, os.path.join(args.out_dir, "vocab", "llama_cpp_ids.json"))
    if not args.gguf:
        return

    metadata = read_metadata(args.gguf)
    texts = all_texts()
    provenance = f"llama-cpp-python {llama_cpp.__version__} (llama.cpp), vocab_only tokenize"
    byte_level = {"source": provenance, "gguf": os.path.basename(args.gguf),
                  "vocab_sha256": vocab_digest(metadata["tokenizer.ggml.tokens"][0]),
                  "texts": texts, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (overrides, removed) in BYTE_LEVEL_VARIANTS.items():
            path = os.path.join(tmp, f"{name}.gguf")
            write_vocab_only(path, relabelled(metadata, overrides, removed))
            byte_level["variants"][name] = {"overrides": overrides, "removed": removed,
                                            "ids": record(path, texts)}
            print(f"{name}: {len(texts)} texts recorded", file=sys.stderr)

        tokens, scores, types = sentencepiece_vocab(metadata)
        path = os.path.join(tmp, "spm.gguf")
        write_vocab_only(path, sentencepiece_metadata(metadata, tokens, scores, types))
        spm = {"source": provenance, "tokens": tokens, "scores": scores, "token_types": types,
               "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0,
               "texts": texts, "ids": record(path, texts)}
        print(f"sentencepiece: {len(tokens)} tokens", file=sys.stderr)

    for filename, payload in (("smollm2_tokens.json", byte_level),
                              ("sentencepiece_tokens.json", spm)):
        write_fixture(os.path.join(args.out_dir, filename), payload)


if __name__ == "__main__":
    main()
