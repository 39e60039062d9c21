"""tools/bench_attention.py runs, checks each kernel against the reference and reports a
row per kernel and key count (its timings are not asserted: speed lives in benchmarks)."""
import sys

from repo_paths import TOOLS

sys.path.insert(0, str(TOOLS))

import bench_attention  # noqa: E402


def test_bench_attention_reports_every_kernel(capsys, monkeypatch):
    monkeypatch.setattr(bench_attention, "BUDGET_S", 0.01)
    bench_attention.main(["--kv", "f16,q8_0,f32", "--keys", "1,40", "--layers", "2", "--rounds", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llb_attention_paged_")]
    assert len(rows) == 6
    assert all(" ns, " in row and " GB/s |" in row for row in rows)


def test_bench_attention_split_calls_match_the_reference(capsys, monkeypatch):
    """--step: each layer as a decode step's threads split it (segments seg0 mod step, then the
    combine); the tool checks the combined output against the reference before timing."""
    monkeypatch.setattr(bench_attention, "BUDGET_S", 0.01)
    bench_attention.main(["--kv", "f16,q8_0", "--keys", "600", "--layers", "1", "--rounds", "1", "--step", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llb_attention_paged_")]
    assert len(rows) == 2


def test_bench_attention_on_a_pool_with_streams_between(capsys, monkeypatch):
    """--threads: the layers run as a decode plan on a worker pool (split calls as dynamic
    chunks, each with its own scratch, then the combine), checked against the reference
    before timing; --between adds a stream op after each layer and reports the streams alone."""
    monkeypatch.setattr(bench_attention, "BUDGET_S", 0.01)
    bench_attention.main(["--kv", "f16,q8_0", "--keys", "700", "--layers", "2", "--rounds", "1",
                          "--threads", "2", "--between", "0.5"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| llb_attention_paged_")]
    assert len(rows) == 2
    assert out.startswith("2 threads on a worker pool, 0.5 MB streamed after each layer's attention")
    assert out.count("streams alone, ms per layer: lib 0: ") == 2


def test_bench_attention_times_a_prompt_chunk(capsys, monkeypatch):
    """--rows: M rows of one sequence at the last M positions in one call (checked against the
    reference first); --group: only the first KV head's query heads."""
    monkeypatch.setattr(bench_attention, "BUDGET_S", 0.01)
    bench_attention.main(["--kv", "f16,f32,q8_0", "--keys", "300", "--layers", "1", "--rounds", "1",
                          "--rows", "5", "--group"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| llb_attention_paged_")]
    assert len(rows) == 3
    assert "ns per (row, key, KV head), GB/s" in out
