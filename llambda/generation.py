"""The decode loop: sample, stop on end-of-generation / stop strings / max tokens, stream text."""
import time
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Timings of one generate call (seconds), as the CLI prints them."""
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose K/V were already in the cache
    prefill_s: float = 0.0
    first_token_s: float = 0.0      # from the call to the first sampled token
    generated_tokens: int = 0
    decode_s: float = 0.0
    stop_reason: str = ""
    prompt_ids: list = field(default_factory=list)
    ids: list = field(default_factory=list)

    @property
    def prefill_tok_s(self):
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self):
        # the first generated token comes from the prefill logits: decode steps = tokens - 1
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self):
        return dict(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                    generated_tokens=self.generated_tokens, prefill_s=self.prefill_s,
                    prefill_tok_s=self.prefill_tok_s, time_to_first_token_s=self.first_token_s,
                    decode_s=self.decode_s, decode_tok_s=self.decode_tok_s, stop_reason=self.stop_reason)


class StopStrings:
    """Streams text but holds back any tail that could still become a stop string."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = False

    def feed(self, text):
        """Returns the text safe to emit now; sets ``hit`` when a stop string completed."""
        self.pending += text
        for s in self.stops:
            at = self.pending.find(s)
            if at >= 0:
                self.hit = True
                out, self.pending = self.pending[:at], ""
                return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self):
        out, self.pending = self.pending, ""
        return out


def generate(model, prompt_ids, sampler, max_tokens, stops=(), stats=None, ignore_eos=False):
    """Yield text pieces of the continuation of ``prompt_ids`` (decoded, UTF-8 complete)."""
    stats = stats if stats is not None else Stats()
    tok = model.tokenizer
    t0 = time.perf_counter()
    logits = model.evaluate(prompt_ids, stats)
    stats.prefill_s = time.perf_counter() - t0
    history = list(prompt_ids)
    decoder = tok.streaming_decoder()
    stopper = StopStrings(stops)
    # until a rule below ends the loop: left by Ctrl-C or by the caller's close(), it stays
    stats.stop_reason = "interrupted"
    t_decode = None
    for i in range(max_tokens):
        token = sampler.sample(logits, history)
        if i == 0:
            stats.first_token_s = time.perf_counter() - t0
            t_decode = time.perf_counter()
        if token in tok.eog_ids and not ignore_eos:
            stats.stop_reason = "eos"
            break
        history.append(token)
        stats.ids.append(token)
        stats.generated_tokens += 1
        piece = stopper.feed(decoder.feed(token))
        if piece:
            yield piece
        if stopper.hit:
            stats.stop_reason = "stop_string"
            break
        if i + 1 == max_tokens:
            stats.stop_reason = "max_tokens"
            break
        if model.position >= model.n_ctx:
            stats.stop_reason = "context_full"
            break
        logits = model.evaluate(history, stats=None)
    else:
        stats.stop_reason = "max_tokens"      # max_tokens == 0
    if t_decode is not None:
        stats.decode_s = time.perf_counter() - t_decode
    if not stopper.hit:
        rest = stopper.feed(decoder.flush()) + stopper.flush()
        if rest:
            yield rest
