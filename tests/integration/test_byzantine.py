"""Byzantine members with real peer processes: garbage is left out, named, and banned; the honest
peers stay finite and bit-identical."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

COMMON = ["--sync-every", "3", "--allreduce-timeout", "12", "--max-rounds", "3", "--quiet"]


def _start(swarm, n: int, attackers: dict[int, str], tmp_path: Path) -> list:
    owner = swarm("p0", "--new-run", "byz", "--target-group-size", str(n), "--matchmaking-timeout", "8",
                  "--wait-for-peers", str(n), *COMMON)
    info = owner.wait_info()
    peers = [owner]
    for i in range(1, n):
        extra = (["--fault", f"{attackers[i]}@parts:1", "--fault-log", str(tmp_path / f"fault{i}.log")]
                 if i in attackers else [])
        peers.append(swarm(f"p{i}", "--run", info["run_key"], "--initial-peers", info["maddrs"][0],
                           "--wait-for-peers", str(n), *COMMON, *extra))
    for p in peers:
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    return peers


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
        assert len({r["void"] for r in records}) == 1, [r["why"] for r in records]
        assert len({r["state_hash"] for r in records}) == 1, f"honest peers differ in round {round_}"
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
