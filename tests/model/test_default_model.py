"""The default model (SmolLM2-135M-Instruct Q4_1) through the whole stack."""
import json
import subprocess
import sys

import numpy as np
import pytest

import llambda
from reference_forward import ReferenceModel, reference_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def model(default_gguf):
    return llambda.load(default_gguf, n_ctx=512, progress=False)


def test_greedy_continuation_names_paris(model):
    text = "".join(model.generate("The capital of France is", max_tokens=12, temperature=0))
    assert "Paris" in text, text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_reference(model, default_gguf, prompt):
    """Q4_1 weights x Q8 activations vs the exact float math. Rounding activations to
    int8 blocks moves logits by ~2% of their spread (llama.cpp: the same, measured
    0.9-1.4 logits on these prompts); we allow 5% and require the same top-1 at
    75% of positions or more (near-ties may flip)."""
    ids = model.tokenize(prompt)
    fast = model.logits(ids)
    ref = reference_logits(default_gguf, ids)
    assert np.abs(fast - ref).max() <= LOGIT_TOLERANCE * (ref.max() - ref.min())
    assert (fast.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


LOGIT_TOLERANCE = 0.05


def test_decode_over_a_cached_prefix_equals_prefill(model):
    """Recomputing the last tokens over the cached prefix (decode, m = 1) gives the prefill's
    logits bit for bit (issue 8: the AVX2 GEMV and the VNNI GEMM sum a row alike)."""
    ids = model.tokenize("The capital of France is Paris. The capital of Germany is")
    full = model.logits(ids)
    for i in range(len(ids) - 3, len(ids) + 1):
        np.testing.assert_array_equal(model.evaluate(ids[:i]), full[i - 1], err_msg=f"position {i - 1}")


# Where the reference's best leads its runner-up by more than this share of the logit spread,
# llambda must choose it: int8 activation rounding moves llambda's logits by a fraction of a
# logit, enough to flip a closer race (which of them flip then depends on any change in
# summation order), never a decisive one.
DECISIVE = 0.02


def _check_greedy_ids(gguf, prompt_ids, ids):
    """Each id llambda chose greedily is the reference's argmax, or, where it is not, the
    reference itself rates it within the logit tolerance of its own best (a near-tie
    that int8 activation rounding may flip), and never where the reference's choice is
    decisive. The reference follows llambda's ids, so one near-tie does not derail the rest.
    Returns how many steps were decisive."""
    ref = ReferenceModel(gguf)
    logits = ref.prefill(prompt_ids)[-1]
    decisive = 0
    for step, token in enumerate(ids):
        best, runner_up = np.argsort(logits)[::-1][:2]
        spread = float(logits.max() - logits.min())
        assert token == best or logits[best] - logits[token] <= LOGIT_TOLERANCE * spread, \
            f"llambda chose {token}, the reference {best} by {logits[best] - logits[token]:.3f}"
        if logits[best] - logits[runner_up] > DECISIVE * spread:
            assert token == best, (f"step {step}: llambda chose {token}, the reference's {best} leads by "
                                   f"{logits[best] - logits[runner_up]:.3f} of a spread of {spread:.1f}")
            decisive += 1
        logits = ref.step(token)
    return decisive


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cli_json_greedy_ids_equal_reference(default_gguf, prompt):
    n = 8
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "run", "--model", default_gguf, "--prompt",
                           prompt, "--max-tokens", str(n), "--temperature", "0", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] and len(out["ids"]) <= n
    decisive = _check_greedy_ids(default_gguf, out["prompt_ids"], out["ids"])
    assert decisive >= len(out["ids"]) // 2          # the check compared something


def test_same_seed_same_text_different_seed_differs(model):
    def sample(seed):
        return "".join(model.generate("Once upon a time", max_tokens=24, temperature=1.0, seed=seed))
    assert sample(1) == sample(1)
    assert len({sample(s) for s in (1, 2, 3)}) > 1
