"""Anthropic's Messages API (/v1/messages) with the official anthropic client: plain and
streamed replies equal to the chat route's (the same chat path), the raw event stream (its
event lines, ping, block indexes), the tool_use loop with tool_result blocks, a forced tool,
stop_sequences with the sequence that stopped it, count_tokens, <think> blocks as thinking
blocks, and Anthropic's error shape for bad requests and a wrong key. The default model's
server is started with an API key, which the anthropic client sends as x-api-key."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from server_process import CLIENT_TIMEOUT_S, default_model_server, openai_client

KEY = "sk-test-anthropic-1"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_PARAMS},
         {"name": "get_time", "description": "Local time in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                           "required": ["city"]}}]
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]
HI = [{"role": "user", "content": "Say hi"}]
GREEDY = dict(max_tokens=120, extra_body={"temperature": 0})


@pytest.fixture(scope="module")
def server(default_gguf):
    s = default_model_server(default_gguf, "--api-key", KEY, headers={"x-api-key": KEY})
    yield s
    assert s.stop() == 0, "".join(s.log)


def client_of(server, key=KEY):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


def chat_reply(server, messages, **options):
    """The chat route's greedy reply to the same messages (the openai client, Bearer key)."""
    client = openai_client(server, api_key=KEY)
    return client.chat.completions.create(model=server.model_id, messages=messages, temperature=0, **options)


def raw_events(server, body):
    """[(event name, data)] of a raw streamed /v1/messages, each name checked against data's type."""
    status, _, raw = server.request("POST", "/v1/messages", dict(body, stream=True))
    assert status == 200, raw
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_plain_reply_is_the_chat_routes_reply(server):
    r = client_of(server).messages.create(model=server.model_id, system="Be brief.", messages=HI, **GREEDY)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == server.model_id
    [block] = r.content
    assert block.type == "text" and block.text
    chat = chat_reply(server, [{"role": "system", "content": "Be brief."}] + HI, max_tokens=120)
    assert block.text == chat.choices[0].message.content
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert r.stop_sequence is None
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    # system as text blocks, content as text blocks: the same prompt
    again = client_of(server).messages.create(
        model=server.model_id, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}], **GREEDY)
    assert text_of(again) == block.text


def test_streamed_replies_equal_the_plain_one(server):
    client = client_of(server)
    ask = dict(model=server.model_id, system="Be brief.", messages=HI, **GREEDY)
    plain = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        pieces = [e.text for e in stream if e.type == "text"]
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(plain) and len(pieces) > 1
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    # the raw stream, event by event
    events = raw_events(server, dict(model=server.model_id, system="Be brief.", messages=HI, max_tokens=120,
                                     temperature=0))
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d for name, d in events if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == text_of(plain)
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": plain.stop_reason, "stop_sequence": None}
    assert end["usage"]["output_tokens"] == plain.usage.output_tokens


def tool_uses(message):
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_use_loop(server, stream):
    client = client_of(server)
    ask = dict(model=server.model_id, tools=TOOLS, max_tokens=200, extra_body={"temperature": 0.7, "seed": 3})

    def create(**more):
        if not stream:
            return client.messages.create(**ask, **more)
        with client.messages.stream(**ask, **more) as s:
            return s.get_final_message()
    # 1. the model calls a tool
    r = create(messages=QUESTION, tool_choice={"type": "any"})
    calls = tool_uses(r)
    assert r.stop_reason == "tool_use" and calls
    for call in calls:
        assert call.id.startswith("toolu_") and call.name in ("get_weather", "get_time")
        assert isinstance(call.input, dict)
        if call.name == "get_weather":
            jsonschema.validate(call.input, WEATHER_PARAMS)
    # 2. the results go back as tool_result blocks; the model answers or calls again
    history = QUESTION + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "18 C and sunny"}
                                     for c in calls[:-1]] +
                                    [{"type": "tool_result", "tool_use_id": calls[-1].id, "is_error": True,
                                      "content": [{"type": "text", "text": "the service is down"}]}]}]
    again = create(messages=history)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert (again.stop_reason == "tool_use") == bool(tool_uses(again))
    # 3. with tool_choice none the reply is text
    text = create(messages=history, tool_choice={"type": "none"})
    assert not tool_uses(text) and text.stop_reason in ("end_turn", "max_tokens")


def test_a_forced_tool_gets_input_valid_under_its_schema(server):
    for seed in range(3):
        r = client_of(server).messages.create(
            model=server.model_id, messages=QUESTION, tools=TOOLS, max_tokens=200,
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body={"temperature": 1.0, "seed": seed})
        [call] = r.content
        assert call.type == "tool_use" and call.name == "get_weather" and r.stop_reason == "tool_use"
        jsonschema.validate(call.input, WEATHER_PARAMS)


def test_the_raw_stream_of_a_tool_use(server):
    body = dict(model=server.model_id, messages=QUESTION, tools=TOOLS, max_tokens=200, seed=1, temperature=0.5,
                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    events = raw_events(server, body)
    [(_, start)] = [(n, d) for n, d in events if n == "content_block_start"]
    block = start["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert pieces and all(d["delta"]["type"] == "input_json_delta" for n, d in events if n == "content_block_delta")
    jsonschema.validate(json.loads("".join(pieces)), WEATHER_PARAMS)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_end_the_reply_and_are_named(server, stream):
    client = client_of(server)
    ask = dict(model=server.model_id, system="Be brief.", messages=HI, **GREEDY)
    full = text_of(client.messages.create(**ask))
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    cut = full[:full.index(stop)]
    if stream:
        with client.messages.stream(stop_sequences=["zzqqx", stop], **ask) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(stop_sequences=["zzqqx", stop], **ask)
    assert (r.stop_reason, r.stop_sequence, text_of(r)) == ("stop_sequence", stop, cut)


def test_count_tokens_is_the_prompt_of_a_message(server):
    client = client_of(server)
    ask = dict(model=server.model_id, system="Be brief.", messages=QUESTION, tools=TOOLS)
    counted = client.messages.count_tokens(**ask).input_tokens
    r = client.messages.create(max_tokens=1, **ask)
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model=server.model_id, messages=QUESTION).input_tokens < counted


@pytest.mark.parametrize("body, where", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA",
                                                                            "media_type": "image/png"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: 'any' needs tools"),
    ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
])
def test_bad_requests_are_400_in_anthropics_shape(server, body, where):
    client = client_of(server)
    body = dict({"max_tokens": 5, "messages": QUESTION}, **body)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=server.model_id, max_tokens=body.pop("max_tokens"),
                               messages=body.pop("messages"), extra_body=body)
    e = info.value
    assert e.status_code == 400 and e.body["type"] == "error", e.body
    assert e.body["error"]["type"] == "invalid_request_error" and where in e.body["error"]["message"], e.body
    # and the server goes on serving
    assert client.messages.create(model=server.model_id, messages=HI, max_tokens=2).content


def test_an_unknown_model_and_a_wrong_key(server):
    with pytest.raises(anthropic.NotFoundError) as info:
        client_of(server).messages.create(model="claude-nope", messages=HI, max_tokens=2)
    assert info.value.body["error"]["type"] == "not_found_error" and "claude-nope" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        client_of(server, key="sk-wrong").messages.create(model=server.model_id, messages=HI, max_tokens=2)


REASONING = {"regex": r"<think>\n[a-z ]{5,40}\n</think>\n\n[A-Z][a-z ]{3,30}\.", "seed": 2}


def test_a_think_block_is_a_thinking_block(qwen_server):
    client = anthropic.Anthropic(base_url=qwen_server.url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    ask = dict(model=qwen_server.model_id, messages=[{"role": "user", "content": "Think, then answer."}],
               max_tokens=80, extra_body=REASONING)
    r = client.messages.create(**ask)
    thinking, text = r.content
    assert thinking.type == "thinking" and thinking.thinking and "<think>" not in text.text
    assert text.type == "text" and text.text.endswith(".")
    with client.messages.stream(**ask) as s:
        pieces = [e.thinking for e in s if e.type == "thinking"]
        final = s.get_final_message()
    assert "".join(pieces) == final.content[0].thinking == thinking.thinking
    assert final.content[1].text == text.text
    # the thinking block goes back with the conversation
    history = ask["messages"] + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                                 {"role": "user", "content": "Again."}]
    assert client.messages.create(model=qwen_server.model_id, messages=history, max_tokens=3).content
