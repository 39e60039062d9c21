"""POST /v1/responses: OpenAI's Responses API, stateless, translated onto the chat path.

    {"model", "input": "text" | [item, ...], "instructions", "tools": [{"type": "function", "name",
     "description", "parameters", "strict"}], "tool_choice", "parallel_tool_calls",
     "max_output_tokens", "temperature", "top_p", "text": {"format": {...}}, "stream"}
    -> {"id": "resp_...", "object": "response", "status": "completed" | "incomplete", "output": [
        {"type": "reasoning", ...}, {"type": "message", "content": [{"type": "output_text", ...}]},
        {"type": "function_call", "call_id", "name", "arguments"}, ...], "usage": {...}}

Input items: messages (role user, system, developer or assistant; content a string or parts of
type input_text / output_text), ``function_call`` items (an earlier call: call_id, name,
arguments) and ``function_call_output`` items (its result), and ``reasoning`` items (an earlier
reply's reasoning, given back to the template as that reply's reasoning_content). So a client
appends a response's ``output`` and its tool results to its ``input`` and sends the whole
conversation again. ``instructions`` is a system message before them.

The server keeps nothing: ``previous_response_id`` and ``conversation`` are refused with a 400
that says to send the whole input, ``background`` too; ``store`` is accepted and ignored (a
stored response could never be retrieved). Only function tools: OpenAI's hosted tools
(web_search, file_search, ...) are a 400 naming ``tools[i].type``. ``text.format`` json_schema /
json_object constrain the reply as the chat route's response_format does. llama.cpp's sampling
extras (seed, top_k, min_p, repeat_penalty, the penalties, stop, grammar, regex) are accepted
beside them.

A stream is OpenAI's semantic events, each an SSE with an ``event:`` line and a
``sequence_number``: response.created, response.in_progress, then per output item
output_item.added, content_part.added, output_text.delta / reasoning_text.delta ... / .done,
content_part.done, output_item.done (a function call: output_item.added,
function_call_arguments.delta ... / .done, output_item.done), and last response.completed
(response.incomplete when max_output_tokens cut it, response.failed when the engine failed).
No ``[DONE]``.
"""
import time
import uuid
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from . import schemas
from .chat_bridge import as_chat_request, deltas, final_deltas, reasoning_tokens, sse_event, start_turn
from .errors import ApiError, from_validation

router = APIRouter()


# -- the request ---------------------------------------------------------------------------
class Part(schemas._Body):
    """A content part; only text parts (input_text, output_text) are understood."""
    type: str
    text: Optional[str] = None


class MessageItem(schemas._Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Part]]


class FunctionCallItem(schemas._Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(schemas._Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Part]]


class ReasoningItem(schemas._Body):
    type: Literal["reasoning"]
    content: Optional[list[Part]] = None
    summary: list[Part] = []


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem,
         "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


class FunctionTool(schemas._Body):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None            # the schema binds a forced call either way


class TextFormat(schemas._Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[schemas.JsonSchema] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(schemas._Body):
    format: Optional[TextFormat] = None


class ResponsesRequest(schemas._Body):
    model: str
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], dict]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    text: Optional[TextConfig] = None
    stream: Optional[bool] = False
    store: Optional[bool] = None                        # ignored: nothing is kept
    previous_response_id: Optional[str] = None          # refused: stateless
    conversation: Optional[Union[str, dict]] = None     # refused: stateless
    background: Optional[bool] = None                   # refused unless false
    # llama.cpp's and the chat route's sampling extras
    seed: Optional[schemas.Seed] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, lt=1.0)]] = None
    repeat_penalty: Optional[Annotated[float, Field(gt=0.0)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    stop: Optional[schemas.Stop] = None
    chat_template_kwargs: Optional[dict] = None
    reasoning_format: Optional[Literal["auto", "none", "deepseek"]] = None
    grammar: Optional[str] = None                       # llama.cpp's GBNF, vLLM's regex: instead of text.format
    regex: Optional[str] = None


# chat field names in errors -> this API's
RENAMES = [(r"^tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"^tools\[(\d+)\]\.function$", r"tools[\1]"),
           (r"^tool_choice\.function\.name$", "tool_choice.name"), (r"^messages", "input"),
           (r"^response_format\.json_schema\.schema$", "text.format.schema"), (r"^response_format$", "text.format"),
           (r"^max_tokens$", "max_output_tokens")]


def _check_stateless(req):
    if req.previous_response_id is not None:
        raise ApiError(400, "previous_response_id: this server is stateless and keeps no responses; send the "
                            "whole conversation in input (earlier output items and tool results included)",
                       param="previous_response_id", code="unsupported_parameter")
    if req.conversation is not None:
        raise ApiError(400, "conversation: this server is stateless and keeps no conversations; send the "
                            "whole conversation in input", param="conversation", code="unsupported_parameter")
    if req.background:
        raise ApiError(400, "background: responses run in the foreground here (stream them instead)",
                       param="background", code="unsupported_parameter")


def _validated(model, raw, where):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        error = from_validation(e)
        inner = error.param or ""
        param = f"{where}.{inner}" if inner and not inner.startswith("[") else f"{where}{inner}"
        if inner:
            message = error.message.replace(f"'{inner}'", f"'{param}'", 1)
        else:
            message = f"{where}: {error.message.removeprefix('the body: ')}"
        raise ApiError(400, message, param=param, code=error.code) from None


def _text_of(content, where):
    """A content string or text parts, joined; a part that is not text is a 400 naming it."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise ApiError(400, f"{where}[{j}]: content of type {part.type!r} is not supported (only text: "
                                "input_text or output_text)", param=f"{where}[{j}].type", code="unsupported_content")
    return "".join(part.text for part in content)


def chat_messages(req):
    """The request's instructions and input as OpenAI chat messages."""
    messages = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    reasoning = None                 # an earlier reply's reasoning, for the assistant turn that follows
    for i, raw in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise ApiError(400, f"{where}: expected an input item (an object)", param=where)
        kind = raw.get("type", "message")
        if kind not in ITEMS:
            raise ApiError(400, f"{where}.type: input items of type {kind!r} are not supported (message, "
                                "function_call, function_call_output or reasoning)", param=f"{where}.type",
                           code="unsupported_content")
        item = _validated(ITEMS[kind], raw, where)
        if kind == "reasoning":
            parts = item.content or item.summary
            reasoning = _text_of(parts, f"{where}.content")
        elif kind == "message":
            m = {"role": item.role, "content": _text_of(item.content, f"{where}.content")}
            if item.role == "assistant" and reasoning:
                m["reasoning_content"], reasoning = reasoning, None
            messages.append(m)
        elif kind == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            # calls that follow the assistant's text (or other calls) belong to that same turn
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                m = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    m["reasoning_content"], reasoning = reasoning, None
                messages.append(m)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text_of(item.output, f"{where}.output")})
    return messages


def chat_tools(req):
    """Responses' flat function tools as chat tools; any other kind is a 400 naming it."""
    if req.tools is None:
        return None
    out = []
    for i, raw in enumerate(req.tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools[{i}].type: only tools of type 'function' are supported here, not "
                                f"{kind!r} (OpenAI's hosted tools run on OpenAI's servers)",
                           param=f"tools[{i}].type", code="unsupported_tool")
        tool = _validated(FunctionTool, raw, f"tools[{i}]")
        fn = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        if tool.parameters is not None:
            fn["parameters"] = tool.parameters
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                   param="tool_choice", code="invalid_tool_choice")


def chat_response_format(text):
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ApiError(400, "text.format: a format of type 'json_schema' needs a schema", param="text.format.schema",
                       code="missing_required_parameter")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def chat_request(req):
    fields = {"model": req.model, "messages": chat_messages(req), "tools": chat_tools(req),
              "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
              "max_tokens": req.max_output_tokens, "response_format": chat_response_format(req.text)}
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "chat_template_kwargs", "reasoning_format", "grammar", "regex"):
        fields[name] = getattr(req, name)
    return as_chat_request(fields)


# -- the reply -----------------------------------------------------------------------------
def _hex():
    return uuid.uuid4().hex


class OutputItems:
    """A reply's output items, built from chat deltas (reasoning_content, content, tool_calls),
    with the stream events that build them. The plain route feeds it the whole reply at once,
    the stream piece by piece: both answer with the same items."""

    def __init__(self):
        self.items = []              # [{"kind", "id", "text", ...}] in output order
        self.open = None             # the item being written
        self.calls = {}              # a chat tool call's index -> its item

    def apply(self, delta):
        """[(event type, payload)] of one chat delta."""
        out = []
        if delta.get("reasoning_content"):
            out += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:                       # a new call: its name first, then arguments
                out += self._close()
                item = {"kind": "function_call", "id": f"fc_{_hex()}", "call_id": call["id"],
                        "name": call["function"]["name"], "text": ""}
                out += self._add(item)
                self.calls[call["index"]] = item
            piece = call["function"].get("arguments") or ""
            if piece:
                item = self.calls[call["index"]]
                item["text"] += piece
                out.append(("response.function_call_arguments.delta",
                            {"item_id": item["id"], "output_index": item["index"], "delta": piece}))
        return out

    def close(self, status="completed"):
        """The events that end the open item (``status`` for it), and an empty message first
        when the reply had nothing at all."""
        out = []
        if not self.items:
            out += self._add({"kind": "message", "id": f"msg_{_hex()}", "text": ""})
        return out + self._close(status)

    def output(self):
        return [self.as_item(item, item.get("status", "in_progress")) for item in self.items]

    def text_of(self, kind):
        return "".join(item["text"] for item in self.items if item["kind"] == kind)

    # -- items and their events -----------------------------------------------------------
    @staticmethod
    def as_item(item, status, empty=False):
        """The output item's JSON; ``empty``: as output_item.added shows it, before its parts."""
        kind = item["kind"]
        if kind == "message":
            content = [] if empty else [{"type": "output_text", "text": item["text"], "annotations": []}]
            return {"type": "message", "id": item["id"], "status": status, "role": "assistant", "content": content}
        if kind == "reasoning":
            content = [] if empty else [{"type": "reasoning_text", "text": item["text"]}]
            return {"type": "reasoning", "id": item["id"], "summary": [], "content": content, "status": status}
        return {"type": "function_call", "id": item["id"], "call_id": item["call_id"], "name": item["name"],
                "arguments": item["text"], "status": status}

    @staticmethod
    def _part(item, text):
        if item["kind"] == "message":
            return {"type": "output_text", "text": text, "annotations": []}
        return {"type": "reasoning_text", "text": text}

    def _write(self, kind, text):
        out = []
        if self.open is None or self.open["kind"] != kind:
            out += self._close()
            prefix = "msg" if kind == "message" else "rs"
            out += self._add({"kind": kind, "id": f"{prefix}_{_hex()}", "text": ""})
        item = self.open
        item["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        payload = {"item_id": item["id"], "output_index": item["index"], "content_index": 0, "delta": text}
        if kind == "message":
            payload["logprobs"] = []
        return out + [(name, payload)]

    def _add(self, item):
        item["index"] = len(self.items)
        self.items.append(item)
        self.open = item
        added = self.as_item(item, "in_progress", empty=True)
        out = [("response.output_item.added", {"output_index": item["index"], "item": added})]
        if item["kind"] != "function_call":
            out.append(("response.content_part.added", {"item_id": item["id"], "output_index": item["index"],
                                                        "content_index": 0, "part": self._part(item, "")}))
        return out

    def _close(self, status="completed"):
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = {"item_id": item["id"], "output_index": item["index"]}
        if item["kind"] == "function_call":
            out = [("response.function_call_arguments.done", dict(at, arguments=item["text"], name=item["name"]))]
        else:
            done = "response.output_text.done" if item["kind"] == "message" else "response.reasoning_text.done"
            text = dict(at, content_index=0, text=item["text"])
            if item["kind"] == "message":
                text["logprobs"] = []
            out = [(done, text), ("response.content_part.done",
                                  dict(at, content_index=0, part=self._part(item, item["text"])))]
        return out + [("response.output_item.done", {"output_index": item["index"],
                                                     "item": self.as_item(item, status)})]


class Head:
    """The response object's fields that do not change as it is written (the request's echo)."""

    def __init__(self, req):
        self.id, self.created = f"resp_{_hex()}", int(time.time())
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        text_format = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
        self.fields = {
            "id": self.id, "object": "response", "created_at": self.created, "model": req.model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": text_format}, "tool_choice": req.tool_choice or "auto",
            "tools": [dict(t, strict=t.get("strict")) for t in req.tools or ()], "truncation": "disabled",
            "metadata": {}, "user": None}

    def response(self, status, output=(), usage=None, error=None):
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return dict(self.fields, status=status, output=list(output), usage=usage, error=error,
                    incomplete_details=incomplete)


def usage_of(completion, events, items):
    reasoning = reasoning_tokens(events, items.text_of("reasoning"))
    return {"input_tokens": completion.prompt_tokens,
            "input_tokens_details": {"cached_tokens": completion.cached_tokens},
            "output_tokens": completion.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def status_of(completion):
    return "incomplete" if completion.finish_reason == "length" else "completed"


@router.post("/v1/responses")
async def responses(request: Request):
    from .app import EventStream, collected, parse
    served = request.app.state.served
    req = await parse(request, ResponsesRequest)
    _check_stateless(req)
    chat = chat_request(req)
    _, run, reader = await start_turn(served, chat, RENAMES, "input")
    head = Head(req)
    if req.stream:
        return EventStream(response_stream(served, run, reader, head), served, run)
    [events] = await collected(served, run, request)
    c = run.completion
    items = OutputItems()
    for delta in deltas(reader, "".join(e.text for e in events)) + final_deltas(reader):
        items.apply(delta)
    status = status_of(c)
    items.close(status)
    return JSONResponse(head.response(status, items.output(), usage_of(c, events, items)))


async def response_stream(served, run, reader, head):
    from .app import failure
    number = 0

    def event(kind, payload):
        nonlocal number
        body = {"type": kind, "sequence_number": number, **payload}
        number += 1
        return sse_event(kind, body)
    try:
        yield event("response.created", {"response": head.response("in_progress")})
        yield event("response.in_progress", {"response": head.response("in_progress")})
        items, events = OutputItems(), []
        async for _, e in run.events():
            events.append(e)
            for delta in deltas(reader, e.text):
                for kind, payload in items.apply(delta):
                    yield event(kind, payload)
        c = run.completion
        if c.finish_reason not in ("stop", "length"):
            error = failure(c)
            yield event("response.failed", {"response": head.response(
                "failed", items.output(), error={"code": "server_error", "message": error.message})})
            return
        for delta in final_deltas(reader):
            for kind, payload in items.apply(delta):
                yield event(kind, payload)
        status = status_of(c)
        for kind, payload in items.close(status):
            yield event(kind, payload)
        final = head.response(status, items.output(), usage_of(c, events, items))
        yield event("response.completed" if status == "completed" else "response.incomplete", {"response": final})
    finally:
        served.finished(run)
