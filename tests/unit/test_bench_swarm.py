"""bench.swarm: the table's keys and JSON, the search's output, replay by seed, bad arguments."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench import swarm as bench
from hivetrain.peer.sim.attacks import ANY_ATTACKS, ATTACK_NAMES, FIRST_ATTACKS, LATEST_ATTACKS, NOW_ATTACKS
from hivetrain.peer.sim.measure import ancestors, bandwidth_bound, lineage
from hivetrain.peer.sim.search import (
    ANY_SEEDS,
    LARGE_SEEDS,
    LATEST_SEEDS,
    MAX_CONTAINER,
    NEXT_SEEDS,
    NOW_SEEDS,
    RELAY_SEEDS,
    _foreign,
    check,
    schedule,
    search,
    search_row,
)
from hivetrain.peer.sim.swarm import Scenario, simulate

KEYS = {"peers", "target", "jitter_s", "slow_fraction", "rounds", "states_per_round", "lineages",
        "single_state_fraction", "discarded_fraction", "data_bytes_per_peer_round", "control_bytes_per_peer_round",
        "dht_reads_per_peer_round", "hot_holder_bytes_per_round", "matchmaking_s", "allreduce_over_bound",
        "utilization", "wall_s", "virtual_s", "trace_hash"}


def last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_one_configuration_prints_a_row_with_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--peers", "6", "--rounds", "2", "--target", "4", "--jitter", "2", "--json"]) == 0
    (r,) = last_json(capsys)["results"]
    assert KEYS <= set(r) and (r["peers"], r["rounds"], r["target"], r["jitter_s"]) == (6, 2, 4, 2.0)
    assert r["states_per_round"] >= 1 and 0 <= r["single_state_fraction"] <= 1 and r["virtual_s"] > 0
    assert r["data_bytes_per_peer_round"] > 0 and r["dht_reads_per_peer_round"] > 0


def test_the_search_reports_schedules_and_violations_with_their_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--search", "--budget", "0.1", "--seed", "17", "--json"]) == 0
    out = last_json(capsys)
    assert out["schedules"] >= 1
    for v in out["violations"]:
        assert set(v) == {"invariant", "seed", "attack", "summary"} and v["invariant"] in ("I1", "I3", "I5")


@pytest.mark.slow  # (two spawned processes, four schedules and two again here: about a minute on a busy machine)
def test_the_search_in_several_processes_runs_one_range_of_seeds_in_order_with_the_same_rows() -> None:
    n, _, rows = search(0.1, 17, workers=2)
    assert n == len(rows) >= 2 and [r["seed"] for r in rows] == list(range(17, 17 + n))  # what was under way too
    for row in (rows[0], rows[-1]):  # (each schedule depends on its seed alone: the same row in this process)
        assert {k: v for k, v in row.items() if k != "wall_s"} == \
            {k: v for k, v in search_row(row["seed"])[0].items() if k != "wall_s"}
    with pytest.raises(ValueError, match="workers"):
        search(0.1, 17, workers=0)


def test_a_schedule_is_drawn_from_its_seed_alone_and_replays_bit_for_bit() -> None:
    a, b = schedule(17), schedule(17)
    assert a == b and schedule(18) != a
    assert 3 * len(a.dishonest) < a.peers and 1 <= a.attacker_prefixes <= len(a.dishonest) and a.attacks
    first, again = simulate(a), simulate(b)
    assert first.trace_hash == again.trace_hash
    assert check(first)[0] == check(again)[0]


def test_the_large_family_draws_runs_whose_records_spread_over_buckets() -> None:
    small = [schedule(s) for s in range(40)]
    large = [schedule(LARGE_SEEDS + s) for s in range(40)]
    assert all(6 <= sc.peers <= 14 and not sc.spec for sc in small)  # the documented seeds keep their schedules
    assert all(24 <= sc.peers <= 40 and sc.target == 2 and 3 * len(sc.dishonest) < sc.peers for sc in large)
    expected = [dict(sc.spec)["expected_peers"] for sc in large]
    assert all(sc.peers <= e <= 4 * sc.peers for sc, e in zip(large, expected, strict=True))
    assert any(e > 64 for e in expected) and any(e <= 64 for e in expected)  # heartbeat buckets too, or not
    assert schedule(LARGE_SEEDS + 3) == schedule(LARGE_SEEDS + 3)


def test_the_slow_family_draws_slow_members_and_the_relay_attack_and_the_others_keep_their_attacks() -> None:
    slow = [schedule(RELAY_SEEDS + s) for s in range(40)]
    assert all(6 <= sc.peers <= 12 and sc.slow_fraction >= 0.25 and sc.numel >= 1 << 19 for sc in slow)
    assert sum("tampered_relay" in sc.attacks for sc in slow) >= 10
    # the earlier families draw from the attacks they had when their seeds were documented
    assert not any("tampered_relay" in schedule(s).attacks or "tampered_relay" in schedule(LARGE_SEEDS + s).attacks
                   for s in range(200))


@pytest.mark.parametrize("argv", [["--peers", "-1"], ["--target", "1"], ["--search", "--budget", "0"], ["--search", "--workers", "0"],
                                  ["--slow", "2"], ["--replay", "x"]])
def test_bad_arguments_are_refused_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_invariants_see_an_attacker_pull_the_mean_and_an_unbounded_container() -> None:
    # one honest peer and one attacker that sends -1000 x its pseudo-gradient: every round is a pair
    # without an honest majority; the pair's clip keeps the attacker's part to the honest norm, and it
    # still pulls the applied mean a whole norm away from the one honest part, which I1 must report
    # (and I7 count); I5 must see a container grown past its bound (planted here: the checker is
    # what is tested)
    result = simulate(Scenario(peers=2, rounds=2, target=2, seed=1, dishonest=(1,), attacks=("bias",)))
    broken, measured = check(result)
    assert any(inv == "I1" and "largest honest deviation" in why for inv, why in broken), broken
    assert measured["I4_completed_fraction"] == 1.0 and measured["I7_without_honest_majority"] >= 1
    result.peers[0].incarnations[-1].averager.planted = dict.fromkeys(range(MAX_CONTAINER + 1))
    assert any(inv == "I5" and "planted" in why for inv, why in check(result)[0])


def test_a_lone_honest_peer_is_measured_against_what_its_partner_computed() -> None:
    # one honest peer and one attacker whose auditor gets another part than its reducer: the shard the
    # attacker reduces is void, and in the other the attacker's part is the one its learner computed,
    # honestly. With one honest peer at the base the honest spread is 0, and I1 took that mean for
    # 3.04e12 x it (the long search's seed 6,201,101); measured against both pseudo-gradients it holds
    result = simulate(Scenario(peers=2, rounds=2, target=2, seed=1, dishonest=(1,), attacks=("unverifiable_parts",)))
    (first,) = [rec for i, rec in result.records if i == 0 and rec.get("round") == 0 and rec.get("event") == "round"]
    assert not first["void"] and first["void_shards"] and len(first["group"]) == 2  # the attack happened
    assert {p.peer for p in result.attacker_probes} == {1} and not any(p.honest for p in result.attacker_probes)
    broken, measured = check(result)
    assert broken == [] and measured["I7_without_honest_majority"] == 1
    # what the attacker did to its parts still counts against that reference
    biased = simulate(Scenario(peers=2, rounds=2, target=2, seed=1, dishonest=(1,), attacks=("bias",)))
    assert any(inv == "I1" and "1 attackers' own" in why for inv, why in check(biased)[0])


class _Records:
    """What ``_foreign`` and ``lineage`` read of a run's result: its records and who was honest."""

    def __init__(self, records: list[tuple[int, dict]], honest: set[int]):
        self.records, self.peers = records, [SimpleNamespace(index=i, honest=i in honest) for i in range(3)]

    def honest(self) -> list:
        return [p for p in self.peers if p.honest]


def test_a_state_only_attackers_computed_breaks_i1_for_every_honest_state_built_on_it() -> None:
    def done(base: str, state: str, round_: int, void: bool = False) -> dict:
        return {"event": "round", "round": round_, "base_hash": base, "state_hash": state, "void": void}

    records = [(2, done("g", "a1", 0)),  # the attacker alone: its own state
               (0, done("g", "g", 0, void=True)), (1, done("g", "h1", 0)),  # honest peers: a void round, and h1
               (2, done("h1", "s2", 1)), (1, done("h1", "s2", 1)),  # a group with an attacker: honest-computed
               (0, done("a1", "x2", 1))]  # honest peer 0 took a1 and trained on it
    foreign = _foreign(_Records(records, honest={0, 1}))
    assert set(foreign) == {"a1"} and "attacker 2 round 0" in foreign["a1"]
    parent = lineage(_Records(records, honest={0, 1}))
    assert "a1" in ancestors("x2", parent) and not foreign.keys() & ancestors("s2", parent)


def test_an_honest_swarm_breaks_no_invariant() -> None:
    # every mean of honest parts lies within the largest honest deviation: I1 has no false alarm here
    result = simulate(Scenario(peers=7, rounds=2, target=4, seed=2))
    broken, measured = check(result)
    assert broken == [] and measured["I7_without_honest_majority"] == 0
    assert len(result.probes) == 14 and all(p.applied is not None for p in result.probes)


def test_the_bandwidth_bound_lets_a_slow_member_send_its_parts_once() -> None:
    b, fast, slow = 8_000_000, 12.5e6, 2.5e6
    equal = bandwidth_bound([fast] * 8, [fast] * 8, b, audit=True)
    assert equal == pytest.approx(21 / 8 * b / fast, rel=1e-3)  # parts twice (7/8 each), results 7 x 1/8: all reduce
    one_slow = bandwidth_bound([fast] * 7 + [slow], [fast] * 7 + [slow], b, audit=True)
    assert one_slow == pytest.approx(b / slow, rel=1e-3)  # it sends once (relayed), and downloads the results once
    assert bandwidth_bound([fast, slow], [fast, slow], b, audit=True) == pytest.approx(b / slow, rel=1e-3)  # a pair


def test_each_search_family_draws_its_own_frozen_attacks_and_the_latest_the_whole_library() -> None:
    # (a documented seed keeps its schedule when the library grows: only the last family sees new attacks)
    assert ATTACK_NAMES[:len(FIRST_ATTACKS)] == FIRST_ATTACKS and ATTACK_NAMES[:len(ANY_ATTACKS)] == ANY_ATTACKS
    assert ATTACK_NAMES[:len(LATEST_ATTACKS)] == LATEST_ATTACKS and ATTACK_NAMES[:len(NOW_ATTACKS)] == NOW_ATTACKS
    small = {a for s in range(300) for a in schedule(s).attacks}
    any_ = {a for s in range(ANY_SEEDS, ANY_SEEDS + 300) for a in schedule(s).attacks}
    latest = {a for s in range(LATEST_SEEDS, LATEST_SEEDS + 300) for a in schedule(s).attacks}
    now = {a for s in range(NOW_SEEDS, NOW_SEEDS + 300) for a in schedule(s).attacks}
    assert small == set(FIRST_ATTACKS) and any_ == set(ANY_ATTACKS) and latest == set(LATEST_ATTACKS)
    later = {a for s in range(NEXT_SEEDS, NEXT_SEEDS + 300) for a in schedule(s).attacks}
    assert now == set(NOW_ATTACKS) and later == set(ATTACK_NAMES)
