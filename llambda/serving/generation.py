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


def stream(completion, stats=None):
    """Yield the text pieces of an engine Completion as they come; fill ``stats`` at the end.
    Leaving early (break, an exception, Ctrl-C) cancels the sequence."""
    read_to_the_end = False
    try:
        for event in completion:
            if event.text:
                yield event.text
        read_to_the_end = True
    finally:
        if not completion.done:
            completion.cancel()
            completion.wait()
        if stats is not None:
            fill_stats(stats, completion, interrupted=not read_to_the_end)


def fill_stats(stats, c, interrupted=False):
    stats.prompt_tokens = c.prompt_tokens
    stats.cached_tokens = c.cached_tokens
    stats.prompt_ids = c.tokens[:c.prompt_tokens]
    stats.ids = list(c.ids)
    stats.generated_tokens = c.completion_tokens
    # left early (Ctrl-C, the caller's close()): "interrupted", as the CLI says it
    stats.stop_reason = "interrupted" if interrupted or c.stop_reason in ("cancelled", None) else c.stop_reason
    if c.t_first is not None:
        stats.first_token_s = c.t_first - c.t_submit
        stats.prefill_s = c.t_first - (c.t_start or c.t_submit)
        stats.decode_s = (c.t_end or c.t_first) - c.t_first
