"""Structured output over HTTP: `llambda serve` with the default model (a real vocabulary),
driven by the official openai client. Every constrained reply parses (JSON validates under its
schema), plain and streamed, on both endpoints; bad constraints get a 400 in OpenAI's error
shape naming the field, and the server keeps serving."""
import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from server_process import ServerProcess, openai_client

RECIPE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
    "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 1, "maxItems": 3}},
    "required": ["title", "minutes", "steps"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_gguf):
    s = ServerProcess(default_gguf, "--ctx", "1024", "--parallel", "4", "--threads", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def ask(client, server, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "A quick recipe as JSON."}])
    kw.setdefault("max_tokens", 300)
    return client.chat.completions.create(model=server.model_id, **kw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_reply_validates(client, server, seed):
    r = ask(client, server, seed=seed, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), RECIPE)


def test_json_schema_streamed_equals_plain(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE}}
    plain = ask(client, server, seed=7, temperature=0.8, response_format=fmt).choices[0].message.content
    pieces, finish = [], None
    for chunk in ask(client, server, seed=7, temperature=0.8, response_format=fmt, stream=True):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == plain and finish == "stop"
    jsonschema.validate(json.loads(plain), RECIPE)


def test_the_clients_own_parse_helper(client, server):
    # openai's parse(): a pydantic model becomes a strict json_schema, the reply becomes the model
    class City(pydantic.BaseModel):
        name: str
        country: str
        population: int
    r = client.chat.completions.parse(model=server.model_id, response_format=City, max_tokens=200, seed=1,
                                      messages=[{"role": "user", "content": "Describe Paris."}])
    assert isinstance(r.choices[0].message.parsed, City)


def test_json_object_reply_is_an_object(client, server):
    r = ask(client, server, seed=4, temperature=0.7, max_tokens=500, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Return a small JSON object about cats."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_regex_choice_and_grammar_on_both_endpoints(client, server):
    options = ["positive", "negative", "neutral"]
    r = ask(client, server, seed=1, extra_body={"choice": options},
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}])
    assert r.choices[0].message.content in options
    c = client.completions.create(model=server.model_id, prompt="Call me at", max_tokens=30, seed=2,
                                  temperature=1.0, extra_body={"regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", c.choices[0].text) and c.choices[0].finish_reason == "stop"
    c = client.completions.create(model=server.model_id, prompt="Yes or no?", max_tokens=10, seed=3,
                                  extra_body={"grammar": 'root ::= " " ("yes" | "no")'})
    assert c.choices[0].text in (" yes", " no")
    c = client.completions.create(model=server.model_id, prompt="Pick:", max_tokens=10, seed=3,
                                  extra_body={"guided_choice": ["A", "B"]})
    assert c.choices[0].text in ("A", "B")
    r = ask(client, server, seed=5, extra_body={"structured_outputs": {"regex": "[a-z]{2,5}"}})
    assert re.fullmatch("[a-z]{2,5}", r.choices[0].message.content)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=server.model_id, prompt="Call me at", max_tokens=30, seed=2, temperature=1.0, stream=True,
        extra_body={"regex": r" \d{3}-\d{4}"}) if ch.choices)
    assert re.fullmatch(r" \d{3}-\d{4}", streamed)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ({"regex": "(unclosed"}, "regex", "unclosed"),
    ({"choice": []}, "choice", "at least one"),
    ({"regex": "a", "choice": ["a"]}, "choice", "at most one"),
    ({"json_schema": {"type": "object"}, "response_format": {"type": "json_object"}}, "json_schema", "at most one"),
])
def test_bad_constraints_are_400_naming_the_field(client, server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, server, extra_body=extra)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param and words in error["message"]
    assert ask(client, server, max_tokens=3).choices[0].finish_reason in ("stop", "length")   # still serving
