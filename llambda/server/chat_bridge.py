"""What the Responses and Anthropic Messages routes share: both are translated onto the chat
path, as llama-server does, so one set of sampling, limit and tool rules serves all three.

    chat = as_chat_request({"model": ..., "messages": [...], "tools": [...], "max_tokens": 64})
    turn, run, reader = await start_turn(served, chat, RENAMES, "input")
    async for _, event in run.events():           # (or app.collected for a plain reply)
        for delta in deltas(reader, event.text):  # {"content"} | {"reasoning_content"} | {"tool_calls"}
            ...

A route builds OpenAI-style chat fields from its own request (after its own schema checked
them, naming its own fields), and this module turns them into a ChatRequest and a running
sequence through Served.chat_turn and Served.start: the chat route's context check, 429 on a
full queue, model names, tool and constraint checks. Errors those raise name chat fields
(``tools[0].function.name``); ``RENAMES`` turns them back into the route's own.
"""
import json
import re

from pydantic import ValidationError

from llambda.chat.reply import CLOSE
from . import schemas
from .errors import ApiError, from_validation


def as_chat_request(fields):
    """A schemas.ChatRequest of ``fields`` (None values left out)."""
    try:
        return schemas.ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:          # the route's own schema should have caught it
        raise from_validation(e) from None


def renamed(error, renames):
    """``error`` (an ApiError) with its param, and the message's leading mention of it, in the
    route's own words: ``renames`` is [(regex, replacement)] applied in order."""
    param = error.param
    if not param:
        return error
    new = param
    for pattern, replacement in renames:
        new = re.sub(pattern, replacement, new)
    if new == param:
        return error
    message = error.message
    if message.startswith(param):
        message = new + message[len(param):]
    return ApiError(error.status, message, type=error.type, param=new, code=error.code, headers=error.headers)


async def start_turn(served, chat, renames, param):
    """(turn, run, reader) of a ChatRequest: the model name and server state checked, the prompt
    rendered with its tools, the sequence submitted. ``param``: the field a prompt that does not
    fit is blamed on."""
    try:
        served.check(chat)
        turn = await served.chat_turn(chat)
        run = served.start(turn.ids, chat, None, param, turn.constraint)
    except ApiError as e:
        raise renamed(e, renames) from None
    return turn, run, served.reader(turn)


def deltas(reader, piece):
    """The chat deltas of one more piece of text: a ReplyReader's, or the text as content."""
    if reader is None:
        return [{"content": piece}] if piece else []
    return reader.feed(piece)


def final_deltas(reader):
    return [] if reader is None else reader.finish()


def reasoning_tokens(events, reasoning):
    """How many of the generated tokens (``events``, each with .text and .token) wrote the
    reasoning: those up to the end of the </think> tag, or all of them in a block never closed."""
    if not reasoning:
        return 0
    text = "".join(e.text for e in events)
    end = text.find(CLOSE)
    if end < 0:
        return sum(1 for e in events if e.token is not None)
    end += len(CLOSE)
    count, at = 0, 0
    for e in events:
        if at >= end:
            break
        if e.token is not None:
            count += 1
        at += len(e.text)
    return count


def matched_stop(model, completion, text, stops):
    """Which of ``stops`` ended ``completion`` (its stop_reason "stop_string"), else None.
    ``text``: what it emitted (everything before the stop). The engine's StopStrings takes the
    first stop, in the request's order, found in the text held back after what was emitted; the
    generated ids decoded again hold that text."""
    if completion.stop_reason != "stop_string" or not stops:
        return None
    decoded = model.detokenize(list(completion.ids))
    tail = decoded[max(0, len(text) - 2):]      # a decoder may differ by a leading space
    for s in stops:
        if s and s in tail:
            return s
    return stops[0] if len(stops) == 1 else None


def loads_object(arguments):
    """A tool call's JSON arguments as an object ({} when they are not one: a call cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sse_event(name, obj):
    """One Server-Sent Event with an ``event:`` line (Responses and Anthropic streams name theirs)."""
    return f"event: {name}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
