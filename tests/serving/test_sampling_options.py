"""logit_bias, stop_token_ids and min_tokens (OpenAI's and vLLM's options) through Model.submit on a
tiny random model: a -100 bias bans a token greedy picked, +100 forces one, a stop token ends the
reply like EOS, min_tokens holds EOS back; each stays batch invariant and bad values raise an
OptionError naming the argument. Every wait is bounded."""
import math
import threading
import types

import numpy as np
import pytest

import llambda
from llambda.errors import OptionError
from llambda.serving.sampling import Sampler, check_logit_bias
from synth import write_random_llama

VOCAB = 300
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=VOCAB,
                       tensor_type="Q8_0", n_ctx=512, seed=11)
    with llambda.load(path, n_ctx=256, parallel=8, progress=False) as m:
        yield m


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def generated(model, ids, n=12, **kw):
    """(tokens, completion) of one finished submission."""
    c = model.submit(ids, max_tokens=n, **kw)
    tokens = [e.token for e in c if e.token is not None]
    assert c.wait(TIMEOUT_S)
    return tokens, c


def greedy(model, ids, n=12, **kw):
    kw.setdefault("ignore_eos", True)
    return generated(model, ids, n, temperature=0.0, **kw)


# -- the sampler ---------------------------------------------------------------------------
def test_check_logit_bias_takes_ids_and_their_text():
    ids, biases = check_logit_bias({"7": -100, 3: 2.5, "12": 100.0}, n_vocab=13)
    assert ids.tolist() == [3, 7, 12] and biases.tolist() == [2.5, -100.0, 100.0]
    assert ids.dtype == np.int64 and biases.dtype == np.float32
    assert check_logit_bias(None) is None and check_logit_bias({}) is None


def test_bias_is_added_before_the_filters_and_keeps_banned_tokens_banned():
    logits = np.array([3.0, 2.0, 1.0, -np.inf, 0.0], dtype=np.float32)
    sampler = Sampler(temperature=0.0, logit_bias={0: -100, 4: 5, 3: 100})
    assert sampler.sample(logits.copy()) == 4           # 0.0 + 5 beats 2.0; -inf + 100 stays -inf
    row = logits.copy()
    Sampler(temperature=1.0, top_k=2, logit_bias={"0": -100}, seed=1).sample(row)
    np.testing.assert_array_equal(row, [-97.0, 2.0, 1.0, -np.inf, 0.0])   # in place, once
    ids, p = Sampler(temperature=1.0, top_k=1, logit_bias={2: 10}, seed=1).distribution(logits.copy())
    assert ids.tolist() == [2] and p.tolist() == [1.0]


@pytest.mark.parametrize("bias, match", [
    ({"300": 1}, "outside the vocabulary"), ({"-1": 1}, "not a token id"), ({"x": 1}, "not a token id"),
    ({True: 1}, "not a token id"), ({"5": 100.5}, r"\[-100.0, 100.0\]"), ({"5": math.nan}, "finite"),
    ({"5": "1"}, "finite number"), ({"5": 1, 5: 2}, "twice"), ([1, 2], "expected an object")])
def test_bad_logit_bias_is_refused(bias, match):
    with pytest.raises(ValueError, match="logit_bias"):
        check_logit_bias(bias, n_vocab=VOCAB)
    with pytest.raises(ValueError, match=match):
        Sampler(logit_bias=bias, n_vocab=VOCAB)


# -- through the engine ----------------------------------------------------------------------
def test_minus_100_bans_a_token_greedy_picked(model):
    ids = prompt(10, seed=1)
    plain, _ = greedy(model, ids)
    banned = plain[0]
    biased, _ = greedy(model, ids, logit_bias={str(banned): -100})
    assert biased[0] != banned and banned not in biased
    assert len(biased) == 12


def test_plus_100_forces_a_token_even_when_sampling(model):
    ids = prompt(10, seed=2)
    plain, _ = greedy(model, ids)
    forced = next(t for t in range(3, VOCAB) if t not in plain and t not in model.tokenizer.eog_ids)
    tokens, c = generated(model, ids, n=8, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=5,
                          logit_bias={forced: 100})
    assert tokens == [forced] * 8 and c.finish_reason == "length"


def test_stop_token_ids_end_the_reply_like_eos(model):
    ids = prompt(12, seed=3)
    plain, _ = greedy(model, ids, n=16)
    k = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])
    tokens, c = greedy(model, ids, n=16, stop_token_ids=[plain[k]])
    assert tokens == plain[:k]                          # the stop token itself is not emitted
    assert c.finish_reason == "stop" and c.stop_reason == "stop_token" and c.completion_tokens == k
    # ignore_eos does not keep a stop token from stopping
    assert c.completion_tokens < 16


def test_min_tokens_holds_back_eos(model):
    eos = model.tokenizer.eos_id
    ids = prompt(8, seed=4)
    # EOS pushed to the top: without min_tokens the reply ends at once
    tokens, c = generated(model, ids, n=20, temperature=0.0, logit_bias={eos: 100})
    assert tokens == [] and c.finish_reason == "stop" and c.stop_reason == "eos"
    tokens, c = generated(model, ids, n=20, temperature=0.0, logit_bias={eos: 100}, min_tokens=5)
    assert len(tokens) == 5 and eos not in tokens
    assert c.finish_reason == "stop" and c.stop_reason == "eos" and c.completion_tokens == 5
    # the same with the second best when EOS is banned: what greedy picks with EOS out of the way
    banned, _ = generated(model, ids, n=5, temperature=0.0, logit_bias={eos: -100}, ignore_eos=True)
    assert tokens == banned


def test_min_tokens_holds_back_stop_token_ids_too(model):
    ids = prompt(8, seed=5)
    stop = 42
    tokens, c = generated(model, ids, n=20, temperature=0.0, logit_bias={stop: 100}, stop_token_ids=[stop])
    assert tokens == [] and c.stop_reason == "stop_token"
    tokens, c = generated(model, ids, n=20, temperature=0.0, logit_bias={stop: 100}, stop_token_ids=[stop],
                          min_tokens=3)
    assert len(tokens) == 3 and stop not in tokens and c.stop_reason == "stop_token"


def test_min_tokens_with_ignore_eos_lets_eos_through_as_a_token(model):
    eos = model.tokenizer.eos_id
    tokens, c = generated(model, prompt(8, seed=6), n=4, temperature=0.0, logit_bias={eos: 100},
                          min_tokens=2, ignore_eos=True)
    assert tokens == [eos] * 4 and c.finish_reason == "length"


def test_options_are_batch_invariant(model):
    """A sequence's tokens with these options are the same alone and beside seven others with
    other options (each row's bias and bans are its own)."""
    jobs = [dict(ids=prompt(6 + 3 * i, seed=20 + i), seed=i, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0,
                 logit_bias={str(i + 3): -100, str(2 * i + 7): 4.0}, stop_token_ids=[100 + i],
                 min_tokens=i % 3, ignore_eos=i % 2 == 0) for i in range(8)]
    solo = []
    for job in jobs:
        job = dict(job)
        solo.append(generated(model, job.pop("ids"), n=10, **job)[0])
    results = [None] * 8

    def run(i):
        job = dict(jobs[i])
        results[i] = generated(model, job.pop("ids"), n=10, **job)[0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert results == solo
    assert all(str(i + 3) not in map(str, tokens) for i, tokens in enumerate(solo))


@pytest.mark.parametrize("kw, field, match", [
    (dict(logit_bias={"300": 5}), "logit_bias", "outside the vocabulary"),
    (dict(logit_bias={"a": 5}), "logit_bias", "not a token id"),
    (dict(logit_bias={"1": -101}), "logit_bias", "-100"),
    (dict(logit_bias="1"), "logit_bias", "expected an object"),
    (dict(stop_token_ids=[300]), "stop_token_ids", "not a token id"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "not a token id"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids", "not a token id"),
    (dict(stop_token_ids=7), "stop_token_ids", "list of token ids"),
    (dict(stop_token_ids="7"), "stop_token_ids", "list of token ids"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=1.5), "min_tokens", ">= 0"),
    (dict(min_tokens=11, max_tokens=10), "min_tokens", "more than max_tokens")])
def test_bad_values_raise_naming_the_argument(model, kw, field, match):
    kw.setdefault("max_tokens", 4)
    with pytest.raises(OptionError, match=match) as caught:
        model.submit([1, 2, 3], **kw)
    assert caught.value.field == field and str(caught.value).startswith(field)


def test_generate_and_chat_take_the_options(model):
    eos = model.tokenizer.eos_id
    stats = types.SimpleNamespace()
    "".join(model.generate([1, 2, 3], max_tokens=6, temperature=0.0, logit_bias={eos: 100}, min_tokens=2,
                           stats=stats))
    assert stats.generated_tokens == 2 and stats.stop_reason == "eos"
    "".join(model.chat([{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.0,
                       stop_token_ids=[7], logit_bias={7: 100}, stats=stats))
    assert stats.generated_tokens == 0 and stats.stop_reason == "stop_token"
    with pytest.raises(OptionError, match="min_tokens"):
        "".join(model.chat([{"role": "user", "content": "hi"}], min_tokens=-2))


def test_min_tokens_under_a_grammar_ends_where_the_grammar_does(model):
    """With EOS pushed up, a choice grammar ends at its first complete choice; min_tokens holds
    EOS back, so the longer choice is taken, and the grammar then ends the reply, not an error."""
    eos = model.tokenizer.eos_id
    texts = {}
    for min_tokens in (0, 5):
        c = model.submit([1, 2, 3], max_tokens=10, temperature=0.0, logit_bias={eos: 100}, min_tokens=min_tokens,
                         choice=["ab", "abc"])
        texts[min_tokens] = "".join(e.text for e in c)
        assert c.wait(TIMEOUT_S) and c.finish_reason == "stop" and c.error is None
    assert texts == {0: "ab", 5: "abc"}
