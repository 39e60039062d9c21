"""The OpenAI details real clients rely on (issue 35 part 5), over HTTP on a real `llambda serve`:
logit_bias, stop_token_ids and min_tokens through the official openai client, llama-server's
/tokenize, /detokenize and /apply-template, and --alias names. A tiny random model keeps every
request fast; an in-process Model of the same file is the reference. Every wait is bounded."""
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import llambda
from synth import write_random_llama
from server_process import ServerProcess, openai_client

N_CTX = 256
VOCAB = 300
ALIASES = ("gpt-4o-mini", "team/small-model")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("details") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=VOCAB,
                       tensor_type="Q8_0", n_ctx=1024, seed=11)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--ctx", str(N_CTX), "--parallel", "4", "--threads", "1",
                      *[arg for name in ALIASES for arg in ("--alias", name)])
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def ref(model_path):
    """The same model in this process: what the server must answer."""
    with llambda.load(model_path, n_ctx=N_CTX, threads=1, progress=False) as m:
        yield m


PROMPT = [5, 17, 42, 99, 123, 7, 64]


def ref_ids(ref, n=8, **kw):
    c = ref.submit(PROMPT, max_tokens=n, temperature=0.0, **kw)
    ids = [e.token for e in c if e.token is not None]
    return ids, c


def ref_text(ref, n=8, **kw):
    return "".join(ref.generate(PROMPT, max_tokens=n, temperature=0.0, **kw))


def complete(client, server, n=8, **extra):
    r = client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body=extra)
    return r.choices[0], r.usage


def chat(client, server, n=8, model=None, **extra):
    r = client.chat.completions.create(model=model or server.model_id, max_tokens=n, temperature=0,
                                       messages=[{"role": "user", "content": "hello"}], extra_body=extra)
    return r


# -- logit_bias, stop_token_ids, min_tokens ---------------------------------------------------
def test_logit_bias_minus_100_bans_what_greedy_picked(server, client, ref):
    plain, _ = ref_ids(ref, ignore_eos=True)
    choice, _ = complete(client, server, ignore_eos=True)
    assert choice.text == ref_text(ref, ignore_eos=True)
    bias = {str(plain[0]): -100}
    banned, _ = ref_ids(ref, ignore_eos=True, logit_bias=bias)
    assert plain[0] not in banned
    choice = client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias=bias, extra_body={"ignore_eos": True}).choices[0]
    assert choice.text == ref_text(ref, ignore_eos=True, logit_bias=bias) != ref_text(ref, ignore_eos=True)


def test_logit_bias_plus_100_forces_a_token_when_sampling(server, client, ref):
    forced = next(t for t in range(50, VOCAB) if ref.tokenizer.token_bytes(t).isascii()
                  and ref.tokenizer.token_bytes(t).strip() and t not in ref.tokenizer.eog_ids)
    piece = ref.tokenizer.token_bytes(forced).decode()
    r = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=1.0, seed=3, logit_bias={str(forced): 100})
    assert r.choices[0].message.content == piece * 5 and r.usage.completion_tokens == 5


def test_stop_token_ids_stop_like_eos(server, client, ref):
    plain, _ = ref_ids(ref, n=12, ignore_eos=True)
    k = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])
    choice, usage = complete(client, server, n=12, ignore_eos=True, stop_token_ids=[plain[k]])
    assert choice.finish_reason == "stop" and usage.completion_tokens == k
    assert choice.text == ref.tokenizer.decode(plain[:k])
    # streamed, on the chat endpoint: the last chunk says stop
    stop = 77
    finishes, pieces = [], []
    for chunk in client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=8, temperature=0, stream=True, logit_bias={"77": 100},
                                                extra_body={"stop_token_ids": [stop]}):
        for c in chunk.choices:
            finishes.append(c.finish_reason)
            pieces.append(c.delta.content or "")
    assert finishes[-1] == "stop" and "".join(pieces) == ""


def test_min_tokens_holds_back_eos_on_both_endpoints(server, client, ref):
    eos = str(ref.tokenizer.eos_id)
    r = chat(client, server, n=10, logit_bias={eos: 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 0
    r = chat(client, server, n=10, logit_bias={eos: 100}, min_tokens=3)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    choice, usage = complete(client, server, n=10, logit_bias={eos: 100}, min_tokens=4)
    assert choice.finish_reason == "stop" and usage.completion_tokens == 4
    assert choice.text == ref_text(ref, n=10, logit_bias={eos: 100}, min_tokens=4)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("change, param", [
    ({"logit_bias": {"300": 5}}, "logit_bias"),              # outside the vocabulary
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"logit_bias": {"-3": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"stop_token_ids": [300]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "7"}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens")])
def test_bad_values_get_400_naming_the_field(server, path, change, param):
    body = {"model": server.model_id, "max_tokens": 4}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, _, error = server.post_json(path, dict(body, **change))
    assert status == 400, error
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
    assert param.split(".")[0] in error["error"]["message"]
    assert server.get("/health")[0] == 200


def test_the_openai_client_sees_a_bad_logit_bias_as_bad_request(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, logit_bias={"100000": 1})
    assert e.value.body["param"] == "logit_bias" and "outside the vocabulary" in e.value.body["message"]


# -- /tokenize, /detokenize, /apply-template -----------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server, ref):
    text = "Hello world, hello tokens!"
    status, _, body = server.post_json("/tokenize", {"content": text})
    assert status == 200 and body["tokens"] == ref.tokenize(text, add_special=False)
    status, _, again = server.post_json("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and again == {"content": text}
    _, _, special = server.post_json("/tokenize", {"content": text, "add_special": True})
    assert special["tokens"] == ref.tokenize(text, add_special=True)


def test_tokenize_with_pieces(server, ref):
    text = "pieces of text"
    _, _, body = server.post_json("/tokenize", {"content": text, "with_pieces": True})
    assert [t["id"] for t in body["tokens"]] == ref.tokenize(text, add_special=False)
    assert "".join(t["piece"] for t in body["tokens"]) == text
    # a token whose bytes are not whole UTF-8 shows them as a list of byte values
    split = next(t for t in range(VOCAB) if not _is_utf8(ref.tokenizer.token_bytes(t)))
    _, _, body = server.post_json("/tokenize", {"content": ["a", split], "with_pieces": True})
    assert body["tokens"][-1] == {"id": split, "piece": list(ref.tokenizer.token_bytes(split))}


def _is_utf8(raw):
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_tokenize_mixed_content_and_parse_special(server, ref):
    _, _, body = server.post_json("/tokenize", {"content": ["one", 7, " two"], "add_special": True})
    assert body["tokens"] == ref.tokenize("one", add_special=True) + [7] + ref.tokenize(" two", add_special=False)
    end = ref.tokenizer.token_text(ref.tokenizer.eos_id)         # <|im_end|>
    _, _, parsed = server.post_json("/tokenize", {"content": end})
    _, _, literal = server.post_json("/tokenize", {"content": end, "parse_special": False})
    assert parsed["tokens"] == [ref.tokenizer.eos_id]
    assert ref.tokenizer.eos_id not in literal["tokens"] and len(literal["tokens"]) > 1


def test_apply_template_gives_the_chat_prompt(server, client, ref):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    status, _, body = server.post_json("/apply-template", {"messages": messages})
    assert status == 200 and body == {"prompt": ref.render_chat(messages)}
    # the prompt sent to /v1/completions gives the reply /v1/chat/completions gives
    assert ref.chat_template.builtin is False
    r = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    c = client.completions.create(model=server.model_id, prompt=body["prompt"], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].text == r.choices[0].message.content


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a", 300]}, "content[1]"),
    ("/tokenize", {"content": ["a", -1]}, "content[1]"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/detokenize", {"tokens": [1, 300]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-2]}, "tokens[0]"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/apply-template", {}, "messages"),
    ("/apply-template", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("/apply-template", {"messages": [{"role": "user", "content": "x"}],
                         "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs")])
def test_utility_routes_refuse_bad_input_with_400(server, path, body, param):
    status, _, error = server.post_json(path, body)
    assert status == 400 and error["error"]["param"] == param, error
    assert server.request("POST", path, b"{not json")[0] == 400
    assert server.get("/health")[0] == 200


# -- --alias -------------------------------------------------------------------------------------
def test_models_lists_the_id_then_the_aliases(server, client):
    assert [m.id for m in client.models.list().data] == [server.model_id, *ALIASES]
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    assert client.models.retrieve(server.model_id).id == server.model_id


def test_an_alias_reaches_the_model(server, client):
    r = chat(client, server, n=4, model="gpt-4o-mini", ignore_eos=True)
    plain = chat(client, server, n=4, ignore_eos=True)
    assert r.model == "gpt-4o-mini" and r.choices[0].message.content == plain.choices[0].message.content
    c = client.completions.create(model="team/small-model", prompt="hi", max_tokens=2)
    assert c.model == "team/small-model"


def test_an_unknown_name_gets_404_with_the_names_that_exist(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    body = e.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model" and "'gpt-5'" in body["message"]
    assert all(repr(name) in body["message"] for name in (server.model_id, *ALIASES))
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_a_blank_alias_is_refused_before_the_model_loads(model_path):
    r = subprocess.run([sys.executable, "-m", "llambda.cli", "serve", "--model", str(model_path), "--port", "0",
                        "--alias", " padded"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--alias" in r.stderr and "Traceback" not in r.stderr


def test_every_choice_of_n_follows_the_options(server, client, ref):
    eos = str(ref.tokenizer.eos_id)
    r = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10, temperature=1.0, seed=9, n=3, logit_bias={eos: 100},
                                       extra_body={"min_tokens": 2})
    assert len(r.choices) == 3 and all(c.finish_reason == "stop" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 2
