"""Embeddings (llambda/serving/embedding.py, Model.embed): a text's final-norm rows, pooled.

Against the numpy reference forward (tests/reference_forward.py: its final norm's output,
pooled here), batch invariant (a text's vector is the same bit for bit alone, beside other
texts, while generation runs, cut into other chunks, from the prefix cache), with no LM head
in a step of embeddings alone; the GGUF's pooling_type; the errors. llama.cpp (through
llama-cpp-python, the optional referee) judges the default model and a random qwen3 model
of Qwen3-Embedding-0.6B's layer shapes.
"""
import importlib.util
import threading
import time

import numpy as np
import pytest

import llambda
from llambda.errors import UserError
from reference_forward import ReferenceModel
from synth_arch import write_random_model

TIMEOUT_S = 120
VOCAB = 320


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float model: llambda's rows match the reference's to float32 rounding."""
    path = tmp_path_factory.mktemp("embed") / "tiny-qwen3-F32.gguf"
    return write_random_model(path, arch="qwen3", seed=5, n_layer=2, dim=64, n_head=4, n_kv_head=2,
                              head_dim=32, ffn_dim=128, vocab_size=VOCAB, tensor_type="F32", n_ctx=1024)


@pytest.fixture(scope="module")
def model(tiny):
    # an f32 KV cache: f16's rounding would be most of the difference from the reference
    with llambda.load(tiny, n_ctx=512, parallel=4, kv_type="f32", progress=False) as m:
        yield m


def ids(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def reference_rows(path, tokens):
    ref = ReferenceModel(str(path))
    return ref.hidden(tokens).astype(np.float64)


POOLED = {"mean": lambda rows: rows.mean(axis=0), "cls": lambda rows: rows[0], "last": lambda rows: rows[-1]}


# -- the numbers ----------------------------------------------------------------------

@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_final_norm_rows_match_the_reference(model, tiny, pooling):
    texts = [ids(7, 1), ids(40, 2), ids(1, 3)]
    got = model.embed(texts, pooling=pooling, normalize=False)
    assert got.shape == (3, model.config.dim) and got.dtype == np.float32
    for text, vector in zip(texts, got):
        want = POOLED[pooling](reference_rows(tiny, text))
        np.testing.assert_allclose(vector, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_numpy_backend_pools_the_same_rows(tiny):
    text = ids(20, 4)
    with llambda.load(tiny, n_ctx=128, backend="numpy", kv_type="f32", progress=False) as m:
        got = m.embed([text], normalize=False)[0]
    want = reference_rows(tiny, text).mean(axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_normalize_gives_unit_rows_in_the_same_direction(model):
    texts = [ids(9, 5), ids(30, 6)]
    raw = model.embed(texts, normalize=False)
    unit = model.embed(texts)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-6, atol=1e-7)


def test_text_is_tokenized_as_generate_tokenizes_it(model):
    text = "hello world, embed me"
    np.testing.assert_array_equal(model.embed(text), model.embed([model.tokenize(text)]))
    assert model.embed(text).shape == (1, model.config.dim)


# -- batch invariance --------------------------------------------------------------------

def test_a_text_is_the_same_alone_and_beside_others(model, tiny):
    text = ids(33, 7)
    alone = model.embed([text])
    crowd = [ids(5 + 11 * i, 100 + i) for i in range(9)]
    beside = model.embed(crowd[:4] + [text] + crowd[4:])
    np.testing.assert_array_equal(beside[4], alone[0])
    with llambda.load(tiny, n_ctx=512, parallel=1, kv_type="f32", progress=False) as single:    # one sequence per step
        np.testing.assert_array_equal(single.embed([text]), alone)


def test_a_text_is_the_same_while_generation_runs(tiny):
    text = ids(300, 8)            # longer than a step's rows: cut into other chunks beside the decoders
    # a long context, so that the streams are still generating when the texts are done
    with llambda.load(tiny, n_ctx=8192, parallel=4, progress=False) as m:
        alone = m.embed([text], pooling="mean")
        alone_last = m.embed([text], pooling="last")
        streams = [m.submit(ids(20, 200 + i), max_tokens=8000, seed=i, ignore_eos=True) for i in range(2)]
        try:
            for s in streams:     # both decoding before the texts arrive
                next(iter(s))
            during = m.embed([text, ids(3, 9)], pooling="mean")
            during_last = m.embed([text], pooling="last")
            assert not any(s.done for s in streams)
        finally:
            for s in streams:
                s.cancel()
    np.testing.assert_array_equal(during[0], alone[0])
    np.testing.assert_array_equal(during_last, alone_last)


def test_many_threads_embed_at_once(model):
    texts = [ids(4 + 7 * i, 300 + i) for i in range(12)]
    alone = model.embed(texts)
    results = [None] * len(texts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, model.embed(texts[i])))
               for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got[0], alone[i])


def test_last_pooling_from_the_prefix_cache_equals_computing_it(model):
    text = ids(150, 10)           # several whole KV blocks, sealed by the first run
    first = model.embed([text], pooling="last")
    cached_before = model.stats()["cached_tokens"]
    again = model.embed([text], pooling="last")
    assert model.stats()["cached_tokens"] > cached_before       # the second run read the cache
    np.testing.assert_array_equal(again, first)
    # mean reads every row: it never starts from the cache, and gives the same again
    np.testing.assert_array_equal(model.embed([text]), model.embed([text]))


def test_more_texts_than_may_wait_are_embedded(tiny):
    texts = [ids(3, 400 + i) for i in range(20)]
    with llambda.load(tiny, n_ctx=64, parallel=2, max_waiting=2, progress=False) as m:
        got = m.embed(texts)
        assert got.shape == (20, m.config.dim)
        np.testing.assert_array_equal(got[13], m.embed([texts[13]])[0])


def test_cancel_ends_the_texts_queued_and_queues_no_more(model):
    from llambda.serving.embedding import Batch
    texts = [ids(500, 600 + i) for i in range(200)]
    batch, out = Batch(model.engine, texts, "mean"), {}
    before = model.stats()

    def run():
        try:
            out["vectors"] = batch.run()
        except UserError as e:
            out["error"] = e
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while model.stats()["requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    batch.cancel()
    thread.join(TIMEOUT_S)
    assert "cancelled" in str(out.get("error")), out
    after = model.stats()
    assert after["requests_running"] == after["requests_waiting"] == 0
    assert after["prompt_tokens"] - before["prompt_tokens"] < 500 * len(texts)     # not all were run
    assert model.embed("on it goes").shape == (1, model.config.dim)


# -- the step ------------------------------------------------------------------------------

def test_a_step_of_embeddings_alone_runs_no_lm_head(model):
    net = model.net
    def run():
        net.logits[:] = np.nan            # the LM head would write these rows
        model.engine.submit_embedding(ids(10, 11), "mean")
    model.engine.call(run)
    assert model.embed([ids(10, 11)]).shape == (1, model.config.dim)
    assert np.isnan(model.engine.call(lambda: net.logits.copy())).all()


def test_hidden_rows_are_the_rows_the_lm_head_reads(model):
    """A step with head rows and hidden rows: the head's gathered, normed rows equal the hidden
    rows it picked (one op, one row, one value)."""
    net = model.net

    def run():
        tokens = ids(12, 12)
        net.token_ids[:12] = tokens
        net.positions[:12] = range(12)
        table, blocks = net.kv.open([], 16)[:2]
        try:
            net.row_seq[:12] = table
            net.head_rows[:3] = [0, 5, 11]
            net.step(12, 3, hidden=True)
            return net.hidden[:12].copy(), net.xh[:3].copy()
        finally:
            net.kv.close(table, blocks)
    hidden, heads = model.engine.call(run)
    np.testing.assert_array_equal(heads, hidden[[0, 5, 11]])


# -- the pooling a file asks for -------------------------------------------------------------

@pytest.mark.parametrize("code, name", [(1, "mean"), (2, "cls"), (3, "last"), (0, "mean")])
def test_the_gguf_pooling_type_is_the_default(tmp_path, code, name):
    path = write_random_model(tmp_path / f"pool{code}.gguf", arch="qwen3", seed=1, n_layer=1, dim=64, n_head=2,
                              n_kv_head=1, head_dim=32, ffn_dim=64, vocab_size=VOCAB, pooling_type=code)
    with llambda.load(path, n_ctx=64, progress=False) as m:
        assert m.pooling == name                    # none (0): no vector per text, so mean
        text = ids(6, 13)
        np.testing.assert_array_equal(m.embed([text]), m.embed([text], pooling=name))
        m.pooling = "cls"                           # llambda serve --pooling
        np.testing.assert_array_equal(m.embed([text]), m.embed([text], pooling="cls"))


def test_a_rank_model_says_it_gives_no_vector(tmp_path):
    path = write_random_model(tmp_path / "rank.gguf", arch="qwen3", seed=1, n_layer=1, dim=64, n_head=2,
                              n_kv_head=1, head_dim=32, ffn_dim=64, vocab_size=VOCAB, pooling_type=4)
    with llambda.load(path, n_ctx=64, progress=False) as m:
        with pytest.raises(UserError, match=r"qwen3\.pooling_type = 4 \(rank\)"):
            m.embed("x")
        m.pooling = "last"                          # the caller's choice wins
        assert m.embed([ids(4, 1)]).shape == (1, 64)


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("texts, match", [
    ([], r"texts: nothing to embed"),
    ("", r"texts: empty text"),
    (["a", ""], r"texts\[1\]: empty text"),
    ([[1, 2], []], r"texts\[1\]: no tokens"),
    ([[1, VOCAB]], rf"texts\[0\]: token id {VOCAB} is outside the vocabulary"),
    ([1, -1], r"texts: token id -1 is outside"),
    ([[1, 2.5]], r"texts\[0\]\[1\]: expected an integer token id"),
    (b"bytes", r"texts: expected a string"),
    (42, r"texts: expected a string"),
    (["\ud800"], r"texts\[0\]: not valid UTF-8"),
    ([ids(513, 1)], r"texts\[0\]: 513 tokens, but the context holds 512"),
])
def test_bad_texts_are_named(model, texts, match):
    with pytest.raises(UserError, match=match):
        model.embed(texts)


def test_a_text_as_long_as_the_context_is_embedded(model):
    assert model.embed([ids(512, 14)]).shape == (1, model.config.dim)


@pytest.mark.parametrize("pooling", ["max", "none", "rank", "", None, 3])
def test_bad_pooling_is_named(model, pooling):
    with pytest.raises(UserError, match=r"pooling: expected one of mean, cls, last"):
        if pooling is None:
            model.pooling = None
        else:
            model.embed("x", pooling=pooling)


def test_the_model_serves_on_after_a_bad_request(model):
    with pytest.raises(UserError):
        model.embed([[1, 2], []])
    assert model.embed("still here").shape == (1, model.config.dim)
    assert model.stats()["requests_running"] == 0


# -- llama.cpp, the referee --------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python (the optional referee) is not installed")
LLAMA_POOLING = {"mean": 1, "cls": 2, "last": 3}
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "a",
         "Batch invariance: a row's result never depends on the other rows of its step. " * 6]


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def llama_cpp_vectors(path, texts, pooling):
    """llama.cpp's pooled embeddings of ``texts`` and the ids it ran (its own tokenizer)."""
    import llama_cpp
    cpp = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, n_ubatch=512, embedding=True,
                          pooling_type=LLAMA_POOLING[pooling], verbose=False)
    try:
        tokens = [cpp.tokenize(t.encode(), add_bos=True, special=False) for t in texts]   # as embed() does
        return np.array(cpp.embed(texts, normalize=False), np.float64), tokens
    finally:
        getattr(cpp, "close", lambda: None)()


@needs_llama_cpp
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_default_model_matches_llama_cpp(default_gguf, pooling):
    want, tokens = llama_cpp_vectors(default_gguf, TEXTS, pooling)
    with llambda.load(default_gguf, n_ctx=512, parallel=4, progress=False) as m:
        got = m.embed(tokens, pooling=pooling)              # the very ids llama.cpp ran
        assert [m.tokenize(t) for t in TEXTS] == tokens      # and they are llambda's too
    assert cosines(got, want).min() >= 0.999, cosines(got, want)


@pytest.fixture(scope="module")
def qwen3_real_shapes(tmp_path_factory):
    """Qwen3-Embedding-0.6B's layer shapes (dim 1024, 16 query heads and 8 KV heads of 128,
    FFN 3072), two layers, a small vocabulary; its file says last-token pooling, as the real
    one's does."""
    path = tmp_path_factory.mktemp("qwen3") / "qwen3-embed-shapes-Q8_0.gguf"
    return write_random_model(path, arch="qwen3", seed=35, n_layer=2, dim=1024, n_head=16, n_kv_head=8,
                              head_dim=128, ffn_dim=3072, vocab_size=2048, tensor_type="Q8_0", n_ctx=4096,
                              rms_eps=1e-6, pooling_type=3)


@needs_llama_cpp
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_qwen3_with_real_shapes_matches_llama_cpp(qwen3_real_shapes, pooling):
    texts = [" ".join(f"word{j * i % 31}" for j in range(3 * i)) for i in range(1, 6)]
    want, tokens = llama_cpp_vectors(qwen3_real_shapes, texts, pooling)
    with llambda.load(qwen3_real_shapes, n_ctx=512, parallel=4, progress=False) as m:
        assert m.pooling == "last"
        got = m.embed(tokens, pooling=pooling)
    assert cosines(got, want).min() >= 0.999, cosines(got, want)
