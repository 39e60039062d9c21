"""Sampler tests: greedy paths exactly, each filter statistically with fixed seeds."""
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llambda.serving import sampling
from llambda.serving.sampling import DRAW_BLOCK, NEAR_BEST, Sampler

VOCAB = 49152
NO_FILTERS = dict(top_k=0, top_p=1.0, min_p=0.0)


def random_logits(seed, size=VOCAB, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(size) * scale).astype(np.float32)


def logits_of(probabilities):
    """Logits whose softmax is `probabilities` (zero -> -inf, never drawn)."""
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probabilities, dtype=np.float64)).astype(np.float32)


def frequencies(sampler, logits, draws=4000, history=()):
    counts = Counter(sampler.sample(logits, history) for _ in range(draws))
    return {token: n / draws for token, n in counts.items()}


# ---------------------------------------------------------------------------
# Deterministic paths
# ---------------------------------------------------------------------------

@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 100, VOCAB]))
def test_temperature_zero_is_argmax(seed, size):
    logits = random_logits(seed, size)
    assert Sampler(temperature=0, seed=seed).sample(logits) == int(np.argmax(logits))


@given(st.integers(0, 2**32 - 1), st.sampled_from([0.1, 0.8, 1.5, 10.0]))
def test_top_k_one_is_greedy(seed, temperature):
    logits = random_logits(seed)
    sampler = Sampler(temperature=temperature, top_k=1, seed=seed)
    assert sampler.sample(logits) == int(np.argmax(logits))


def test_same_seed_same_sequence():
    logits = random_logits(0, scale=1.0)
    first = [Sampler(seed=7).sample(logits) for _ in range(3)]
    a, b = Sampler(seed=7), Sampler(seed=7)
    run_a = [a.sample(logits) for _ in range(50)]
    run_b = [b.sample(logits) for _ in range(50)]
    assert run_a == run_b
    assert first == [run_a[0]] * 3
    other = Sampler(seed=8)
    assert [other.sample(logits) for _ in range(50)] != run_a


def test_input_logits_are_not_modified():
    logits = random_logits(1)
    before = logits.copy()
    Sampler(repeat_penalty=1.3, seed=0).sample(logits, history=list(range(100)))
    np.testing.assert_array_equal(logits, before)


# ---------------------------------------------------------------------------
# The filtered distribution against a plain full-sort reference
# ---------------------------------------------------------------------------

def reference_distribution(logits, temperature, top_k, top_p, min_p):
    """llama.cpp's chain written from its description, sorting the whole vocabulary. Top-p's
    shares are float32 weights exp(logit - best) over their float64 total (the sampler's
    definition, sampling.py); min-p compares logits: p >= min_p * p_max as
    logit >= best + log(min_p)."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    if 0 < top_k < logits.size:
        order = order[:top_k]
    kept = logits[order]
    p = np.exp(kept - kept.max()).astype(np.float64)        # float32 exp, then float64
    p /= p.sum()
    kept = kept.astype(np.float64)
    if top_p < 1.0:
        reach = next(i for i, c in enumerate(np.cumsum(p)) if c >= top_p or i == p.size - 1)
        order, kept = order[:reach + 1], kept[:reach + 1]
    if min_p > 0.0:
        survive = kept >= kept.max() + math.log(min_p)
        order, kept = order[survive], kept[survive]
    weights = np.exp((kept - kept.max()) / temperature)
    return order, weights / weights.sum()


def zipf_like_logits(seed, size, steepness):
    """Distinct logits falling off like a language model's: -steepness·log(1 + rank)."""
    rank = np.random.default_rng(seed).permutation(size)
    return (-steepness * np.log1p(rank)).astype(np.float32)


@given(seed=st.integers(0, 2**32 - 1), size=st.sampled_from([1, 2, 7, 300, 5000, VOCAB]),
       steepness=st.sampled_from([0.1, 0.5, 1.0, 3.0]),
       temperature=st.sampled_from([0.3, 1.0, 2.5]), top_k=st.sampled_from([0, 1, 40, 1000]),
       top_p=st.sampled_from([0.05, 0.5, 0.9, 0.95, 1.0]),
       min_p=st.sampled_from([0.0, 0.001, 0.05, 0.5]))
def test_distribution_equals_full_sort_reference(seed, size, steepness, temperature, top_k,
                                                 top_p, min_p):
    logits = zipf_like_logits(seed, size, steepness)
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)
    ids, probabilities = sampler.distribution(logits)
    ref_ids, ref_probabilities = reference_distribution(logits, temperature, top_k, top_p, min_p)
    ours = dict(zip(ids.tolist(), probabilities))
    assert set(ours) == set(ref_ids.tolist())
    # float64 softmax of the same float32 logits, summed in a different order.
    np.testing.assert_allclose([ours[i] for i in ref_ids.tolist()], ref_probabilities,
                               rtol=1e-9, atol=1e-15)


# ---------------------------------------------------------------------------
# Filters, each on a crafted distribution
# ---------------------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


def test_unfiltered_draws_follow_the_softmax():
    # 6000 draws: the standard error of a frequency is <= 0.0065; allow ~5 sigma.
    freq = frequencies(Sampler(temperature=1.0, seed=1, **NO_FILTERS), logits_of(PROBS), 6000)
    for token, p in enumerate(PROBS):
        assert abs(freq.get(token, 0.0) - p) < 0.03


def test_temperature_sharpens_and_flattens():
    logits = logits_of(PROBS)
    cold = frequencies(Sampler(temperature=0.2, seed=2, **NO_FILTERS), logits)
    hot = frequencies(Sampler(temperature=5.0, seed=2, **NO_FILTERS), logits)
    # p ∝ PROBS**(1/T): at T=0.2 the top token has 0.5^5 / Σ p^5 ≈ 0.92.
    expected_cold = 0.5**5 / sum(p**5 for p in PROBS)
    assert abs(cold[0] - expected_cold) < 0.03
    expected_hot = 0.5**0.2 / sum(p**0.2 for p in PROBS)
    assert abs(hot[0] - expected_hot) < 0.03


def test_top_k_keeps_only_the_k_most_likely():
    freq = frequencies(Sampler(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=3),
                       logits_of(PROBS))
    assert set(freq) == {0, 1}
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Cumulative 0.5, 0.8, ...: 0.75 is first reached by token 1, which is kept.
    freq = frequencies(Sampler(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0, seed=4),
                       logits_of(PROBS))
    assert set(freq) == {0, 1}
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_top_p_judges_the_untempered_distribution():
    # llama.cpp applies temperature last: a hot sampler still keeps tokens {0, 1} only.
    freq = frequencies(Sampler(temperature=10.0, top_k=0, top_p=0.75, min_p=0.0, seed=5),
                       logits_of(PROBS))
    assert set(freq) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # min_p 0.2 of p_max 0.5 is 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    freq = frequencies(Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=6),
                       logits_of(PROBS))
    assert set(freq) == {0, 1, 2}
    assert abs(freq[2] - 0.15 / 0.95) < 0.03


def test_banned_tokens_are_never_drawn():
    freq = frequencies(Sampler(temperature=2.0, seed=7, **NO_FILTERS),
                       logits_of([0.0, 0.5, 0.0, 0.5]), 1000)
    assert set(freq) == {1, 3}


# ---------------------------------------------------------------------------
# Repetition penalty
# ---------------------------------------------------------------------------

def test_repeat_penalty_divides_positive_logits():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    greedy = Sampler(temperature=0, repeat_penalty=1.5)
    assert greedy.sample(logits, history=[0]) == 1  # 2.0 / 1.5 < 1.9
    assert greedy.sample(logits, history=[2]) == 0


def test_repeat_penalty_multiplies_negative_logits():
    logits = np.array([-1.0, -1.2, -5.0], dtype=np.float32)
    assert Sampler(temperature=0, repeat_penalty=1.5).sample(logits, history=[0]) == 1


def test_repeat_penalty_only_looks_at_the_last_n_ids():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    sampler = Sampler(temperature=0, repeat_penalty=1.5, repeat_last_n=3)
    assert sampler.sample(logits, history=[0, 2, 2, 2]) == 0
    assert sampler.sample(logits, history=[2, 0, 2, 2]) == 1


def test_repeat_penalty_one_changes_nothing():
    logits = random_logits(9)
    history = np.argsort(logits)[-64:].tolist()
    assert Sampler(temperature=0, repeat_penalty=1.0).sample(logits, history) == int(np.argmax(logits))


# ---------------------------------------------------------------------------
# Bad options and inputs
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("min_p", -0.01), ("min_p", 1.0),
    ("min_p", math.inf), ("repeat_penalty", 0.0), ("repeat_penalty", -1.0),
    ("repeat_penalty", math.inf), ("repeat_last_n", -1), ("seed", -5), ("seed", 1.5),
])
def test_bad_option_is_a_value_error_naming_it(option, value):
    with pytest.raises(ValueError, match=f"^{option}:"):
        Sampler(**{option: value})


@pytest.mark.parametrize("logits", [
    np.array([1.0, np.nan], dtype=np.float32), np.array([1.0, np.inf], dtype=np.float32),
    np.array([-np.inf, -np.inf], dtype=np.float32), np.zeros((2, 3), dtype=np.float32),
    np.zeros(0, dtype=np.float32),
])
@pytest.mark.parametrize("options", [{}, {"temperature": 0}, {"temperature": 0, "repeat_penalty": 1.3},
                                     dict(temperature=1.0, **NO_FILTERS), {"top_k": 0}])
def test_bad_logits_are_a_value_error(logits, options):
    # every path: greedy (one argmax finds NaN and +inf), penalised, unfiltered, filtered
    with pytest.raises(ValueError, match="^logits:"):
        Sampler(seed=0, **options).sample(logits, history=[0])


def test_history_ids_outside_the_vocabulary_are_ignored():
    logits = np.array([2.0, 1.9], dtype=np.float32)
    assert Sampler(temperature=0, repeat_penalty=2.0).sample(logits, history=[-1, 7]) == 0


# ---------------------------------------------------------------------------
# OpenAI's presence and frequency penalties
# ---------------------------------------------------------------------------

def test_presence_penalty_subtracts_once_per_id_seen():
    logits = np.array([2.0, 1.5, 0.0], dtype=np.float32)
    greedy = Sampler(temperature=0, presence_penalty=0.6)
    assert greedy.sample(logits, history=[0, 0, 0]) == 1      # 2.0 - 0.6 < 1.5
    assert Sampler(temperature=0, presence_penalty=0.4).sample(logits, history=[0, 0, 0]) == 0


def test_frequency_penalty_grows_with_the_count():
    logits = np.array([2.0, 1.5, 0.0], dtype=np.float32)
    greedy = Sampler(temperature=0, frequency_penalty=0.2)
    assert greedy.sample(logits, history=[0, 0]) == 0          # 2.0 - 0.4 > 1.5
    assert greedy.sample(logits, history=[0, 0, 0]) == 1       # 2.0 - 0.6 < 1.5


@pytest.mark.parametrize("option", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.5, 2.5, float("nan"), True])
def test_openai_penalties_out_of_range_name_the_option(option, value):
    with pytest.raises(ValueError, match=option):
        Sampler(**{option: value})


# ---------------------------------------------------------------------------
# The fast paths against plain numpy
# ---------------------------------------------------------------------------

def weight_arrays():
    """float32 weights in [0, 1], at least one positive, across 1, DRAW_BLOCK +- 1 and many blocks,
    with runs of zeros (banned tokens) and a wide range of magnitudes."""
    sizes = st.sampled_from([1, 2, DRAW_BLOCK - 1, DRAW_BLOCK, DRAW_BLOCK + 1, 3 * DRAW_BLOCK + 7, VOCAB])

    def build(size, seed, zero_share, spread):
        rng = np.random.default_rng(seed)
        z = rng.standard_normal(size) * spread
        w = np.exp(z - z.max()).astype(np.float32)          # as the sampler's: the largest is 1
        w[rng.random(size) < zero_share] = 0.0
        if not w.any():
            w[rng.integers(size)] = 1.0
        return w
    return st.builds(build, sizes, st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.5, 0.99]),
                     st.sampled_from([0.1, 3.0, 20.0]))


@given(weights=weight_arrays(), u=st.one_of(st.floats(0.0, 1.0, exclude_max=True),
                                            st.sampled_from([0.0, 1.0 - 2.0**-53, 0.5])))
def test_draw_is_the_sequential_cumulative_search(weights, u):
    """_draw sums blocks, then one block: the index a float64 cumulative sum of every weight
    picks (the first whose running sum exceeds u x total), up to the sums' last bits, and
    never a weight of 0."""
    i = sampling._draw(weights, u)
    assert 0 <= i < weights.size and weights[i] > 0
    cumulative = np.cumsum(weights, dtype=np.float64)
    target = u * cumulative[-1]
    slack = 1e-12 * cumulative[-1]
    low = int(np.searchsorted(cumulative, target - slack, side="right"))
    high = int(np.searchsorted(cumulative, target + slack, side="right"))
    assert low <= i <= min(high, weights.size - 1)


def test_draw_at_the_top_of_the_range_skips_trailing_zero_weights():
    # u * total is below the total for every u < 1; the guard for a target at the total
    # (u = 1 here) still draws the last weighted id, not one of the banned ids after it
    weights = np.zeros(3 * DRAW_BLOCK, np.float32)
    weights[:32] = 1.0
    for u in (1.0, 1.0 - 2.0**-53, 0.999999999):
        assert sampling._draw(weights, u) == 31


def test_unfiltered_draws_follow_the_softmax_across_blocks():
    # mass in four blocks far apart, the rest banned: 6000 draws, ~5 sigma as above
    logits = np.full(VOCAB, -np.inf, dtype=np.float32)
    where = [3, DRAW_BLOCK, 100 * DRAW_BLOCK + 17, VOCAB - 1]
    logits[where] = np.log(PROBS).astype(np.float32)
    freq = frequencies(Sampler(temperature=1.0, seed=3, **NO_FILTERS), logits, 6000)
    assert set(freq) <= set(where)
    for token, p in zip(where, PROBS):
        assert abs(freq.get(token, 0.0) - p) < 0.03


@given(seed=st.integers(0, 2**32 - 1), size=st.sampled_from([5, 300, 5000, VOCAB]),
       scale=st.sampled_from([0.3, 3.0, 8.0, 40.0]), count=st.sampled_from([1, 40, 256, 1000]))
def test_largest_are_the_largest(seed, size, scale, count):
    """_largest's candidates near the best (logits within NEAR_BEST of it) or a whole
    argpartition: the same ids as a full sort, whichever it took."""
    logits = (np.random.default_rng(seed).standard_normal(size) * scale).astype(np.float32)
    count = min(count, size)
    ids = sampling._largest(logits, count, np.max(logits))
    assert sorted(ids.tolist()) == sorted(np.argsort(-logits, kind="stable")[:count].tolist())


def test_largest_partitions_only_the_near_candidates_when_they_are_enough(monkeypatch):
    # a peaked distribution: 50 logits near the best, the rest far below
    logits = np.full(VOCAB, -40.0, dtype=np.float32)
    logits[:50] = np.linspace(10.0, 10.0 - NEAR_BEST[0] + 0.5, 50, dtype=np.float32)
    sizes = []
    argpartition = np.argpartition
    monkeypatch.setattr(sampling.np, "argpartition", lambda a, k: sizes.append(a.size) or argpartition(a, k))
    ids = sampling._largest(logits, 40, np.max(logits))
    assert sorted(ids.tolist()) == list(range(40))
    assert sizes == [50]
    sampling._largest(logits, 60, np.max(logits))        # not enough near: the whole vocabulary
    assert sizes == [50, VOCAB]


@given(seed=st.integers(0, 2**32 - 1), top_k=st.sampled_from([2, 40, sampling.FEW_TOP_K]),
       top_p=st.sampled_from([0.5, 0.95, 1.0]), min_p=st.sampled_from([0.0, 0.05]))
def test_few_top_k_draws_what_distribution_gives(seed, top_k, top_p, min_p):
    """sample()'s top-k path on Python floats draws, with the same seed, the id a numpy
    draw from distribution() picks (distribution() is checked against the full sort above)."""
    logits = zipf_like_logits(seed, VOCAB, 0.5)
    options = dict(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p)
    fast, slow = Sampler(seed=seed, **options), Sampler(seed=seed, **options)
    for _ in range(3):
        ids, probabilities = slow.distribution(logits)
        cumulative = np.cumsum(probabilities)
        pick = min(int(np.searchsorted(cumulative, slow._rng.random() * cumulative[-1], side="right")), ids.size - 1)
        assert fast.sample(logits) == int(ids[pick])


def test_min_p_alone_sums_no_probabilities(monkeypatch):
    """Without top-k and top-p, min-p compares logits only: no weight of the vocabulary
    (an exp of every logit, the slowest step of the sampler) is taken."""
    monkeypatch.setattr(sampling, "_weights", lambda *a: pytest.fail("weighed the vocabulary"))
    logits = zipf_like_logits(0, VOCAB, 0.5)
    ids, _ = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05).distribution(logits)
    assert ids.tolist() == reference_distribution(logits, 1.0, 0, 1.0, 0.05)[0].tolist()
