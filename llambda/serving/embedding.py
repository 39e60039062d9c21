"""Embeddings: a text's vector is its rows' final-norm output, pooled over the sequence.

What llama.cpp returns as a generative model's embeddings is the output of the final norm,
the vector the LM head would multiply (``t_embd``, "result_norm"), pooled per sequence as
the context's pooling type says (llama.h's enum llama_pooling_type):

    0 none   every token's vector (llama-server's /v1/embeddings refuses it: not OpenAI's shape)
    1 mean   the mean of every token's vector
    2 cls    the first token's (with a causal model: the BOS token's, whatever the text)
    3 last   the last token's (Qwen3-Embedding)
    4 rank   a reranker's classification head (not a vector)

The caller's choice comes first (``pooling=``, ``Model.pooling``, ``llambda serve
--pooling``), then the GGUF's ``<arch>.pooling_type`` (embedding models carry it), then mean:
llama.cpp's own default for a model without the key is none, which gives no vector per text;
llama-server users pass ``--pooling mean`` for it.

An Embedding is a sequence of the engine (engine.py): its prompt rows share steps with
generation and other embeddings, the step keeps every row's final-norm output (no LM head
for them: TransformerModel.step's ``hidden``), and the rows the pooling needs are copied
here after each step. Pooling runs once every row is in, in one fixed order over the whole
text, so a vector does not depend on how the engine cut the text into chunks: it is batch
invariant like every row of the model.
"""
import collections
import numbers
import threading
from collections.abc import Sequence

import numpy as np

from llambda import inputs
from llambda.errors import UserError
from llambda.serving.engine import Completion

POOLINGS = ("mean", "cls", "last")
# llama.h's enum llama_pooling_type, as GGUF files store it in <arch>.pooling_type
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
DEFAULT_POOLING = "mean"


def check_pooling(pooling, what="pooling"):
    """``pooling`` if it is one of POOLINGS, else a UserError naming ``what``."""
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise UserError(f"{what}: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def file_pooling(path, arch):
    """The pooling of a llambda model file's GGUF (``<arch>.pooling_type``), or None when it
    has none or says none (a generative model). A type that gives no vector per text (rank,
    an unknown number) is a UserError naming the key."""
    from llambda.runtime import weightfile
    key = f"{arch}.pooling_type"
    value = weightfile.open_weights(path).metadata.get("gguf", {}).get(key)
    if value is None:
        return None
    name = GGUF_POOLING.get(value) if isinstance(value, int) and not isinstance(value, bool) else None
    if name == "none":
        return None
    if name not in POOLINGS:
        raise UserError(f"{path}: GGUF metadata {key} = {value!r} ({name or 'unknown'}) gives no embedding "
                        f"llambda pools; choose one of {', '.join(POOLINGS)} (pooling=, --pooling)")
    return name


def token_lists(model, texts, what="texts"):
    """``texts`` (a string, a list of strings, a list of token ids, or a list of such lists) as
    one token-id list per text, each checked: strings tokenized as llama-server does (BOS/EOS
    where the model asks, special tokens parsed); a UserError names the text at fault
    (``what[i]``) when one is empty, not text or ids, outside the vocabulary or longer than the
    context."""
    if isinstance(texts, str):
        items, names = [texts], [what]
    elif isinstance(texts, (bytes, bytearray, memoryview)) or not isinstance(texts, (Sequence, np.ndarray)):
        raise UserError(f"{what}: expected a string, a list of strings or token ids, got {type(texts).__name__}")
    elif len(texts) == 0:
        raise UserError(f"{what}: nothing to embed (an empty list)")
    elif _is_id(texts[0]) or isinstance(texts, np.ndarray) and texts.ndim == 1:
        items, names = [texts], [what]                     # one text as token ids
    else:
        items, names = list(texts), [f"{what}[{i}]" for i in range(len(texts))]
    vocab, n_ctx = model.config.vocab_size, model.n_ctx
    lists = []
    for item, name in zip(items, names):
        if isinstance(item, str):
            if not inputs.check_text(item, name):
                raise UserError(f"{name}: empty text")
            ids = model.tokenizer.encode(item, add_special=True, parse_special=True)
        else:
            ids = inputs.check_token_ids(item, name)
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise UserError(f"{name}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if not ids:
            raise UserError(f"{name}: no tokens to embed")
        if len(ids) > n_ctx:
            raise UserError(f"{name}: {len(ids)} tokens, but the context holds {n_ctx} "
                            "(use a larger --ctx, or a shorter text)")
        lists.append(ids)
    return lists


def _is_id(value):
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


class Embedding(Completion):
    """One text's embedding, as the engine runs it: prompt rows only, never sampled.
    ``result()`` waits for it and returns the pooled vector (float32 [dim], not normalized)."""

    pooled = True

    def __init__(self, engine, prompt, pooling, dim):
        super().__init__(engine, prompt, sampler=None, max_tokens=0, stops=(), ignore_eos=True, logprobs=None,
                         on_event=None)
        self.pooling = check_pooling(pooling)
        # every row is computed for mean and cls (a cached prefix would skip rows the pooling
        # reads); last reads only the last row, which the cache never holds
        self.reads_cache = pooling == "last"
        self._rows = np.empty((len(prompt) if pooling == "mean" else 1, dim), np.float32)

    def keep(self, hidden, start):
        """On the engine thread, after a step: ``hidden`` holds the final-norm output of this
        text's positions start.. (a view of the model's buffer): copy the rows the pooling reads."""
        n = len(hidden)
        if self.pooling == "mean":
            self._rows[start:start + n] = hidden
        elif self.pooling == "cls" and start == 0:
            self._rows[0] = hidden[0]
        elif self.pooling == "last" and start + n == len(self.tokens):
            self._rows[0] = hidden[n - 1]

    def result(self, timeout=None):
        """The pooled vector, once the engine has run every row; raises what ended it otherwise."""
        if not self._done.wait(timeout):
            raise TimeoutError("the embedding is not done yet")
        if self.stop_reason != "pooled":
            raise self.error or UserError(f"the embedding was {self.finish_reason} before it was done")
        if self.pooling == "mean":
            # float64 sums over the whole text, then one rounding: the same rows give the same
            # vector, however the engine cut the text into steps
            return (self._rows.sum(axis=0, dtype=np.float64) / len(self._rows)).astype(np.float32)
        return self._rows[0].copy()


class Batch:
    """The texts of one embed call as engine sequences, a window of them queued at a time (every
    slot busy and one more behind each, never more than may wait): ``run()`` on the caller's
    thread returns their vectors; ``cancel()`` from any thread (a client that went away) ends
    the ones queued and queues no more."""

    def __init__(self, engine, token_lists, pooling):
        self.engine, self.token_lists, self.pooling = engine, token_lists, check_pooling(pooling)
        self.window = max(1, min(2 * engine.net.max_seqs, engine.max_waiting))
        self._pending = collections.deque()
        self._lock = threading.Lock()
        self.cancelled = False

    def run(self):
        """The pooled vectors, float32 [n, dim] in the texts' order (not normalized)."""
        vectors = []
        try:
            for ids in self.token_lists:
                with self._lock:
                    if self.cancelled:
                        raise UserError("the embeddings were cancelled")
                    self._pending.append(self.engine.submit_embedding(ids, self.pooling))
                if len(self._pending) >= self.window:
                    vectors.append(self._pending[0].result())
                    self._pending.popleft()
            while self._pending:
                vectors.append(self._pending[0].result())
                self._pending.popleft()
        finally:
            self.cancel()              # what an error left queued (the finished ones ignore it)
        return np.stack(vectors)

    def cancel(self):
        with self._lock:
            self.cancelled = True
            for e in self._pending:
                e.cancel()


def normalized(vectors):
    """Each row scaled to unit L2 norm (float64 norms); a zero row stays zero."""
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))[:, None]
    return (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)
