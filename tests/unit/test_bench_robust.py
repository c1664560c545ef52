"""bench/robust.py runs end to end at a tiny size and its JSON rows are sane."""

from __future__ import annotations

import json

import pytest

from bench.robust import main


def test_bench_robust_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--params", "300K", "--groups", "4", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["rows"]
    assert (row["params"], row["group"], row["shard_numel"]) == (300_000, 4, 75_000)
    assert row["mean_ms"] > 0 and row["robust_ms"] > 0 and row["ratio"] > 0
    assert set(row["phases_ms"]) == {"mean", "robust"}
    assert all(v >= 0 for phases in row["phases_ms"].values() for v in phases.values())
    assert row["transfer_s"] > 0 and row["transfer_bytes"] > 2 * 3 * 75_000  # 2 (n-1) int8 shards + headers
    assert row["stack_bytes"] == 4 * 75_000 * 4
    assert row["peak_extra_bytes_analytic"] > row["stack_bytes"]
    assert row["stages_match_aggregate"] and row["robust_stages_ms"]["median_dim0"] > 0
