"""POST /v1/messages (and /v1/messages/count_tokens): Anthropic's Messages API, translated onto
the chat path.

    {"model", "max_tokens", "system": "text" | [{"type": "text", "text"}], "messages": [{"role":
     "user" | "assistant", "content": "text" | [block, ...]}], "tools": [{"name", "description",
     "input_schema"}], "tool_choice": {"type": "auto" | "any" | "tool" | "none", "name"},
     "stop_sequences", "temperature", "top_p", "top_k", "stream", "thinking", "output_config"}
    -> {"id": "msg_...", "type": "message", "role": "assistant", "model", "content": [{"type":
        "thinking", ...}, {"type": "text", "text"}, {"type": "tool_use", "id": "toolu_...", "name",
        "input": {...}}], "stop_reason", "stop_sequence", "usage": {"input_tokens", "output_tokens",
        "cache_read_input_tokens"}}

Content blocks in: text; tool_use (an assistant's earlier call); tool_result (its result: a
string or text blocks; ``is_error`` marks the text as an error); thinking (an assistant's earlier
reasoning, given back to the template as reasoning_content). Images and documents are a 400
naming the block. Server tools (web search, code execution, ...) are a 400 naming the tool.

``thinking`` {"type": "enabled" | "adaptive"} and {"type": "disabled"} set the chat template's
``enable_thinking`` (Qwen3's switch; templates without one ignore it); the budget is not kept
apart from max_tokens. ``output_config.format`` {"type": "json_schema", "schema"} constrains the
reply as the chat route's response_format does (llama.cpp's ``grammar`` and vLLM's ``regex``
are accepted too, with the sampling extras ``seed``, ``min_p``, ``repeat_penalty``). ``metadata``, ``service_tier``, ``cache_control``
and the anthropic-version header are accepted and ignored.

Usage follows Anthropic's meaning: ``input_tokens`` are the prompt tokens computed for this
request, ``cache_read_input_tokens`` those served from the prefix cache (their sum is the
prompt). stop_reason: ``end_turn`` (the model ended), ``max_tokens``, ``stop_sequence`` (with
the sequence in ``stop_sequence``) or ``tool_use``.

A stream is Anthropic's events, each an SSE with an ``event:`` line: message_start, ping, then
per content block content_block_start, content_block_delta (text_delta, thinking_delta,
input_json_delta) ..., content_block_stop, and message_delta (stop_reason and the usage) and
message_stop; a failure is an ``error`` event. Errors of this route, 4xx and 5xx, are in
Anthropic's shape: {"type": "error", "error": {"type": "invalid_request_error", "message"}}.
(A refused API key is answered by auth.py before any route, in OpenAI's shape; Anthropic's
client raises its AuthenticationError on the status alike.)
"""
import json
import uuid
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import Field, ValidationError

from . import schemas
from .chat_bridge import (as_chat_request, deltas, final_deltas, loads_object, matched_stop, renamed, sse_event,
                          start_turn)
from .errors import ApiError, from_validation

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_type(status):
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status, message):
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


class AnthropicErrors(APIRoute):
    """A route whose ApiErrors and invalid bodies are answered in Anthropic's error shape (the
    app's handlers answer every other route in OpenAI's)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except (ApiError, ValidationError) as e:
                error = from_validation(e) if isinstance(e, ValidationError) else e
                message = error.message
                if error.param and error.param not in message:
                    message = f"{error.param}: {message}"
                request.app.state.served.metrics.error(error.status)
                return JSONResponse(error_body(error.status, message), status_code=error.status,
                                    headers=error.headers)
        return route


router = APIRouter(route_class=AnthropicErrors)


# -- the request ---------------------------------------------------------------------------
class Block(schemas._Body):
    """A content block; which fields matter depends on its type (see chat_messages)."""
    type: str
    text: Optional[str] = None
    id: Optional[str] = None                      # tool_use
    name: Optional[str] = None
    input: Optional[dict] = None
    tool_use_id: Optional[str] = None             # tool_result
    content: Optional[Union[str, list[dict]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None                # thinking


class Message(schemas._Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class SystemBlock(schemas._Body):
    type: Literal["text"]
    text: str


class ToolChoice(schemas._Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(schemas._Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class OutputFormat(schemas._Body):
    type: Literal["json_schema"]
    schema_: schemas.JsonSchema = Field(alias="schema")


class OutputConfig(schemas._Body):
    format: Optional[OutputFormat] = None


class MessagesRequest(schemas._Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Optional[Union[str, list[SystemBlock]]] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[ToolChoice] = None
    stop_sequences: Optional[Annotated[list[str], Field(max_length=16)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    stream: Optional[bool] = False
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    # llama.cpp's sampling extras, as on the other routes
    seed: Optional[schemas.Seed] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, lt=1.0)]] = None
    repeat_penalty: Optional[Annotated[float, Field(gt=0.0)]] = None
    grammar: Optional[str] = None                # llama.cpp's GBNF, vLLM's regex: instead of output_config
    regex: Optional[str] = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None


# chat field names in errors -> this API's
RENAMES = [(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
           (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"^tools\[(\d+)\]\.function$", r"tools[\1]"),
           (r"^tool_choice\.function\.name$", "tool_choice.name"), (r"^stop$", "stop_sequences"),
           (r"^response_format\.json_schema\.schema$", "output_config.format.schema"),
           (r"^response_format$", "output_config.format"), (r"^chat_template_kwargs$", "thinking")]


def _text_blocks(content, where):
    """A tool result's or a block list's text; a block that is not text is a 400 naming it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ApiError(400, f"{where}[{j}]: content of type {kind!r} is not supported here (only text)",
                           param=f"{where}[{j}]")
        texts.append(block["text"])
    return "\n".join(texts)


def _needs(block, where, *fields):
    for name in fields:
        if getattr(block, name) is None:
            raise ApiError(400, f"{where}.{name}: a {block.type} block needs {name}", param=f"{where}.{name}",
                           code="missing_required_parameter")


def chat_messages(req):
    """The request's system prompt and messages as OpenAI chat messages."""
    out = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, reasoning = [], [], [], []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                _needs(block, where, "text")
                texts.append(block.text)
            elif block.type == "tool_use" and m.role == "assistant":
                _needs(block, where, "id", "name", "input")
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
            elif block.type == "tool_result" and m.role == "user":
                _needs(block, where, "tool_use_id")
                text = _text_blocks(block.content, f"{where}.content")
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": f"Error: {text}" if block.is_error else text})
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                if block.thinking:
                    reasoning.append(block.thinking)
            else:
                raise ApiError(400, f"{where}: content blocks of type {block.type!r} are not supported in a "
                                    f"{m.role} message here", param=f"{where}.type")
        if m.role == "assistant":
            message = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
            out.append(message)
        else:
            out += results                     # a tool's results answer the turn before: they come first
            if texts or not results:
                out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_tools(req):
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}].type: only client tools (name, description, input_schema) are "
                                f"supported here, not {kind!r}", param=f"tools[{i}].type")
        if "input_schema" not in tool:
            raise ApiError(400, f"tools[{i}].input_schema: a tool needs an input_schema",
                           param=f"tools[{i}].input_schema", code="missing_required_parameter")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice, tools):
    """(tool_choice, parallel_tool_calls) in the chat route's words."""
    if choice is None:
        return None, None
    if choice.type in ("any", "tool") and not tools:
        raise ApiError(400, f"tool_choice: {choice.type!r} needs tools", param="tool_choice")
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise ApiError(400, "tool_choice.name: a tool_choice of type 'tool' needs the tool's name",
                           param="tool_choice.name", code="missing_required_parameter")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(req, max_tokens):
    tool_choice, parallel = chat_tool_choice(req.tool_choice, req.tools)
    fields = {"model": req.model, "messages": chat_messages(req), "tools": chat_tools(req),
              "tool_choice": tool_choice, "parallel_tool_calls": parallel, "max_tokens": max_tokens,
              "stop": req.stop_sequences}
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    for name in ("temperature", "top_p", "top_k", "seed", "min_p", "repeat_penalty", "grammar", "regex"):
        fields[name] = getattr(req, name)
    return as_chat_request(fields)


# -- the reply -----------------------------------------------------------------------------
class ContentBlocks:
    """A reply's content blocks, built from chat deltas (reasoning_content, content, tool_calls),
    with the stream events that build them; the plain route feeds it the whole reply at once."""

    def __init__(self):
        self.blocks = []              # [{"kind", "text", ...}] in order
        self.open = None
        self.calls = {}               # a chat tool call's index -> its block

    def apply(self, delta):
        """[(event type, payload)] of one chat delta."""
        out = []
        if delta.get("reasoning_content"):
            out += self._write("thinking", delta["reasoning_content"])
        if delta.get("content"):
            out += self._write("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                out += self._close()
                block = {"kind": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                         "name": call["function"]["name"], "text": ""}
                out += self._add(block)
                self.calls[call["index"]] = block
            piece = call["function"].get("arguments") or ""
            if piece:
                block = self.calls[call["index"]]
                block["text"] += piece
                out.append(("content_block_delta", {"index": block["index"],
                                                    "delta": {"type": "input_json_delta", "partial_json": piece}}))
        return out

    def close(self):
        """The events that end the open block, after an empty text block when there was none
        (a reply with nothing in it is one empty text block)."""
        out = [] if self.blocks else self._add({"kind": "text", "text": ""})
        return out + self._close()

    def content(self):
        return [self.as_block(b) for b in self.blocks]

    @property
    def called(self):
        return any(b["kind"] == "tool_use" for b in self.blocks)

    @staticmethod
    def as_block(block, empty=False):
        text = "" if empty else block["text"]
        if block["kind"] == "text":
            return {"type": "text", "text": text}
        if block["kind"] == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        return {"type": "tool_use", "id": block["id"], "name": block["name"],
                "input": {} if empty else loads_object(block["text"])}

    def _write(self, kind, text):
        out = []
        if self.open is None or self.open["kind"] != kind:
            out += self._close()
            out += self._add({"kind": kind, "text": ""})
        self.open["text"] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return out + [("content_block_delta", {"index": self.open["index"], "delta": delta})]

    def _add(self, block):
        block["index"] = len(self.blocks)
        self.blocks.append(block)
        self.open = block
        return [("content_block_start", {"index": block["index"], "content_block": self.as_block(block, empty=True)})]

    def _close(self):
        block, self.open = self.open, None
        return [] if block is None else [("content_block_stop", {"index": block["index"]})]


def stop_reason(served, completion, blocks, text, stops):
    """(stop_reason, stop_sequence) of a finished reply."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if blocks.called:
        return "tool_use", None
    stop = matched_stop(served.model, completion, text, stops)
    if stop is not None:
        return "stop_sequence", stop
    return "end_turn", None


def usage_of(completion):
    return {"input_tokens": completion.prompt_tokens - completion.cached_tokens,
            "cache_read_input_tokens": completion.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": completion.completion_tokens}


@router.post("/v1/messages")
async def messages(request: Request):
    from .app import EventStream, collected, parse
    served = request.app.state.served
    req = await parse(request, MessagesRequest)
    _, run, reader = await start_turn(served, chat_request(req, req.max_tokens), RENAMES, "messages")
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": req.model}
    stops = req.stop_sequences or []
    if req.stream:
        return EventStream(message_stream(served, run, reader, head, stops), served, run)
    [events] = await collected(served, run, request)
    c = run.completion
    text = "".join(e.text for e in events)
    blocks = ContentBlocks()
    for delta in deltas(reader, text) + final_deltas(reader):
        blocks.apply(delta)
    blocks.close()
    reason, sequence = stop_reason(served, c, blocks, text, stops)
    return JSONResponse(dict(head, content=blocks.content(), stop_reason=reason, stop_sequence=sequence,
                             usage=usage_of(c)))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """{"input_tokens": n}: the prompt's tokens as /v1/messages would render it, tools included."""
    from .app import parse
    served = request.app.state.served
    req = await parse(request, CountTokensRequest)
    chat = chat_request(req, None)
    try:
        served.check(chat)
        turn = await served.chat_turn(chat)
    except ApiError as e:
        raise renamed(e, RENAMES) from None
    return {"input_tokens": len(turn.ids)}


async def message_stream(served, run, reader, head, stops):
    from .app import failure
    try:
        c = run.completion
        start = dict(head, content=[], stop_reason=None, stop_sequence=None,
                     usage=dict(usage_of(c), output_tokens=0))
        yield sse_event("message_start", {"type": "message_start", "message": start})
        yield sse_event("ping", {"type": "ping"})
        blocks, text = ContentBlocks(), ""
        async for _, e in run.events():
            text += e.text
            for delta in deltas(reader, e.text):
                for kind, payload in blocks.apply(delta):
                    yield sse_event(kind, dict(payload, type=kind))
        if c.finish_reason not in ("stop", "length"):
            error = failure(c)
            yield sse_event("error", error_body(error.status, error.message))
            return
        for delta in final_deltas(reader):
            for kind, payload in blocks.apply(delta):
                yield sse_event(kind, dict(payload, type=kind))
        for kind, payload in blocks.close():
            yield sse_event(kind, dict(payload, type=kind))
        reason, sequence = stop_reason(served, c, blocks, text, stops)
        yield sse_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": usage_of(c)})
        yield sse_event("message_stop", {"type": "message_stop"})
    finally:
        served.finished(run)

