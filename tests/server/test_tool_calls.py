"""Tool calls and reasoning over HTTP, with the official openai client: the tool-call loop
(call, tool result, answer) plain and streamed, a named function whose arguments validate
against its schema, OpenAI's exact streaming shape (id, type and name once, then argument
pieces; finish_reason "tool_calls"), <think> blocks as reasoning_content, and 400s naming the
field for bad tools. Two servers of the default model: its own template (no tools: the
prompted JSON format) and Qwen3's template (the <tool_call> format, <think> blocks)."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from server_process import default_model_server, openai_client

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_gguf):
    s = default_model_server(default_gguf)
    yield s
    assert s.stop() == 0, "".join(s.log)


client_of = openai_client


def streamed_message(stream):
    """(content, reasoning, [tool call dicts], finish_reason) of a streamed chat reply, checking
    OpenAI's delta shapes on the way."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id is not None:
                    assert entry["id"] is None and call.type == "function" and call.function.name
                    entry["id"], entry["name"] = call.id, call.function.name
                else:
                    assert call.function.name is None
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("which", ["server", "qwen_server"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_call_loop(request, which, stream):
    server = request.getfixturevalue(which)
    client = client_of(server)
    ask = dict(model=server.model_id, tools=TOOLS, max_tokens=200, seed=3, temperature=0.7)
    # 1. the model calls a tool
    if stream:
        content, _, calls, finish = streamed_message(client.chat.completions.create(
            messages=QUESTION, tool_choice="required", stream=True, **ask))
    else:
        r = client.chat.completions.create(messages=QUESTION, tool_choice="required", **ask)
        finish, message = r.choices[0].finish_reason, r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
        json.loads(call["arguments"])
    # 2. its result goes back, and the model answers (or calls again: either is a valid reply)
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": "18 C and sunny"} for c in calls]
    if stream:
        content, _, again, finish = streamed_message(client.chat.completions.create(
            messages=history, stream=True, **ask))
    else:
        r = client.chat.completions.create(messages=history, **ask)
        finish, content, again = r.choices[0].finish_reason, r.choices[0].message.content, r.choices[0].message.tool_calls
    assert finish in ("stop", "length", "tool_calls")
    assert (finish == "tool_calls") == bool(again)
    # 3. with tool_choice none the reply is text
    r = client.chat.completions.create(messages=history, tool_choice="none", **ask)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("which", ["server", "qwen_server"])
def test_a_named_function_gets_arguments_valid_under_its_schema(request, which):
    server = request.getfixturevalue(which)
    for seed in range(3):
        r = client_of(server).chat.completions.create(
            model=server.model_id, messages=QUESTION, tools=TOOLS, max_tokens=200, seed=seed, temperature=1.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_plain_and_streamed_calls_agree(qwen_server):
    client = client_of(qwen_server)
    ask = dict(model=qwen_server.model_id, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=200,
               seed=11, temperature=0.9)
    plain = client.chat.completions.create(**ask).choices[0].message
    _, _, calls, _ = streamed_message(client.chat.completions.create(stream=True, **ask))
    assert [(c.function.name, c.function.arguments) for c in plain.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls]


def test_reasoning_goes_to_reasoning_content(qwen_server):
    client = client_of(qwen_server)
    ask = dict(model=qwen_server.model_id, messages=[{"role": "user", "content": "Think, then answer."}],
               max_tokens=80, seed=2, extra_body={"regex": r"<think>\n[a-z ]{5,40}\n</think>\n\n[A-Z][a-z ]{3,30}\."})
    message = client.chat.completions.create(**ask).choices[0].message
    assert message.reasoning_content and "<think>" not in message.content and message.content.endswith(".")
    content, reasoning, _, _ = streamed_message(client.chat.completions.create(stream=True, **ask))
    assert (content, reasoning) == (message.content, message.reasoning_content)
    raw = client.chat.completions.create(**dict(ask, extra_body=dict(ask["extra_body"], reasoning_format="none")))
    assert raw.choices[0].message.content.startswith("<think>")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nope"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"reasoning_format": "sometimes"}, "reasoning_format"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param):
    client = client_of(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model_id, messages=QUESTION, max_tokens=5, extra_body=extra)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert client.chat.completions.create(model=server.model_id, messages=QUESTION, max_tokens=2).choices


def test_a_tool_message_needs_no_tools_in_the_request(server):
    # a conversation that called tools earlier goes on without offering them again
    client = client_of(server)
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=server.model_id, messages=history, max_tokens=8)
    assert r.choices[0].message.tool_calls is None
