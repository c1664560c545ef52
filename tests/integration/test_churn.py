"""Peers join, crash, stall and restart mid-run: verified state sync and void-or-identical rounds."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from .conftest import wait_until

pytestmark = pytest.mark.timeout(600)

FAST = ["--sync-every", "4", "--allreduce-timeout", "12"]


def _wait_rounds(peers: list[Any], n: int, timeout: float) -> None:
    wait_until(lambda: all(len(p.records()) >= n for p in peers), peers, timeout, f"{n} rounds")


def _hash_after(peer: Any, round_: int) -> str:
    return next(r["state_hash"] for r in peer.records() if r["round"] == round_)


def test_join_mid_run_syncs_verified_state_and_avoids_poisoned_donor(swarm, tmp_path: Path) -> None:
    owner = swarm("p0", "--new-run", "joins", *FAST, "--until-round", "12", "--target-group-size", "4",
                  "--matchmaking-timeout", "6", "--quiet", "--wait-for-peers", "3")
    info = owner.wait_info()
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], "--until-round", "12", "--quiet"]
    poisoned = swarm("p1", *join, "--wait-for-peers", "3", "--fault", "corrupt@serve_state:0",
                     "--fault-log", str(tmp_path / "fault.log"))
    p2 = swarm("p2", *join, "--wait-for-peers", "3")
    _wait_rounds([owner, poisoned, p2], 2, 150)

    joiner = swarm("p3", *join)
    assert joiner.wait(240) == 0, joiner.log.read_text()[-3000:]
    for p in (owner, poisoned, p2):
        assert p.wait(120) == 0

    syncs = joiner.records("sync")
    # A joiner's first sync lands somewhere inside the others' round; it then waits for their next
    # boundary and syncs again, so that it starts a round together with them (peer/train/loop.py).
    assert len(syncs) >= 2, joiner.records()
    poisoned_id = poisoned.records("start")[0]["peer_id"]
    for sync in syncs:
        # right after a sync, the joiner's parameters hash to the state the others announced for that round
        assert sync["state_hash"] == _hash_after(owner, sync["round"] - 1) == _hash_after(p2, sync["round"] - 1)
        assert poisoned_id not in sync["donors"], sync
    # the poisoned donor really served bad bytes (to the joiner, the only peer that downloads) and the
    # joiner dropped it; which download it hit depends on how pieces were spread among donors, so the
    # joiner's own log is the witness, not one sync's record
    assert (tmp_path / "fault.log").read_text().startswith("corrupt@serve_state")
    assert f"dropping state donor {poisoned_id}: piece" in joiner.log.read_text()
    # it takes part from the boundary of its last sync on, on the round's one state
    first = [r for r in joiner.records() if r["round"] == syncs[-1]["round"]][-1]
    assert not first["void"] and first["state_hash"] == _hash_after(owner, first["round"]), joiner.records()
    assert joiner.records()[-1]["state_hash"] == owner.records()[-1]["state_hash"]
    # Sybil brake: in the first round it shared a group with them, the established reducers gave the
    # newcomer's part weight 0. (That is mostly the round of its last sync; on a busy machine its ready
    # record can reach the others' boards after they derived their group: it is then a group of its own
    # that round, still in the round's one model through the cross stage, and grouped the next.)
    joiner_id = joiner.records("start")[0]["peer_id"]
    together = next(r for r in owner.records() if r["round"] >= first["round"] and joiner_id in r["group"])
    assert together["round"] <= first["round"] + 1, owner.records()
    assert "on probation" in together["excluded"].get(joiner_id, ""), together["excluded"]
    later = next(r for r in owner.records() if r["round"] == together["round"] + 1)
    assert joiner_id in later["group"] and joiner_id not in later["excluded"], later


# the same at every point of the round (after matchmaking, after the parts, before the results) runs in
# virtual time in tests/protocol/test_sim.py; here one point, with a real process and a real SIGKILL
@pytest.mark.parametrize("point", ["after_parts"])
def test_sigkill_inside_allreduce_voids_or_agrees(swarm, tmp_path: Path, point: str) -> None:
    common = [*FAST, "--until-round", "4", "--quiet", "--wait-for-peers", "4"]
    owner = swarm("p0", "--new-run", "kills", "--target-group-size", "4", "--matchmaking-timeout", "6", *common)
    info = owner.wait_info()
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common]
    victim = swarm("victim", *join, "--fault", f"kill@{point}:1", "--fault-log", str(tmp_path / "fault.log"))
    others = [owner, swarm("p1", *join), swarm("p2", *join)]
    for p in others:
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    victim.wait(10)
    assert victim.proc.returncode == -signal.SIGKILL
    assert (tmp_path / "fault.log").read_text().startswith(f"kill@{point}:1")

    round1 = {p.records("start")[0]["peer_id"]: next(r for r in p.records() if r["round"] == 1) for p in others}
    story = [(r["void"], r["group_size"], r["why"]) for r in round1.values()]
    # never a mix of partials: a survivor that applied did so with every surviving member of its group, all with
    # the same bytes (a survivor that decided without the victim, before the others did, can apply alone: its own
    # group). The victim itself may be in a completed group: it can die after its parts were delivered and its
    # roles done (or with none: a member measured too slow only sends), and 3 of 4 are a majority that agrees
    for r in round1.values():
        if not r["void"]:
            assert all(not round1[m]["void"] and round1[m]["state_hash"] == r["state_hash"]
                       for m in r["group"] if m in round1), story
    # however round 1 split them, the survivors complete round 2 together, bit-identical: one that voided
    # or went alone waits to see how the round ended for the others before it chooses its state
    round2 = {p.records("start")[0]["peer_id"]: next(r for r in p.records() if r["round"] == 2) for p in others}
    assert all(not r["void"] and set(round1) <= set(r["group"]) for r in round2.values()), (story, round2)
    assert len({r["state_hash"] for r in round2.values()}) == 1


def test_sigstop_past_deadline_then_resync(swarm, tmp_path: Path) -> None:
    common = [*FAST, "--until-round", "40", "--wait-for-peers", "3"]
    owner = swarm("p0", "--new-run", "stalls", "--target-group-size", "3", "--matchmaking-timeout", "6", *common)
    info = owner.wait_info()
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common]
    stalled = swarm("stalled", *join, "--fault", "stop@after_parts:1", "--fault-log", str(tmp_path / "fault.log"))
    p1 = swarm("p1", *join)
    # the others void round 1 at the deadline and go on without it: wait until they finished round 2
    _wait_rounds([owner, p1], 3, 180)
    assert (tmp_path / "fault.log").read_text().startswith("stop@after_parts:1")
    os.killpg(stalled.proc.pid, signal.SIGCONT)
    peers = [owner, p1, stalled]

    def together() -> bool:
        last = [p.records()[-1] for p in peers]
        return len({(r["round"], r["state_hash"]) for r in last}) == 1 and all(r["group_size"] == 3 for r in last)

    wait_until(together, peers, 300, "the stalled peer back in the group, bit-identical")
    for p in peers:
        p.proc.send_signal(signal.SIGTERM)
    for p in peers:
        assert p.wait(30) in (0, 130), p.log.read_text()[-3000:]
    assert next(r for r in owner.records() if r["round"] == 1)["void"] is True
    syncs = stalled.records("sync")
    assert syncs, "the stalled peer did not notice it was behind"
    assert syncs[0]["state_hash"] == _hash_after(owner, syncs[0]["round"] - 1)


def test_restart_resumes_or_resyncs_and_ends_identical(swarm, tmp_path: Path) -> None:
    common = [*FAST, "--until-round", "10", "--quiet", "--wait-for-peers", "3"]
    owner = swarm("p0", "--new-run", "restarts", "--target-group-size", "3", "--matchmaking-timeout", "6", *common)
    info = owner.wait_info()
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common]
    p1 = swarm("p1", *join)
    crashy = swarm("crashy", *join, "--fault", "kill@after_round:1", "--fault-log", str(tmp_path / "fault.log"))
    crashy.wait(180)
    assert crashy.proc.returncode == -signal.SIGKILL
    checkpoint = tmp_path / "crashy-state" / "checkpoints" / f"{info['run_key']}.ckpt"
    assert checkpoint.exists()
    assert checkpoint.with_suffix(".trust.json").exists()  # whom it completed rounds with, kept for the restart
    assert checkpoint.with_suffix(".began.json").exists()  # the rounds it began averaging (a restart inside one voids it)
    crashy.info.unlink()
    again = swarm("crashy", *[a for a in join if a != "--quiet"])  # same name: same state folder and metrics
    for p in (owner, p1, again):
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    log = again.log.read_text()
    # checkpoints are written by a writer thread, so a SIGKILL right after round 1 may catch the one of
    # round 2 still unwritten: the restart resumes from the newest complete one (verified), then syncs
    assert "resumed from checkpoint: round 2" in log or "resumed from checkpoint: round 1" in log, log[-2000:]
    assert re.search(r"trust ledger: [12] peers we completed rounds with, 0 banned", log), log[-2000:]
    finals = {p.name: p.records()[-1] for p in (owner, p1, again)}
    assert len({r["round"] for r in finals.values()}) == 1
    assert len({r["state_hash"] for r in finals.values()}) == 1, finals


def test_a_signal_while_the_peer_waits_in_its_averaging_stops_it(swarm, tmp_path: Path) -> None:
    """Ctrl+C or SIGTERM during a round's averaging stops the peer (exit 130), as at any other time:
    it was caught as the round's failure, the round voided and the peer trained on (found re-running
    the UX review's bad inputs, docs/BAD-INPUTS.md case 66). The partner stops itself after sending
    its parts of round 1, so the owner waits in that round's averaging (up to its 60 s deadline)."""
    common = ["--sync-every", "4", "--allreduce-timeout", "60", "--until-round", "50", "--wait-for-peers", "2",
              "--target-group-size", "2"]
    owner = swarm("p0", "--new-run", "sigavg", *common)
    info = owner.wait_info()
    fault = tmp_path / "fault.log"
    stalled = swarm("stalled", "--join", info["join"], *common, "--fault", "stop@after_parts:1",
                    "--fault-log", str(fault))
    try:
        wait_until(lambda: fault.exists() and fault.read_text().startswith("stop@after_parts:1"), [owner], 180,
                   "the partner stopped inside round 1")
        assert not [r for r in owner.records() if r["round"] >= 1], owner.records()  # round 1 not ended yet
        owner.proc.send_signal(signal.SIGTERM)
        assert owner.wait(20) == 130, owner.log.read_text()[-3000:]  # well before round 1's deadline
        log = owner.log.read_text()
        assert "stopped after" in log and "KeyboardInterrupt" not in log, log[-3000:]
    finally:
        os.killpg(stalled.proc.pid, signal.SIGKILL)
