"""A Model's lifetime (issue 39): close() while requests are in flight ends each of them with
finish_reason "cancelled" and an error, and nothing hangs; every use after close() is a clear
UserError; a Model that nobody holds but a stream still reads keeps serving that stream, and is
collected (its threads stopped) once the stream is gone. Every wait is bounded."""
import gc
import threading
import weakref

import numpy as np
import pytest

import llambda
from llambda.errors import UserError
from synth import write_random_llama

VOCAB = 300
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("lifetime") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=VOCAB,
                       tensor_type="Q4_1", n_ctx=4096, seed=3)
    return path


def load(tiny, **kw):
    kw.setdefault("n_ctx", 2048)
    return llambda.load(tiny, progress=False, threads=1, **kw)


def prompt(n=8, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def engine_threads():
    return {t for t in threading.enumerate() if t.name == "llambda-engine"}


def assert_stopped_since(before):
    """Every engine thread started since ``before`` (a set of them) ends."""
    for thread in engine_threads() - before:
        thread.join(TIMEOUT_S)
    assert engine_threads() <= before, "the engine thread of a collected Model still runs"


def test_close_with_requests_in_flight_cancels_each_with_an_error(tiny):
    model = load(tiny, parallel=2, max_waiting=8)
    running = [model.submit(prompt(seed=i), max_tokens=2000, ignore_eos=True, seed=i) for i in range(2)]
    waiting = [model.submit(prompt(seed=10 + i), max_tokens=2000, ignore_eos=True, seed=i) for i in range(3)]
    first = next(iter(running[0]))          # the engine is generating
    assert first.token is not None
    closer = threading.Thread(target=model.close)
    closer.start()
    closer.join(TIMEOUT_S)
    assert not closer.is_alive(), "close() hangs with requests in flight"
    for c in running + waiting:
        assert c.wait(TIMEOUT_S), "a request never ended after close()"
        assert c.finish_reason == "cancelled"
        assert isinstance(c.error, UserError) and "closed" in str(c.error)
        with pytest.raises(UserError, match="closed"):
            for _ in c:                     # reading it to the end says why it ended
                pass
    assert model.engine.net.kv.blocks_in_use == 0


def test_a_stream_being_read_when_the_model_closes_ends_with_the_error(tiny):
    model = load(tiny)
    stream = model.generate(prompt(), max_tokens=2000, ignore_eos=True, temperature=0)
    assert next(stream)
    model.close()
    with pytest.raises(UserError, match="closed"):
        for _ in stream:
            pass


def test_close_from_another_thread_while_a_thread_reads_a_stream(tiny):
    model = load(tiny)
    outcome = {}
    started = threading.Event()

    def read():
        try:
            for _ in model.generate(prompt(), max_tokens=2000, ignore_eos=True, temperature=0):
                started.set()
            outcome["ended"] = "normally"
        except UserError as error:
            outcome["ended"] = str(error)
    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(TIMEOUT_S)
    model.close()
    reader.join(TIMEOUT_S)
    assert not reader.is_alive()
    assert "closed" in outcome["ended"]


@pytest.mark.parametrize("use", ["generate", "submit", "chat", "logits", "evaluate", "reset", "embed", "tokenize"])
def test_every_use_after_close_is_a_clear_error(tiny, use):
    model = load(tiny)
    model.close()
    calls = {
        "generate": lambda: list(model.generate("hello", max_tokens=4)),
        "submit": lambda: model.submit(prompt(), max_tokens=4),
        "chat": lambda: list(model.chat([{"role": "user", "content": "hi"}], max_tokens=4)),
        "logits": lambda: model.logits(prompt()),
        "evaluate": lambda: model.evaluate(prompt()),
        "reset": lambda: model.reset(),
        "embed": lambda: model.embed("hello"),
        "tokenize": lambda: model.tokenize("hello"),
    }
    if use == "tokenize":           # needs no engine: still answers
        assert calls[use]()
        return
    with pytest.raises(UserError, match="closed"):
        calls[use]()


def test_close_twice_and_with_a_context_manager(tiny):
    with load(tiny) as model:
        assert list(model.generate(prompt(), max_tokens=3, temperature=0, ignore_eos=True))
    model.close()
    with pytest.raises(UserError, match="closed"):
        model.logits(prompt())


def test_a_model_nobody_holds_keeps_serving_its_stream_then_is_collected(tiny):
    before = engine_threads()
    reference = list(load(tiny).generate(prompt(), max_tokens=40, temperature=0, ignore_eos=True))
    gc.collect()
    stream = load(tiny).generate(prompt(), max_tokens=40, temperature=0, ignore_eos=True)
    pieces = [next(stream)]
    gc.collect()                    # the Model is unreachable but for the stream
    pieces += list(stream)
    assert pieces == reference
    del stream
    gc.collect()
    assert_stopped_since(before)


def test_a_stream_dropped_mid_way_is_cancelled_and_frees_its_blocks(tiny):
    model = load(tiny)
    stream = model.generate(prompt(), max_tokens=2000, ignore_eos=True, temperature=0)
    next(stream)
    del stream
    gc.collect()
    assert list(model.generate(prompt(), max_tokens=3, temperature=0, ignore_eos=True))
    assert model.engine.net.kv.blocks_in_use <= model.engine.net.kv.blocks_for(prompt().__len__() + 3)
    model.close()


def test_a_model_collected_with_a_completion_unread_ends_it(tiny):
    """A submitted Completion does not keep its Model's threads alive forever: once the Model
    is collected and the completion dropped, the engine stops."""
    before = engine_threads()
    model = load(tiny)
    ref = weakref.ref(model)
    completion = model.submit(prompt(), max_tokens=5, ignore_eos=True, temperature=0)
    assert completion.wait(TIMEOUT_S)
    del model, completion
    gc.collect()
    assert ref() is None
    assert_stopped_since(before)
