"""Constrained decoding (llambda/serving/constraints.py and the engine's use of it).

On the default model's real vocabulary: every constrained reply parses (JSON validates under its
schema with jsonschema, a regex matches whole, a choice is one of the list, a GBNF grammar's
language holds it), at temperature 1 across seeds, so the grammar and not the model's good
manners holds the output in shape. Seeded constrained runs are batch invariant. The bitmask
is applied as a plain loop over bits would (hypothesis, exact). Bad grammars fail before
anything is queued, naming the option; a grammar failing mid-run ends its sequence only.
"""
import json
import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import llambda
from llambda.serving import constraints
from llambda.serving.constraints import ConstraintError, ConstraintFailed, apply_bitmask, grammar_from

jsonschema = pytest.importorskip("jsonschema")

SEEDS = range(6)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "pets", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(default_gguf):
    with llambda.load(default_gguf, n_ctx=1024, parallel=4, threads=1, progress=False) as m:
        yield m


def chat_prompt(model, text):
    """The token ids of a one-message chat."""
    return model.tokenize(model.render_chat([{"role": "user", "content": text}]),
                          add_special=model.chat_template.builtin)


def reply(model, prompt, **kw):
    kw.setdefault("max_tokens", 256)
    c = model.submit(prompt, **kw)
    text = "".join(e.text for e in c)
    return text, c


# -- grammars -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field, message", [
    (dict(json_schema={"type": "nope"}), "json_schema", "nope"),
    (dict(json_schema="{not json"), "json_schema", "not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema", "expected a JSON schema"),
    (dict(regex="("), "regex", "unclosed group"),
    (dict(regex=5), "regex", "a string"),
    (dict(choice=[]), "choice", "at least one"),
    (dict(choice="yes"), "choice", "a list of strings"),
    (dict(choice=["a", 3]), "choice[1]", "expected a string"),
    (dict(grammar="root ::= foo"), "grammar", "foo"),
    (dict(grammar="root ::= ("), "grammar", "GBNF"),
    (dict(lark="start: nope"), "lark", "nope"),
    (dict(regex="a", choice=["a"]), "regex and choice", "at most one"),
])
def test_bad_grammars_name_their_option(kw, field, message):
    with pytest.raises(ConstraintError) as info:
        grammar_from(**kw)
    assert info.value.field == field and message in str(info.value)
    assert "\n" not in str(info.value)


def test_no_constraint_is_none():
    assert grammar_from() is None and grammar_from(json_object=False) is None


def test_a_bad_constraint_is_refused_before_anything_is_queued(model):
    before = model.stats()["requests"]
    with pytest.raises(ConstraintError, match="^regex: "):
        model.submit("x", regex="[")
    with pytest.raises(llambda.errors.UserError, match="not both"):
        model.submit("x", regex="a", constraint=model.constraint(regex="b"))
    assert model.stats()["requests"] == before


# -- the bitmask ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n_vocab=st.sampled_from([1, 31, 32, 33, 63, 64, 65, 300, 49152]), pad=st.integers(0, 40),
       seed=st.integers(0, 2 ** 32 - 1), density=st.sampled_from([0.0, 0.01, 0.5, 1.0]))
def test_apply_bitmask_matches_a_loop_over_bits(n_vocab, pad, seed, density):
    # exact: each logit is either kept bit for bit or set to -inf
    rng = np.random.default_rng(seed)
    words = (n_vocab + 31) // 32
    allowed = rng.random(words * 32) < density
    mask = np.packbits(allowed.reshape(-1, 8), axis=1, bitorder="little").reshape(-1).view(np.int32)
    logits = rng.standard_normal(n_vocab + pad).astype(np.float32)
    expected = logits.copy()
    for i in range(expected.size):
        if i >= n_vocab or not allowed[i]:
            expected[i] = -np.inf
    apply_bitmask(mask, logits, n_vocab)
    np.testing.assert_array_equal(logits, expected)


def test_masks_filled_together_equal_masks_filled_alone(model):
    cs = [model.constraint(json_schema=PERSON), model.constraint(regex=r"[0-9]{3}"),
          model.constraint(choice=["alpha", "beta"]), model.constraint(json_object=True)]
    together = constraints.MaskBatch(4, model.n_vocab)
    together.fill(cs)
    for i, c in enumerate(cs):
        alone = constraints.MaskBatch(1, model.n_vocab)
        alone.fill([c])
        np.testing.assert_array_equal(together.bitmask[i], alone.bitmask[0])
        assert c.failure is None


# -- what the engine makes ------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_replies_validate(model, seed):
    text, c = reply(model, chat_prompt(model, "Describe a person as JSON."), json_schema=PERSON,
                    temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    assert c.finish_reason == "stop" and c.stop_reason in ("grammar", "eos"), text
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_json_object_replies_are_objects(model, seed):
    text, c = reply(model, chat_prompt(model, "Give me some JSON."), json_object=True, temperature=1.0,
                    seed=seed, max_tokens=400)
    if c.finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:                      # free text inside a string can run to the length: still a JSON prefix
        assert c.finish_reason == "length" and text.lstrip().startswith("{")


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_regex_choice_and_gbnf_replies_hold(model, seed):
    sample = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    text, c = reply(model, "My phone number is", regex=r"\(\d{3}\) \d{3}-\d{4}", **sample)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) and c.stop_reason == "grammar"
    options = ["Paris", "Lyon", "Marseille", "not sure"]
    text, c = reply(model, "The capital of France is", choice=options, **sample)
    assert text in options and c.finish_reason == "stop"
    gbnf = r'''root ::= "[" item ("," item){0,4} "]"
item ::= [1-9] [0-9]{0,2}'''
    text, c = reply(model, "Some numbers:", grammar=gbnf, **sample)
    assert re.fullmatch(r"\[[1-9][0-9]{0,2}(,[1-9][0-9]{0,2}){0,4}\]", text), text


def test_the_grammar_chooses_the_likely_option_greedily(model):
    text, _ = reply(model, "The capital of France is", choice=[" Berlin", " Paris", " Rome"], temperature=0)
    assert text == " Paris"


def test_forced_text_is_generated_without_sampling_and_counted(model):
    # a const is forced whole: the engine runs those tokens as prompt rows of the next step
    schema = {"type": "object", "properties": {"kind": {"const": "a very long constant string that is forced"},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["kind", "n"], "additionalProperties": False}
    text, c = reply(model, chat_prompt(model, "JSON please"), json_schema=schema, temperature=0.7, seed=1,
                    logprobs=0)
    assert json.loads(text)["kind"] == "a very long constant string that is forced"
    assert c.completion_tokens == len(c.ids) > 10


def test_max_tokens_cuts_a_constrained_reply(model):
    text, c = reply(model, chat_prompt(model, "JSON"), json_schema=PERSON, max_tokens=5, temperature=0)
    assert c.finish_reason == "length" and c.completion_tokens == 5 and text.startswith("{")


def test_constrained_runs_are_batch_invariant(default_gguf, model):
    prompts = [chat_prompt(model, f"Person number {i} as JSON.") for i in range(4)]
    kinds = [dict(json_schema=PERSON), dict(), dict(regex=r"[a-z ]{1,40}\."), dict(json_schema=PERSON)]
    sample = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=64)
    with llambda.load(default_gguf, n_ctx=1024, parallel=1, threads=1, progress=False) as alone:
        solo = [reply(alone, p, seed=i, **k, **sample)[1].ids for i, (p, k) in enumerate(zip(prompts, kinds))]
    together = [None] * 4

    def one(i):
        together[i] = reply(model, prompts[i], seed=i, **kinds[i], **sample)[1].ids
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == solo


def test_a_failing_grammar_ends_its_sequence_only(model):
    broken = model.constraint(regex=r"[a-z]{1,200}")

    def consume(token):
        raise broken.failed("injected")
    broken.consume = consume
    bad = model.submit(chat_prompt(model, "hi"), constraint=broken, max_tokens=20, seed=1)
    good = model.submit(chat_prompt(model, "hi"), json_schema=PERSON, max_tokens=200, seed=1)
    with pytest.raises(ConstraintFailed, match="injected"):
        list(bad)
    assert bad.finish_reason == "error" and bad.error.field == "regex"
    jsonschema.validate(json.loads("".join(e.text for e in good)), PERSON)
    assert model.stats()["kv_blocks_in_use"] >= 0 and "Paris" in "".join(
        model.generate("The capital of France is", max_tokens=4, temperature=0))


def test_a_draw_redrawn_under_the_mask_when_refused_is_a_draw_from_the_masked_distribution():
    # the engine's draw-first path (Engine._draws_first): rejection sampling, exact when the
    # sampler says so; checked here by a chi-square test of 6,000 seeded draws over 8 allowed
    # ids (7 degrees of freedom: 24.32 is the statistic's 0.999 quantile)
    from llambda.serving.sampling import Sampler
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(40).astype(np.float32) * 2
    allowed = np.zeros(40, dtype=bool)
    allowed[rng.choice(40, 8, replace=False)] = True
    masked = np.where(allowed, logits, -np.inf).astype(np.float32)
    counts = np.zeros(40)
    for seed in range(6000):
        sampler = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        assert sampler.redraw_is_exact(40)
        token = sampler.sample(logits.copy())
        if not allowed[token]:
            token = sampler.sample(masked.copy())
        counts[token] += 1
    expected = np.exp(masked - masked.max())
    expected = expected / expected.sum() * counts.sum()
    assert counts[~allowed].sum() == 0
    chi2 = float(np.sum((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]))
    assert chi2 < 24.32, chi2
    assert not Sampler(top_p=0.9).redraw_is_exact(40) and not Sampler(logit_bias={1: 5.0}).redraw_is_exact(40)
    assert Sampler(temperature=0.0, top_p=0.5).redraw_is_exact(40)
