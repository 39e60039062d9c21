"""`llambda bench --serve`, briefly: it starts `llambda serve`, runs concurrent streams and reports
(llama-server is never needed here: only llambda is measured)."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from llambda.bench import serve as bench_serve
from synth import write_random_llama


def test_bench_serve_reports_every_level(tmp_path, capsys):
    path = write_random_llama(tmp_path / "tiny.gguf", n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64,
                              vocab_size=300, tensor_type="Q8_0", n_ctx=512, seed=3)
    report = bench_serve.run(str(path), threads=1, streams=(1, 2), max_tokens=4, n_ctx=512, repeats=1,
                             engines=("llambda",))
    assert [(r["engine"], r["streams"], r["requests"]) for r in report["rows"]] == [("llambda", 1, 1), ("llambda", 2, 2)]
    assert all(r["tok_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] for r in report["rows"])
    assert "| llambda | 2 |" in capsys.readouterr().out


def test_missing_llama_server_binary_is_named(tmp_path):
    from llambda.errors import UserError
    with pytest.raises(UserError, match="no such file"):
        bench_serve.find_llama_server(tmp_path / "nope")


def test_bench_serve_constrained_streams_are_json_of_the_schema(default_gguf, capsys):
    # every other stream is held to the schema: the report names it, and each level counts its requests
    report = bench_serve.run(str(default_gguf), threads=1, streams=(2,), max_tokens=6, n_ctx=512, repeats=1,
                             engines=("llambda",), constrained="half")
    assert report["constrained"] == "half"
    assert [(r["streams"], r["requests"], r["constrained"]) for r in report["rows"]] == [(2, 2, "half")]
    assert "every other stream a json_schema chat reply" in capsys.readouterr().out


def test_bench_serve_request_bodies():
    import json
    path, body = bench_serve.request_body("m", "Story", 8, bench_serve.SCHEMA)
    body = json.loads(body)
    assert path == "/v1/chat/completions"
    assert body["response_format"]["json_schema"]["schema"] == bench_serve.SCHEMA
    path, body = bench_serve.request_body("m", "Story", 8)
    assert path == "/v1/completions" and json.loads(body)["ignore_eos"] is True
    assert [bench_serve.stream_schema("half", i) is None for i in range(4)] == [False, True, False, True]


def test_bench_serve_refuses_an_unknown_constraint_mode():
    from llambda.errors import UserError
    with pytest.raises(UserError, match="--constrained"):
        bench_serve.run(None, constrained="xml")


def test_bench_serve_reports_the_grammars_share_of_a_step(default_gguf, capsys):
    report = bench_serve.run(str(default_gguf), threads=1, streams=(2,), max_tokens=6, n_ctx=512, repeats=1,
                             engines=("llambda",), constrained="json_schema")
    [row] = report["rows"]
    assert row["step_ms"] > 0 and 0 < row["constraint_ms"] < row["step_ms"]
    assert "grammars in a step" in capsys.readouterr().out
