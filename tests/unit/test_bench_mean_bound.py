"""bench/mean_bound.py trains real learners of the tiny model and measures the designees' bound on
their pseudo-gradients: honest means within it, a mean times -1000 far past it."""

from __future__ import annotations

import json

import pytest

from bench.mean_bound import main
from hivetrain.peer.averaging.cross import MEAN_BOUND


def test_bench_mean_bound_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--peers", "3", "--groups", "1,2", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bound"] == MEAN_BOUND and [r["group"] for r in out["rows"]] == [1, 2]
    for row in out["rows"]:
        assert 0.0 < row["honest"]["max"] < MEAN_BOUND  # an honest mean is never refused ...
        assert row["x1000"]["median"] > 100 * MEAN_BOUND  # ... a lying designee's is
        assert row["flipped"]["median"] > row["honest"]["max"]


def test_bench_mean_bound_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--groups", "two"]) == 2
    assert main(["--peers", "1"]) == 2
    err = capsys.readouterr().err
    assert "--groups" in err and "--peers" in err
