"""OpenAI's Responses API (/v1/responses) with the official openai client: plain and streamed
replies equal to the chat route's (the same chat path), OpenAI's stream events in order with
their sequence numbers, max_output_tokens as an incomplete response, the function-call loop
(function_call items, then function_call_output items sent back with the whole input),
text.format json_schema, reasoning items from a <think> block, and 400s naming the field
(previous_response_id among them: the server is stateless). Two servers of the default model:
its own template (tools in the prompted JSON format) and Qwen3's (<think> blocks)."""
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
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER_PARAMS, "strict": True},
         {"type": "function", "name": "get_time", "description": "Local time in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                         "required": ["city"]}}]
QUESTION = "What's the weather in Paris?"
GREEDY = dict(temperature=0, max_output_tokens=120)


@pytest.fixture(scope="module")
def server(default_gguf):
    s = default_model_server(default_gguf)
    yield s
    assert s.stop() == 0, "".join(s.log)


client_of = openai_client


def streamed(stream):
    """(events, final response) of a raw stream, checking the event grammar on the way: numbered
    from 0 without gaps, created and in_progress first, every item added before its deltas and
    done after them, text and arguments deltas adding up to their .done, a terminal event last."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    open_items, text, done_items = {}, {}, {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index not in open_items and e.output_index == len(open_items)
            open_items[e.output_index] = e.item
            text[e.output_index] = ""
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                        "response.function_call_arguments.delta"):
            assert e.output_index in open_items and e.output_index not in done_items
            assert e.item_id == open_items[e.output_index].id
            text[e.output_index] += e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert e.text == text[e.output_index]
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == text[e.output_index]
        elif e.type == "response.output_item.done":
            assert e.item.id == open_items[e.output_index].id
            done_items[e.output_index] = e.item
        else:
            assert e.type in ("response.content_part.added", "response.content_part.done"), e.type
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert sorted(done_items) == sorted(open_items) == list(range(len(final.response.output)))
    for i, item in enumerate(final.response.output):
        assert item.id == done_items[i].id
    return events, final.response


def test_a_plain_reply_is_the_chat_routes_reply(server):
    client = client_of(server)
    r = client.responses.create(model=server.model_id, input="Say hi", instructions="Be brief.", **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model_id
    assert r.status == "completed" and r.incomplete_details is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert message.content[0].annotations == [] and r.output_text
    chat = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
        temperature=0, max_tokens=120)
    assert r.output_text == chat.choices[0].message.content
    u = r.usage
    assert u.input_tokens == chat.usage.prompt_tokens and u.output_tokens == chat.usage.completion_tokens
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens


def test_streamed_replies_equal_the_plain_one(server):
    client = client_of(server)
    ask = dict(model=server.model_id, input=[{"role": "developer", "content": "Be brief."},
                                             {"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
               **GREEDY)
    plain = client.responses.create(**ask)
    events, final = streamed(client.responses.create(stream=True, **ask))
    assert final.output_text == plain.output_text and final.status == "completed"
    assert [e.type for e in events[2:6]] == ["response.output_item.added", "response.content_part.added",
                                             "response.output_text.delta", "response.output_text.delta"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    assert final.usage.output_tokens == plain.usage.output_tokens
    # the client's own stream helper accumulates the same reply
    with client.responses.stream(**ask) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == deltas == plain.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_makes_an_incomplete_response(server, stream):
    ask = dict(model=server.model_id, input="Tell me a long story about a dragon.", max_output_tokens=5, temperature=0)
    if stream:
        events, r = streamed(client_of(server).responses.create(stream=True, **ask))
        assert events[-1].type == "response.incomplete"
    else:
        r = client_of(server).responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def calls_of(response):
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_function_call_loop(server, stream):
    client = client_of(server)
    ask = dict(model=server.model_id, tools=TOOLS, max_output_tokens=200, temperature=0.7, extra_body={"seed": 3})
    # 1. the model calls a function
    if stream:
        events, r = streamed(client.responses.create(input=QUESTION, tool_choice="required", stream=True, **ask))
        assert "response.function_call_arguments.delta" in {e.type for e in events}
    else:
        r = client.responses.create(input=QUESTION, tool_choice="required", **ask)
    assert r.status == "completed"
    calls = calls_of(r)
    assert calls and r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        assert call.name in ("get_weather", "get_time")
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    # 2. the output and the results go back with the whole input; the model answers or calls again
    history = [{"role": "user", "content": QUESTION}] + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"} for call in calls]
    if stream:
        _, again = streamed(client.responses.create(input=history, stream=True, **ask))
    else:
        again = client.responses.create(input=history, **ask)
    assert again.status in ("completed", "incomplete") and again.output
    assert again.output_text or calls_of(again)
    # 3. with tool_choice none the reply is text
    text = client.responses.create(input=history, tool_choice="none", **ask)
    assert not calls_of(text) and [item.type for item in text.output] == ["message"]


def test_a_named_function_gets_arguments_valid_under_its_schema(server):
    for seed in range(3):
        r = client_of(server).responses.create(
            model=server.model_id, input=QUESTION, tools=TOOLS, max_output_tokens=200, temperature=1.0,
            tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
            extra_body={"seed": seed})
        [call] = calls_of(r)
        assert call.name == "get_weather" and r.parallel_tool_calls is False
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)


def test_text_format_json_schema_binds_the_reply(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    for seed in range(3):
        r = client_of(server).responses.create(model=server.model_id, input="Name a big city.", text=fmt,
                                               max_output_tokens=100, temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), schema)
    r = client_of(server).responses.create(model=server.model_id, input="Name a big city, in JSON.",
                                           text={"format": {"type": "json_object"}}, max_output_tokens=100,
                                           temperature=0)
    assert isinstance(json.loads(r.output_text), dict)


def test_previous_response_id_is_a_400_saying_the_server_is_stateless(server):
    client = client_of(server)
    first = client.responses.create(model=server.model_id, input="Say hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=server.model_id, input="And again", previous_response_id=first.id,
                                max_output_tokens=3)
    assert info.value.body["param"] == "previous_response_id" and "stateless" in info.value.body["message"]
    assert "whole conversation" in info.value.body["message"]
    # store is accepted and ignored; the server goes on serving
    assert client.responses.create(model=server.model_id, input="Say hi", store=True, max_output_tokens=3).output


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "nested"}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests_are_400_naming_the_field(server, extra, param):
    client = client_of(server)
    body = dict({"input": QUESTION, "max_output_tokens": 5}, **extra)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=server.model_id, input=body.pop("input"), extra_body=body)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as info:
        client_of(server).responses.create(model="gpt-nope", input="hi", max_output_tokens=2)
    assert info.value.body["param"] == "model"


REASONING = {"regex": r"<think>\n[a-z ]{5,40}\n</think>\n\n[A-Z][a-z ]{3,30}\."}


def test_a_think_block_is_a_reasoning_item(qwen_server):
    client = client_of(qwen_server)
    ask = dict(model=qwen_server.model_id, input="Think, then answer.", max_output_tokens=80,
               extra_body=dict(REASONING, seed=2))
    r = client.responses.create(**ask)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    [part] = reasoning.content
    assert part.type == "reasoning_text" and part.text and "<think>" not in r.output_text
    assert r.output_text.endswith(".") and message.type == "message"
    details = r.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.output_tokens
    events, final = streamed(client.responses.create(stream=True, **ask))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == part.text
    assert final.output[0].content[0].text == part.text and final.output_text == r.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    # the reasoning item goes back as input with the rest of the output
    history = [{"role": "user", "content": "Think, then answer."}] + [item.model_dump(exclude_none=True)
                                                                      for item in r.output]
    history.append({"role": "user", "content": "Again."})
    assert client.responses.create(model=qwen_server.model_id, input=history, max_output_tokens=3).output
