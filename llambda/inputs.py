"""What the API accepts as a prompt, a stop string, token ids and text, and the one-line
error for anything else.

The text rule: text is a Python str that encodes to UTF-8. Text that does not (a lone
surrogate such as "\\ud800", or the "\\udcff" stand-in Python puts in argv and in stdin
lines for a byte that is not UTF-8) is **refused**, never replaced: replacing would
silently change the prompt the model sees. The error names where the text came from
and the first offending character's position. Every door text enters by applies it:
the prompt (generate, tokenize), stop strings, chat messages, the CLI's --prompt and
chat's input lines (chat refuses the line and keeps the conversation), template files
and prompt files (read as strict UTF-8 by their readers).

The other rules stop silent coercions:
- a prompt is a str or a sequence of token ids; bytes are neither (b"hi" used to be
  taken as the ids 104, 105);
- token ids are integers (Python or numpy), never bool, float or str ([1.7], ["5"],
  [True] used to become 1, 5 and 1);
- ``stop`` is a string or a sequence of strings ("is" used to become "i" and "s").
"""
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from llambda.errors import UserError


def is_text(text):
    """Whether a str encodes to UTF-8 (the text rule above), without naming a fault."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def is_count(value):
    """Whether a JSON value is a count: an int >= 0 (a bool is none)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_text(text, what="text"):
    """``text`` if it is a str that encodes to UTF-8, else a UserError naming ``what``."""
    if not isinstance(text, str):
        raise UserError(f"{what}: expected a str, got {_kind(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what}: {_not_utf8(text, e.start)}") from None
    return text


def _not_utf8(text, at):
    char = ord(text[at])
    if 0xDC80 <= char <= 0xDCFF:     # surrogateescape's stand-in for an undecodable byte
        return f"not valid UTF-8 (byte 0x{char - 0xDC00:02x} at character {at})"
    return f"not valid UTF-8 (lone surrogate U+{char:04X} at character {at})"


def check_prompt(prompt):
    """A prompt as given to generate: the str itself, or the token ids as a list of ints
    (the range against the vocabulary is the model's to check)."""
    if isinstance(prompt, str):
        return check_text(prompt, "prompt")
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise UserError("prompt: bytes are neither text nor token ids; decode them "
                        "(prompt.decode('utf-8')) or pass a list of token ids")
    if isinstance(prompt, (Sequence, np.ndarray)):
        return check_token_ids(prompt, "prompt")
    raise UserError(f"prompt: expected a str or a list of token ids, got {_kind(prompt)}")


def check_token_ids(ids, what="token ids"):
    """``ids`` as a list of Python ints; a UserError naming the first that is not an integer."""
    if isinstance(ids, (str, bytes, bytearray, memoryview)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise UserError(f"{what}: expected a list of integer token ids, got {_kind(ids)}")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise UserError(f"{what}: expected a 1-D array of token ids, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise UserError(f"{what}: expected integer token ids, got an array of {ids.dtype}")
        return ids.tolist()
    out = []
    for i, value in enumerate(ids):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise UserError(f"{what}[{i}]: expected an integer token id, got {value!r:.40} ({_kind(value)})")
        out.append(int(value))
    return out


def check_stop(stop):
    """``stop`` as a list of strings: None, one string, or a sequence of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [check_text(stop, "stop")]
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, (Sequence, set, frozenset)):
        raise UserError(f"stop: expected a string or a list of strings, got {_kind(stop)}")
    return [check_text(s, f"stop[{i}]") for i, s in enumerate(stop)]


def check_messages(messages):
    """``messages`` as a list, every string in it (roles, contents, nested parts) checked
    against the text rule."""
    bad = UserError("messages: expected a list of {'role': ..., 'content': ...} mappings")
    if isinstance(messages, (str, bytes, Mapping)):
        raise bad
    try:
        messages = list(messages)
    except TypeError:
        raise bad from None
    for i, message in enumerate(messages):
        _check_strings(message, f"messages[{i}]")
    return messages


def _check_strings(value, where, depth=0):
    if depth > 32:
        raise UserError(f"{where}: nested too deeply")
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(key, f"{where} key")
            _check_strings(item, f"{where}[{key!r:.30}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for j, item in enumerate(value):
            _check_strings(item, f"{where}[{j}]", depth + 1)


def _kind(value):
    return type(value).__name__
