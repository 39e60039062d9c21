"""The engine: one thread that runs every step of every sequence, for callers on any thread.

    completion = engine.submit(prompt_ids, sampler, max_tokens=64, stop=["\\n"])
    for event in completion:        # from any thread; Event(token, text, logprob, top_logprobs)
        print(event.text, end="")
    completion.finish_reason        # "stop", "length" or "cancelled"
    completion.cancel()             # from any thread: the engine drops it before its next step

Callers enqueue sequences; only the engine thread touches the model's buffers, plans and
KV pool (DESIGN.md, "Many sequences"). Each step is one plan run over (a) the next token of
every sequence that is generating and (b) prompt chunks of the sequences prefilling, in
arrival order, as many rows as the step's budget leaves: a long prompt arriving delays the
running streams by one chunk per step, never by its whole prefill, and short prompts that
arrive together are prefilled together. The engine
thread is worker 0 of the pool, so it is the thread that gets pinned, never a caller.

Sampling, stop strings and detokenizing run here too, right after the step, so a sequence
that finishes frees its table row and KV blocks before the next step is built.
"""
import collections
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from llambda.errors import UserError
from llambda.serving.generation import StopStrings


# How long the engine is idle before it makes plans ahead (a request arriving then waits for
# at most the one plan being made)
IDLE_WARM_S = 0.25
# How long the engine is idle before the KV cache's filled huge pages are collapsed (kv_pool.py):
# a collapse slows the steps around it for tens of ms, so not in a busy server's short gaps
IDLE_COLLAPSE_S = 0.25


class EngineBusy(UserError):
    """The waiting queue is full: try again later (a server answers 429 or 503)."""


@dataclass
class Event:
    """One generated token: its id, the text it completes (may be empty: a partial UTF-8
    character, or text held back while it could still become a stop string), and, when
    asked for, its log-probability and the most likely alternatives [(id, logprob), ...]."""
    token: int
    text: str
    logprob: float = None
    top_logprobs: list = None


@dataclass
class Counters:
    """Totals since the engine started (the server's /metrics)."""
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from the prefix cache
    steps: int = 0
    step_seconds: float = 0.0         # in steps: the plan runs, sampling, detokenizing
    constraint_seconds: float = 0.0   # of which grammars: masks, their application, advancing


class Completion:
    """A submitted sequence, as its caller sees it: iterate for events, cancel, read usage."""

    # serving/embedding.py's Embedding sets these: a sequence run for its rows' final-norm
    # output (``pooled``: prompt rows only, no LM head, never sampled), which computes every
    # row unless ``reads_cache`` lets its prompt start from the prefix cache
    pooled = False
    reads_cache = True
    after = None                           # the Completion whose prefill a fork waits for (submit)

    def __init__(self, engine, prompt, sampler, max_tokens, stops, ignore_eos, logprobs, on_event,
                 constraint=None, stop_token_ids=(), min_tokens=0):
        self._engine = engine
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason = None          # "stop" | "length" | "cancelled" once finished
        self.stop_reason = None            # finer: "eos", "stop_string", "max_tokens", "context_full", ...
        self.error = None                  # the exception that ended it, if the engine failed
        self.ids = []                      # generated ids
        self.t_submit = time.perf_counter()
        self.t_start = self.t_first = self.t_end = None
        self._on_event = on_event
        self._events = queue.SimpleQueue()
        self._cancelled = False
        self._done = threading.Event()
        # the engine's side
        self.tokens = list(prompt)         # prompt, then generated ids
        self.computed = 0                  # positions whose K/V are in the cache
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.stopper = StopStrings(stops)
        self.constraint = constraint       # a constraints.Constraint, or None
        self.stop_token_ids = frozenset(stop_token_ids)     # end it like EOS (finish "stop")
        self.min_tokens = min_tokens       # until this many are generated, no id that ends it is drawn
        # the ids that end it, banned while fewer than min_tokens are generated (Engine._hold_back_end)
        self.end_ids = None if not min_tokens else np.array(
            [i for i in sorted(self.stop_token_ids | (set() if ignore_eos else engine.tokenizer.eog_ids))
             if i < engine.n_vocab], dtype=np.int64)
        self.decoder = None
        self.table = None
        self.blocks = []
        self.keys = []

    def cancel(self):
        """Stop generating (from any thread); the iterator then ends with finish_reason "cancelled"."""
        if not self._done.is_set():
            self._cancelled = True
            self._engine._poke()

    @property
    def done(self):
        return self._done.is_set()

    def __iter__(self):
        """The events, as the engine produces them; ends when the completion finishes. Raises the
        engine's error, if one ended it."""
        while True:
            item = self._events.get()
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def wait(self, timeout=None):
        return self._done.wait(timeout)

    # -- the engine thread's side --------------------------------------------
    def _emit(self, event):
        if self._on_event is not None:
            self._on_event(self, event)
        else:
            self._events.put(event)

    def _finish(self, reason, stop_reason, error=None):
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        self.t_end = time.perf_counter()
        self._done.set()
        if self._on_event is not None:
            self._on_event(self, None)
        else:
            self._events.put(None)


class Engine:
    """Runs the steps of ``net`` (a llambda.model.forward.TransformerModel) for many sequences.

    tokenizer: for detokenizing and the end-of-generation ids; n_vocab: ids from here on are
    never sampled; max_waiting: submissions beyond this many waiting raise EngineBusy; path:
    the model file, named when its logits go wrong."""

    def __init__(self, net, tokenizer, n_vocab, max_waiting=64, path="the model file", warm_when_idle=False):
        self.net = net
        # warm_when_idle: after IDLE_WARM_S with nothing to do, record (or read from the disk
        # cache) the plan of one step shape not yet made, and so on while idle, so that a prompt
        # of a new length does not wait for its plan
        self._cold = warm_when_idle and net.backend.runs_plans
        self._warming = False
        self.path = path
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.max_waiting = max_waiting
        self.counters = Counters()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting = collections.deque()
        self._running = []
        self._calls = collections.deque()
        self._closing = False
        self._masks = None                 # constraints.MaskBatch, made for the first constrained step
        self._thread = threading.Thread(target=self._loop, name="llambda-engine", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------
    def submit(self, prompt, sampler, max_tokens, stops=(), ignore_eos=False, logprobs=None, on_event=None,
               constraint=None, stop_token_ids=(), min_tokens=0, after=None):
        """Queue a sequence: ``prompt`` token ids (checked by the caller), a Sampler of its own.
        ``logprobs``: None, or how many alternatives each event lists (0: only the token's).
        ``on_event(completion, event)``: called on the engine thread instead of queueing events
        (None marks the end); it must be quick. ``constraint``: a constraints.Constraint of
        this sequence's own, which every generated token then follows (finish_reason "stop",
        stop_reason "grammar" when the grammar is complete). ``stop_token_ids``: ids that end it
        as EOS does (finish_reason "stop", stop_reason "stop_token"; the id is not emitted);
        ``min_tokens``: EOS and those ids are never drawn before it has generated that many
        (both checked by the caller). ``after``: a Completion of the same prompt submitted
        before: this one waits until that one's prompt is in the cache, then starts from its
        sealed blocks (a fork: a request's n choices share one prefill)."""
        net = self.net
        if len(prompt) >= net.n_ctx:
            raise UserError(f"the prompt has {len(prompt)} tokens but the context holds {net.n_ctx} "
                            "with room for the reply (use a larger --ctx, or truncate)")
        c = Completion(self, prompt, sampler, max_tokens, stops, ignore_eos, logprobs, on_event, constraint,
                       stop_token_ids=stop_token_ids, min_tokens=min_tokens)
        c.after = after
        if net.kv.blocks_for(self._reserve(c)) > net.kv.n_blocks - 1:
            raise UserError(f"the request needs {net.kv.blocks_for(self._reserve(c))} KV blocks; the pool "
                            f"holds {net.kv.n_blocks - 1}")
        return self._enqueue(c)

    def submit_embedding(self, prompt, pooling):
        """Queue a sequence whose rows' final-norm output is pooled (serving/embedding.py) instead
        of sampled: ``prompt`` token ids (checked by the caller; as many as the context holds),
        ``pooling`` "mean", "cls" or "last". Returns its Embedding (``.result()`` waits)."""
        from llambda.serving.embedding import Embedding
        net = self.net
        if len(prompt) > net.n_ctx:
            raise UserError(f"the text has {len(prompt)} tokens but the context holds {net.n_ctx} "
                            "(use a larger --ctx, or shorten it)")
        c = Embedding(self, prompt, pooling, net.config.dim)
        if net.kv.blocks_for(self._reserve(c)) > net.kv.n_blocks - 1:
            raise UserError(f"the text needs {net.kv.blocks_for(self._reserve(c))} KV blocks; the pool "
                            f"holds {net.kv.n_blocks - 1}")
        return self._enqueue(c)

    def _enqueue(self, c):
        with self._lock:
            if self._closing:
                raise UserError("the model is closed")
            if len(self._waiting) >= self.max_waiting:
                raise EngineBusy(f"{len(self._waiting)} requests are waiting already (the limit): try again later")
            self._waiting.append(c)
            self.counters.requests += 1
            self._wake.notify()
        return c

    def call(self, fn):
        """Run ``fn()`` on the engine thread between steps and return what it returns (or raise)."""
        if threading.current_thread() is self._thread:
            return fn()
        box = {}
        done = threading.Event()
        with self._lock:
            if self._closing:
                raise UserError("the model is closed")
            self._calls.append((fn, box, done))
            self._wake.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stats(self):
        """What /metrics reports: gauges now and the counters."""
        kv = self.net.kv
        with self._lock:
            waiting = len(self._waiting)
            running = len(self._running)
        return dict(requests_running=running, requests_waiting=waiting, kv_blocks_in_use=kv.blocks_in_use,
                    kv_blocks_total=kv.n_blocks - 1, kv_bytes=kv.nbytes, **vars(self.counters))

    def close(self):
        """Cancel everything and stop the engine thread (and the worker pool)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _poke(self):
        with self._lock:
            self._wake.notify()

    def _reserve(self, c):
        """Positions to hold for a sequence: its prompt and reply, within the context."""
        return min(len(c.tokens) + c.max_tokens, self.net.n_ctx)

    # -- the engine thread ------------------------------------------------------
    def _loop(self):
        try:
            while True:
                idle = False
                with self._lock:
                    while not (self._closing or self._calls or self._running
                               or (self._waiting and self._admittable())):
                        if self.net.kv.has_filled_pages:
                            if not self._wake.wait(IDLE_COLLAPSE_S):
                                self.net.kv.collapse_filled()
                            continue
                        if not self._cold:
                            self._wake.wait()
                        elif self._warming or not self._wake.wait(IDLE_WARM_S):
                            idle = True         # idle for a while, or still idle after the last plan
                            break
                    if self._closing:
                        break
                    calls, self._calls = list(self._calls), collections.deque()
                self._warming = idle
                if idle:
                    self._warm_one()
                    continue
                for fn, box, done in calls:
                    try:
                        box["value"] = fn()
                    except BaseException as error:       # handed to the caller
                        box["error"] = error
                    done.set()
                calls = fn = box = done = None       # a call's closure may hold the caller's Model
                self._admit()
                self._drop_cancelled()
                if self._running:
                    self._step()
        finally:
            self._shut_down()

    def _warm_one(self):
        """While idle: make the plan of one more step shape; stop when none is left (or on an
        error, which the step that needs that shape then reports)."""
        try:
            shape = self.net.cold_shape()
            if shape is None:
                self._cold = False
            else:
                self.net.warm_plans([shape])
        except Exception:
            self._cold = False

    def _admittable(self):
        c = self._waiting[0]
        return c._cancelled or (len(self._running) < self.net.max_seqs and self.net.kv.tables_available > 0
                                and _prefilled(c.after))

    def _admit(self):
        kv = self.net.kv
        while True:
            with self._lock:
                if not self._waiting:
                    return
                c = self._waiting[0]
                if c._cancelled:
                    self._waiting.popleft()
                    c._finish("cancelled", "cancelled")
                    continue
                if len(self._running) >= self.net.max_seqs or not _prefilled(c.after):
                    return             # (a fork waits for the prompt it shares to be in the cache)
                opened = kv.open(c.tokens if c.reads_cache else [], self._reserve(c))
                if opened is None and self._running:
                    return             # not enough free blocks now: it waits for a sequence to end
                if opened is None:     # nothing will end and free blocks (evaluate()'s sequence holds them)
                    self._waiting.popleft()
                    c._finish("error", "error", UserError(
                        f"the KV cache has no room for {kv.blocks_for(self._reserve(c))} more blocks "
                        "(evaluate()'s own sequence holds the rest): use a larger kv_cache_mb"))
                    continue
                self._waiting.popleft()
                self._running.append(c)
            c.table, c.blocks, c.keys, c.cached_tokens = opened
            c.computed = c.cached_tokens
            c.decoder = self.tokenizer.streaming_decoder()
            c.t_start = time.perf_counter()
            self.counters.prompt_tokens += c.prompt_tokens
            self.counters.cached_tokens += c.cached_tokens

    def _drop_cancelled(self):
        for c in [c for c in self._running if c._cancelled]:
            self._end(c, "cancelled", "cancelled")

    def _end(self, c, reason, stop_reason, error=None):
        with self._lock:
            self._running.remove(c)
        self.net.kv.close(c.table, c.blocks)
        c.table, c.blocks = None, []
        if reason != "cancelled" and error is None and not c.stopper.hit:
            rest = c.stopper.feed(c.decoder.flush()) + c.stopper.flush()
            if rest:
                c._emit(Event(None, rest))
        c._finish(reason, stop_reason, error)

    def _step(self):
        """One plan run: every generating sequence's next token, then a chunk of one prompt."""
        t0 = time.perf_counter()
        try:
            self._run_step()
        finally:
            self.counters.step_seconds += time.perf_counter() - t0

    def _run_step(self):
        net = self.net
        rows = [(c, c.computed, 1) for c in self._running if c.computed == len(c.tokens) - 1]
        budget = net.max_batch - len(rows)
        for c in self._running:                 # prompts in arrival order, as much as fits
            if budget <= 0:
                break
            if c.computed < len(c.tokens) - 1:
                n = min(budget, len(c.tokens) - c.computed)
                rows.append((c, c.computed, n))
                budget -= n
        r = 0
        head = []                          # (sequence, head row) of rows whose logits are sampled
        pooled = []                        # (embedding, its first row, start, n): final-norm rows kept
        for c, start, n in rows:
            net.token_ids[r:r + n] = c.tokens[start:start + n]
            net.positions[r:r + n] = range(start, start + n)
            net.row_seq[r:r + n] = c.table
            if c.pooled:
                pooled.append((c, r, start, n))
            elif start + n == len(c.tokens):
                head.append(c)
                net.head_rows[len(head) - 1] = r + n - 1
            r += n
        if not head:
            net.head_rows[0] = 0
        try:
            # a step of embeddings alone runs no LM head (0 head rows)
            logits = net.step(r, len(head) if pooled else max(len(head), 1), hidden=bool(pooled))
        except Exception as error:
            for c, _, _ in rows:
                self._end(c, "error", "error", error)
            return
        self.counters.steps += 1
        for c, start, n in rows:
            c.computed = start + n
            net.kv.seal(c.blocks, c.keys, c.tokens, c.computed)
        for c, at, start, n in pooled:
            c.keep(net.hidden[at:at + n], start)
            if c.computed == len(c.tokens):
                self._end(c, "stop", "pooled")
        self._fill_masks(head)
        for i, c in enumerate(head):
            try:
                self._sample(c, logits[i])
            except ValueError as error:          # NaN or +inf logits: the weights went wrong
                self._end(c, "error", "error", UserError(
                    f"the model produced bad logits ({error}): {self.path} may be damaged; "
                    f"run `llambda verify {self.path}`"))

    def _sample(self, c, logits):
        if c.max_tokens == 0:                  # the prompt is evaluated (and cached), nothing generated
            self._end(c, "length", "max_tokens")
            return
        if logits.size > self.n_vocab:         # padding rows of the LM head: never drawn
            logits[self.n_vocab:] = -np.inf
        if c.constraint is not None:
            if not self._timed(self._ready, c):
                return                         # it ended, or its grammar forces the next tokens
            if self._draws_first(c):
                token = c.sampler.sample(logits, c.tokens)
                if self._timed(c.constraint.allows, token):
                    if self._take(c, token, None):
                        self._force(c)
                    return
                self._timed(self._masks.fill_one, c.constraint)       # refused: draw under the mask
            if not self._timed(self._mask, c, logits):
                return                         # its mask failed: it ended
        if c.completion_tokens < c.min_tokens:
            self._hold_back_end(c, logits)
        token = c.sampler.sample(logits, c.tokens)
        if self._take(c, token, lambda: token_logprobs(logits, token, c.logprobs)) and c.constraint is not None:
            self._force(c)

    def _take(self, c, token, logprob_of):
        """``c`` generated ``token`` (sampled, or forced by its grammar): end ``c`` on an end id,
        else append it and emit its event (``logprob_of()``: its logprob and alternatives, when
        asked for). True while ``c`` goes on."""
        if c.t_first is None:
            c.t_first = time.perf_counter()
        if self._ends(c, token):
            return False
        event = Event(token, "")
        if c.logprobs is not None:
            event.logprob, event.top_logprobs = logprob_of()
        return self._append(c, token, event)

    def _draws_first(self, c):
        """Whether ``c`` draws before its grammar's mask is made: a draw the grammar allows is
        kept, a refused one is drawn again under the mask, which gives the masked distribution
        exactly when the sampler says so (Sampler.redraw_is_exact) and costs a mask only at
        refusals (inside a JSON string, almost never). Not with logprobs (they describe the
        masked row) nor while min_tokens holds end ids back."""
        return (c.logprobs is None and c.completion_tokens >= c.min_tokens
                and c.sampler.redraw_is_exact(self.n_vocab))

    def _ready(self, c):
        """Before sampling ``c``: False when its grammar failed or is complete (``c`` ended) or
        forces the next tokens (generated now, without sampling; the next step runs them as
        prompt rows of ``c``)."""
        constraint = c.constraint
        if constraint.failure is not None:     # its mask could not be made (MaskBatch.fill)
            self._end(c, "error", "error", constraint.failure)
            return False
        try:
            if constraint.stopped:
                self._end(c, "stop", "grammar")
                return False
            forced = constraint.forced()
        except Exception as error:
            self._end(c, "error", "error", constraint.failed(error))
            return False
        if forced:
            self._force(c, forced)
            return False
        return True

    def _hold_back_end(self, c, logits):
        """min_tokens: ban the ids that would end ``c`` (EOS unless ignore_eos, its stop_token_ids)
        in its own row, before sampling. A grammar that allows nothing else wins: ``c`` may end."""
        ids = c.end_ids
        kept = logits[ids] if c.constraint is not None else None
        logits[ids] = -np.inf
        if kept is not None and not np.max(logits) > -np.inf:
            logits[ids] = kept

    def _ends(self, c, token):
        """End ``c`` if ``token`` is an end-of-generation id (unless ignore_eos) or one of its
        stop_token_ids: such a token is not emitted. True when it ended."""
        if token in c.stop_token_ids:
            self._end(c, "stop", "stop_token")
        elif token in self.tokenizer.eog_ids and not c.ignore_eos:
            self._end(c, "stop", "eos")
        else:
            return False
        return True

    def _append(self, c, token, event):
        """Add a generated token to ``c`` and emit its event (its text filled in here); end ``c``
        if it ends with this token. True while it goes on."""
        c.tokens.append(token)
        c.ids.append(token)
        c.completion_tokens += 1
        self.counters.generated_tokens += 1
        event.text = c.stopper.feed(c.decoder.feed(token))
        c._emit(event)
        if c.stopper.hit:
            self._end(c, "stop", "stop_string")
        elif c.constraint is not None and not self._consume(c, token):
            pass                                      # its grammar is complete, or failed: ended
        elif c.completion_tokens >= c.max_tokens:
            self._end(c, "length", "max_tokens")
        elif len(c.tokens) > self._reserve(c):        # no room for the next token's position
            self._end(c, "length", "context_full")
        else:
            return True
        return False

    # -- constrained sequences (constraints.py) ---------------------------------
    def _fill_masks(self, head):
        """The allowed next tokens of every constrained sequence sampled in this step, computed
        together; a grammar whose mask fails gets its ``failure`` (_ready ends it)."""
        constrained = [c.constraint for c in head if c.constraint is not None and not self._draws_first(c)]
        if self._masks is None and any(c.constraint is not None for c in head):
            from llambda.serving.constraints import MaskBatch
            self._masks = MaskBatch(self.net.max_seqs, self.n_vocab)
        if not constrained:
            return
        t0 = time.perf_counter()
        if self._masks is None:
            from llambda.serving.constraints import MaskBatch
            self._masks = MaskBatch(self.net.max_seqs, self.n_vocab)
        self._masks.fill(constrained)
        self.counters.constraint_seconds += time.perf_counter() - t0

    def _mask(self, c, logits):
        """Ban what ``c``'s grammar refuses in ``logits``, from the mask this step made for it
        (True: sample). False when the mask could not be made or applied: ``c`` ended."""
        constraint = c.constraint
        failure = constraint.failure
        if failure is None:
            try:
                self._masks.apply(constraint, logits)
            except Exception as error:         # llguidance's, or ours: this sequence's end only
                failure = constraint.failed(error)
        if failure is not None:
            self._end(c, "error", "error", failure)
            return False
        return True

    def _timed(self, fn, *args):
        """``fn(*args)``, its time counted as constraint work."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.counters.constraint_seconds += time.perf_counter() - t0

    def _consume(self, c, token):
        """Advance ``c``'s grammar over a generated token; end ``c`` when the grammar is complete
        or refuses it. True while ``c`` goes on."""
        try:
            self._timed(c.constraint.consume, token)
            complete = c.constraint.stopped
        except Exception as error:                # ConstraintFailed, or llguidance's own
            self._end(c, "error", "error", error if isinstance(error, UserError) else c.constraint.failed(error))
            return False
        if complete:
            self._end(c, "stop", "grammar")
        return not complete

    def _force(self, c, tokens=None):
        """Generate the tokens ``c``'s grammar forces now (default: ask it), without sampling:
        each is a generated token like any other (text, stop strings, max_tokens, usage), and
        the next step runs them as prompt rows of ``c``. Their logprob is 0: under the grammar
        they are certain."""
        if tokens is None:
            try:
                tokens = self._timed(c.constraint.forced)
            except Exception as error:
                self._end(c, "error", "error", c.constraint.failed(error))
                return
        for token in tokens:
            if not self._take(c, token, lambda: (0.0, [(token, 0.0)] if c.logprobs else [])):
                return

    def _shut_down(self):
        error = UserError("the model was closed")
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
        for c in waiting:           # with the error: a reader learns why the reply stopped short
            c._finish("cancelled", "closed", error)
        for c in list(self._running):
            self._end(c, "cancelled", "closed", error)
        for _, box, done in calls:
            box["error"] = error
            done.set()
        self.net.close()


def _prefilled(leader):
    """A fork may start: its leader (None: no leader) has its prompt in the cache, or ended."""
    return leader is None or leader.t_first is not None or leader.done


def token_logprobs(logits, token, top):
    """(log p(token), [(id, log p), ...] of the ``top`` most likely ids) under softmax(logits)."""
    finite = logits[np.isfinite(logits)]
    peak = float(finite.max())
    log_z = peak + float(np.log(np.exp(finite.astype(np.float64) - peak).sum()))
    alternatives = []
    if top:
        ids = np.argpartition(-logits, top - 1)[:top]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        # banned ids (-inf: a grammar's, the LM head's padding) are no alternative
        alternatives = [(int(i), float(logits[i]) - log_z) for i in ids if logits[i] != -np.inf]
    return float(logits[token]) - log_z, alternatives
