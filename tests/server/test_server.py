"""`llambda serve` end to end: a real server on loopback, driven by the official openai client
(and by raw HTTP where the bytes matter). A tiny random model keeps every request fast on
any backend. Every wait is bounded (timeouts on the client, deadlines on polls)."""
import concurrent.futures
import json
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from llambda.codegen.contract import KV_BLOCK
from synth import write_random_llama
from server_process import ServerProcess, openai_client

N_CTX = 256
LONG_CTX = 32768         # the long server's: a stream of that many tokens outlasts the test's checks, even on AVX2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=LONG_CTX, seed=11)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--ctx", str(N_CTX), "--parallel", "4", "--threads", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def long_server(model_path):
    """One slot, one waiting place, long contexts: for streams that must still run when looked at."""
    s = ServerProcess(model_path, "--ctx", str(LONG_CTX), "--parallel", "1", "--max-waiting", "1", "--threads", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


def client_for(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


def stream_completion(client, model, prompt, seed, max_tokens=12):
    """(text, token strings, finish_reason, usage) of one streamed, seeded completion."""
    text, tokens, finish, usage = [], [], None, None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                                       seed=seed, stream=True, logprobs=0, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text)
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
            finish = choice.finish_reason or finish
    return "".join(text), tokens, finish, usage


# -- the endpoints ---------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model_id]
    assert server.get("/health")[0] == 200


def test_chat_completion_plain_and_streamed_agree(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=10, seed=3,
                                           extra_body={"ignore_eos": True})
    choice = plain.choices[0]
    assert plain.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 10
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 10

    pieces, finishes, usage, roles = [], [], None, []
    for chunk in client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=10, seed=3,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            roles.append(c.delta.role)
            pieces.append(c.delta.content or "")
            finishes.append(c.finish_reason)
    assert "".join(pieces) == choice.message.content
    assert roles[0] == "assistant" and finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert usage.completion_tokens == 10 and usage.prompt_tokens == plain.usage.prompt_tokens


def test_sse_bytes_end_with_done(server):
    status, headers, raw = server.request("POST", "/v1/completions", dict(
        model=server.model_id, prompt="hi", max_tokens=3, seed=1, stream=True))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in last                   # only with stream_options.include_usage


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, seed=2, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 or entry.token == entry.top_logprobs[0].token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_stop_string_and_greedy_text_equals_the_library(server, client, model_path):
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    import llambda
    with llambda.load(model_path, n_ctx=N_CTX, threads=1, progress=False) as m:
        mine = "".join(m.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True))
    assert text == mine
    if len(text) >= 6:
        stop = text[3:5]
        cut = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=16, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True})
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_concurrent_seeded_streams_equal_their_solo_runs(server, client):
    prompts = [(f"Request number {i} says", 100 + i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: stream_completion(client, server.model_id, *p), prompts))
    alone = [stream_completion(client, server.model_id, *p) for p in prompts]
    for (text, tokens, finish, usage), solo in zip(together, alone):
        assert (text, tokens, finish) == solo[:3]
        assert len(tokens) == 12 and finish == "length" and usage.completion_tokens == 12
    assert len({t for t, *_ in together}) > 1           # the seeds do differ


def test_prefix_reuse_is_reported(server, client):
    system = "You are a careful assistant. " * 4          # several KV blocks of shared prefix
    before = server.metrics()["llambda_prefix_cache_hit_tokens_total"]
    usages = []
    for question in ("first question", "second question"):
        r = client.chat.completions.create(model=server.model_id, max_tokens=2, seed=1,
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": question}])
        usages.append(r.usage)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert usages[1].prompt_tokens > 3 * KV_BLOCK
    assert cached >= 2 * KV_BLOCK and cached % KV_BLOCK == 0 and cached < usages[1].prompt_tokens
    after = server.metrics()["llambda_prefix_cache_hit_tokens_total"]
    assert after - before >= cached


def test_metrics_names(server):
    m = server.metrics()
    for name in ("llambda_requests_running", "llambda_requests_waiting", "llambda_prompt_tokens_total",
                 "llambda_generated_tokens_total", "llambda_prefix_cache_hit_tokens_total",
                 "llambda_kv_blocks_in_use", "llambda_kv_blocks_total"):
        assert name in m, name
    assert m["llambda_generated_tokens_total"] > 0
    # vLLM's names beside ours, for routers and dashboards made for vLLM
    assert m["vllm:num_requests_running"] == m["llambda_requests_running"]
    assert m["vllm:num_requests_waiting"] == m["llambda_requests_waiting"]
    assert m["vllm:kv_cache_usage_perc"] == m["llambda_kv_blocks_in_use"] / m["llambda_kv_blocks_total"]


def test_disconnect_cancels_and_frees_kv_blocks(long_server):
    server, client = long_server, client_for(long_server)
    idle = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0)
    assert idle["llambda_requests_running"] == 0
    stream = client.completions.create(model=server.model_id, prompt="go on and on", max_tokens=LONG_CTX,
                                       temperature=1.0, seed=5, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    busy = server.metrics()
    assert busy["llambda_requests_running"] == 1 and busy["llambda_kv_blocks_in_use"] > 0
    stream.close()                                       # the client goes away mid-stream
    m = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0 and m["llambda_kv_blocks_in_use"] == 0)
    assert m["llambda_requests_running"] == 0 and m["llambda_kv_blocks_in_use"] == 0
    assert m["llambda_generated_tokens_total"] - idle["llambda_generated_tokens_total"] < LONG_CTX - 100
    assert m["llambda_client_disconnects_total"] >= 1


def test_disconnect_cancels_a_plain_request_too(long_server):
    server = long_server
    idle = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0)
    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):           # the client gives up and closes the connection
        impatient.completions.create(model=server.model_id, prompt="take your time", max_tokens=LONG_CTX,
                                     temperature=1.0, seed=6, extra_body={"ignore_eos": True})
    m = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0 and m["llambda_kv_blocks_in_use"] == 0)
    assert m["llambda_requests_running"] == 0 and m["llambda_kv_blocks_in_use"] == 0
    assert m["llambda_generated_tokens_total"] - idle["llambda_generated_tokens_total"] < LONG_CTX - 100


# -- bad requests: 4xx with OpenAI's error body, and the server goes on -----------------------
def _good(server):
    return dict(model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


BAD_CHAT = [
    ("not json", b'{"model": "m", "messages": [', 400, None, "json_invalid"),
    ("not an object", b'[1, 2]', 400, None, None),
    ("empty body", b"", 400, None, None),
    ("missing messages", {"max_tokens": 2}, 400, "messages", "missing_required_parameter"),
    ("missing model", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "missing_required_parameter"),
    ("messages not a list", {"messages": "hi"}, 400, "messages", None),
    ("empty messages", {"messages": []}, 400, "messages", None),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("temperature a string", {"temperature": "hot"}, 400, "temperature", None),
    ("max_tokens a float", {"max_tokens": 1.5}, 400, "max_tokens", None),
    ("stream a string", {"stream": "yes"}, 400, "stream", None),
    ("stop a number", {"stop": 5}, 400, "stop", None),
    ("temperature too high", {"temperature": 3.0}, 400, "temperature", None),
    ("top_p too high", {"top_p": 1.5}, 400, "top_p", None),
    ("negative max_tokens", {"max_tokens": -1}, 400, "max_tokens", None),
    ("presence_penalty out of range", {"presence_penalty": 5}, 400, "presence_penalty", None),
    ("top_logprobs too many", {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None),
    ("n of 0", {"n": 0}, 400, "n", None),
    ("n too many", {"n": 129}, 400, "n", None),
    ("unknown model", {"model": "gpt-9"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("name,change,status,param,code", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests_get_openai_errors(server, name, change, status, param, code):
    if isinstance(change, bytes):
        body = change
    else:
        body = {k: v for k, v in {**_good(server), **change}.items()}
        if name.startswith("missing"):
            body.pop(name.split()[1])
    got, _, raw = server.request("POST", "/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert got == status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert server.post_json("/v1/chat/completions", _good(server))[0] == 200       # still serving


def test_prompt_longer_than_the_context(server, client):
    for prompt in ([7] * N_CTX, "word " * (2 * N_CTX)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=server.model_id, prompt=prompt, max_tokens=1)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, max_tokens=1,
                                       messages=[{"role": "user", "content": "word " * (2 * N_CTX)}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):           # a token id outside the vocabulary
        client.completions.create(model=server.model_id, prompt=[1, 100000], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert client.completions.create(model=server.model_id, prompt="hi", max_tokens=1).choices[0].finish_reason


def test_unknown_route_and_method(server):
    status, _, raw = server.get("/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    status, _, raw = server.get("/v1/completions")
    assert status == 405 and "error" in json.loads(raw)


# -- load and shutdown: servers of their own ----------------------------------------------
def test_full_waiting_queue_gets_429_with_retry_after(long_server):
    s, client = long_server, client_for(long_server)
    s.wait_metrics(lambda m: m["llambda_requests_running"] + m["llambda_requests_waiting"] == 0)
    long = dict(model=s.model_id, prompt="a long one", max_tokens=LONG_CTX, temperature=1.0, seed=1,
                stream=True, extra_body={"ignore_eos": True})
    running = client.completions.create(**long)
    next(iter(running))                                       # admitted: it holds the only slot
    waiting = client.completions.create(**long)               # queued
    try:
        m = s.wait_metrics(lambda m: m["llambda_requests_waiting"] == 1)
        assert m["llambda_requests_running"] == 1 and m["llambda_requests_waiting"] == 1
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=s.model_id, prompt="one more", max_tokens=1)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.code == "server_busy"
    finally:
        running.close()
        waiting.close()
    m = s.wait_metrics(lambda m: m["llambda_requests_running"] + m["llambda_requests_waiting"] == 0)
    assert m["llambda_requests_running"] + m["llambda_requests_waiting"] == 0
    assert client.completions.create(model=s.model_id, prompt="now", max_tokens=1).choices


# grace 0: the running stream is cancelled at once (it ends with an error event, unless it was
# already done); grace 30: it runs to its end, then the server exits
@pytest.mark.parametrize("sig,grace", [(signal.SIGTERM, 0), (signal.SIGINT, 30)], ids=["SIGTERM", "SIGINT"])
def test_shutdown_exits_0_and_ends_running_streams(model_path, sig, grace):
    s = ServerProcess(model_path, "--ctx", str(N_CTX), "--parallel", "2", "--threads", "1",
                      "--shutdown-grace", str(grace))
    client = client_for(s)
    outcome = {}

    def read_stream():
        try:
            stream = client.completions.create(model=s.model_id, prompt="never ending", max_tokens=N_CTX,
                                               temperature=1.0, seed=1, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                outcome.setdefault("first", time.monotonic())
                for choice in chunk.choices:
                    outcome["finish"] = choice.finish_reason or outcome.get("finish")
            outcome["ended"] = "completed"
        except openai.APIError as e:
            outcome["ended"] = type(e).__name__
    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while "first" not in outcome and reader.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    s.signal(sig)
    code = s.proc.wait(timeout=60)
    reader.join(timeout=30)
    assert code == 0, "".join(s.log)
    assert not reader.is_alive()
    if grace == 0:
        assert time.monotonic() - t0 < 10
        assert outcome.get("ended") in ("APIError", "completed"), outcome
    else:
        assert outcome.get("ended") == "completed" and outcome["finish"] == "length", outcome
    with pytest.raises(OSError):                       # nobody listens any more
        s.get("/health")


def test_model_names(tmp_path):
    from types import SimpleNamespace
    from llambda.server.serve import model_names
    converted = SimpleNamespace(path="/cache/converted/x-0123.llb")
    gguf = tmp_path / "My-Model.Q4_K_M.gguf"
    gguf.write_bytes(b"")
    assert model_names(converted, str(gguf)) == ("My-Model.Q4_K_M", {"My-Model.Q4_K_M.gguf", str(gguf), "x-0123"})
    assert model_names(converted, None)[0] == "SmolLM2-135M-Instruct.Q4_1"
    assert "smollm2-135m" in model_names(converted, None)[1]
    assert model_names(converted, "smollm2-135m") == (
        "SmolLM2-135M-Instruct.Q4_1", {"SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m", "x-0123"})
