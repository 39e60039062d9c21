"""A request's n choices (Model.choices): the first prefills the prompt, the others fork from
its sealed KV blocks once it has, and each equals a lone run with its own seed (seed + i),
constrained ones too."""
import json

import numpy as np
import pytest

import llambda
from llambda.codegen.contract import KV_BLOCK
from llambda.errors import OptionError
from synth import write_random_llama

VOCAB = 300
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("choices") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=VOCAB,
                       tensor_type="Q8_0", n_ctx=1024, seed=5)
    return path


def finished_ids(c):
    assert c.wait(TIMEOUT_S)
    return list(c.ids)


@pytest.mark.parametrize("prompt_len", [1, KV_BLOCK - 1, KV_BLOCK, 2 * KV_BLOCK + 3])
def test_forks_equal_lone_runs_and_share_the_prefill(tiny, prompt_len):
    prompt = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len).tolist()
    with llambda.load(tiny, n_ctx=256, parallel=4, progress=False) as m:
        forks = m.choices(prompt, 4, seed=9, max_tokens=10, temperature=1.0, ignore_eos=True)
        got = [finished_ids(c) for c in forks]
        shared = [c.cached_tokens for c in forks[1:]]
    with llambda.load(tiny, n_ctx=256, parallel=1, progress=False) as alone:
        solo = [finished_ids(alone.submit(prompt, seed=9 + i, max_tokens=10, temperature=1.0, ignore_eos=True))
                for i in range(4)]
    assert got == solo
    # every fork starts from the first's full blocks (the last prompt token is always computed)
    assert shared == [(prompt_len - 1) // KV_BLOCK * KV_BLOCK] * 3


def test_choices_without_a_seed_differ(tiny):
    with llambda.load(tiny, n_ctx=256, parallel=3, progress=False) as m:
        got = [finished_ids(c) for c in m.choices([1, 2, 3], 3, max_tokens=12, temperature=1.0, ignore_eos=True)]
    assert len({tuple(ids) for ids in got}) > 1


def test_bad_n_is_refused(tiny):
    with llambda.load(tiny, n_ctx=256, progress=False) as m:
        for bad in (0, -1, True, 1.5):
            with pytest.raises(OptionError, match="^n: "):
                m.choices([1, 2], bad)


def test_constrained_choices_each_follow_their_grammar(default_gguf):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    with llambda.load(default_gguf, n_ctx=512, parallel=3, threads=1, progress=False) as m:
        prompt = m.tokenize("A number as JSON:")
        texts = [m.detokenize(finished_ids(c))
                 for c in m.choices(prompt, 3, seed=1, json_schema=schema, max_tokens=30, temperature=1.0)]
        alone = m.detokenize(finished_ids(m.submit(prompt, seed=2, json_schema=schema, max_tokens=30, temperature=1.0)))
    assert all(0 <= json.loads(t)["n"] <= 99 for t in texts) and texts[1] == alone
