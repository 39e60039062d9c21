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
