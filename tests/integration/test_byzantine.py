"""Byzantine members with real peer processes: garbage is left out, named, and banned; the honest
peers stay finite and bit-identical."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hivetrain.peer.averaging.api import shard_bounds

pytestmark = pytest.mark.timeout(600)

COMMON = ["--sync-every", "3", "--allreduce-timeout", "12", "--max-rounds", "3", "--quiet"]


def _start(swarm, n: int, attackers: dict[int, str], tmp_path: Path, point: str = "parts") -> list:
    owner = swarm("p0", "--new-run", "byz", "--target-group-size", str(n), "--matchmaking-timeout", "15",
                  "--wait-for-peers", str(n), *COMMON)
    info = owner.wait_info()
    peers = [owner]
    for i in range(1, n):
        extra = (["--fault", f"{attackers[i]}@{point}:1", "--fault-log", str(tmp_path / f"fault{i}.log")]
                 if i in attackers else [])
        peers.append(swarm(f"p{i}", "--run", info["run_key"], "--initial-peers", info["maddrs"][0],
                           "--wait-for-peers", str(n), *COMMON, *extra))
    for p in peers:
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    return peers


def _story(peers: list) -> str:
    """Every peer's rounds in one line each, for assertion messages: a flake must say what happened."""
    def line(r: dict) -> str:
        return f"r{r['round']}:{'void' if r['void'] else 'ok'}/{len(r['group'])}:{(r['why'] or '')[:60]}"
    return "\n".join(f"{p.name}: " + " | ".join(line(r) for r in p.records()) for p in peers)


def _completed_alike(honest: list, n_rounds: int) -> list[list[dict]]:
    """Per round: the honest peers' records, asserted completed (not void) and bit-identical."""
    rounds = []
    for round_ in range(n_rounds):
        records = [next(r for r in p.records() if r["round"] == round_) for p in honest]
        assert not any(r["void"] for r in records), _story(honest)
        assert len({r["state_hash"] for r in records}) == 1, f"honest peers differ in round {round_}\n{_story(honest)}"
        rounds.append(records)
    return rounds


def _check(peers: list, attackers: dict[int, str], tmp_path: Path, attributed: bool) -> None:
    honest = [p for i, p in enumerate(peers) if i not in attackers]
    bad_ids = {peers[i].records("start")[0]["peer_id"] for i in attackers}
    for i, action in attackers.items():  # the attack really happened
        assert (tmp_path / f"fault{i}.log").read_text().startswith(f"{action}@parts")
    for r in (r for p in honest for r in p.records()):
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["eval_loss"]), r
    for round_ in range(3):
        records = [next(r for r in p.records() if r["round"] == round_) for p in honest]
        # an attacker that also withholds its shard's result costs one deadline: void for all honest peers
        assert len({r["void"] for r in records}) == 1, _story(peers)
        assert len({r["state_hash"] for r in records}) == 1, f"honest peers differ in round {round_}\n{_story(peers)}"
        assert round_ != 2 or not records[0]["void"], "the round after the attack did not complete"
    round1 = [next(r for r in p.records() if r["round"] == 1) for p in honest]
    if attributed:
        for r in round1:  # every honest peer names the attackers
            assert bad_ids <= set(r["excluded"]), r["excluded"]
        round2 = [next(r for r in p.records() if r["round"] == 2) for p in honest]
        for r in round2:  # and none of them is grouped with an attacker again
            assert not bad_ids & set(r["group"]), r["group"]
    first, last = honest[0].records("start")[0], honest[0].records()[-1]
    assert last["eval_loss"] < first["eval_loss"]


@pytest.mark.parametrize("attack", ["nan", "flip", "scale", "shortlen"])
def test_one_of_four_sends_garbage(swarm, tmp_path: Path, attack: str) -> None:
    attackers = {3: attack}
    _check(_start(swarm, 4, attackers, tmp_path), attackers, tmp_path, attributed=True)


@pytest.mark.slow
def test_two_of_five_huge_and_constant_direction(swarm, tmp_path: Path) -> None:
    attackers = {3: "huge", 4: "const"}
    peers = _start(swarm, 5, attackers, tmp_path)
    _check(peers, attackers, tmp_path, attributed=False)
    huge_id = peers[3].records("start")[0]["peer_id"]
    round1 = [next(r for r in p.records() if r["round"] == 1) for p in peers[:3]]
    assert all(huge_id in r["excluded"] for r in round1)  # the huge one is an outlier; const is clipped


def test_reducer_returning_a_wrong_aggregate_is_caught(swarm, tmp_path: Path) -> None:
    """A reducer sends every member a shifted aggregate with honest part digests: its auditor recomputes
    the shard, every honest member voids that shard (and only it), and the auditor drops the cheater."""
    peers = _start(swarm, 4, {3: "wrongsum"}, tmp_path, point="results")
    assert (tmp_path / "fault3.log").read_text().startswith("wrongsum@results:1")
    honest, cheat = peers[:3], peers[3].records("start")[0]["peer_id"]
    numel = honest[0].records("start")[0]["numel"]
    rounds = _completed_alike(honest, 3)
    for r in (r for records in rounds for r in records):
        assert all(math.isfinite(r[k]) for k in ("train_loss", "eval_loss")), r
    round1 = rounds[1]
    for r in round1:
        order = r["group"]
        assert cheat in order, order
        assert r["void_shards"] == [list(shard_bounds(numel, len(order))[order.index(cheat)])]
        assert "auditor" in r["excluded"][cheat] and "wrong aggregate" in r["excluded"][cheat]
    auditor = round1[0]["group"][(round1[0]["group"].index(cheat) + 1) % 4]
    for p, r in zip(honest, round1, strict=True):  # the others checked the auditor's evidence themselves
        if p.records("start")[0]["peer_id"] != auditor:
            assert "checked ourselves" in r["excluded"][cheat], r["excluded"]
    round2 = [next(r for r in p.records() if r["round"] == 2) for p in honest]
    honest_ids = {p.records("start")[0]["peer_id"] for p in honest}
    for r in round2:  # all of them drop the cheater, and only it
        assert set(r["group"]) == honest_ids and r["void_shards"] == [], r


def test_auditor_accusing_falsely_is_found_out(swarm, tmp_path: Path) -> None:
    """An auditor calls a correct shard a wrong aggregate: the shard is void for the round (what a lie
    costs), every other member recomputes it from the auditor's own evidence, finds it correct and
    drops the liar; the accused reducer stays in the run."""
    peers = _start(swarm, 4, {3: "accuse"}, tmp_path, point="results")
    assert (tmp_path / "fault3.log").read_text().startswith("accuse@results:1")
    honest, liar = peers[:3], peers[3].records("start")[0]["peer_id"]
    honest_ids = {p.records("start")[0]["peer_id"] for p in honest}
    numel = honest[0].records("start")[0]["numel"]
    for r in _completed_alike(honest, 3)[1]:
        order = r["group"]
        accused = (order.index(liar) - 1) % len(order)
        assert r["void_shards"] == [list(shard_bounds(numel, len(order))[accused])]
        assert "accused" in r["excluded"][liar], r["excluded"]  # the accused itself, and the others after checking
    for r in (next(r for r in p.records() if r["round"] == 2) for p in honest):
        assert set(r["group"]) == honest_ids, r["group"]


def test_replayed_parts_of_an_earlier_round_are_refused_and_attributed(swarm, tmp_path: Path) -> None:
    """From round 1 on, one member re-sends its previous round's part messages verbatim instead of new
    ones: every honest reducer refuses them as stale, leaves the member out at once (no deadline lost)
    and names it; shards whose audit it spoils are void; nobody uses old bytes."""
    peers = _start(swarm, 4, {3: "replay"}, tmp_path)
    assert (tmp_path / "fault3.log").read_text().startswith("replay@parts:1")
    honest, replayer = peers[:3], peers[3].records("start")[0]["peer_id"]
    numel = honest[0].records("start")[0]["numel"]
    round1 = _completed_alike(honest, 3)[1]
    for r in round1:
        order = r["group"]
        assert replayer in order and "replayed its part of round 0" in r["excluded"][replayer], r["excluded"]
        bounds, k = shard_bounds(numel, len(order)), order.index(replayer)
        # void: its own shard (its auditor never got its part) and possibly the one it audits (its
        # copy of its own part is not what that reducer refused): nothing else
        assert list(bounds[k]) in r["void_shards"], r["void_shards"]
        assert all(tuple(v) in (bounds[k], bounds[(k - 1) % len(order)]) for v in r["void_shards"]), r["void_shards"]
    for r in (next(r for r in p.records() if r["round"] == 2) for p in honest):
        assert replayer not in r["group"], r["group"]


def test_identities_from_one_prefix_are_capped_per_group(swarm, tmp_path: Path) -> None:
    """Sybil brake with real peers: three identities that every member sees at one address prefix
    (loopback, counted here as one /8 by a test switch) and a cap of 2 per prefix: each group holds
    at most 2 of them, the same ones for everybody, and the one left out is told why."""
    common = ["--sync-every", "3", "--allreduce-timeout", "12", "--max-rounds", "2", "--quiet",
              "--wait-for-peers", "3", "--count-loopback-prefix"]
    owner = swarm("p0", "--new-run", "capped", "--target-group-size", "3", "--matchmaking-timeout", "6",
                  "--max-per-prefix", "2", *common)
    info = owner.wait_info()
    peers = [owner] + [swarm(f"p{i}", "--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common)
                       for i in (1, 2)]
    for p in peers:
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    for round_ in range(2):
        records = [next(r for r in p.records() if r["round"] == round_) for p in peers]
        groups = {tuple(r["group"]) for r in records if not r["void"]}
        assert groups and all(len(g) <= 2 for g in groups), groups
        left_out = [r for r in records if not r["void"] and len(r["group"]) == 2]
        assert all("at most 2 per prefix" in why for r in left_out for why in r["excluded"].values()), left_out
        assert len(groups) == 1 or all(len(g) == 1 for g in groups - {max(groups, key=len)}), groups
