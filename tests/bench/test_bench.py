"""`llambda bench` end to end on a tiny model (speed itself is never asserted)."""
import io
import json
import os
import time

import pytest

from llambda.bench import engines as bench
from synth import write_random_llama


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
    assert set(parsed["ceilings"]["read_gbs_at_model_size"]) == {"1", "2"}
    for row in llambda_rows:
        t = str(row["threads"])
        want = row["decode_tok_s"]["median"] * parsed["bytes_per_token"] / (
            parsed["ceilings"]["read_gbs_at_model_size"][t] * 1e9)
        assert row["decode_pct_model_read"] == pytest.approx(want)

    table = bench._markdown(report, [r["engine"] for r in parsed["rows"] if r["threads"] == 1], (1, 2))
    assert "| decode 8 (tok/s) | 2 |" in table
    assert "| start-up to first token of 'Hi' (ms) | 1 |" in table
    assert "of the read rate over the model's size" in table and "over the model's size;" in table
    assert parsed["ceilings"]["prefill"] == "INT8" and "of the INT8 ceiling" in table


def test_bench_times_the_prompts_asked_for(tiny):
    """prompt_sizes (`--prompts`): a row per prompt size, ascending (the smallest the time to
    first token, the largest against the prefill ceiling); a context too small for the largest
    is refused."""
    out = io.StringIO()
    report = bench.run(str(tiny), threads=(1,), repeats=1, n_ctx=400, as_json=True, out=out, gen_tokens=4,
                       prompt_sizes=(300, 40, 300))
    (row,) = [r for r in report["rows"] if r["engine"] == "llambda"]
    assert set(k for k in row if k.startswith("prefill") and k.endswith("_tok_s")) == {"prefill40_tok_s",
                                                                                       "prefill300_tok_s"}
    assert row["prefill_pct_ceiling"]["prompt"] == 300 and row["prefill_pct_ceiling"]["pct"] > 0
    assert row["ttft_ms"]["median"] == pytest.approx(1000 * 40 / row["prefill40_tok_s"]["median"])
    assert report["prompt_sizes"] == [40, 300]
    table = bench._markdown(report, ["llambda"], (1,))
    assert "| prefill 40 (tok/s) | 1 |" in table and "| prefill 300 (tok/s) | 1 |" in table
    assert "prefill 300 at " in table and "prefill 512" not in table
    with pytest.raises(ValueError, match="n_ctx: 300 positions do not hold a prompt of 300 tokens"):
        bench.run(str(tiny), threads=(1,), repeats=1, n_ctx=300, out=io.StringIO(), gen_tokens=4,
                  prompt_sizes=(300,))
    with pytest.raises(ValueError, match="prompt_sizes: expected positive token counts"):
        bench.run(str(tiny), threads=(1,), repeats=1, out=io.StringIO(), prompt_sizes=(0,))


def test_a_float_models_prefill_is_put_against_the_fma_peak(tmp_path):
    """F16 matrices run on FMAs: the prefill ceiling is the FMA peak (zmm where the CPU has it)."""
    from llambda.runtime import cpu
    path = write_random_llama(tmp_path / "tiny-f16.gguf", n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64,
                              vocab_size=2000, tensor_type="F16", n_ctx=2048)
    report = bench.run(str(path), threads=(1,), repeats=1, n_ctx=1024, as_json=True, out=io.StringIO(),
                       gen_tokens=4)
    want = "FMA zmm" if cpu.supports("avx512") else "FMA ymm"
    assert report["ceilings"]["prefill"] == want
    assert f"of the {want} ceiling" in bench._markdown(report, ["llambda"], (1,))


def test_bench_rejects_a_converted_file(tiny, tmp_path):
    from llambda.model import convert
    llb = convert.convert(tiny, tmp_path / "tiny.llb", progress=False)
    with pytest.raises(SystemExit, match="must be a GGUF"):
        bench.run(str(llb), threads=(1,), repeats=1)


def test_busy_core_spins_a_pinned_child_for_the_block_only():
    from llambda.bench.busy_core import busy_core
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


def test_the_sweeps_floor_counts_weights_and_the_cache_up_to_the_window_middle():
    """sweep_floors: weights once plus K and V of every layer per position, at the decode
    window's middle, over the read rate at that size; the floor table's (x) and llambda's
    fraction of its floor come from those."""
    from types import SimpleNamespace
    config = SimpleNamespace(n_layer=30, n_kv_head=3, head_dim=64)
    per_position = {"f32": 30 * 2 * 3 * 64 * 4, "f16": 30 * 2 * 3 * 64 * 2, "q8_0": 30 * 2 * 3 * (64 + 8)}
    seen = []

    def read_gbs(nbytes):
        seen.append(nbytes)
        return 40.0 if nbytes < 150e6 else 30.0
    floors = bench.sweep_floors(config, 96e6, (128, 4096), ("f16", "q8_0", "f32"), read_gbs)
    for f in floors:
        want = 96e6 + per_position[f["kv"]] * (f["context"] + bench.SWEEP_TOKENS / 2)
        assert f["mb"] == pytest.approx(want / 1e6)
        assert f["floor"] == pytest.approx(f["gbs"] * 1e9 / want)
    assert seen == [int(f["mb"] * 1e6) for f in floors]
    long_f16 = next(f for f in floors if f["context"] == 4096 and f["kv"] == "f16")
    assert long_f16["gbs"] == 30.0 and long_f16["mb"] == pytest.approx(96 + 0.02304 * 4112, rel=1e-3)
    rows = [{"context": 128, "llambda:f16": 100.0, "llambda:q8_0": 100.0, "llambda:f32": 100.0},
            {"context": 4096, "llambda:f16": 50.0, "llambda:q8_0": 60.0, "llambda:f32": 40.0}]
    table = bench._floor_table(floors, rows, 2)
    short_f16 = next(f for f in floors if f["context"] == 128 and f["kv"] == "f16")
    line = next(l for l in table.splitlines() if l.startswith("| 4096 | f16 |"))
    assert f"({long_f16['floor'] / short_f16['floor']:.2f})" in line
    assert line.endswith(f"| {50.0 / long_f16['floor']:.2f} |")


def test_the_sweep_runs_end_to_end(tiny, monkeypatch):
    """run_sweep (`llambda bench --sweep`) on short contexts: a row per context with every
    cache type, then the floor table under them."""
    monkeypatch.setattr(bench, "SWEEP_CONTEXTS", (16, 48))
    monkeypatch.setattr(bench, "SWEEP_TOKENS", 4)
    out = io.StringIO()
    rows = bench.run_sweep(str(tiny), threads=1, repeats=1, out=out)
    assert [r["context"] for r in rows] == [16, 48]
    assert all(r[f"llambda:{kv}"] > 0 for r in rows for kv in bench.SWEEP_KV_TYPES)
    text = out.getvalue()
    assert "| 48 | " in text and "| context | KV | MB per token |" in text


def test_a_read_probe_is_rounded_to_4_mib_and_capped():
    assert bench._probe_size(1) == 4 << 20
    assert bench._probe_size((4 << 20) + 1) == 8 << 20
    assert bench._probe_size(96.6e6) == 96 << 20                  # 96.6 MB is 92.1 MiB
    assert bench._probe_size(40e9) == bench.PROBE_MAX
