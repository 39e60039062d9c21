"""Choosing the next token from the model's logits.

The filters run in llama.cpp's default order, so that the same options give the
same kind of text in both: repetition penalty -> top-k -> top-p -> min-p ->
temperature -> draw. Top-p and min-p therefore judge the untempered
distribution; temperature only reshapes what survives them.

Only the top-k candidates are ever sorted (argpartition picks them), or without
top-k a prefix just long enough for top-p and min-p. The engine samples between
two steps on its own thread, after a step has pushed the interpreter out of the
caches, so each numpy call costs several times what it does warm (code fetched from
memory again), and each whole-vocabulary pass counts: greedy is one argmax, a draw over
the whole vocabulary sums it in blocks and scans one block, the candidates of top-k
come from the logits near the best when enough of them are, and a top-k of up to
FEW_TOP_K filters them on Python floats (docs/perf-journal/2026-12-06-0428-sampling-between-steps.md).

Top-p judges each candidate's share as a float32 weight exp(logit - best), the one an
unfiltered draw uses, over the candidates' float64 total: the float64 exp of every logit
that the total once took was most of a top-p sample's time, and a float32 exp is within
a few parts in 10^8 of it, far finer than any top_p anyone sets. Min-p compares logits.
"""
import bisect
import itertools
import math
from collections.abc import Mapping
from numbers import Integral, Real

import numpy as np


def _check_real(name, value, low, high, low_inclusive, high_inclusive):
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    too_low = value < low if low_inclusive else value <= low
    too_high = value > high if high_inclusive else value >= high
    if too_low or too_high:
        interval = (("[" if low_inclusive else "(") + f"{low}, {high}"
                    + ("]" if high_inclusive else ")"))
        raise ValueError(f"{name}: expected a value in {interval}, got {value!r}")
    return float(value)


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
    return int(value)


# OpenAI's bounds of a logit_bias value: -100 bans a token in practice, +100 forces it
LOGIT_BIAS_LIMIT = 100.0


def check_logit_bias(bias, n_vocab=None):
    """OpenAI's ``logit_bias`` {token id: bias} as (ids, biases): int64 ids in ascending order
    and their float32 biases, each in [-100, 100]; None for None or {}. A key is an id or its
    decimal text (JSON's object keys are strings). ``n_vocab``: ids from here on are refused.
    Raises ValueError naming logit_bias."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias: expected an object {{token id: bias}}, got {type(bias).__name__}")
    pairs = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        elif isinstance(key, Integral) and not isinstance(key, bool) and key >= 0:
            token = int(key)
        else:
            raise ValueError(f"logit_bias: key {key!r} is not a token id (an integer >= 0)")
        if n_vocab is not None and token >= n_vocab:
            raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (0..{n_vocab - 1})")
        if token in pairs:
            raise ValueError(f"logit_bias: token id {token} is given twice")
        pairs[token] = _check_real(f"logit_bias[{key!r}]", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, True, True)
    if not pairs:
        return None
    ids = np.array(sorted(pairs), dtype=np.int64)
    return ids, np.array([pairs[i] for i in ids.tolist()], dtype=np.float32)


class Sampler:
    """Draws token ids from logits; one instance per generation (it owns the random state).

    temperature: 0 picks the most likely token (greedy); higher flattens the distribution.
    top_k: keep the k most likely tokens (0 keeps all).
    top_p: keep the most likely tokens whose probabilities add up to top_p (1 keeps all).
    min_p: drop tokens less likely than min_p times the most likely one (0 keeps all).
    repeat_penalty: make the ids among the last repeat_last_n of the history less
        likely (1 leaves them alone): positive logits are divided by it, negative
        ones multiplied.
    presence_penalty, frequency_penalty: OpenAI's, over the same window: subtract
        presence_penalty from the logit of every id that occurs in it, and
        frequency_penalty times the number of times it occurs (0 leaves them alone;
        negative values favour repeats).
    seed: the same seed gives the same draws; None draws a fresh seed.
    logit_bias: OpenAI's {token id: bias in [-100, 100]}, added to those logits before
        everything else (check_logit_bias; ``n_vocab`` bounds its ids): one sparse add of
        len(logit_bias) values per draw, in place.
    """

    def __init__(self, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                 repeat_last_n=64, seed=None, presence_penalty=0.0, frequency_penalty=0.0,
                 logit_bias=None, n_vocab=None):
        self.temperature = _check_real("temperature", temperature, 0.0, math.inf, True, False)
        self.top_k = _check_count("top_k", top_k)
        self.top_p = _check_real("top_p", top_p, 0.0, 1.0, False, True)
        self.min_p = _check_real("min_p", min_p, 0.0, 1.0, True, False)
        self.repeat_penalty = _check_real("repeat_penalty", repeat_penalty, 0.0, math.inf,
                                          False, False)
        self.repeat_last_n = _check_count("repeat_last_n", repeat_last_n)
        self.presence_penalty = _check_real("presence_penalty", presence_penalty, -2.0, 2.0, True, True)
        self.frequency_penalty = _check_real("frequency_penalty", frequency_penalty, -2.0, 2.0, True, True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)
                                 or seed < 0):
            raise ValueError(f"seed: expected None or an integer >= 0, got {seed!r}")
        self._bias = check_logit_bias(logit_bias, n_vocab)      # (ids, biases) or None
        self._rng = np.random.default_rng(seed)

    def redraw_is_exact(self, vocab_size):
        """True when a draw from the whole distribution, kept if a grammar allows it and else
        replaced by a draw from the masked one, is a draw from the masked distribution
        (rejection sampling): greedy, or temperature alone (top-k, top-p and min-p would filter
        the whole distribution, not the masked one), and no logit_bias (added in place, it
        would be added twice)."""
        return self._bias is None and (self.temperature == 0.0 or not self._filters_anything(vocab_size))

    def sample(self, logits, history=()):
        """The next token id, given the logits over the vocabulary and the ids so far. With a
        logit_bias, float32 ``logits`` get it added in place (the engine's row is its own, and
        its logprobs then describe the biased distribution); pass a copy to keep them."""
        logits = self._biased(logits)
        if self.temperature == 0.0:
            return self._greedy(logits, history)
        if not self._filters_anything(np.size(logits)):
            return self._sample_unfiltered(*_checked(logits), history)
        if self._few_top_k(np.size(logits)):
            logits, peak = _checked(logits)
            if self._penalizes(history):
                logits, peak = self._penalize_repeats(logits, history), None
            ids, probabilities = self._top_k_filtered(logits, peak)
            if len(ids) == 1:
                return ids[0]
            cumulative = list(itertools.accumulate(probabilities))
            u = self._rng.random() * cumulative[-1]
            return ids[min(bisect.bisect_right(cumulative, u), len(ids) - 1)]
        ids, probabilities = self._distribution(logits, history)
        if ids.size == 1:
            return int(ids[0])
        cumulative = np.cumsum(probabilities)
        u = self._rng.random() * cumulative[-1]
        pick = min(int(np.searchsorted(cumulative, u, side="right")), ids.size - 1)
        return int(ids[pick])

    def _greedy(self, logits, history):
        """The most likely id after the penalties: without them one argmax, which also finds
        a NaN or +inf (argmax stops at the first NaN; +inf beats every finite logit)."""
        logits = _as_logits(logits)
        if self._penalizes(history):
            return int(np.argmax(self._penalize_repeats(_checked_logits(logits), history)))
        best = int(np.argmax(logits))
        _check_peak(logits[best])
        return best

    def _sample_unfiltered(self, logits, peak, history):
        """Draw from softmax(logits / T) over the whole vocabulary (the server's default,
        temperature only): float32 weights, float64 sums, so no id's share is lost to
        rounding. ``peak``: the logits' maximum."""
        if self._penalizes(history):
            logits = self._penalize_repeats(logits, history)
            peak = np.max(logits)
        scale = 1.0 / self.temperature
        if not scale < _FLOAT32_MAX:           # a temperature this small leaves only the best
            return int(np.argmax(logits))
        return _draw(_weights(logits, peak, scale), self._rng.random())

    def _biased(self, logits):
        """``logits`` with the logit_bias added in place (as float32), or as given without one."""
        if self._bias is None:
            return logits
        logits = _as_logits(logits)
        ids, biases = self._bias
        if ids[-1] >= logits.size:
            raise ValueError(f"logit_bias: token id {int(ids[-1])} is outside the vocabulary "
                             f"(0..{logits.size - 1})")
        logits[ids] += biases               # -inf (a banned token) stays -inf
        return logits

    def distribution(self, logits, history=()):
        """(ids, probabilities) that `sample` draws from: what every filter kept,
        reweighted by the temperature. Without filters the ids are the whole vocabulary.
        A logit_bias is added to ``logits`` in place, as `sample` does."""
        return self._distribution(self._biased(logits), history)

    def _distribution(self, logits, history):
        logits, peak = _checked(logits)
        if self._penalizes(history):
            logits = self._penalize_repeats(logits, history)
            peak = np.max(logits)
        if self.temperature == 0.0:
            return np.array([np.argmax(logits)]), np.ones(1)
        if not self._filters_anything(logits.size):
            return np.arange(logits.size), self._tempered(logits.astype(np.float64))
        if self._few_top_k(logits.size):
            ids, probabilities = self._top_k_filtered(logits, peak)
            return np.array(ids, dtype=np.int64), np.array(probabilities)
        ids, sorted_logits, shares = self._sorted_candidates(logits, peak)
        keep = min(self._top_p_count(shares, sorted_logits.size), self._min_p_count(sorted_logits))
        return ids[:keep], self._tempered(sorted_logits[:keep])

    def _few_top_k(self, vocab_size):
        return 0 < self.top_k <= FEW_TOP_K and self.top_k < vocab_size

    def _top_k_filtered(self, logits, peak=None):
        """distribution()'s (ids, probabilities) for a top-k of at most FEW_TOP_K, as lists:
        past picking the candidates, the same steps on Python floats (float64, as numpy's),
        summed in order. ``peak``: the logits' maximum, if known."""
        peak = np.max(logits) if peak is None else peak
        ids = _largest(logits, self.top_k, peak)
        values = logits[ids].tolist()
        order = sorted(range(len(values)), key=values.__getitem__, reverse=True)   # stable, as argsort's
        ids = ids.tolist()
        ids, values = [ids[i] for i in order], [values[i] for i in order]
        best = values[0]
        keep = len(values)
        if self.top_p < 1.0:
            # relative to every candidate; the token that carries the sum over top_p is kept too
            weights = _weights(logits[ids], peak).tolist()
            reach = self.top_p * sum(weights)
            cumulative = 0.0
            for i, w in enumerate(weights):
                cumulative += w
                if cumulative >= reach:
                    keep = i + 1
                    break
        if self.min_p > 0.0:
            floor = best + math.log(self.min_p)
            keep = min(keep, max(1, sum(v >= floor for v in values)))
        weights = [math.exp((v - best) / self.temperature) for v in values[:keep]]
        total = sum(weights)
        return ids[:keep], [w / total for w in weights]

    def _filters_anything(self, vocab_size):
        return 0 < self.top_k < vocab_size or self.top_p < 1.0 or self.min_p > 0.0

    def _penalizes(self, history):
        return ((self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)
                and self.repeat_last_n > 0 and len(history) > 0)

    def _penalize_repeats(self, logits, history):
        if not self._penalizes(history):
            return logits
        recent = np.asarray(history[-self.repeat_last_n:], dtype=np.int64)
        recent, counts = np.unique(recent[(recent >= 0) & (recent < logits.size)], return_counts=True)
        penalized = logits.copy()
        seen = penalized[recent].astype(np.float64)
        with np.errstate(over="ignore"):        # a huge penalty: pushed to the far end, still finite
            changed = np.where(seen > 0, seen / self.repeat_penalty, seen * self.repeat_penalty)
            changed = changed - self.presence_penalty - self.frequency_penalty * counts
        penalized[recent] = np.clip(changed, -_FLOAT32_MAX, _FLOAT32_MAX)
        return penalized

    # Top-p and min-p each keep a prefix of the candidates sorted most likely first.

    def _sorted_candidates(self, logits, peak):
        """(ids, float64 logits) of the candidates most likely first, and top-p's shares of
        them (float64, relative to every candidate; None without top-p).

        Without top-k only a prefix long enough for top-p or min-p to stop inside
        it is sorted: a few hundred ids instead of the whole vocabulary. ``peak``: the
        logits' maximum.
        """
        if 0 < self.top_k < logits.size:
            ids, sorted_logits = _sorted_by_logit(_largest(logits, self.top_k, peak), logits)
            return ids, sorted_logits, self._shares(logits[ids], peak)
        # top-p's shares need every weight's total; min-p alone needs no weight
        weights = _weights(logits, peak) if self.top_p < 1.0 else None
        total = float(np.sum(weights, dtype=np.float64)) if weights is not None else None
        count = _FIRST_PREFIX
        while count < logits.size:
            ids, sorted_logits = _sorted_by_logit(_largest(logits, count, peak), logits)
            shares = _share(weights, ids, total)
            if self._decided_within(sorted_logits, shares):
                return ids, sorted_logits, shares
            count *= 8
        ids, sorted_logits = _sorted_by_logit(np.arange(logits.size), logits)
        return ids, sorted_logits, _share(weights, ids, total)

    def _shares(self, candidate_logits, peak):
        """Top-p's float64 share of each candidate among them (None without top-p)."""
        if self.top_p >= 1.0:
            return None
        weights = _weights(candidate_logits, peak)
        return weights / np.sum(weights, dtype=np.float64)

    def _decided_within(self, sorted_logits, shares):
        below_min_p = (self.min_p > 0.0
                       and sorted_logits[-1] < sorted_logits[0] + math.log(self.min_p))
        reaches_top_p = shares is not None and shares.sum() >= self.top_p
        return below_min_p or reaches_top_p

    def _top_p_count(self, shares, size):
        if shares is None:
            return size
        cumulative = np.cumsum(shares)
        # The token that carries the sum over top_p is kept too.
        return min(int(np.searchsorted(cumulative, self.top_p)) + 1, size)

    def _min_p_count(self, sorted_logits):
        if self.min_p <= 0.0:
            return sorted_logits.size
        # p_i >= min_p * p_max, compared as logits so nothing needs normalising.
        floor = sorted_logits[0] + math.log(self.min_p)
        return max(1, int(np.count_nonzero(sorted_logits >= floor)))

    def _tempered(self, candidate_logits):
        """Softmax of the logits at the temperature. The largest is subtracted before the
        division, so a tiny temperature gives 0 and -inf (weights 1 and 0), never inf - inf."""
        with np.errstate(over="ignore"):
            scaled = (candidate_logits - np.max(candidate_logits)) / self.temperature
        weights = np.exp(scaled)
        return weights / weights.sum()


_FLOAT32_MAX = float(np.finfo(np.float32).max)

# A top-k of at most this many runs its filters on Python floats (Sampler._top_k_filtered):
# cold, each numpy call on a few dozen values costs several times its arithmetic.
FEW_TOP_K = 128

# How many of the most likely ids are sorted first when top-k is off.
_FIRST_PREFIX = 256


# A whole-vocabulary draw: float64 sums of blocks of this many weights, then a cumulative
# sum inside the one block the draw falls in (numpy's cumulative sum of every weight into
# float64 took about ten times the block sums).
DRAW_BLOCK = 256


def _draw(weights, u):
    """An index i drawn with probability weights[i] / sum(weights), from u uniform in
    [0, 1): the first i whose cumulative weight exceeds u times the total, so never an
    index of weight 0. Float64 sums of float32 weights >= 0, at least one positive."""
    starts = np.arange(0, weights.size, DRAW_BLOCK)
    cumulative = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))
    target = u * cumulative[-1]
    if target >= cumulative[-1]:           # (u < 1 keeps it below; a guard all the same)
        target = np.nextafter(cumulative[-1], 0.0)
    block = int(np.searchsorted(cumulative, target, side="right"))
    # cumulative[block] > target: the block holds weight, and the draw falls in it
    within = weights[starts[block]:starts[block] + DRAW_BLOCK]
    inner = np.cumsum(within, dtype=np.float64)
    i = int(np.searchsorted(inner, target - (cumulative[block - 1] if block else 0.0), side="right"))
    if i >= within.size:                   # the block's two sums differ in their last bits
        i = int(np.flatnonzero(within)[-1])
    return int(starts[block]) + i


# The candidates of top-k (or of the sorted prefix) come from the logits within this much
# of the best, when at least the count wanted and at most a quarter of the vocabulary are:
# one comparison pass and a small argpartition instead of an argpartition of everything.
# (SmolLM2's 40th best logit sits a few to a dozen below its best.)
NEAR_BEST = (8.0, 16.0)


def _largest(logits, count, peak=None):
    """Ids of the `count` largest logits, in no particular order (``peak``: their maximum)."""
    if peak is not None and count * 4 < logits.size:
        for gap in NEAR_BEST:
            near = logits >= peak - gap
            found = int(np.count_nonzero(near))
            if found >= count:             # every one of the `count` largest is near the best
                if found * 4 <= logits.size:
                    ids = np.flatnonzero(near)
                    return ids[np.argpartition(logits[ids], found - count)[-count:]]
                break
    return np.argpartition(logits, logits.size - count)[-count:]


def _sorted_by_logit(ids, logits):
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    return ids, logits[ids].astype(np.float64)


def _share(weights, ids, total):
    """float64 weights[ids] / total (None without weights)."""
    return None if weights is None else weights[ids].astype(np.float64) / total


def _weights(logits, peak, scale=1.0):
    """float32 exp((logit - peak) * scale): the best's weight is 1, those far below it 0
    (``scale``: 1 / temperature, below float32's maximum; 1 multiplies nothing)."""
    with np.errstate(over="ignore", under="ignore"):    # far below the best: -inf, a weight of 0
        shifted = logits - np.float32(peak)
        if scale != 1.0:
            shifted *= np.float32(scale)
        return np.exp(shifted, out=shifted)


def _as_logits(logits):
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits: expected a non-empty 1-D array, got shape {logits.shape}")
    if logits.dtype != np.float32:
        logits = logits.astype(np.float32)
    return logits


def _check_peak(peak):
    """-inf marks a banned token; NaN or +inf mean the forward pass went wrong. One pass
    when all is well: the maximum (and argmax's pick) is NaN if any logit is, +inf if any is."""
    peak = float(peak)                  # (math on a float: no ufunc call, see the module's doc)
    if not math.isfinite(peak):
        if math.isnan(peak) or peak > 0:
            raise ValueError("logits: contain NaN or +inf")
        raise ValueError("logits: every token is -inf")


def _checked(logits):
    """(logits as float32, their maximum), the maximum checked."""
    logits = _as_logits(logits)
    peak = np.max(logits)
    _check_peak(peak)
    return logits, peak


def _checked_logits(logits):
    return _checked(logits)[0]
