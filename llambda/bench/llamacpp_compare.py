"""llambda beside llama.cpp on a real GGUF: the checks issue 7 sets for real files.

For one prompt:
1. the prompt's token ids equal llama.cpp's, both with special tokens added and
   parsed (as a chat prompt is fed) and with neither (plain text);
2. llama.cpp decodes greedily for `steps` tokens; llambda is teacher-forced
   along that path (one prefill of prompt + path) and its argmax must equal
   llama.cpp's token at every step where llama.cpp's top-2 margin is clear
   (at least `margin` logits); below it the two may honestly differ;
3. KL(llama.cpp || llambda) of the next-token distribution at the prompt's end
   is at most `kl_max` nats.

llama.cpp runs through llama-cpp-python (optional: `pip install llama-cpp-python`),
with flash attention and its default F16 K/V cache, as a user would run it.
tools/compare_llamacpp.py is the command line; tests/model/test_real_files.py runs the
same checks on whatever real files are present.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llambda.errors import UserError

__all__ = ["DEFAULT_PROMPTS", "DEFAULT_MARGIN", "DEFAULT_KL_MAX", "DEFAULT_STEPS", "Pair", "check_recorded", "record_prompt",
           "PromptReport", "Step", "compare_prompt", "format_report", "kl_divergence"]

DEFAULT_PROMPTS = (
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Ünïcödé, emoji 🦙 and numbers 12345.678: ",
)
# Two implementations may pick different tokens where llama.cpp's top two are
# closer than what their differences (activation quantization, F16 K/V) move
# those logits by. One logit (a factor e between the two probabilities) is above
# every gap at which llambda and llama.cpp were seen to differ on real files.
DEFAULT_MARGIN = 1.0
DEFAULT_KL_MAX = 0.05
DEFAULT_STEPS = 16


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats for each row of two logit arrays."""
    lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


class Pair:
    """The same GGUF loaded in llambda and in llama.cpp (close() releases both).

    The context is sized to the prompts: llama-cpp-python keeps a float32 logits
    row per context position (1 GB at 1024 positions of Gemma 3's 262,144-token
    vocabulary)."""

    def __init__(self, gguf_path, prompts, *, steps: int = DEFAULT_STEPS, threads: int | None = None,
                 progress: bool = False):
        try:
            import llama_cpp
        except ImportError:
            raise UserError("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
        import llambda
        if steps < 1:
            raise UserError(f"--steps must be >= 1, got {steps}")
        if not prompts:
            raise UserError("no prompt given")
        self.path = str(gguf_path)
        self.model = llambda.load(self.path, n_ctx=64, threads=threads, progress=progress)
        longest = max(len(self.model.tokenize(p)) for p in prompts)
        self.n_ctx = -(-(longest + steps + 8) // 64) * 64
        if self.n_ctx > 64:
            self.model.close()
            self.model = llambda.load(self.path, n_ctx=self.n_ctx, threads=threads, progress=False)
        threads = self.model.net.threads        # the same count on both sides
        self.llm = llama_cpp.Llama(model_path=self.path, n_ctx=self.n_ctx, n_batch=512,
                                   logits_all=True, flash_attn=True, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def close(self):
        self.llm.close()
        self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Step:
    position: int            # position of the logits row in the teacher-forced sequence
    token: int               # llama.cpp's greedy token from that row
    margin: float            # llama.cpp's top-1 minus top-2 logit
    ours: int                # llambda's argmax of the same row
    kl: float                # KL(llama.cpp || llambda) of that row
    max_abs: float           # max |logit difference| over the vocabulary
    clear: bool              # margin >= the required margin: the argmax must agree

    @property
    def ok(self) -> bool:
        return not self.clear or self.ours == self.token


@dataclass
class PromptReport:
    prompt: str
    ids_ours: dict           # variant -> llambda's ids
    ids_llamacpp: dict       # variant -> llama.cpp's ids
    steps: list[Step]
    margin: float
    kl_max: float
    vocab_note: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def kl_prompt_end(self) -> float:
        return self.steps[0].kl

    @property
    def ok(self) -> bool:
        return not self.failures


def compare_prompt(pair: Pair, prompt: str, *, steps: int = DEFAULT_STEPS,
                   margin: float = DEFAULT_MARGIN, kl_max: float = DEFAULT_KL_MAX) -> PromptReport:
    """Run the three checks on one prompt; the report lists every failure."""
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    model, llm = pair.model, pair.llm
    data = prompt.encode("utf-8")
    ids_ours = {"special": model.tokenize(prompt, add_special=True, parse_special=True),
                "plain": model.tokenize(prompt, add_special=False, parse_special=False)}
    ids_cpp = {"special": llm.tokenize(data, add_bos=True, special=True),
               "plain": llm.tokenize(data, add_bos=False, special=False)}
    failures = [f"token ids ({variant}) differ from llama.cpp's at index "
                f"{_first_difference(ids_ours[variant], ids_cpp[variant])}"
                for variant in ids_ours if list(ids_ours[variant]) != list(ids_cpp[variant])]

    prompt_ids = list(ids_cpp["special"])   # llama.cpp's ids drive both sides
    if not prompt_ids:
        raise UserError("the prompt has no tokens")
    if len(prompt_ids) + steps > pair.n_ctx:
        raise UserError(f"prompt ({len(prompt_ids)} tokens) + {steps} steps exceed the context "
                        f"({pair.n_ctx}) the Pair was sized for: pass this prompt to Pair too")
    theirs, path = _llamacpp_greedy(llm, prompt_ids, steps)
    ours = np.asarray(model.logits(prompt_ids + path[:-1]), dtype=np.float32)[len(prompt_ids) - 1:]
    vocab_note = ""
    if ours.shape[1] != theirs.shape[1]:
        # Padded embeddings (Qwen): rows past the tokenizer's vocabulary are never sampled.
        width = min(ours.shape[1], theirs.shape[1])
        vocab_note = f"compared the first {width} logits (llambda {ours.shape[1]}, llama.cpp {theirs.shape[1]})"
        ours, theirs = ours[:, :width], theirs[:, :width]

    kls = kl_divergence(theirs, ours)
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    report_steps = []
    for i in range(len(path)):
        gap = float(top2[i, 1] - top2[i, 0])
        report_steps.append(Step(position=len(prompt_ids) - 1 + i, token=path[i], margin=gap,
                                 ours=int(ours[i].argmax()), kl=float(kls[i]),
                                 max_abs=float(np.abs(ours[i] - theirs[i]).max()),
                                 clear=gap >= margin))
    bad = [s for s in report_steps if not s.ok]
    if bad:
        failures.append(f"argmax differs from llama.cpp's at {len(bad)} step(s) with a clear margin "
                        f"(>= {margin}): positions {[s.position for s in bad]}")
    if not kls[0] <= kl_max:
        failures.append(f"KL(llama.cpp || llambda) at the prompt end is {kls[0]:.4f} > {kl_max}")
    return PromptReport(prompt=prompt, ids_ours=ids_ours, ids_llamacpp=ids_cpp, steps=report_steps,
                        margin=margin, kl_max=kl_max, vocab_note=vocab_note, failures=failures)


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _llamacpp_greedy(llm, prompt_ids, steps):
    """llama.cpp's logits rows [steps, vocab] from the prompt's last position on, and its
    greedy tokens (each the argmax of its row)."""
    llm.reset()
    llm.eval(prompt_ids)
    path = [int(np.argmax(llm.scores[len(prompt_ids) - 1]))]
    while len(path) < steps:
        llm.eval([path[-1]])
        path.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    rows = np.array(llm.scores[len(prompt_ids) - 1:len(prompt_ids) - 1 + steps], dtype=np.float32)
    return rows, path


def format_report(report: PromptReport, detokenize=None) -> str:
    """A table of the teacher-forced steps, then the verdict of each check."""
    def piece(token):
        return repr(detokenize([token]))[1:-1][:12] if detokenize else str(token)

    lines = [f"prompt {report.prompt!r}",
             f"  prompt ids: {len(report.ids_llamacpp['special'])} tokens"]
    lines.append(f"  {'pos':>5} {'llama.cpp':>14} {'margin':>7} {'llambda':>14} {'KL':>9} {'max|d|':>7}  check")
    for s in report.steps:
        verdict = ("ok" if s.ours == s.token else "FAIL") if s.clear else \
                  ("ok" if s.ours == s.token else "near tie")
        lines.append(f"  {s.position:>5} {piece(s.token):>14} {s.margin:7.3f} {piece(s.ours):>14} "
                     f"{s.kl:9.2e} {s.max_abs:7.3f}  {verdict}")
    if report.vocab_note:
        lines.append("  " + report.vocab_note)
    ids_ok = all(report.ids_ours[v] == list(report.ids_llamacpp[v]) for v in report.ids_ours)
    clear = [s for s in report.steps if s.clear]
    lines.append(f"  token ids equal llama.cpp's (with and without specials): {'PASS' if ids_ok else 'FAIL'}")
    lines.append(f"  argmax agrees at {sum(s.ours == s.token for s in clear)}/{len(clear)} steps with margin "
                 f">= {report.margin} ({sum(s.ours == s.token for s in report.steps)}/{len(report.steps)} "
                 f"overall): {'PASS' if all(s.ok for s in report.steps) else 'FAIL'}")
    lines.append(f"  KL at the prompt end {report.kl_prompt_end:.2e} <= {report.kl_max}: "
                 f"{'PASS' if report.kl_prompt_end <= report.kl_max else 'FAIL'}")
    for failure in report.failures:
        lines.append("  FAILED: " + failure)
    return "\n".join(lines)


# -- llama.cpp's side recorded once, so that make test checks a real file without it --------
RECORD_TOP = 64     # llama.cpp's largest logits kept per step (and the log-sum-exp of the row)


def record_prompt(pair: Pair, prompt: str, *, steps: int = DEFAULT_STEPS, top: int = RECORD_TOP) -> dict:
    """llama.cpp's side of compare_prompt as JSON-able data: its token ids, its greedy path and,
    per step, its `top` largest logits with their ids and the log-sum-exp of the whole row
    (a 262,144-token row is 1 MB: the top of it decides every check)."""
    llm = pair.llm
    data = prompt.encode("utf-8")
    ids = {"special": list(llm.tokenize(data, add_bos=True, special=True)),
           "plain": list(llm.tokenize(data, add_bos=False, special=False))}
    rows, path = _llamacpp_greedy(llm, ids["special"], steps)
    order = np.argsort(-rows, axis=-1)[:, :top]
    logits = np.take_along_axis(rows, order, axis=-1)
    peak = rows.max(-1, keepdims=True).astype(np.float64)
    lse = (peak[:, 0] + np.log(np.exp(rows - peak).sum(-1))).tolist()
    return dict(prompt=prompt, ids=ids, path=path, top_ids=order.tolist(),
                top_logits=np.round(logits, 4).tolist(), logsumexp=lse)


def check_recorded(model, record: dict, *, margin: float = DEFAULT_MARGIN,
                   kl_max: float = DEFAULT_KL_MAX) -> PromptReport:
    """compare_prompt's checks against a recording (record_prompt) instead of a live llama.cpp.

    KL is taken over llama.cpp's recorded top tokens plus one bucket for the rest of the
    vocabulary on both sides: grouping outcomes can only lower a KL divergence, so this is
    a lower bound of the full KL that the top tokens dominate."""
    prompt = record["prompt"]
    ids_ours = {"special": model.tokenize(prompt, add_special=True, parse_special=True),
                "plain": model.tokenize(prompt, add_special=False, parse_special=False)}
    ids_cpp = record["ids"]
    failures = [f"token ids ({variant}) differ from llama.cpp's at index "
                f"{_first_difference(ids_ours[variant], ids_cpp[variant])}"
                for variant in ids_ours if list(ids_ours[variant]) != list(ids_cpp[variant])]
    prompt_ids, path = list(ids_cpp["special"]), list(record["path"])
    ours = np.asarray(model.logits(prompt_ids + path[:-1]), dtype=np.float64)[len(prompt_ids) - 1:]
    steps = []
    for i, token in enumerate(path):
        top_ids = np.asarray(record["top_ids"][i])
        lp = np.asarray(record["top_logits"][i], dtype=np.float64) - record["logsumexp"][i]
        lq = ours[i] - ours[i].max()
        lq = lq - np.log(np.exp(lq).sum())
        lq_top = lq[top_ids]
        p_rest = max(1.0 - np.exp(lp).sum(), 0.0)
        q_rest = max(1.0 - np.exp(lq_top).sum(), 1e-300)
        kl = float((np.exp(lp) * (lp - lq_top)).sum() + (p_rest * np.log(p_rest / q_rest) if p_rest > 0 else 0.0))
        gap = float(lp[0] - lp[1])
        steps.append(Step(position=len(prompt_ids) - 1 + i, token=token, margin=gap, ours=int(ours[i].argmax()),
                          kl=kl, max_abs=float(np.abs(ours[i][top_ids] - (lp + record["logsumexp"][i])).max()),
                          clear=gap >= margin))
    bad = [s for s in steps if not s.ok]
    if bad:
        failures.append(f"argmax differs from llama.cpp's at {len(bad)} step(s) with a clear margin "
                        f"(>= {margin}): positions {[s.position for s in bad]}")
    if not steps[0].kl <= kl_max:
        failures.append(f"KL(llama.cpp || llambda) at the prompt end is {steps[0].kl:.4f} > {kl_max}")
    return PromptReport(prompt=prompt, ids_ours=ids_ours, ids_llamacpp=ids_cpp, steps=steps, margin=margin,
                        kl_max=kl_max, vocab_note="KL over llama.cpp's recorded top tokens + the rest",
                        failures=failures)
