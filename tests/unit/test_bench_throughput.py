"""bench.throughput runs and measures both loops on the same model (a smoke test: numbers belong in the bench)."""

from __future__ import annotations

from bench.throughput import measure


def test_throughput_bench_measures_both_loops() -> None:
    row = measure("tiny", steps=1, repeats=1)
    assert row["parameters"] == 869_504 and row["tokens_per_step"] == 16 * 128
    assert row["ours_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
    assert abs(row["ratio"] - row["ours_tokens_per_s"] / row["plain_tokens_per_s"]) < 1e-9
