"""The engine (llambda/serving/engine.py): many sequences per step, from many threads, batch invariant.

A sequence's tokens for a seed must be bit-identical whether it runs alone or beside
others, in any batch position, and whether its prefix came from the cache or was computed
now; a Model is safe to share between threads, a reply can be cancelled from another one,
and no caller's CPU affinity changes. Every wait here is bounded.
"""
import os
import threading
import time

import numpy as np
import pytest

import llambda
from llambda.codegen.contract import KV_BLOCK
from llambda.serving.engine import EngineBusy
from llambda.errors import UserError
from synth import write_random_llama

VOCAB = 300
TIMEOUT_S = 120


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0", "F16"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / f"tiny-{request.param}.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=VOCAB,
                       tensor_type=request.param, n_ctx=1024, seed=11)
    return path


@pytest.fixture(scope="module")
def shared(tiny):
    """One Model with room for 16 sequences at once."""
    with llambda.load(tiny, n_ctx=256, parallel=16, progress=False) as model:
        yield model


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def tokens_of(completion):
    return [e.token for e in completion if e.token is not None]


def run(model, ids, seed, n=10, **kw):
    kw.setdefault("temperature", 0.9)
    return tokens_of(model.submit(ids, max_tokens=n, seed=seed, ignore_eos=True, **kw))


def test_sixteen_concurrent_sequences_equal_their_solo_runs(shared, tiny):
    prompts = [prompt(5 + 9 * i, seed=i) for i in range(16)]
    with llambda.load(tiny, n_ctx=256, parallel=1, progress=False) as alone:
        solo = [run(alone, p, seed=i) for i, p in enumerate(prompts)]
    results = [None] * 16
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(shared, prompts[i], seed=i)))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert results == solo
    assert shared.stats()["steps"] > 0


def test_a_prefix_from_the_cache_gives_the_same_tokens_as_computing_it(shared):
    system = prompt(3 * KV_BLOCK + 3, seed=100)
    first = shared.submit(system + [1, 2, 3], max_tokens=6, seed=5, ignore_eos=True, temperature=0.9)
    first_tokens = tokens_of(first)
    again = shared.submit(system + [1, 2, 3], max_tokens=6, seed=5, ignore_eos=True, temperature=0.9)
    assert tokens_of(again) == first_tokens
    assert again.cached_tokens >= 3 * KV_BLOCK
    # a different model object computes everything from scratch: same tokens
    other = shared.submit(system + [1, 2, 3], max_tokens=6, seed=5, ignore_eos=True, temperature=0.9)
    assert tokens_of(other) == first_tokens


def test_generated_blocks_are_reused_by_the_next_turn(shared):
    turn = prompt(KV_BLOCK + 4, seed=7)
    c = shared.submit(turn, max_tokens=2 * KV_BLOCK, seed=1, ignore_eos=True, temperature=0.9)
    reply = tokens_of(c)
    nxt = shared.submit(turn + reply + [5, 6], max_tokens=2, seed=2, ignore_eos=True)
    tokens_of(nxt)
    assert nxt.cached_tokens >= (len(turn) + len(reply) - 1) // KV_BLOCK * KV_BLOCK - KV_BLOCK


def test_decode_and_prefill_give_identical_logits(tiny):
    """Batch invariance at its root: the logits of position i are the same bits whether i was
    the last row of a prefill chunk, a decode step, or a row of a larger chunk."""
    ids = prompt(40, seed=3)
    with llambda.load(tiny, n_ctx=256, progress=False) as model:
        every = model.logits(ids)
        steps = []
        for i in range(30, 41):
            steps.append(model.evaluate(ids[:i]).copy())
        model._cached = []
        chunk = model.evaluate(ids[:35]).copy()
    for i, row in zip(range(30, 41), steps):
        np.testing.assert_array_equal(row[:VOCAB], every[i - 1][:VOCAB])
    np.testing.assert_array_equal(chunk[:VOCAB], every[34][:VOCAB])


def test_greedy_generate_equals_submit_and_evaluate(shared):
    ids = prompt(20, seed=9)
    text_tokens = run(shared, ids, seed=None, n=8, temperature=0.0)
    history = list(ids)
    for _ in range(8):
        history.append(int(np.argmax(shared.evaluate(history))))
    assert text_tokens == history[len(ids):]


def test_reset_gives_evaluates_blocks_back(tiny):
    """Model.reset(): evaluate()'s sequence (a whole context of the KV cache, apart from
    generate()'s) forgets its tokens and gives its blocks back to the pool, where the next
    sequence takes them; evaluate() afterwards computes the same logits again."""
    with llambda.load(tiny, n_ctx=256, progress=False) as model:
        kv = model.net.kv
        ids = prompt(200, seed=4)
        free = kv.available
        first = model.evaluate(ids)
        assert model.position == 200 and kv.available == free - kv.blocks_for(256)
        model.reset()
        assert model.position == 0 and kv.available == free
        model.reset()                                   # nothing held: nothing to give back
        assert kv.available == free
        np.testing.assert_array_equal(model.evaluate(ids), first)
        assert kv.available == free - kv.blocks_for(256)


def test_cancel_from_another_thread_frees_the_blocks(shared):
    c = shared.submit(prompt(30, seed=1), max_tokens=10_000, seed=1, ignore_eos=True)
    got = []
    def consume():
        for e in c:
            got.append(e)
    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    c.cancel()
    t.join(TIMEOUT_S)
    assert not t.is_alive() and c.finish_reason == "cancelled"
    assert c.wait(TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while shared.stats()["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shared.stats()["requests_running"] == 0


def test_leaving_generate_early_cancels_the_sequence(shared):
    gen = shared.generate(prompt(10, seed=4), max_tokens=10_000, ignore_eos=True)
    next(gen)
    gen.close()
    deadline = time.monotonic() + TIMEOUT_S
    while shared.stats()["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shared.stats()["requests_running"] == 0


def test_a_long_prompt_does_not_freeze_running_streams(tiny):
    """Chunked prefill: while a prompt of several chunks is prefilled, a running stream still
    gets a token per step."""
    # three steps of rows: 384 tokens, or 768 for a float model's larger steps (model.FLOAT_BATCH)
    with llambda.load(tiny, n_ctx=1024, parallel=2, progress=False) as model:
        stream = model.submit(prompt(5, seed=1), max_tokens=400, seed=1, ignore_eos=True)
        times = []
        def consume():
            for _ in stream:
                times.append(model.stats()["steps"])
        t = threading.Thread(target=consume)
        t.start()
        while len(times) < 3:
            time.sleep(0.001)
        long = model.submit(prompt(3 * model.net.max_batch, seed=2), max_tokens=1, seed=2)
        steps_before = model.stats()["steps"]
        tokens_of(long)
        steps_after = model.stats()["steps"]
        stream.cancel()
        t.join(TIMEOUT_S)
    assert steps_after - steps_before >= 3          # the prompt took several steps...
    during = [s for s in times if steps_before < s <= steps_after]
    assert len(during) >= 2                         # ...and the stream got tokens in them


def test_limits_and_bad_requests(tiny):
    with llambda.load(tiny, n_ctx=64, parallel=1, max_waiting=1, progress=False) as model:
        with pytest.raises(UserError, match="context"):
            model.submit(prompt(64, seed=0), max_tokens=1)
        with pytest.raises(UserError, match="max_tokens"):
            model.submit([1], max_tokens=-1)
        with pytest.raises(UserError, match="temperature"):
            model.submit([1], temperature=-1)
        running = model.submit([1, 2], max_tokens=10_000, ignore_eos=True)
        deadline = time.monotonic() + TIMEOUT_S
        while model.stats()["requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        waiting = model.submit([3], max_tokens=1)
        with pytest.raises(EngineBusy):
            model.submit([4], max_tokens=1)
        running.cancel()
        assert waiting.wait(TIMEOUT_S) and waiting.finish_reason in ("length", "stop")
        c = model.submit([5, 6], max_tokens=3, ignore_eos=True)
        assert len(tokens_of(c)) == 3 and c.finish_reason == "length"


def test_the_context_ends_a_reply(tiny):
    with llambda.load(tiny, n_ctx=32, progress=False) as model:
        c = model.submit(prompt(20, seed=0), max_tokens=100, ignore_eos=True)
        # positions 20..31 are computed; the last token comes from position 31's logits
        assert len(tokens_of(c)) == 13 and c.finish_reason == "length" and c.stop_reason == "context_full"


def test_stop_strings_are_whole_strings(shared):
    ids = prompt(8, seed=12)
    text = "".join(shared.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True))
    if len(text) < 4:
        pytest.skip("the random model's reply is too short to cut")
    stop = text[2:4]
    cut = "".join(shared.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop))
    assert cut == text[:text.index(stop)]


def test_the_callers_cpu_affinity_never_changes(tiny):
    before = os.sched_getaffinity(0)
    with llambda.load(tiny, n_ctx=64, threads=2, progress=False) as model:
        list(model.generate([1, 2, 3], max_tokens=4))
        model.evaluate([1, 2, 3, 4])
        assert os.sched_getaffinity(0) == before
    assert os.sched_getaffinity(0) == before


def test_closing_ends_what_runs_and_refuses_more(tiny):
    model = llambda.load(tiny, n_ctx=64, progress=False)
    c = model.submit([1, 2], max_tokens=10_000, ignore_eos=True)
    model.close()
    assert c.wait(TIMEOUT_S) and c.finish_reason == "cancelled"
    with pytest.raises(UserError, match="closed"):
        model.submit([1], max_tokens=1)


def test_a_bounded_kv_cache_makes_sequences_wait_their_turn(tiny):
    """kv_cache_mb bounds the pool: with room for about one sequence, four submitted at once
    run one after another and each still equals its solo run."""
    from llambda.serving.kv_pool import KVPool
    with llambda.load(tiny, n_ctx=64, parallel=4, progress=False) as probe:
        block = KVPool.block_bytes(probe.config, probe.net.kv.kv_type)
    mb = 6.5 * block / 2 ** 20               # 6 blocks: trash, 5 for sequences of 3 blocks
    with llambda.load(tiny, n_ctx=64, parallel=4, kv_cache_mb=mb, progress=False) as model:
        assert model.net.kv.nbytes <= mb * 2 ** 20 and model.net.kv.n_blocks == 6
        solo = [run(model, prompt(30, seed=i), seed=i) for i in range(4)]
        together = [model.submit(prompt(30, seed=i), max_tokens=10, seed=i, ignore_eos=True, temperature=0.9)
                    for i in range(4)]
        assert [tokens_of(c) for c in together] == solo


def test_a_model_nobody_holds_stops_its_threads(tiny):
    """No close(): dropping the last reference ends the engine thread and the workers."""
    def use():
        model = llambda.load(tiny, n_ctx=64, threads=2, progress=False)
        model.logits([1, 2, 3])
        list(model.generate([1, 2], max_tokens=3))
    before = {t.ident for t in threading.enumerate()}
    use()
    deadline = time.monotonic() + TIMEOUT_S
    def ours():
        return [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("llambda-")]
    while ours() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ours()


def test_a_request_that_can_never_fit_ends_with_an_error_instead_of_waiting(tiny):
    from llambda.serving.kv_pool import KVPool
    with llambda.load(tiny, n_ctx=64, progress=False) as probe:
        block = KVPool.block_bytes(probe.config, probe.net.kv.kv_type)
    with llambda.load(tiny, n_ctx=64, kv_cache_mb=6.5 * block / 2 ** 20, progress=False) as model:
        model.evaluate([1, 2, 3])            # evaluate()'s sequence takes 4 of the 5 blocks
        c = model.submit(prompt(30, seed=0), max_tokens=10, ignore_eos=True)
        assert c.wait(TIMEOUT_S) and c.finish_reason == "error"
        with pytest.raises(UserError, match="KV cache has no room"):
            list(c)


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-long") / "tiny-long.gguf"
    write_random_llama(path, n_layer=2, dim=128, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=VOCAB,
                       tensor_type="Q4_1", n_ctx=2048, seed=12)     # head_dim 32: q8_0 caches too
    return path


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "f32"])
def test_decode_and_prefill_give_identical_logits_at_long_contexts(tiny_long, kv_type):
    """The same at positions past several attention segments (codegen/contract.py KV_SEGMENT),
    on 2 threads: a decode step splits its keys between the threads and combines the
    segments after, a prefill chunk combines each row's own; the bits agree."""
    from llambda.codegen.contract import KV_SEGMENT
    n = 2 * KV_SEGMENT + 90
    ids = prompt(n, seed=5)
    with llambda.load(tiny_long, n_ctx=1024, threads=2, kv_type=kv_type, progress=False) as model:
        every = model.logits(ids)
        steps = []
        for i in range(n - 6, n + 1):
            steps.append(model.evaluate(ids[:i]).copy())
    for i, row in zip(range(n - 6, n + 1), steps):
        np.testing.assert_array_equal(row[:VOCAB], every[i - 1][:VOCAB])


def test_the_kv_cache_is_collapsed_into_huge_pages_only_while_nothing_runs(tiny):
    """A collapse can stall the steps around it for tens of ms (kv_pool.py), so the engine
    hands the filled huge pages over only once it has had nothing to run for a while."""
    with llambda.load(tiny, n_ctx=256, parallel=2, progress=False) as model:
        engine, kv, seen = model.engine, model.net.kv, []
        real_filled, real_collapse = kv.filled, kv.collapse_filled

        def filled(blocks):                 # as if every sealed block completed a huge page
            real_filled(blocks)
            kv._filled_pages.append(0)

        def collapse_filled():
            seen.append(len(engine._running))
            return real_collapse()

        kv.filled, kv.collapse_filled = filled, collapse_filled
        first = model.submit(prompt(40, seed=3), max_tokens=60, seed=3, ignore_eos=True)
        second = model.submit(prompt(7, seed=4), max_tokens=60, seed=4, ignore_eos=True)
        assert len(tokens_of(first)) == 60 and len(tokens_of(second)) == 60
        deadline = time.monotonic() + TIMEOUT_S
        while kv.has_filled_pages and time.monotonic() < deadline:    # idle now: handed over
            time.sleep(0.01)
        assert not kv.has_filled_pages and seen and set(seen) == {0}
