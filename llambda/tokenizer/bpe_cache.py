"""The BPE models of vocabularies built before, kept as the files HF `tokenizers` saves.

Building HF's BPE from Python means a dict of every token and a tuple of two new
strings per merge rule: on SmolLM2's vocabulary some 150,000 Python objects, made,
converted to Rust and dropped, which is about half of the tokenizer's share of a
load's peak memory. ``models.BPE.from_file`` reads the same model from the
``vocab.json`` and ``merges.txt`` that ``model.save`` wrote, in Rust, with no Python
objects at all. The first load of a vocabulary builds its model as before and saves
it here (``<cache>/tokenizers/bpe-<key>/``); later loads read that.

The key hashes everything the model is built from (token texts, merge rules or
SentencePiece scores, the BPE options), so a different vocabulary never reads
another's files. ``merges.txt`` holds one "left right" rule per line: a vocabulary
whose rules have a space or a line break inside a side cannot be written that way and
is always built from Python. (SentencePiece vocabularies are not BPE models here:
llambda.tokenizer.spm.)
Everything here is best effort: an unreadable or unwritable cache only means
building the model again.
"""
import os
import shutil

from tokenizers import models

# Bump when what is saved changes: old entries are then never read.
CACHE_VERSION = 1
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"


def key(kind, tokens, rules, options):
    """The cache key of a BPE model: ``kind`` names what ``rules`` are (merge rule
    texts, or the bytes of SentencePiece scores), ``options`` the BPE's keyword arguments."""
    import hashlib
    digest = hashlib.sha256(f"llambda bpe v{CACHE_VERSION} {kind} {sorted(options.items())!r}\0".encode())
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update("\0".join(tokens).encode("utf-8", "surrogateescape"))
    digest.update(b"\1")
    digest.update(rules if isinstance(rules, bytes) else "\n".join(rules).encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:32]


def _directory(cache_key):
    from llambda.runtime import paths
    return paths.cache_dir() / "tokenizers" / f"bpe-{cache_key}"


def load(cache_key, tokens, options):
    """The saved model of ``cache_key``, or None (never saved, or damaged: then removed)."""
    directory = _directory(cache_key)
    vocab, merges = directory / VOCAB_FILE, directory / MERGES_FILE
    if not (vocab.is_file() and merges.is_file()):
        return None
    try:
        model = models.BPE.from_file(str(vocab), str(merges), **options)
    except Exception:          # tokenizers raises bare Exceptions for unreadable files
        model = None
    if model is None or not _agrees(model, tokens):
        shutil.rmtree(directory, ignore_errors=True)       # damaged: the next store writes it again
        return None
    return model


def _agrees(model, tokens):
    """A spot check that the files hold this vocabulary (the key already says so; this
    catches a file damaged on disk). A text repeated in the vocabulary belongs to its
    last id, so an earlier id may have no text of its own."""
    n = len(tokens)
    for token_id in sorted({0, n // 3, n // 2, 2 * n // 3, n - 1}):
        text = model.id_to_token(token_id)
        if text is None and token_id != n - 1:
            continue
        if text != tokens[token_id]:
            return False
    return True


def store(cache_key, model, pairs):
    """Save ``model``, built from the merge rules ``pairs`` ((left, right) texts), when
    merges.txt can hold every rule. Written to a temporary directory and renamed
    into place, so a reader sees all of the files or none."""
    if not _writable_as_lines(pairs):
        return
    directory = _directory(cache_key)
    if directory.exists():
        return
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        model.save(str(tmp))
        os.replace(tmp, directory)
    except Exception:          # OSError, or tokenizers failing to write
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _writable_as_lines(pairs):
    """True when every rule survives merges.txt: tokenizers splits each line at its
    spaces into exactly two sides, ends lines at "\\n" (dropping a "\\r" before it) and
    skips lines starting with "#version"."""
    for left, right in pairs:
        if (not left or not right or " " in left or " " in right or "\n" in left or "\n" in right or "\r" in left or "\r" in right
                or left.startswith("#version")):
            return False
    return True
