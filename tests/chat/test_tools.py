"""Tool calls and reasoning (llambda/chat/tools.py, reply.py, turn.py).

Each format reads back what its model family writes, whole and cut anywhere while it streams
(the streamed deltas always add up to the whole reply's message); every format's grammar is
accepted by llguidance on a real vocabulary and forces a call that parses and validates under
the tool's schema; real templates (Qwen 2.5/3, Llama 3.2, Hermes) render the tools, earlier
calls and tool results; bad tool lists and choices name the field at fault.
"""
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import llambda
from llambda.chat import tools
from llambda.chat.reply import ReplyReader, split_reasoning
from llambda.chat.tools import ToolError, parse_tool_choice, parse_tools
from llambda.chat import turn

jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: tools.closed_objects(t["function"]["parameters"]) for t in TOOLS}

# (format, a reply in it, its content, its calls)
REPLIES = [
    (tools.HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]),
    (tools.HERMES, "No call, only <tool_call text.", "No call, only <tool_call text.", []),
    (tools.LLAMA3, '{"name": "add", "parameters": {"a": 4, "b": {"deep": [1, "}"]}}}', None,
     [("add", '{"a": 4, "b": {"deep": [1, "}"]}}')]),
    (tools.PHI4, 'Sure<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|/tool_call|>', "Sure",
     [("get_weather", '{"city": "Oslo"}')]),
    (tools.JSON, '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}', None, [("add", '{"a": 1, "b": 2}')]),
    (tools.JSON, '{"response": "It is \\"sunny\\" \\u00e0 Paris.\\n"}', 'It is "sunny" à Paris.\n', []),
]


# -- reading replies ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, text, content, calls", REPLIES)
def test_each_format_reads_its_calls(fmt, text, content, calls):
    reply = ReplyReader(fmt, reasoning=False)
    reply.feed(text)
    message = reply.message()
    assert message["content"] == content
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]
    assert got == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"] or [])


def streamed(reader, pieces):
    deltas = [d for p in pieces for d in reader.feed(p)] + reader.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for call in d.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert entry["name"] is None and call["type"] == "function"      # id and name once, first
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return content, reasoning, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(REPLIES + [(tools.HERMES, "<think>\nHmm, weather.\n</think>\n\nOk.\n<tool_call>\n"
                                                      '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                                        "Ok.", [("add", '{"a": 1, "b": 2}')])]),
       cuts=st.lists(st.integers(1, 400), max_size=30))
def test_streamed_deltas_add_up_to_the_message(case, cuts):
    fmt, text, _, _ = case
    points = sorted({c for c in cuts if c < len(text)})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    reader = ReplyReader(fmt, reasoning=True)
    content, reasoning, calls = streamed(reader, pieces)
    whole = ReplyReader(fmt, reasoning=True)
    whole.feed(text)
    message = whole.message()
    assert content == (message["content"] or "") and reasoning == (message["reasoning_content"] or "")
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>\nstep 1\n</think>\n\nAnswer", False, ("step 1\n", "Answer")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("no think here", False, ("", "no think here")),
    ("still thinking", False, ("", "still thinking")),
    ("prompt opened it</think>\nAnswer", True, ("prompt opened it", "Answer")),
    ("<think>never closed", False, ("never closed", "")),
])
def test_split_reasoning(text, thinking, expected):
    assert split_reasoning(text, thinking) == expected


def test_a_partial_think_tag_waits():
    assert split_reasoning("<thi", partial=True) == ("", "")
    assert split_reasoning("<think>abc</thi", partial=True) == ("abc", "")


# -- tool lists and choices -----------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ("tools", "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
])
def test_bad_tools_name_the_field(bad, field):
    with pytest.raises(ToolError) as info:
        parse_tools(bad)
    assert info.value.field == field


def test_tool_choices():
    offered = parse_tools(TOOLS)
    assert parse_tool_choice(None, offered) == ("auto", None)
    assert parse_tool_choice("required", offered) == ("required", None)
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, offered) == ("required", "add")
    assert parse_tool_choice("auto", []) == ("none", None)
    for bad, field in (("sometimes", "tool_choice"), ({"type": "function", "function": {"name": "nope"}},
                                                      "tool_choice.function.name"), (5, "tool_choice")):
        with pytest.raises(ToolError) as info:
            parse_tool_choice(bad, offered)
        assert info.value.field == field
    with pytest.raises(ToolError, match="needs tools"):
        parse_tool_choice("required", [])


def test_unmentioned_properties_are_closed():
    closed = tools.closed_objects({"type": "object", "properties": {"o": {"type": "object", "properties": {}}}})
    assert closed["additionalProperties"] is False and closed["properties"]["o"]["additionalProperties"] is False
    kept = tools.closed_objects({"type": "object", "properties": {}, "additionalProperties": True})
    assert kept["additionalProperties"] is True


@pytest.mark.parametrize("name, expected", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"), ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"), ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("google-gemma-2-2b-it.jinja", "json"), ("microsoft-Phi-3.5-mini-instruct.jinja", "json"),
])
def test_the_format_comes_from_the_template(name, expected):
    assert tools.format_for((TEMPLATES / name).read_text()).name == expected


# -- on a real vocabulary ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(default_gguf):
    with llambda.load(default_gguf, n_ctx=2048, parallel=2, threads=1, progress=False) as m:
        yield m


def run_turn(model, t, seed=1, max_tokens=200):
    c = model.submit(t.ids, constraint=t.constraint, max_tokens=max_tokens, temperature=0.8, seed=seed)
    reader = t.reader()
    for event in c:
        reader.feed(event.text)
    return c, reader.message()


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "phi4", "json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_parse_and_validate_in_every_format(model, fmt, choice, parallel):
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    t = turn.prepare(model, messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                     tool_format=tools.format_named(fmt))
    c, message = run_turn(model, t)
    calls = message["tool_calls"]
    assert calls, (c.stop_reason, model.detokenize(c.ids))
    assert parallel or len(calls) == 1
    for call in calls:
        name = call["function"]["name"]
        assert isinstance(choice, str) or name == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_auto_json_format_replies_or_calls(model):
    messages = [{"role": "user", "content": "Say hello."}]
    t = turn.prepare(model, messages, tools=TOOLS, tool_format=tools.JSON)
    for seed in range(3):
        c, message = run_turn(model, t, seed=seed, max_tokens=300)
        assert c.finish_reason == "stop"
        assert message["tool_calls"] or isinstance(message["content"], str)


def test_auto_lazy_grammar_leaves_text_free_until_the_trigger(model):
    # hermes, auto: free text passes; a call that starts must be a tool's, with valid arguments
    t = turn.prepare(model, [{"role": "user", "content": "Hi"}], tools=TOOLS, tool_format=tools.HERMES)
    text = model.tokenize("Hello there! <tool_call>\n", add_special=False)
    assert t.constraint.matcher.consume_tokens(text)
    assert not t.constraint.matcher.consume_tokens(model.tokenize('{"name": "nope"', add_special=False))


@pytest.mark.parametrize("template", ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja",
                                      "meta-llama-Llama-3.2-3B-Instruct.jinja",
                                      "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"])
def test_real_templates_render_tools_calls_and_results(default_gguf, template):
    with llambda.load(default_gguf, n_ctx=4096, threads=1, progress=False,
                      chat_template=str(TEMPLATES / template)) as m:
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        t = turn.prepare(m, messages, tools=TOOLS)
        prompt = m.detokenize(t.ids)
        assert "get_weather" in prompt and "The weather in a city" in prompt        # the tools
        assert '"city": "Paris"' in prompt and '"{\\"city' not in prompt            # the call, as an object
        assert "sunny, 21 C" in prompt                                               # its result


def test_json_format_writes_history_into_the_conversation(model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = model.detokenize(turn.prepare(model, messages, tools=TOOLS).ids)
    assert "Be brief." in prompt and "You can call these tools" in prompt
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in prompt
    assert '"tool_response"' in prompt and "sunny" in prompt
    none = model.detokenize(turn.prepare(model, messages, tools=TOOLS, tool_choice="none").ids)
    assert "You can call these tools" not in none and "sunny" in none


def test_template_kwargs_reach_the_template(default_gguf):
    with llambda.load(default_gguf, threads=1, progress=False,
                      chat_template=str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja")) as m:
        messages = [{"role": "user", "content": "hi"}]
        off = m.detokenize(turn.prepare(m, messages, template_kwargs={"enable_thinking": False}).ids)
        on = m.detokenize(turn.prepare(m, messages).ids)
        assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")
        with pytest.raises(llambda.errors.UserError, match="chat_template_kwargs"):
            turn.prepare(m, messages, template_kwargs={"messages": []})


def test_tools_and_another_constraint_do_not_mix(model):
    with pytest.raises(ToolError, match="response_format"):
        turn.prepare(model, [{"role": "user", "content": "x"}], tools=TOOLS,
                     constraint=model.constraint(json_object=True))


def test_respond_is_the_python_api_of_a_turn(model):
    reply = model.respond([{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False, max_tokens=300, seed=1, temperature=0.5)
    assert reply["role"] == "assistant" and reply["finish_reason"] == "tool_calls" and reply["content"] is None
    for call in reply["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    plain = model.respond([{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    assert plain["tool_calls"] is None and plain["reasoning_content"] is None and isinstance(plain["content"], str)
    with pytest.raises(ToolError, match="tool_choice"):
        model.respond([{"role": "user", "content": "Hi"}], tools=TOOLS, tool_choice="always")


def test_a_forced_call_may_follow_a_think_block(model):
    offered = parse_tools(TOOLS)
    grammar = tools.HERMES.grammar(offered, "required", "add", False, set(), think=True)
    from llambda.serving.constraints import Constraint

    def accepts(text):
        c = Constraint(grammar, model.tokenizer, model.n_vocab)
        return c.matcher.consume_tokens(model.tokenize(text, add_special=False))
    assert accepts("<think>\nadd them </thin k>\n</think>\n<tool_call>\n")          # the block ends at </think>
    assert accepts('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert not accepts("<think>x</think> Sure, here")                                # then only the call
    assert not accepts("Sure")
