"""bench.utilization's numbers from synthetic round records: utilization, medians, bound, warm-up, missing modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.netns import parse_rate
from bench.peers import MetricsFollower
from bench.utilization import skipped
from bench.utilization_rows import PeerRun, format_table, missing_row, peer_row, round_times

MBIT = 1e6


def legacy(round_: int, arrived: float, compute: float, mm: float, total: float, sent: int,
           void: bool = False) -> dict[str, Any]:
    """A record as today's peers write it: allreduce_s = matchmaking + all-reduce + outer step, no round_s."""
    return {"event": "round", "round": round_, "void": void, "group_size": 0 if void else 3,
            "bytes_sent": 0 if void else sent, "compute_s": compute, "matchmaking_s": None if void else mm,
            "allreduce_s": total, "arrived_s": arrived}


def new(round_: int, compute: float, mm: float, ar: float, round_s: float, sent: int,
        void: bool = False, **extra: Any) -> dict[str, Any]:
    return {"event": "round", "round": round_, "void": void, "group_size": 0 if void else 3, "inner_steps": 8,
            "bytes_sent": 0 if void else sent, "compute_s": compute, "matchmaking_s": mm, "allreduce_s": ar,
            "idle_s": round_s - compute, "round_s": round_s, "arrived_s": 1000.0 + round_, **extra}


def test_legacy_records_take_round_time_from_arrivals_and_subtract_matchmaking() -> None:
    # round k arrives at 10 k + the warm-up's; compute 5, matchmaking 1, matchmaking+all-reduce 4
    recs = [legacy(0, 30.0, 9.0, 2.0, 20.0, 999)]
    recs += [legacy(k, 30.0 + 10 * k, 5.0, 1.0, 4.0, 10_000_000) for k in range(1, 6)]
    times = round_times(recs)
    assert times[0]["round_s"] is None and times[0]["utilization"] is None  # nothing before the first
    assert [t["round_s"] for t in times[1:]] == [10.0] * 5
    assert all(t["legacy"] for t in times)
    assert [t["allreduce_s"] for t in times] == [18.0] + [3.0] * 5  # 20 - 2, then 4 - 1
    row = peer_row(PeerRun("sync", "100mbit", "p0", 100 * MBIT, recs), warmup=1, hivemind_s=2.5)
    assert row["rounds"] == 5 and row["void_rounds"] == 0
    assert row["utilization"] == pytest.approx(0.5)
    assert (row["matchmaking_s"], row["allreduce_s"], row["round_s"]) == (1.0, 3.0, 10.0)
    assert row["bound_s"] == pytest.approx(10_000_000 * 8 / 100e6)  # 0.8 s
    assert row["ratio"] == pytest.approx(3.0 / 0.8)
    assert row["hivemind_allreduce_s"] == 2.5 and row["legacy_metrics"] and row["missing"] is None
    assert row["steps_per_s"] is None  # these records do not say H


def test_new_fields_win_over_arrivals_and_allreduce_is_taken_as_is() -> None:
    recs = [new(0, 9.0, 2.0, 7.0, 30.0, 1)]
    recs += [new(k, 4.0, 0.5, 3.0, 5.0 + k, 8_000_000) for k in range(1, 6)]  # round_s 6, 7, 8, 9, 10
    row = peer_row(PeerRun("overlap", "100mbit", "p1", 100 * MBIT, recs), warmup=1)
    assert row["round_s"] == 8.0 and row["utilization"] == pytest.approx(4.0 / 8.0)
    assert row["steps_per_s"] == pytest.approx(8 / 8.0)  # H = 8 inner steps over the median round
    assert row["allreduce_s"] == 3.0 and row["matchmaking_s"] == 0.5 and row["idle_s"] == 4.0
    assert not row["legacy_metrics"] and row["hivemind_allreduce_s"] is None
    # a utilization written by the peer is used as written
    recs = [new(k, 4.0, 0.5, 3.0, 8.0, 1, utilization=0.9) for k in range(3)]
    assert peer_row(PeerRun("overlap", "100mbit", "p1", 100 * MBIT, recs), warmup=1)["utilization"] == 0.9


def test_warmup_is_skipped_by_position_and_medians_are_medians() -> None:
    computes = [100.0, 1.0, 2.0, 30.0, 4.0, 5.0]  # the warm-up outlier must not count
    recs = [new(k, c, 0.1 * k, float(k), 10.0, 1000 * k) for k, c in enumerate(computes)]
    row = peer_row(PeerRun("sync", "100mbit", "p0", 100 * MBIT, recs), warmup=1)
    assert row["rounds"] == 5 and row["compute_s"] == 4.0 and row["utilization"] == pytest.approx(0.4)
    assert row["allreduce_s"] == 3.0 and row["matchmaking_s"] == pytest.approx(0.3) and row["bytes_sent"] == 3000
    row = peer_row(PeerRun("sync", "100mbit", "p0", 100 * MBIT, recs), warmup=2)
    assert row["rounds"] == 4 and row["compute_s"] == pytest.approx((4.0 + 5.0) / 2)
    assert skipped("sync", 1) == 1 and skipped("overlap", 1) == 2  # overlap mode skips one more round
    with pytest.raises(ValueError, match="warmup"):
        peer_row(PeerRun("sync", "100mbit", "p0", 100 * MBIT, recs), warmup=-1)


def test_void_rounds_count_as_wall_time_but_not_as_allreduces() -> None:
    recs = [legacy(0, 10.0, 5.0, 1.0, 4.0, 10)]
    recs += [legacy(1, 20.0, 5.0, 1.0, 4.0, 2_000_000), legacy(2, 40.0, 5.0, 0.0, 0.1, 0, void=True),
             legacy(3, 50.0, 5.0, 1.0, 6.0, 4_000_000)]
    row = peer_row(PeerRun("sync", "20mbit", "p2", 20 * MBIT, recs), warmup=1)
    assert (row["rounds"], row["void_rounds"]) == (3, 1)
    assert row["round_s"] == 10.0 and row["utilization"] == pytest.approx(0.5)  # 10, 20, 10 s
    assert row["allreduce_s"] == pytest.approx(4.0)  # (3 + 5) / 2: the void round's 0.1 s is left out
    assert row["bytes_sent"] == 3_000_000
    assert row["bound_s"] == pytest.approx(3_000_000 * 8 / 20e6)  # the slow peer's own rate: 1.2 s


def test_no_measured_round_gives_none_not_an_error() -> None:
    recs = [legacy(0, 10.0, 5.0, 1.0, 4.0, 10)]
    row = peer_row(PeerRun("sync", "100mbit", "p0", 100 * MBIT, recs), warmup=1)
    assert row["rounds"] == 0 and row["utilization"] is None and row["bound_s"] is None and row["ratio"] is None


def test_missing_mode_row_and_table() -> None:
    miss = missing_row("overlap", "20mbit", "p2", 20 * MBIT, "no --overlap flag", hivemind_s=7.0)
    assert miss["missing"] == "no --overlap flag" and miss["rounds"] == 0 and miss["hivemind_allreduce_s"] == 7.0
    assert all(miss[k] is None for k in ("utilization", "matchmaking_s", "allreduce_s", "bound_s"))
    recs = [new(k, 4.0, 0.5, 3.0, 8.0, 1_000_000) for k in range(3)]
    row = peer_row(PeerRun("sync", "20mbit", "p2", 20 * MBIT, recs), warmup=1, hivemind_s=7.0)
    table = format_table([row, miss]).splitlines()
    assert len(table) == 4 and "0.50" in table[2] and "7.00" in table[2]
    assert "not measured: no --overlap flag" in table[3]


def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 100e6 and parse_rate("20Mbit") == 20e6 and parse_rate("1gbit") == 1e9
    assert parse_rate("500kbit") == 500e3 and parse_rate("12345") == 12345.0


def test_follower_stamps_complete_round_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    follower = MetricsFollower(path)
    follower.poll(1.0)  # no file yet
    path.write_text('{"event": "start", "round": 0}\n{"event": "round", "round": 0}\n{"event": "rou')
    follower.poll(2.0)
    assert follower.rounds == [{"event": "round", "round": 0, "arrived_s": 2.0}]
    with open(path, "a") as f:
        f.write('nd", "round": 1}\n')
    follower.poll(3.0)
    assert [(r["round"], r["arrived_s"]) for r in follower.rounds] == [(0, 2.0), (1, 3.0)]
