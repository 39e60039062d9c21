"""``n`` > 1 over HTTP with the official openai client: n choices indexed 0..n-1, each equal to
a request of n=1 with seed + i, streamed and not, on both endpoints; usage counts the prompt
once and every choice's tokens."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from synth import write_random_llama
from server_process import ServerProcess, openai_client


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("choices") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=1024, seed=11)
    s = ServerProcess(path, "--ctx", "256", "--parallel", "4", "--threads", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_chat_choices_equal_single_requests_with_seed_plus_i(server, client):
    ask = dict(model=server.model_id, messages=[{"role": "user", "content": "tell me"}], max_tokens=8,
               temperature=1.0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(n=3, seed=40, **ask)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=40 + i, **ask) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens and r.usage.completion_tokens == 24
    texts, finishes = ["", "", ""], [None] * 3
    for chunk in client.chat.completions.create(n=3, seed=40, stream=True, **ask):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in r.choices] and finishes == ["length"] * 3


def test_completion_choices_streamed_and_plain(server, client):
    ask = dict(model=server.model_id, prompt="abc", max_tokens=6, temperature=1.0, seed=7, n=2,
               extra_body={"ignore_eos": True})
    plain = client.completions.create(**ask)
    texts = ["", ""]
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **ask):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in plain.choices] and texts[0] != texts[1]
    assert usage.completion_tokens == 12 == plain.usage.completion_tokens


def test_n_out_of_range_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model_id, prompt="x", n=0)
    assert info.value.body["param"] == "n"
