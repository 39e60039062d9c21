"""/v1/embeddings over HTTP (llambda/server/embeddings.py): `llambda serve` with the default model,
driven by the official openai client. The vectors are Model.embed's bit for bit, as floats and
as base64 (the client's default: it asks for base64 and decodes it); every input shape OpenAI
takes; usage counts the tokens; `--pooling` overrides the file; bad requests get a 400 in
OpenAI's error shape naming the field, and the server goes on."""
import base64

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import llambda
from server_process import ServerProcess, openai_client

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]


@pytest.fixture(scope="module")
def server(default_gguf):
    s = ServerProcess(default_gguf, "--ctx", "256", "--parallel", "4", "--threads", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def local(default_gguf):
    """The same model in this process: what the server's vectors must equal."""
    with llambda.load(default_gguf, n_ctx=256, parallel=4, progress=False) as m:
        yield m


def vectors(response):
    assert response.object == "list"
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    return np.array([d.embedding for d in response.data], np.float32)


def test_floats_equal_model_embed(client, server, local):
    r = client.embeddings.create(model=server.model_id, input=TEXTS, encoding_format="float")
    got = vectors(r)
    np.testing.assert_array_equal(got, local.embed(TEXTS))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-6)
    assert r.model == server.model_id
    tokens = sum(len(local.tokenize(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_the_clients_default_base64_decodes_to_the_same(client, server, local):
    r = client.embeddings.create(model=server.model_id, input=TEXTS[0])      # base64 under the hood
    np.testing.assert_array_equal(vectors(r), local.embed(TEXTS[:1]))


def test_base64_is_little_endian_float32(client, server, local):
    r = client.embeddings.create(model=server.model_id, input=TEXTS, encoding_format="base64")
    got = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in r.data])
    np.testing.assert_array_equal(got, local.embed(TEXTS))


def test_token_id_inputs(client, server, local):
    ids = [local.tokenize(t) for t in TEXTS]
    one = client.embeddings.create(model=server.model_id, input=ids[1], encoding_format="float")
    np.testing.assert_array_equal(vectors(one), local.embed(TEXTS[1:2]))
    assert one.usage.prompt_tokens == len(ids[1])
    many = client.embeddings.create(model=server.model_id, input=ids, encoding_format="float")
    np.testing.assert_array_equal(vectors(many), local.embed(TEXTS))


def test_dimensions_equal_to_the_width_and_user_are_accepted(client, server, local):
    r = client.embeddings.create(model=server.model_id, input="x", dimensions=local.config.dim, user="u-1",
                                 encoding_format="float")
    assert vectors(r).shape == (1, local.config.dim)


def test_other_dimensions_are_refused_saying_why(client, server, local):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=server.model_id, input="x", dimensions=64)
    body = e.value.body
    assert body["param"] == "dimensions" and f"have {local.config.dim} dimensions" in body["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "nothing to embed"),
    ({"input": ""}, "input", "empty text"),
    ({"input": ["a", ""]}, "input", "input[1]: empty text"),
    ({"input": [[1, 2], []]}, "input", "input[1]: no tokens"),
    ({"input": [1, 10 ** 9]}, "input", "outside the vocabulary"),
    ({"input": [[5] * 300]}, "input", "input[0]: 300 tokens, but the context holds 256"),
    ({"input": [1, "a"]}, "input", ""),
    ({"input": 3}, "input", ""),
    ({}, "input", "missing"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "x", "dimensions": "576"}, "dimensions", ""),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    status, _, answer = server.post_json("/v1/embeddings", {"model": server.model_id, **body})
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]


def test_an_unknown_model_is_404(server):
    status, _, answer = server.post_json("/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and answer["error"]["param"] == "model"


def test_the_server_serves_on(client, server, local):
    server.post_json("/v1/embeddings", {"model": server.model_id, "input": []})
    r = client.embeddings.create(model=server.model_id, input="still here", encoding_format="float")
    np.testing.assert_array_equal(vectors(r), local.embed("still here"))
    chat = client.chat.completions.create(model=server.model_id, max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_a_client_that_leaves_cancels_its_texts(server):
    idle = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0)
    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=0.5)
    texts = [[7 + i] * 250 for i in range(64)]
    with pytest.raises(openai.APITimeoutError):           # the client gives up and closes the connection
        impatient.embeddings.create(model=server.model_id, input=texts)
    m = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0 and m["llambda_requests_waiting"] == 0)
    assert m["llambda_requests_running"] == 0 and m["llambda_requests_waiting"] == 0
    assert m["llambda_prompt_tokens_total"] - idle["llambda_prompt_tokens_total"] < 250 * len(texts)


def test_pooling_flag_overrides_the_file(default_gguf, local):
    s = ServerProcess(default_gguf, "--ctx", "256", "--parallel", "2", "--threads", "1", "--pooling", "last")
    try:
        status, _, answer = s.post_json("/v1/embeddings", {"model": s.model_id, "input": TEXTS})
        assert status == 200, answer
        got = np.array([d["embedding"] for d in answer["data"]], np.float32)
        np.testing.assert_array_equal(got, local.embed(TEXTS, pooling="last"))
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_a_rank_gguf_is_a_400_naming_the_model(tmp_path):
    from fastapi.testclient import TestClient
    from llambda.server import create_app
    from synth_arch import write_random_model
    path = write_random_model(tmp_path / "rank.gguf", arch="qwen3", seed=1, n_layer=1, dim=64, n_head=2,
                              n_kv_head=1, head_dim=32, ffn_dim=64, vocab_size=320, pooling_type=4)
    with llambda.load(path, n_ctx=64, progress=False) as m:
        http = TestClient(create_app(m, "rank"))
        r = http.post("/v1/embeddings", json={"model": "rank", "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_model", r.text
        assert "pooling_type = 4 (rank)" in r.json()["error"]["message"]
        m.pooling = "mean"                     # what --pooling does
        r = http.post("/v1/embeddings", json={"model": "rank", "input": "x"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
