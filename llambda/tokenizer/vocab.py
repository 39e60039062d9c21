"""Text <-> token ids for the vocabularies that GGUF files carry.

Three vocabulary kinds are supported, named by `tokenizer.ggml.model`:

- "gpt2": byte-level BPE (SmolLM, Llama 3, Qwen 2/3.5, GPT-2, DeepSeek, Falcon,
  Command-R, ...). The text is split by the pre-tokenizer regexes that
  `tokenizer.ggml.pre` names, each piece is mapped byte by byte onto printable
  stand-in characters, and the merges are applied.
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral, Phi-3,
  Gemma 3). Spaces become "▁", a space is prefixed to the text unless the file
  says otherwise, pieces merge by token score, and characters outside the
  vocabulary fall back to <0xXX> byte tokens.
- "gemma4": BPE by merge rank over the text's own characters (spaces as "▁"),
  line by line, with <0xXX> byte fallback.

All follow llama.cpp's behaviour, because that is what GGUF files are converted
for and what the test fixtures are recorded from (llama.cpp's own tokenizer test
suite among them). The merge loops themselves run in libraries: HF `tokenizers`
(Rust) for BPE by merge rules, `sentencepiece` (C++, llambda.tokenizer.spm) for
SentencePiece's merge-by-score; this module decides what each call gets to see.
"""
import codecs
import re
from enum import IntEnum

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _HfTokenizer
from tokenizers import models, pre_tokenizers

from llambda.tokenizer import bpe_cache
from llambda.tokenizer.spm import SentencePieceEngine
from llambda.errors import UserError
from llambda.inputs import check_text, is_text


class TokenType(IntEnum):
    """Values of `tokenizer.ggml.token_type` (the GGUF spec's enumeration)."""
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# ---------------------------------------------------------------------------
# Pre-tokenizers of byte-level BPE vocabularies
# ---------------------------------------------------------------------------

_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3 and Qwen 2 match contractions case-insensitively; spelled out as
# classes because the case-insensitive group syntax differs between engines.
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_WORDS = (_CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_WORDS = (_CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 3.5 keeps combining marks with the letters they modify.
_QWEN35_WORDS = (_CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek's pre-tokenizers spell their letter, punctuation and CJK classes as
# explicit code point ranges (the values their tokenizer.json lists).
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-Ί"
    "ΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷ"
    "ᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌ"
    "ῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿ"
    "ⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆ"
    "ﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
_DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"


class _PreTokenizer:
    """How a vocabulary cuts text into words before merging.

    regexes: applied one after another; every regex splits the pieces the
    previous one left, keeping both its matches and the text between them as
    pieces (so SmolLM first isolates every digit, then splits words).
    whole_words_first: a word that is itself a token is taken whole, unmerged
    (Llama 3's vocabulary holds words its merges cannot reach).
    adds_bos: llama.cpp adds BOS unless the file says otherwise.
    """

    def __init__(self, *regexes, whole_words_first=False, adds_bos=False):
        self.regexes = regexes
        self.whole_words_first = whole_words_first
        self.adds_bos = adds_bos


_PRE_TOKENIZERS = {
    "smollm": _PreTokenizer(r"\p{N}", _GPT2_WORDS),
    "gpt2": _PreTokenizer(_GPT2_WORDS),
    "llama3": _PreTokenizer(_LLAMA3_WORDS, whole_words_first=True, adds_bos=True),
    "qwen2": _PreTokenizer(_QWEN2_WORDS),
    "qwen35": _PreTokenizer(_QWEN35_WORDS),
    "deepseek-llm": _PreTokenizer(r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                                  r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+\z", _DEEPSEEK_CJK,
                                  r"\p{N}+"),
    "deepseek-coder": _PreTokenizer(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK,
                                    r"\p{N}"),
    "falcon": _PreTokenizer(r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_WORDS, r"[0-9][0-9][0-9]"),
}

# GGUF `tokenizer.ggml.pre` values (as llama.cpp's converter writes them) -> pre-tokenizer.
_PRE_TOKENIZER_NAMES = {
    "smollm": "smollm",
    "starcoder": "smollm",
    "refact": "smollm",
    "command-r": "smollm",
    "codeshell": "smollm",
    "exaone": "smollm",
    "minerva-7b": "smollm",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "qwen2",
    "qwen35": "qwen35",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
}


def byte_level_alphabet():
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Bytes that are printable Latin-1 stand for themselves; the rest (controls,
    space, soft hyphen, ...) are moved, in order, to code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    byte_to_char = {b: chr(b) for b in printable}
    moved = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + moved)
            moved += 1
    return byte_to_char


_CHAR_TO_BYTE = str.maketrans({char: chr(b) for b, char in byte_level_alphabet().items()})

# llama.cpp recognises special tokens by their text (GGUF files rarely carry an
# id for them) and forces them to control, so that they are only matched in
# text when special tokens are parsed. These are its lists.
#
# Tokens that end generation:
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle markers, by role; the pad, repository and file-separator
# markers also end generation. A GGUF key naming the role's id replaces the search.
_FILL_IN_THE_MIDDLE_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
               "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
               "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
               "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FILL_IN_THE_MIDDLE_ENDS = ("fim_pad", "fim_rep", "fim_sep")
# End-of-turn tokens named by key or found by text.
_END_OF_TURN_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
}

# Gemma 4 merges each line and each run of newlines separately.
_LINES_AND_NEWLINES = re.compile(r"[^\n]+|\n+")


# ---------------------------------------------------------------------------
# Reading the metadata
# ---------------------------------------------------------------------------

def _required(md, key):
    if key not in md:
        raise UserError(f"the model's tokenizer is incomplete: GGUF metadata has no '{key}'")
    return md[key]


def _optional_id(md, key, n_tokens):
    """A token id from the metadata, or None when absent or out of range."""
    value = md.get(key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_tokens else None


def _token_types(md, n_tokens):
    types = md.get("tokenizer.ggml.token_type")
    if types is None:
        return [TokenType.NORMAL] * n_tokens
    if len(types) != n_tokens:
        raise UserError(f"the model's tokenizer is inconsistent: {len(types)} token types "
                        f"for {n_tokens} tokens")
    return np.asarray(types, dtype=np.int64).tolist()


# ---------------------------------------------------------------------------
# The merge engines (one HF `tokenizers` pipeline per vocabulary kind)
# ---------------------------------------------------------------------------

def _split_merge(merge):
    # The separator is the first space after the first character: a merge's
    # left side may itself be a lone space in non-byte-level vocabularies.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise UserError(f"the model's tokenizer has a malformed merge rule: {merge!r}")
    return merge[:cut], merge[cut + 1:]


def _vocab_dict(tokens):
    # Like llama.cpp, a repeated token text maps to its last id. A token whose bytes are
    # not UTF-8 (kept as surrogate escapes, see gguf_file) cannot be matched in text, and
    # HF refuses it: it stays out of the encoder and decodes to its raw bytes.
    if is_text("".join(tokens)):        # one check for the usual, all-text vocabulary
        return {text: token_id for token_id, text in enumerate(tokens)}
    return {text: token_id for token_id, text in enumerate(tokens) if is_text(text)}


def _bpe_model(tokens, merges, **options):
    """HF's BPE over the file's merge rules.

    HF refuses a rule whose sides or result are not tokens, which llama.cpp
    keeps (it can only ever make a piece that is spelled out byte by byte);
    such rules are left out rather than the vocabulary refused. A vocabulary
    built before is read back from llambda.tokenizer.bpe_cache.
    """
    cache_key = bpe_cache.key("merges", tokens, merges, options)
    model = bpe_cache.load(cache_key, tokens, options)
    if model is not None:
        return model
    vocab = _vocab_dict(tokens)
    pairs = [_split_merge(m) for m in merges]
    try:
        model = models.BPE(vocab=vocab, merges=pairs, **options)
    except Exception:     # tokenizers raises a bare Exception naming the token
        pairs = [(left, right) for left, right in pairs
                 if left in vocab and right in vocab and left + right in vocab]
        model = models.BPE(vocab=vocab, merges=pairs, **options)
    bpe_cache.store(cache_key, model, pairs)
    return model


def _byte_level_bpe_engine(tokens, merges, pre):
    model = _bpe_model(tokens, merges, ignore_merges=pre.whole_words_first)
    engine = _HfTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.regexes]
    engine.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return engine


def _raw_bpe_engine(tokens, merges):
    """Gemma 4: BPE over the text's own characters ("▁" for space, no byte-level
    stand-ins), unknown characters spelled as <0xXX> byte tokens."""
    model = _bpe_model(tokens, merges, byte_fallback=True)
    return _HfTokenizer(model)


def _pre_tokenizer(md):
    if "tokenizer.ggml.pre" not in md:
        raise UserError("the model's GGUF names no pre-tokenizer (tokenizer.ggml.pre); "
                        "it predates them: convert the model again with a current llama.cpp")
    name = md["tokenizer.ggml.pre"]
    pre = _PRE_TOKENIZER_NAMES.get(name)
    if pre is None:
        known = ", ".join(sorted(_PRE_TOKENIZER_NAMES))
        raise UserError(f"unsupported pre-tokenizer '{name}' (tokenizer.ggml.pre); "
                        f"supported: {known}")
    return _PRE_TOKENIZERS[pre]


_SUPPORTED_MODELS = ("gpt2 (byte-level BPE), llama (SentencePiece), "
                     "gemma4 (BPE over characters)")


def _engine_for(kind, md, tokens, token_types):
    """(merge engine, adds BOS unless told, prefixes a space) for a vocabulary kind."""
    if kind == "gpt2":
        pre = _pre_tokenizer(md)
        merges = _required(md, "tokenizer.ggml.merges")
        return _byte_level_bpe_engine(tokens, merges, pre), pre.adds_bos, False
    if kind == "llama":
        scores = np.asarray(_required(md, "tokenizer.ggml.scores"), dtype=np.float32)
        if scores.shape != (len(tokens),):
            raise UserError(f"the model's tokenizer is inconsistent: {scores.size} scores "
                            f"for {len(tokens)} tokens")
        unknown_id = _optional_id(md, "tokenizer.ggml.unknown_token_id", len(tokens))
        engine = SentencePieceEngine(tokens, scores, token_types, unknown_id)
        return engine, True, bool(md.get("tokenizer.ggml.add_space_prefix", True))
    if kind == "gemma4":
        merges = _required(md, "tokenizer.ggml.merges")
        return _raw_bpe_engine(tokens, merges), True, False
    if kind in ("bert", "t5"):
        raise UserError(f"tokenizer model '{kind}' (tokenizer.ggml.model) belongs to an "
                        "embedding or encoder model, which llambda does not run; "
                        f"supported: {_SUPPORTED_MODELS}")
    raise UserError(f"unsupported tokenizer model '{kind}' (tokenizer.ggml.model); "
                    f"supported: {_SUPPORTED_MODELS}")


def _special_tokens(md, tokens, token_types):
    """The ids that end generation; ``token_types`` is updated where llama.cpp
    re-types tokens by their text (see the lists above)."""
    n_tokens = len(tokens)
    wanted = _END_OF_GENERATION_TEXTS.union(
        *_FILL_IN_THE_MIDDLE_TEXTS.values(), *_END_OF_TURN_TEXTS.values())
    id_of = {}                 # a repeated text means its last id, as in llama.cpp
    for token_id, text in enumerate(tokens):
        if text in wanted:
            id_of[text] = token_id

    def found(texts):
        ids = [id_of[text] for text in texts if text in id_of]
        return min(ids) if ids else None

    eog_ids = set()
    for role, texts in {**_FILL_IN_THE_MIDDLE_TEXTS, **_END_OF_TURN_TEXTS}.items():
        token_id = _optional_id(md, f"tokenizer.ggml.{role}_token_id", n_tokens)
        if token_id is None:
            token_id = found(texts)
            if token_id is not None:
                token_types[token_id] = TokenType.CONTROL
        if token_id is not None and role in (*_FILL_IN_THE_MIDDLE_ENDS, "eot", "eom"):
            eog_ids.add(token_id)
    for text, token_id in id_of.items():
        if text in _END_OF_GENERATION_TEXTS:
            eog_ids.add(token_id)
            token_types[token_id] = TokenType.CONTROL
    eos_id = _optional_id(md, "tokenizer.ggml.eos_token_id", n_tokens)
    if eos_id is not None:
        eog_ids.add(eos_id)

    texts = {tokens[token_id]: token_id for token_id in eog_ids}
    # o200k (gpt-oss) and Solar Open end a message with <|end|> but keep going.
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
        eog_ids.discard(texts["<|end|>"])
        token_types[texts["<|end|>"]] = TokenType.USER_DEFINED
    # Gemma 4 and PLaMo 2 use </s> as ordinary text.
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog_ids.discard(texts["</s>"])
        token_types[texts["</s>"]] = TokenType.NORMAL
    return eog_ids


def _stripping_right(md, tokens, token_types):
    """Ids of the tokens that swallow the whitespace after them in raw text.

    GGUF files do not carry this; llama.cpp sets it by model name, for Phi-3
    only among LLMs: every token matched whole except <unk>, <s> and <|endoftext|>.
    """
    name = str(md.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    whole = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
    ids = set(np.flatnonzero(np.isin(np.asarray(token_types), whole)).tolist())
    last_id = {text: token_id for token_id, text in enumerate(tokens)
               if text in ("</s>", "<unk>", "<s>", "<|endoftext|>")}
    if "</s>" in last_id:
        ids.add(last_id["</s>"])
    ids.difference_update(last_id[text] for text in ("<unk>", "<s>", "<|endoftext|>") if text in last_id)
    return frozenset(ids)


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

class Tokenizer:
    """Encodes text to token ids and back, for one model's vocabulary."""

    def __init__(self, *, tokens, token_types, engine, kind, bos_id, eos_id, eog_ids,
                 add_bos, add_eos, add_space_prefix=False, strips_right=frozenset()):
        self._tokens = tokens
        self._types = token_types
        self._engine = engine
        self._kind = kind
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._eog_ids = frozenset(eog_ids)
        self._add_bos = add_bos and bos_id is not None
        self._add_eos = add_eos and eos_id is not None
        self._add_space_prefix = add_space_prefix
        self._piece_bytes = [None] * len(tokens)     # filled as tokens are decoded
        self._special_texts = self._texts_split_before_merging()
        self._strips_right = frozenset(strips_right)  # ids that swallow the whitespace after them

    # -- construction --------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, md):
        """Build from GGUF metadata keyed by full key names ("tokenizer.ggml.tokens", ...)."""
        kind = _required(md, "tokenizer.ggml.model")
        tokens = [str(t) for t in _required(md, "tokenizer.ggml.tokens")]
        n_tokens = len(tokens)
        token_types = _token_types(md, n_tokens)
        eog_ids = _special_tokens(md, tokens, token_types)

        engine, default_add_bos, add_space_prefix = _engine_for(kind, md, tokens, token_types)
        bos_id = _optional_id(md, "tokenizer.ggml.bos_token_id", n_tokens)
        eos_id = _optional_id(md, "tokenizer.ggml.eos_token_id", n_tokens)
        return cls(tokens=tokens, token_types=token_types, engine=engine, kind=kind,
                   bos_id=bos_id, eos_id=eos_id, eog_ids=eog_ids,
                   # llama.cpp adds BOS to Gemma 4 prompts whatever the file says.
                   add_bos=kind == "gemma4" or bool(md.get("tokenizer.ggml.add_bos_token",
                                                            default_add_bos)),
                   add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
                   add_space_prefix=add_space_prefix,
                   strips_right=_stripping_right(md, tokens, token_types))

    def _piece(self, token_id):
        piece = self._piece_bytes[token_id]
        if piece is None:
            piece = self._piece_bytes[token_id] = self._bytes_of(token_id)
        return piece

    def _bytes_of(self, token_id):
        """What a token contributes to decoded text (control tokens included)."""
        text, kind = self._tokens[token_id], self._types[token_id]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if kind == TokenType.UNUSED:
            return b""
        if kind == TokenType.BYTE:
            return bytes([int(text[3:-1], 16)])
        if self._kind in ("llama", "gemma4"):
            return text.replace("▁", " ").encode("utf-8", "surrogateescape")
        stand_ins = text.translate(_CHAR_TO_BYTE)
        try:
            return stand_ins.encode("latin-1")
        except UnicodeEncodeError:  # not a byte-level token after all: keep its text
            return text.encode("utf-8", "surrogateescape")

    def _texts_split_before_merging(self):
        """(text, id, is_control) of the tokens matched whole in raw text, longest first."""
        whole = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        candidates = np.flatnonzero(np.isin(np.asarray(self._types), whole)).tolist()
        found = [(self._tokens[token_id], token_id, self._types[token_id] != TokenType.USER_DEFINED)
                 for token_id in candidates if self._tokens[token_id]]
        found.sort(key=lambda entry: -len(entry[0].encode("utf-8", "surrogateescape")))
        return found

    # -- properties ----------------------------------------------------------

    @property
    def bos_id(self):
        """Beginning-of-sequence id, or None when the vocabulary has none."""
        return self._bos_id

    @property
    def eos_id(self):
        """End-of-sequence id, or None when the vocabulary has none."""
        return self._eos_id

    @property
    def eog_ids(self):
        """Every id that ends generation: EOS and the end-of-turn tokens."""
        return self._eog_ids

    @property
    def vocab_size(self):
        return len(self._tokens)

    def token_text(self, token_id):
        """The token as the vocabulary spells it (e.g. "Ġhello", "<|im_end|>")."""
        return self._tokens[self._checked(token_id)]

    def token_bytes(self, token_id):
        """The bytes the token decodes to."""
        return self._piece(self._checked(token_id))

    def is_special(self, token_id):
        """True for control tokens (BOS, EOS, <|im_start|>, ...), which skip_special drops."""
        return self._types[self._checked(token_id)] in (TokenType.CONTROL, TokenType.UNKNOWN)

    def _checked(self, token_id):
        # A negative id would silently index from the end of the vocabulary.
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"(0..{len(self._tokens) - 1})")
        return token_id

    # -- encoding ------------------------------------------------------------

    def encode(self, text, add_special=True, parse_special=True):
        """Token ids of `text`.

        add_special: add BOS/EOS where the model asks for them (add_bos_token, add_eos_token).
        parse_special: text such as "<|im_start|>" becomes its control token; when False
        it is encoded as ordinary text. User-defined tokens are always matched whole.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        check_text(text, "text")          # the text rule (llambda/inputs.py): UTF-8 or refused
        ids = []
        if add_special and self._add_bos:
            ids.append(self._bos_id)
        after_special = True
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids.extend(self._encode_fragment(fragment, after_special))
                after_special = False
        if add_special and self._add_eos:
            ids.append(self._eos_id)
        return ids

    def _split_special(self, text, parse_special):
        """Text cut into raw strings and whole-token ids.

        Longer token texts are cut out first, over the whole text, as llama.cpp does.
        """
        fragments = [text] if text else []
        for token_text, token_id, is_control in self._special_texts:
            if is_control and not parse_special:
                continue
            if token_text not in text:
                continue
            strip = token_id in self._strips_right
            fragments = [piece for fragment in fragments
                         for piece in _cut_out(fragment, token_text, token_id, strip)]
        return fragments

    def _encode_fragment(self, fragment, after_special):
        if self._kind == "llama":
            if self._add_space_prefix and after_special:
                fragment = " " + fragment
            fragment = fragment.replace(" ", "▁")
        elif self._kind == "gemma4":
            return self._encode_lines(fragment.replace(" ", "▁"))
        return self._engine.encode(fragment, add_special_tokens=False).ids

    def _encode_lines(self, fragment):
        """Gemma 4 merges each line and each run of newlines on its own; a run of
        newlines that is a token is taken whole, as llama.cpp does."""
        ids = []
        for piece in _LINES_AND_NEWLINES.findall(fragment):
            whole = self._engine.token_to_id(piece) if piece[0] == "\n" else None
            if whole is not None:
                ids.append(whole)
            else:
                ids.extend(self._engine.encode(piece, add_special_tokens=False).ids)
        return ids

    # -- decoding ------------------------------------------------------------

    def decode(self, ids, skip_special=False):
        """Text of `ids`; invalid UTF-8 (a character cut between ids) becomes U+FFFD.

        skip_special: leave out control tokens (BOS, <|im_end|>, ...).
        """
        shown = []
        for token_id in ids:
            piece = self._shown_piece(token_id, not shown, skip_special)
            if piece is not None:
                shown.append(piece)
        return b"".join(shown).decode("utf-8", errors="replace")

    def _shown_piece(self, token_id, is_first, skip_special):
        """The bytes `token_id` adds to decoded text, or None when skip_special hides it."""
        special = self.is_special(token_id)
        if skip_special and special:
            return None
        piece = self._piece(token_id)
        # SentencePiece encoding put a space before the text; decoding takes it off.
        if is_first and self._add_space_prefix and not special and piece.startswith(b" "):
            piece = piece[1:]
        return piece

    def streaming_decoder(self, skip_special=False):
        """A decoder fed one id at a time that only ever returns whole characters."""
        return StreamingDecoder(self, skip_special)


_C_WHITESPACE = " \t\n\v\f\r"     # C's isspace, which llama.cpp strips with


def _cut_out(fragment, token_text, token_id, strip_right=False):
    """`fragment` with every occurrence of `token_text` replaced by `token_id`
    (and, with strip_right, the whitespace after each occurrence dropped)."""
    if not isinstance(fragment, str) or token_text not in fragment:
        return [fragment]
    pieces = []
    for i, raw in enumerate(fragment.split(token_text)):
        if i:
            pieces.append(token_id)
            if strip_right:
                raw = raw.lstrip(_C_WHITESPACE)
        if raw:
            pieces.append(raw)
    return pieces


class StreamingDecoder:
    """Turns generated ids into text as they arrive.

    A character can span several byte-level tokens; the bytes of an unfinished
    character are held back until the ids that complete it arrive.
    """

    def __init__(self, tokenizer, skip_special=False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def feed(self, token_id):
        """The text completed by this id ("" while a character is unfinished)."""
        piece = self._tokenizer._shown_piece(token_id, self._at_start, self._skip_special)
        if piece is None:
            return ""
        self._at_start = False
        return self._utf8.decode(piece)

    def flush(self):
        """Whatever is left at the end; an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
