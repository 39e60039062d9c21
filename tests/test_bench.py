"""`llambda bench` end to end on a tiny model (speed itself is never asserted)."""
import io
import json
import os
import time

import pytest

from llambda import bench
from llambda.synth import write_random_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    write_random_llama(path, n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64, vocab_size=2000,
                       tensor_type="Q4_0", n_ctx=2048)
    return path


def test_bench_reports_every_figure(tiny):
    out = io.StringIO()
    report = bench.run(str(tiny), threads=(1, 2), repeats=1, n_ctx=1024, as_json=True, out=out, gen_tokens=8)
    parsed = json.loads(out.getvalue())
    assert parsed["rows"] == json.loads(json.dumps(report["rows"]))
    llambda_rows = [r for r in parsed["rows"] if r["engine"] == "llambda"]
    assert [r["threads"] for r in llambda_rows] == [1, 2]
    for row in llambda_rows:
        for key in ("prefill128_tok_s", "prefill512_tok_s", "decode_tok_s", "ttft_ms", "load_ms", "startup_ms",
                    "peak_rss_mb"):
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"]
            assert row[key]["median"] > 0
    assert parsed["ceilings"]["fma_gflops_per_core"] > 0

    table = bench._markdown(report, [r["engine"] for r in parsed["rows"] if r["threads"] == 1], (1, 2))
    assert "| decode 8 (tok/s) | 2 |" in table
    assert "| start-up to first token of 'Hi' (ms) | 1 |" in table


def test_bench_rejects_a_converted_file(tiny, tmp_path):
    from llambda import convert
    llb = convert.convert(tiny, tmp_path / "tiny.llb", progress=False)
    with pytest.raises(SystemExit, match="must be a GGUF"):
        bench.run(str(llb), threads=(1,), repeats=1)


def test_busy_core_spins_a_pinned_child_for_the_block_only():
    from llambda.busy_core import busy_core
    from llambda.errors import UserError
    cpu = max(os.sched_getaffinity(0))
    with busy_core(cpu) as child:
        assert child.poll() is None
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(child.pid) != {cpu} and time.monotonic() < deadline:
            pass                                    # the child pins itself first thing
        assert os.sched_getaffinity(child.pid) == {cpu}
    assert child.poll() is not None
    with busy_core(None) as nothing:
        assert nothing is None
    with pytest.raises(UserError, match="--busy-core"):
        with busy_core(10_000):
            pass


def test_the_table_says_when_a_core_was_busy(tiny):
    report = bench.run(str(tiny), threads=(1,), repeats=1, n_ctx=1024, as_json=True, out=io.StringIO(),
                       gen_tokens=4, busy_cpu=max(os.sched_getaffinity(0)))
    assert "kept busy by another process" in bench._markdown(report, ["llambda"], (1,))


def test_llamacpp_runs_with_flash_attention(monkeypatch, tmp_path):
    """The anchor is llama.cpp at its best CPU setting: the child asks for flash attention."""
    import ctypes
    import sys
    import types
    made = {}

    class FakeLlama:
        def __init__(self, **kwargs):
            made.update(kwargs)
            self._logits = (ctypes.c_float * 16)()
            self._ctx = types.SimpleNamespace(get_logits_ith=lambda i: self._logits)

        def n_vocab(self):
            return 16

        def tokenize(self, text):
            return [1, 2]

        def eval(self, ids):
            pass

        def reset(self):
            pass

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    bench._measure_llamacpp(tmp_path / "m.gguf", 2, 256, (4,), 2, time.time())
    assert made["flash_attn"] is True and made["n_threads"] == 2


def test_the_bandwidth_probe_reads_memory_not_the_zero_page():
    """Its buffers are written before they are read: untouched fresh zeros are all the one
    zero page, which the probe would read from L1 at any size (a ceiling far above memory)."""
    from llambda.runtime import ceilings
    for buf in ceilings.stream_buffers(2, 1 << 20):
        assert buf.nbytes >= (1 << 20) - 4 and (buf == 1.0).all()
