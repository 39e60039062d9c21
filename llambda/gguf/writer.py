"""What every GGUF that llambda writes shares: the hyper-parameter keys, the built-in
byte-level tokenizer, metadata copied from another file, and the atomic write.

Used by tests/synth.py, tests/synth_arch.py, tests/fixture_models.py and
tools/dequantize_gguf.py. The order in which keys are written is part of a file's
bytes, and of the content sha256 that tests/fixture_models.py records with
llama.cpp's logits: changing it means re-recording (tools/record_llamacpp_logits.py).

Files are written tensor by tensor (header first, then one tensor at a time), so a
1.1B-parameter model never sits in memory as a whole, and atomically (a temp file
renamed into place) so an interrupted run leaves no half file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QType

from llambda.tokenizer.vocab import byte_level_alphabet

FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
}


# ---------------------------------------------------------- hyper-parameters ---

def add_hparams(writer: gguf.GGUFWriter, *, name: str, n_ctx: int, dim: int, n_layer: int,
                ffn_dim: int, n_head: int, n_kv_head: int, rope_dims: int, rope_base: float,
                rms_eps: float, vocab_size: int, file_type, head_dim: int | None = None,
                sliding_window: int | None = None) -> None:
    """general.* and <arch>.* keys of a decoder-only model, in one fixed order.
    ``head_dim`` writes key_length / value_length (readers default them to dim / n_head)."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(ffn_dim)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(rms_eps)
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ------------------------------------------------------------------ metadata ---

Entry = tuple  # (key, value, GGUFValueType, item type of an array or None)


def field_entries(reader: gguf.GGUFReader, keep) -> list[Entry]:
    """The fields of ``reader`` whose key ``keep(key)`` accepts, ready for add_entries."""
    entries = []
    for key, fld in reader.fields.items():
        if keep(key):
            sub_type = fld.types[1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
            entries.append((key, fld.contents(), fld.types[0], sub_type))
    return entries


def add_entries(writer: gguf.GGUFWriter, entries: Iterable[Entry]) -> None:
    for key, value, vtype, sub_type in entries:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)


# ------------------------------------------------------------------ tokenizer ---

@dataclass
class Tokenizer:
    """tokenizer.* key/values ready for a GGUFWriter: (key, value, type, array item type)."""
    entries: list[Entry]
    vocab_size: int

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        add_entries(writer, self.entries)


def copied_tokenizer(gguf_path) -> Tokenizer:
    """Every tokenizer.* key of another GGUF."""
    reader = gguf.GGUFReader(gguf_path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{gguf_path} has no tokenizer.ggml.tokens to copy")
    return Tokenizer(field_entries(reader, lambda key: key.startswith("tokenizer.")),
                     vocab_size=len(tokens.data))


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Enough merges that ordinary English words become multi-byte tokens, so BPE
# merging is exercised; each merge's parts are bytes or earlier merge results.
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"),
    ("r", "e"), ("a", "n"), ("Ġ", "s"), ("Ġ", "o"), ("e", "n"), ("a", "t"), ("o", "r"),
    ("Ġ", "w"), ("Ġ", "c"), ("i", "s"), ("Ġ", "i"), ("Ġ", "f"), ("Ġo", "f"), ("in", "g"),
    ("Ġ", "b"), ("Ġ", "p"), ("Ġa", "n"), ("Ġan", "d"), ("Ġ", "is"), ("Ġ", "h"), ("l", "l"),
    ("Ġ", "T"), ("ĠT", "he"), ("e", "s"), ("Ġ", "m"), ("o", "u"), ("Ġt", "o"),
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def minimal_vocab_size() -> int:
    """The smallest vocab_size the built-in tokenizer fits in."""
    return len(SPECIAL_TOKENS) + 256 + len(MERGES)


def minimal_tokenizer(vocab_size: int, bare: bool = False) -> Tokenizer:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, ChatML's specials, MERGES),
    padded with unused tokens up to ``vocab_size``. ``bare``: only the keys llama.cpp
    needs to load the file (no padding id, space-prefix flag or chat template)."""
    if vocab_size < minimal_vocab_size():
        raise ValueError(f"vocab_size ({vocab_size}) must be >= {minimal_vocab_size()} for the "
                         "built-in byte-level tokenizer (or pass tokenizer_from)")
    byte_tokens = [byte_level_alphabet()[byte] for byte in range(256)]
    merged_tokens = [left + right for left, right in MERGES]
    tokens = list(SPECIAL_TOKENS) + byte_tokens + merged_tokens
    token_types = [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * (256 + len(MERGES))
    # Padding rows of the embedding: real tokens no text can produce.
    n_padding = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_padding)]
    token_types += [TOKEN_UNUSED] * n_padding
    assert len(set(tokens)) == len(tokens), "duplicate token in the built-in vocabulary"

    V = gguf.GGUFValueType
    entries = [
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.pre", "smollm", V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", token_types, V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", [f"{left} {right}" for left, right in MERGES], V.ARRAY, V.STRING),
        ("tokenizer.ggml.bos_token_id", tokens.index("<|im_start|>"), V.UINT32, None),
        ("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"), V.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", tokens.index("<|endoftext|>"), V.UINT32, None),
    ]
    if not bare:
        entries.append(("tokenizer.ggml.padding_token_id", tokens.index("<|im_end|>"), V.UINT32, None))
    entries.append(("tokenizer.ggml.add_bos_token", False, V.BOOL, None))
    if not bare:
        entries += [("tokenizer.ggml.add_space_prefix", False, V.BOOL, None),
                    ("tokenizer.chat_template", CHATML_TEMPLATE, V.STRING, None)]
    return Tokenizer(entries, vocab_size=vocab_size)


# ------------------------------------------------------------------- tensors ---

@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry in the header: its storage shape (numpy order; bytes per row
    for block types) and dtype, its size, and its GGML type where the dtype does not say it."""
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    raw_dtype: QType | None = None


def tensor_info(name: str, shape, type_name: str) -> TensorInfo:
    """The entry of a tensor of ``shape`` values (numpy order) stored as GGML ``type_name``."""
    qtype = QType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nbytes = int(np.prod(shape)) // block_size * type_size
    if type_name in ("F32", "F16"):
        return TensorInfo(name, tuple(shape), np.dtype(np.float32 if type_name == "F32" else np.float16), nbytes)
    return TensorInfo(name, tuple(gguf.quant_shape_to_byte_shape(shape, qtype)), np.dtype(np.uint8),
                      nbytes, raw_dtype=qtype)


def write_gguf(path, writer: gguf.GGUFWriter, infos: Iterable[TensorInfo], arrays: Iterable[np.ndarray]) -> Path:
    """Write ``writer``'s keys, the tensor table ``infos`` and then each of ``arrays`` (one per
    info, in order; a generator draws them one at a time) to a temp file renamed to ``path``."""
    path = Path(path)
    for info in infos:
        writer.add_tensor_info(info.name, info.shape, info.dtype, info.nbytes, raw_dtype=info.raw_dtype)
    tmp_name = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer.write_header_to_file(tmp_name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for array in arrays:
            writer.write_tensor_data(np.ascontiguousarray(array))
        writer.close()
        os.replace(tmp_name, path)
    except BaseException:
        writer.close()
        tmp_name.unlink(missing_ok=True)
        raise
    return path
