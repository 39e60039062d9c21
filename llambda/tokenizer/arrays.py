"""The tokenizer's long lists (tokens, merges, token types, scores) as arrays of the model file.

Kept in the JSON header they were nearly all of it (SmolLM2's 49,152 tokens and 48,900
merges) and most of the time a load spent parsing it. So the converter stores
each ``tokenizer.*`` list of at least MIN_ITEMS items as an array beside the tensors, and the
header holds a reference in its place, ``{"array": name, "kind": kind, "count": n}``:

    texts     every item a str without NUL: the items joined by NUL, UTF-8 (lone surrogates
              passed through, as the header itself is written), uint8
    int32     every item an int that fits
    float32   every item a float that f32 holds exactly (GGUF's scores are f32)

Any other list stays in the header as it was. ``expand`` puts the lists back, checking each
reference against the file, so the rest of llambda sees the GGUF's keys verbatim.
"""
import numpy as np

from llambda.errors import UserError
from llambda.inputs import is_count

MIN_ITEMS = 1024
PREFIX = "tokenizer/"
SEPARATOR = "\0"
KINDS = ("texts", "int32", "float32")


def split(tokenizer_md):
    """(the metadata with references in place of its long lists, {array name: array})."""
    kept, arrays = {}, {}
    for key, value in tokenizer_md.items():
        kind = _kind(value) if isinstance(value, list) and len(value) >= MIN_ITEMS else None
        if kind is None:
            kept[key] = value
            continue
        name = PREFIX + key
        arrays[name] = _pack(kind, value)
        kept[key] = {"array": name, "kind": kind, "count": len(value)}
    return kept, arrays


def _kind(items):
    if all(isinstance(v, str) and SEPARATOR not in v for v in items):
        return "texts"
    if all(isinstance(v, int) and not isinstance(v, bool) and -2**31 <= v < 2**31 for v in items):
        return "int32"
    if all(isinstance(v, float) for v in items):
        with np.errstate(over="ignore", invalid="ignore"):      # past f32's range: inf, unequal
            exact = np.array_equal(np.array(items, np.float32).astype(np.float64), np.array(items, np.float64))
        return "float32" if exact else None
    return None


def _pack(kind, items):
    if kind == "texts":
        return np.frombuffer(SEPARATOR.join(items).encode("utf-8", "surrogatepass"), np.uint8).copy()
    return np.array(items, np.dtype(kind))


def expand(tokenizer_md, weights_file, path):
    """The metadata with every reference replaced by its list, read from ``weights_file``."""
    out = dict(tokenizer_md)
    for key, value in tokenizer_md.items():
        if isinstance(value, dict) and "array" in value:
            out[key] = _unpack(key, value, weights_file, path)
    return out


def _unpack(key, ref, weights_file, path):
    def bad(problem):
        return UserError(f"{path}: {key}: {problem}: convert the GGUF again")
    name, kind, count = ref.get("array"), ref.get("kind"), ref.get("count")
    if not (isinstance(name, str) and kind in KINDS and is_count(count)):
        raise bad(f"the reference {ref!r:.120} is not {{array, kind, count}}")
    try:
        array = weights_file[name]
    except KeyError:
        raise bad(f"the file has no array {name!r}") from None
    want = np.uint8 if kind == "texts" else np.dtype(kind)
    if array.dtype != want or array.ndim != 1:
        raise bad(f"array {name!r} is {array.dtype} {array.shape}, not 1-D {np.dtype(want)}")
    if kind != "texts":
        if array.shape[0] != count:
            raise bad(f"array {name!r} holds {array.shape[0]} items, the header says {count}")
        return array.tolist()
    try:
        text = array.tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise bad(f"array {name!r} is not UTF-8 ({e.reason} at byte {e.start})") from None
    items = text.split(SEPARATOR) if array.size else []       # no bytes: no texts, not one empty text
    if len(items) != count:
        raise bad(f"array {name!r} holds {len(items)} texts, the header says {count}")
    return items
