"""tools/bench_attention.py runs, checks each kernel against the reference and reports a
row per kernel and key count (its timings are not asserted: speed lives in benchmarks)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

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
