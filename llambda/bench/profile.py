"""Where a token's time goes: every op of the real plan, timed as it runs.

    report = llambda.load().profile(tokens=32)      # or profile_decode(model, tokens=32)
    print(report.table())
    report.as_dict()

Decode steps run through the normal path (``Model.evaluate`` -> the model's
plan on the worker pool), with one difference: the pool runs the executor's
timed twin, which stamps every op on every thread with the time-stamp
counter (runtime/pool.py, codegen/executor.py). From the stamps:

- each row is one kind of op and the kernel it calls (the library symbol, ISA and
  tile in its name: ``tools/regen.py --disasm SYMBOL`` shows its code); the LM
  head's ops are their own rows, told apart by the tag the model records them with.
- an op's time is what it added to thread 0's run of the plan: from the
  previous op's release to its own, barrier wait included. These times add up
  to the native time of the plan exactly, so "% of token" is a true share.
- "wait %" is the part of that time thread 0 spent at the op's barrier,
  waiting for slower threads (the cost of an uneven split, or of a worker
  waking up late).
- each thread's busy time is the sum of its kernels' times.
- achieved GFLOP/s and GB/s divide the op's nominal work (runtime.recorder's
  OpInfo; attention's from the actual position) by its time.

What is not native is overhead: "pool dispatch" is the time inside
``pool.run`` outside the executor (ctypes, waking the workers, and the
Python around the call running on caches the weight stream has just
flushed: ~50 us a token on SmolLM2-135M, where a warm call takes ~3);
"python" is the rest of the wall time of ``evaluate`` (embedding lookup,
cache bookkeeping, the plan lookup). Sampling is not part of it: the
profile decodes greedily, outside the timed calls. The profiler itself adds
about 4 us per plan run to these two rows (measured: ~1 us of PlanTimer
bookkeeping, ~2 us checking the stamp buffer), ~0.15% of a SmolLM2-135M
token; the stamps add ~15 ns an op to the native time (~0.4%). TSC ticks
become seconds by calibration against ``time.perf_counter`` over the whole
profiling run.

The prefill part times whole chunks (128 tokens by default) the same way.
Profiling leaves the model's KV cache empty.
"""
import time
from dataclasses import dataclass, field, asdict
from pathlib import Path

import numpy as np

from llambda.model.forward import HEAD_TAG
from llambda.runtime.pool import read_tsc

WARMUP_STEPS = 2            # untimed decode steps first: plans built, pages touched
PROMPT = "The capital of France is"
HEAD_SUFFIX = " (LM head)"
WAKE_UP = "worker wake-up"


# -- timing the plan runs ---------------------------------------------------------
@dataclass
class PlanRun:
    """One timed run of a plan: what ran, from which position, and its stamps."""
    plan: object                # the runtime.plan.Plan
    ops: list                   # runtime.recorder.OpInfo per op
    m: int                      # tokens in the chunk
    with_head: bool             # the plan ends with the final norm and LM head
    pos0: int                   # position of its first token
    stamps: np.ndarray          # u64 [n_threads][n_ops + 1][2] (codegen/executor.py)
    pool_s: float               # seconds inside pool.run


class PlanTimer:
    """Stands in for a model's worker pool (see TransformerModel.profile): runs every
    plan with stamps and, while ``recording``, keeps a PlanRun of each.

    ``describe(plan) -> (m, with_head, ops, pos0)`` says what a plan is. What
    ``run`` does besides ``pool.run`` counts as Python overhead, so it does
    little: the stamp buffers of recorded runs are allocated (and their pages
    touched, so that no page fault lands inside a timed op) by ``reserve``."""

    def __init__(self, pool, describe):
        self.pool = pool
        self.n_threads = pool.n_threads
        self.describe = describe
        self.recording = False
        self.runs = []
        self._plans = {}        # id(plan) -> plan, every plan run so far
        self._spare = {}        # id(plan) -> stamp buffers for recorded runs
        self._scratch = {}      # id(plan) -> the stamp buffer of runs not recorded

    def reserve(self, n):
        """Have the stamps of ``n`` recorded runs of every plan run so far ready."""
        for key, plan in self._plans.items():
            spare = self._spare.setdefault(key, [])
            if len(spare) < n:
                spare.extend(_touched((n - len(spare),) + plan.stamp_shape))

    def run(self, plan, stamps=None):
        if stamps is None:
            stamps = self._stamps_for(plan)
        m, with_head, ops, pos0 = self.describe(plan)
        start = time.perf_counter()
        self.pool.run(plan, stamps)
        pool_s = time.perf_counter() - start
        if self.recording:
            self.runs.append(PlanRun(plan, ops, m, with_head, pos0, stamps, pool_s))

    def take(self):
        """The runs recorded so far (and forget them)."""
        runs, self.runs = self.runs, []
        return runs

    def _stamps_for(self, plan):
        key = id(plan)
        if not self.recording:
            if key not in self._scratch:
                self._plans[key] = plan
                self._scratch[key] = _touched(plan.stamp_shape)
            return self._scratch[key]
        spare = self._spare.get(key)
        return spare.pop() if spare else _touched(plan.stamp_shape)

    def __getattr__(self, name):
        return getattr(self.pool, name)


def _touched(shape):
    """Zeroed u64 stamps whose pages are already mapped (np.zeros maps them lazily)."""
    out = np.empty(shape, np.uint64)
    out.fill(0)
    return out


def op_row(op):
    """``(name, kernel)`` of the profile row an op (a runtime.recorder.OpInfo) counts in:
    its name, " (LM head)" added for the ops the model tagged as the head, and its symbol."""
    return op.name + (HEAD_SUFFIX if op.tag == HEAD_TAG else ""), op.symbol


# -- the report -----------------------------------------------------------------
@dataclass
class OpStats:
    """One op kind and the kernel it calls, per step (a decoded token, or a prefill chunk)."""
    name: str
    kernel: str             # the library symbol ("" for rows that are no kernel, such as the wake-up)
    calls: float
    ms: float               # thread 0's critical path, barrier waits included
    pct: float              # of the step's wall time
    wait_pct: float         # of ``ms``: thread 0 waiting at the op's barriers
    gflops: float           # achieved GFLOP/s (0 for an op without arithmetic to speak of)
    gbs: float              # achieved GB/s of nominal traffic


@dataclass
class PhaseProfile:
    """Decode or prefill: per step averages over ``steps`` timed steps."""
    kind: str
    steps: int
    tokens_per_step: int
    positions: tuple        # (first, last) position of the timed tokens
    wall_ms: float          # Model.evaluate, per step
    native_ms: float        # thread 0 inside the executor
    dispatch_ms: float      # inside pool.run but not the executor
    python_ms: float        # the rest of the wall time
    ops: list = field(default_factory=list)
    thread_busy_ms: list = field(default_factory=list)     # per thread: its kernels' time
    thread_late_ms: list = field(default_factory=list)     # per thread: start after thread 0

    def share(self, ms):
        return 100.0 * ms / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def python_pct(self):
        return self.share(self.python_ms)

    @property
    def tokens_per_s(self):
        return 1e3 * self.tokens_per_step / self.wall_ms if self.wall_ms > 0 else 0.0


@dataclass
class ProfileReport:
    model: str
    threads: int
    tsc_hz: float
    decode: PhaseProfile
    prefill: PhaseProfile | None = None

    def as_dict(self):
        out = asdict(self)
        for kind in ("decode", "prefill"):
            phase = getattr(self, kind)
            if phase is not None:
                out[kind].update(python_pct=phase.python_pct, tokens_per_s=phase.tokens_per_s)
        return out

    def table(self):
        lines = [f"llambda profile: {self.model}, {self.threads} thread{'s' * (self.threads > 1)}, "
                 f"TSC {self.tsc_hz / 1e9:.2f} GHz"]
        for phase in (self.decode, self.prefill):
            if phase is not None:
                lines += [""] + _phase_table(phase)
        return "\n".join(lines)


TEXT_COLUMNS = 2            # op and kernel: left-aligned, the numbers right-aligned
COLUMNS = (("op", 24), ("kernel", 31), ("calls", 6), ("ms/{unit}", 9), ("% {unit}", 7), ("wait %", 6), ("GFLOP/s", 8), ("GB/s", 6))


def _row(cells):
    """One Markdown table row: the text columns left-aligned, the others right-aligned."""
    padded = [cell.ljust(width) if i < TEXT_COLUMNS else cell.rjust(width)
              for i, (cell, (_, width)) in enumerate(zip(cells, COLUMNS))]
    return "| " + " | ".join(padded) + " |"


def _phase_table(phase):
    unit = "token" if phase.tokens_per_step == 1 else "chunk"
    what = (f"decode: {phase.steps} tokens at positions {phase.positions[0]}..{phase.positions[1]}"
            if phase.kind == "decode" else
            f"prefill: {phase.steps} chunk{'s' * (phase.steps > 1)} of {phase.tokens_per_step} tokens")
    lines = [f"{what}: {phase.wall_ms:.3f} ms/{unit} ({phase.tokens_per_s:.1f} tok/s)", "",
             _row([title.format(unit=unit) for title, _ in COLUMNS]),
             "|" + "|".join("-" * (width + 2) if i < TEXT_COLUMNS else "-" * (width + 1) + ":"
                            for i, (_, width) in enumerate(COLUMNS)) + "|"]
    for op in phase.ops:
        lines.append(_row([op.name, op.kernel or "-", f"{op.calls:.0f}", f"{op.ms:.3f}", f"{op.pct:.1f}%",
                           f"{op.wait_pct:.1f}%", _rate(op.gflops), _rate(op.gbs)]))
    for name, ms in (("native (sum of ops)", phase.native_ms), ("pool dispatch", phase.dispatch_ms),
                     ("python", phase.python_ms), (f"{unit} (wall)", phase.wall_ms)):
        lines.append(_row([f"**{name}**", "", "", f"{ms:.3f}", f"{phase.share(ms):.1f}%", "", "", ""]))
    busy = ", ".join(f"{ms:.3f} ms ({100 * ms / phase.native_ms:.0f}%)" if phase.native_ms > 0 else "-"
                     for ms in phase.thread_busy_ms)
    lines.append(f"\nin kernels per {unit}, by thread: {busy} of the native time")
    if len(phase.thread_late_ms) > 1:
        late = ", ".join(f"{ms * 1e3:.0f}" for ms in phase.thread_late_ms[1:])
        lines.append(f"workers start after thread 0 by (us): {late}")
    return lines


def _rate(x):
    return f"{x:.1f}" if x > 0 else "-"


def summarize(kind, runs, wall_s, tsc_hz, config):
    """A PhaseProfile from the PlanRuns of ``len(runs)`` steps and their total wall time."""
    steps = len(runs)
    ms_per_tick = 1e3 / tsc_hz / steps          # per step
    n_threads = runs[0].stamps.shape[0]
    by_row = {}                                 # (name, kernel) -> [calls, ticks, wait ticks, flops, bytes]
    busy, late = np.zeros(n_threads), np.zeros(n_threads)
    native = 0
    for run in runs:
        t = _RunTicks(run)
        native += t.native
        busy += t.busy
        late += t.late
        for op, ticks, wait in zip(run.ops, t.ops, t.waits):
            flops, nbytes = _work(op, run, config)
            _accumulate(by_row, op_row(op), ticks, wait, flops, nbytes)
        if t.wake:
            _accumulate(by_row, (WAKE_UP, ""), t.wake, t.wake, 0.0, 0.0)
    wall_ms = 1e3 * wall_s / steps
    pool_ms = 1e3 * sum(r.pool_s for r in runs) / steps
    native_ms = native * ms_per_tick
    ops = [OpStats(name=name, kernel=kernel, calls=calls / steps, ms=ticks * ms_per_tick,
                   pct=100.0 * ticks * ms_per_tick / wall_ms, wait_pct=100.0 * wait / ticks if ticks else 0.0,
                   gflops=_per_second(flops, ticks, tsc_hz) / 1e9, gbs=_per_second(nbytes, ticks, tsc_hz) / 1e9)
           for (name, kernel), (calls, ticks, wait, flops, nbytes) in by_row.items()]
    ops.sort(key=lambda op: -op.ms)
    m = runs[0].m
    return PhaseProfile(kind=kind, steps=steps, tokens_per_step=m,
                        positions=(runs[0].pos0, runs[-1].pos0 + m - 1),
                        wall_ms=wall_ms, native_ms=native_ms, dispatch_ms=max(pool_ms - native_ms, 0.0),
                        python_ms=max(wall_ms - pool_ms, 0.0), ops=ops,
                        thread_busy_ms=list(busy * ms_per_tick), thread_late_ms=list(late * ms_per_tick))


class _RunTicks:
    """One run's stamps read as durations (TSC ticks):

    ops[i]    what op i added to thread 0's time (release to release)
    waits[i]  of which thread 0 waited at op i's barrier
    wake      the part of the first barrier's wait that was workers starting
              late, moved out of that op into a row of its own
    native    thread 0's time in the executor (== ops.sum() + wake)
    busy[t]   thread t's time in kernels; late[t] its start after thread 0's"""

    def __init__(self, run):
        stamps = run.stamps.astype(np.int64)
        returned, released = stamps[:, 1:, 0], stamps[:, :, 1]
        entry = stamps[:, 0, 0]
        self.ops = np.diff(released[0])
        self.waits = released[0, 1:] - returned[0]
        self.native = int(released[0, -1] - entry[0])
        self.busy = (returned - released[:, :-1]).sum(axis=1)
        self.late = entry - entry[0]
        self.wake = 0
        if len(entry) > 1 and len(self.ops):
            first = _first_barrier(run.plan)
            self.wake = int(np.clip(min(self.waits[first], self.late.max()), 0, None))
            self.ops[first] -= self.wake
            self.waits[first] -= self.wake


def _first_barrier(plan):
    """Index of the first op every thread waits after (the plan's last op, at the latest)."""
    flags = np.flatnonzero(plan.records["barrier"][:, 0])
    return int(flags[0]) if len(flags) else plan.n_ops - 1


def _accumulate(by_row, row, ticks, wait, flops, nbytes):
    total = by_row.setdefault(row, [0, 0, 0, 0.0, 0.0])
    for i, x in enumerate((1, ticks, wait, flops, nbytes)):
        total[i] += x


def _per_second(amount, ticks, tsc_hz):
    return amount * tsc_hz / ticks if ticks > 0 else 0.0


def _work(op, run, config):
    """(flops, bytes) of one op of ``run``. The recorder costs attention at the
    position its plan was recorded for; here it is costed where it ran."""
    if op.name != "attention":
        return op.flops, op.bytes
    c, m = config, run.m
    window = op.window
    kv_bytes = 2.0 * c.n_kv_head * (op.kv_row_bytes or 4 * c.head_dim)   # a position's K and V rows, as stored
    if window:                                # a sliding window: each query sees at most `window` keys
        keys = sum(min(run.pos0 + i + 1, window) for i in range(m))
        flops = 4.0 * c.n_head * c.head_dim * keys
        nbytes = kv_bytes * min(run.pos0 + m, window + m - 1)
        return flops, nbytes
    flops = 4.0 * m * c.n_head * c.head_dim * (run.pos0 + (m + 1) / 2)
    nbytes = kv_bytes * (run.pos0 + m)        # the K and V rows it reads
    return flops, nbytes


# -- driving the model ------------------------------------------------------------
def profile_decode(model, tokens=32, prefill=None, prompt=None):
    """Profile ``tokens`` decode steps after ``prompt`` (token ids; default a short one) and
    one ``prefill``-token chunk, unless 0 (None: the rows of one prefill step, 128, or 256
    for a float model: llambda/model/forward.py), of ``model``, a llambda.api.Model, through its
    normal path. A long prompt is what decode attention costs in proportion to: the steps
    run after it, its first ids dropped when the context would not hold the steps too.

    Returns a ProfileReport. The KV cache is left empty."""
    tokens = _count("tokens", tokens, minimum=1)
    net = model.net
    prefill = net.max_batch if prefill is None else _count("prefill", prefill, minimum=0)
    prompt = _prompt(model) if prompt is None else _prompt_ids(model, prompt, tokens)
    tokens = min(tokens, model.n_ctx - len(prompt) - WARMUP_STEPS)
    if tokens < 1:
        raise ValueError(f"tokens: the context of {model.n_ctx} has no room to decode after the prompt")
    model._cached = []
    try:
        with net.profile() as timer:
            tsc_start, clock_start = read_tsc(), time.perf_counter()
            decode_runs, decode_s = _time_decode(model, timer, prompt, tokens)
            prefill_part = _time_prefill(model, timer, prefill) if prefill else None
            tsc_hz = (read_tsc() - tsc_start) / (time.perf_counter() - clock_start)
    finally:
        model._cached = []
    report = ProfileReport(model=Path(model.path).name, threads=timer.n_threads,
                           tsc_hz=tsc_hz, decode=summarize("decode", decode_runs, decode_s, tsc_hz, model.config))
    if prefill_part is not None:
        report.prefill = summarize("prefill", *prefill_part, tsc_hz, model.config)
    return report


def _time_decode(model, timer, prompt, tokens):
    """Greedy decode steps through Model.evaluate; the last ``tokens`` are timed."""
    history = list(prompt)
    logits = model.evaluate(history)
    wall_s = 0.0
    for step in range(WARMUP_STEPS + tokens):
        history.append(int(np.argmax(logits)))
        if step == WARMUP_STEPS:
            timer.reserve(tokens)
            timer.recording = True
        start = time.perf_counter()
        logits = model.evaluate(history)
        if timer.recording:
            wall_s += time.perf_counter() - start
    timer.recording = False
    return timer.take(), wall_s


def _time_prefill(model, timer, size):
    """A prefill of one ``size``-token chunk from position 0: once to build its plan, once timed."""
    size = min(size, model.net.max_batch, model.n_ctx)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size).tolist()
    model._cached = []
    model.evaluate(ids)
    model._cached = []
    timer.reserve(1)
    timer.recording = True
    start = time.perf_counter()
    model.evaluate(ids)
    wall_s = time.perf_counter() - start
    timer.recording = False
    return timer.take(), wall_s


def _prompt(model):
    ids = model.tokenize(PROMPT)
    return ids[:max(1, model.n_ctx // 4)] or [0]


def _prompt_ids(model, prompt, tokens):
    """``prompt`` (token ids) checked, its last ids only when the context must also hold
    the warm-up and the ``tokens`` steps (at least one id, at most n_ctx - 1 - WARMUP_STEPS)."""
    from llambda.errors import UserError
    from llambda.inputs import check_token_ids
    try:
        ids = check_token_ids(prompt, "prompt: token ids")
    except UserError as error:
        raise ValueError(str(error)) from None
    if not ids:
        raise ValueError("prompt: expected at least one token id")
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} is outside [0, {model.config.vocab_size})")
    room = max(1, model.n_ctx - WARMUP_STEPS - tokens)
    return ids[-room:]


def _count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)
