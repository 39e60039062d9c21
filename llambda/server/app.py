"""The OpenAI-compatible HTTP API over one shared Model.

    app = create_app(model, "SmolLM2-135M-Instruct")     # then uvicorn.run(app), or llambda.server.serve

Routes: GET /health, /metrics, /v1/models[/{id}]; POST /v1/completions, /v1/chat/completions,
plain or streamed (Server-Sent Events, ``data: [DONE]`` last, a usage chunk before it when
``stream_options.include_usage``). GET / is the chat page, static/index.html with its
files under /static.

Every request becomes one engine sequence (Model.submit). The engine thread hands each token
to the request's asyncio queue (``call_soon_threadsafe``: it never waits on the event loop);
the route turns tokens into OpenAI's JSON. A client that goes away cancels its sequence: a
stream notices when Starlette cancels the response (it listens for the disconnect), a plain
request through a watcher on the connection. Both free the sequence's KV blocks before the
engine's next step.
"""
import asyncio
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.requests import ClientDisconnect

from llambda.serving.engine import EngineBusy
from llambda.errors import UserError
from . import auth, errors, schemas, utility_routes
from .errors import ApiError
from .metrics import Metrics

RETRY_AFTER_S = 1
STATIC_DIR = Path(__file__).parent / "static"      # the chat page at / (docs/server.md)


class Served:
    """What the routes share: the model, its names, the metrics and the requests in flight."""

    def __init__(self, model, model_id, aliases=(), listed=()):
        """``aliases``: other names requests may use; ``listed``: names (``--alias``) that
        /v1/models shows after the id, each as a card of its own."""
        self.model = model
        self.model_id = model_id
        self.listed = list(dict.fromkeys([model_id, *listed]))      # the id first, no repeats
        self.names = {*self.listed, *aliases}
        self.metrics = Metrics(model)
        self.created = int(time.time())
        self.reasoning_format = "auto"    # --reasoning-format: "none" leaves <think> blocks in the content
        self.tool_format = None           # --tool-format, else the template's (llambda/chat/tools.py)
        self._specials = None
        self.active = set()               # completions not finished yet
        self.draining = False

    # -- checks -----------------------------------------------------------------
    def check_serving(self, model_name):
        """What every route checks first: the server is not shutting down, and it knows the
        model's name."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if model_name not in self.names:
            raise self.unknown_model(model_name)

    def check(self, req):
        self.check_serving(req.model)
        problem = schemas.unsupported(req)
        if problem is not None:
            raise ApiError(400, problem[1], param=problem[0], code="unsupported_parameter")

    def unknown_model(self, name):
        shown = ", ".join(repr(n) for n in self.listed)
        return ApiError(404, f"the model {name!r} does not exist; the models here are {shown}",
                        param="model", code="model_not_found")

    # -- chat turns -------------------------------------------------------------
    async def chat_turn(self, req):
        """The request's llambda.chat.turn.Turn (prompt ids, constraint, reply reader), made
        off the event loop; a bad tool list, tool choice or message is a 400 naming it."""
        constraint = await self.constraint(req)
        reasoning = "none" if "none" in (self.reasoning_format, req.reasoning_format) else "auto"

        def prepare():
            from llambda.chat import turn
            if self._specials is None:
                self._specials = turn.special_tags(self.model.tokenizer)
            return turn.prepare(self.model, schemas.message_dicts(req), tools=req.tools, tool_choice=req.tool_choice,
                                parallel_tool_calls=req.parallel_tool_calls is not False,
                                template_kwargs=req.chat_template_kwargs, reasoning=reasoning,
                                tool_format=self.tool_format, specials=self._specials, constraint=constraint)
        from llambda.chat.tools import ToolError
        try:
            return await run_in_threadpool(prepare)
        except ToolError as e:
            raise ApiError(400, str(e), param=e.field, code="invalid_tools") from None
        except UserError as e:
            param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise ApiError(400, str(e), param=param) from None

    def reader(self, turn):
        """How to read the reply: None when it is plain content (no tools this turn, and no
        <think> block the template or prompt could open), else a ReplyReader."""
        if turn.tool_format is None and not turn.thinking and not (
                turn.reasoning and "<think>" in (self.model.chat_template.text or "")):
            return None
        return turn.reader()

    # -- submitting -------------------------------------------------------------
    async def constraint(self, req):
        """The request's structured-output constraint (llambda.serving.constraints), or None;
        built off the event loop (compiling a schema, or the first of a large vocabulary, takes
        a while). A schema, grammar, regex or choice list it cannot build is a 400 naming its field."""
        options = schemas.constraint_options(req)
        if options is None:
            return None
        field, kinds = options
        try:
            return await run_in_threadpool(lambda: self.model.constraint(field=field, **kinds))
        except UserError as e:
            raise ApiError(400, str(e), param=field, code="invalid_constraint") from None

    def start(self, ids, req, logprobs, param, constraint=None):
        """Submit the sequence; a Run to read its events from. Called on the event loop."""
        n_ctx = self.model.n_ctx
        if len(ids) >= n_ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {n_ctx} with room "
                                "for the reply (start the server with a larger --ctx, or shorten the prompt)",
                           param=param, code="context_length_exceeded")
        n, queue = req.n or 1, self.model.engine.max_waiting
        if n > queue:       # its choices wait together: more than the queue holds would be a 429 forever
            raise ApiError(400, f"n: {n} choices are more than this server queues at once ({queue}, its "
                                "--max-waiting)", param="n", code="invalid_value")
        run = Run(asyncio.get_running_loop())
        try:
            run.completions = self.model.choices(ids, req.n or 1, **schemas.sampling_options(req, n_ctx - len(ids)),
                                                 logprobs=logprobs, on_event=run.on_event, constraint=constraint)
        except EngineBusy as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except UserError as e:
            # an OptionError (logit_bias, stop_token_ids, min_tokens, ...) names its own field
            raise ApiError(400, str(e), param=getattr(e, "field", None) or param) from None
        self.active.update(run.completions)
        return run

    def finished(self, run):
        left = False
        for c in run.completions:
            if c not in self.active:        # said already
                continue
            if not c.done:                  # the client left, or the response failed
                c.cancel()
                left = True
            else:
                self.metrics.finished(c)
            self.active.discard(c)
        if left:
            self.metrics.disconnects.inc()

    def drain(self, grace_s):
        """Refuse new requests; after ``grace_s`` cancel what still runs (on the event loop)."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace_s, self.cancel_all)

    def cancel_all(self):
        for c in list(self.active):
            c.cancel()

    # -- token text -------------------------------------------------------------
    def token_str(self, token):
        return self.model.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def chat_logprob(self, event):
        def entry(token, logprob):
            raw = self.model.tokenizer.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return dict(entry(event.token, event.logprob),
                    top_logprobs=[entry(t, lp) for t, lp in event.top_logprobs or ()])


class Run:
    """One request's sequences (its ``n`` choices) and the queue their events arrive on."""

    def __init__(self, loop):
        self.loop = loop
        self.queue = asyncio.Queue()
        self.completions = []

    @property
    def completion(self):
        return self.completions[0]

    def on_event(self, completion, event):
        """On the engine thread: must be quick and must never raise (it would stop the engine)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (completion, event))
        except RuntimeError:           # the event loop is closed: nobody waits for this any more
            pass

    async def events(self):
        """(choice index, event) as they come, until every choice has ended."""
        index = {id(c): i for i, c in enumerate(self.completions)}
        left = len(self.completions)
        while left:
            completion, event = await self.queue.get()
            if event is None:
                left -= 1
                continue
            yield index[id(completion)], event

    async def collect(self, request):
        """Every choice's events [[event, ...], ...], cancelling the sequences if the client
        disconnects meanwhile."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for c in self.completions:
                c.cancel()
        watcher = asyncio.ensure_future(watch())
        try:
            per_choice = [[] for _ in self.completions]
            async for i, event in self.events():
                per_choice[i].append(event)
            return per_choice
        finally:
            watcher.cancel()


def usage(completions):
    """OpenAI's usage of a request's choices: the prompt once, every choice's tokens."""
    first = completions[0]
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": generated,
            "total_tokens": first.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def failure(c):
    """The ApiError of a completion that neither stopped nor hit its length."""
    from llambda.serving.constraints import ConstraintFailed
    if isinstance(c.error, ConstraintFailed):     # the request's grammar, not the server
        return ApiError(400, str(c.error), param=c.error.field, code="constraint_failed")
    if c.finish_reason == "error":
        return ApiError(500, f"the engine failed: {c.error}", type="server_error", code="engine_error")
    return ApiError(503, "the request was cancelled: the server is shutting down", type="server_error",
                    code="shutting_down")


async def collected(served, run, request):
    """[[event, ...] of each choice] of a run that does not stream, once it has ended; a choice
    that neither stopped nor hit its length raises its ApiError."""
    try:
        events = await run.collect(request)
    finally:
        served.finished(run)
    for c in run.completions:
        if c.finish_reason not in ("stop", "length"):
            raise failure(c)
    return events


MAX_BODY_BYTES = 32 << 20      # far above any prompt a context holds


async def parse(request, schema):
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    except ClientDisconnect:      # closed before its Content-Length arrived: a client's error, not a 500
        raise ApiError(400, "the connection closed before the whole body arrived", code="body_incomplete") from None
    return schema.model_validate_json(bytes(body) or b"null")     # ValidationError -> 400 (errors.install)


STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """An SSE response that ends its sequence however the response ends: a body generator that
    never started (the client left before the first byte) has no ``finally`` to do it."""

    def __init__(self, body, served, run):
        super().__init__(body, media_type="text/event-stream", headers=STREAM_HEADERS)
        self._served, self._run = served, run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._served.finished(self._run)


def create_app(model, model_id, aliases=(), served=None, *, api_keys=(), metrics_public=False, cors_origins=(),
               listed=(), reasoning_format="auto", tool_format=None):
    """``reasoning_format``: "auto" puts <think> blocks in reasoning_content, "none" leaves them
    in the content; ``tool_format``: a tool-call format's name (llambda/chat/tools.py), else
    the template's."""
    served = served or Served(model, model_id, aliases, listed)
    from llambda.chat import turn as chat_turn
    if reasoning_format not in chat_turn.REASONING_FORMATS:
        raise UserError(f"--reasoning-format: expected one of {', '.join(chat_turn.REASONING_FORMATS)}, "
                        f"got {reasoning_format!r}")
    served.reasoning_format = reasoning_format
    served.tool_format = None if tool_format is None else chat_turn.tool_format_of(model, tool_format)
    app = FastAPI(title="llambda", summary="OpenAI-compatible API over a llambda model")
    app.state.served = served
    errors.install(app, on_error=served.metrics.error)
    auth.install(app, api_keys, metrics_public, cors_origins, on_refused=served.metrics.error)   # keys, CORS

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    from .embeddings import router as embeddings_router
    app.include_router(embeddings_router)             # /v1/embeddings (embeddings.py)
    app.include_router(utility_routes.router)        # /tokenize, /detokenize, /apply-template
    from .responses import router as responses_router
    app.include_router(responses_router)              # /v1/responses (responses.py)
    from .anthropic_messages import router as anthropic_router
    app.include_router(anthropic_router)              # /v1/messages[/count_tokens] (anthropic_messages.py)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/health")
    async def health():
        if served.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = served.metrics.render()
        return Response(body, media_type=content_type)

    def model_card(name):
        return {"id": name, "object": "model", "created": served.created, "owned_by": "llambda"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in served.listed]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name not in served.names:
            raise served.unknown_model(name)
        return model_card(name if name in served.listed else served.model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, schemas.ChatRequest)
        served.check(req)
        turn = await served.chat_turn(req)
        top = (req.top_logprobs or 0) if req.logprobs else None
        run = served.start(turn.ids, req, top, "messages", turn.constraint)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
        readers = [served.reader(turn) for _ in run.completions]
        if req.stream:
            return EventStream(chat_stream(served, run, req, head, readers), served, run)
        choices = []
        for i, (events, c, reader) in enumerate(zip(await collected(served, run, request), run.completions, readers)):
            logprobs = None
            if top is not None:
                logprobs = {"content": [served.chat_logprob(e) for e in events if e.token is not None],
                            "refusal": None}
            message = {"role": "assistant", "content": "".join(e.text for e in events), "refusal": None}
            finish_reason = c.finish_reason
            if reader is not None:
                reader.feed(message["content"])
                reply = reader.message()
                message["content"] = reply["content"]
                for key in ("reasoning_content", "tool_calls"):
                    if reply[key] is not None:
                        message[key] = reply[key]
                finish_reason = chat_finish_reason(c, reply["tool_calls"])
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        return dict(head, choices=choices, usage=usage(run.completions))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, schemas.CompletionRequest)
        served.check(req)
        prompt = schemas.completion_prompt(req)
        if isinstance(prompt, str):
            try:
                ids = await run_in_threadpool(model.tokenize, prompt)
            except UserError as e:
                raise ApiError(400, str(e), param="prompt") from None
        else:
            ids = list(prompt)
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else await run_in_threadpool(model.detokenize, ids)
        run = served.start(ids, req, req.logprobs, "prompt", await served.constraint(req))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
        if req.stream:
            return EventStream(completion_stream(served, run, req, head, echo), served, run)
        choices = []
        for i, (events, c) in enumerate(zip(await collected(served, run, request), run.completions)):
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs(served, len(echo))
                for e in events:
                    logprobs.add(e)
                logprobs = logprobs.as_dict()
            text = echo + "".join(e.text for e in events)
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return dict(head, choices=choices, usage=usage(run.completions))

    return app


class CompletionLogprobs:
    """The legacy completions' logprobs: parallel lists of tokens, their logprobs, the top
    alternatives ({token: logprob}) and each token's offset in the text."""

    def __init__(self, served, offset=0):
        self.served, self.offset = served, offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, event):
        if event.token is not None:
            s = self.served
            self.tokens.append(s.token_str(event.token))
            self.token_logprobs.append(event.logprob)
            self.top_logprobs.append({s.token_str(t): lp for t, lp in event.top_logprobs or ()})
            self.text_offset.append(self.offset)
        self.offset += len(event.text)

    def as_dict(self):
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def stream_end(completions, base, include_usage):
    """The SSE lines that end a stream whose choices have all sent their last chunk: the usage
    chunk, or the error of a choice that neither stopped nor hit its length; then [DONE]."""
    failed = [c for c in completions if c.finish_reason not in ("stop", "length")]
    if failed:
        e = failure(failed[0])
        yield sse(errors.error_body(e.message, e.type, e.param, e.code))
    elif include_usage:
        yield sse(dict(base, choices=[], usage=usage(completions)))
    yield "data: [DONE]\n\n"


def chat_finish_reason(c, tool_calls):
    """OpenAI's finish_reason: "tool_calls" when a reply that ended by itself called tools."""
    return "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason


async def chat_stream(served, run, req, head, readers):
    """The chat SSE stream of every choice. A choice with a reader (tools, reasoning) sends what
    it reads in its text so far: content, reasoning_content and tool_calls, in OpenAI's chunk
    shapes; one without sends its text as content."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = bool(req.logprobs)
    base = dict(head, object="chat.completion.chunk")

    def chunk(index, delta, finish_reason=None, logprobs=None):
        d = dict(base, choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason}])
        if include_usage:
            d["usage"] = None
        return sse(d)
    try:
        for i in range(len(run.completions)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, event in run.events():
            logprobs = None
            if want_logprobs and event.token is not None:
                logprobs = {"content": [served.chat_logprob(event)], "refusal": None}
            reader = readers[i]
            if reader is None:
                if logprobs is not None or event.text:
                    yield chunk(i, {"content": event.text}, logprobs=logprobs)
                continue
            deltas = reader.feed(event.text)
            if logprobs is not None and not deltas:
                deltas = [{}]                    # the token's logprobs, with no text to show yet
            for delta in deltas:
                yield chunk(i, delta, logprobs=logprobs)
                logprobs = None
        for i, (c, reader) in enumerate(zip(run.completions, readers)):
            if c.finish_reason not in ("stop", "length"):
                continue
            finish_reason = c.finish_reason
            if reader is not None:
                for delta in reader.finish():
                    yield chunk(i, delta)
                finish_reason = chat_finish_reason(c, reader.message()["tool_calls"])
            yield chunk(i, {}, finish_reason)
        for line in stream_end(run.completions, base, include_usage):
            yield line
    finally:
        served.finished(run)


async def completion_stream(served, run, req, head, echo):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = dict(head, object="text_completion")

    def chunk(index, text, finish_reason=None, logprobs=None):
        d = dict(base, choices=[{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
        if include_usage:
            d["usage"] = None
        return sse(d)
    try:
        offsets = [len(echo)] * len(run.completions)
        if echo:
            for i in range(len(run.completions)):
                yield chunk(i, echo)
        async for i, event in run.events():
            if req.logprobs is not None and event.token is not None:
                lp = CompletionLogprobs(served, offsets[i])
                lp.add(event)
                yield chunk(i, event.text, logprobs=lp.as_dict())
            elif event.text:
                yield chunk(i, event.text)
            offsets[i] += len(event.text)
        for i, c in enumerate(run.completions):
            if c.finish_reason in ("stop", "length"):
                yield chunk(i, "", c.finish_reason)
        for line in stream_end(run.completions, base, include_usage):
            yield line
    finally:
        served.finished(run)
