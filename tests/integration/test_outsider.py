"""End to end: an outside process built from stock hivemind (tests/integration/outsider.py) attacks
three honest ``peer start`` processes while they train: forged heartbeats of a state of its own at
round 10^9 and round+1, a heartbeat in an honest peer's name, ready records of identities that
never answer, an unsolicited "decided: {you, me}" view (review N1), junk frames, bodies pushed
unasked and a flood of silent streams. The honest peers
keep completing rounds with agreeing state hashes, never adopt the forged state, and their memory
stays bounded. And a serving lockout (review N2): ten outsider identities hold silent streams on
every honest peer's state server while a fresh joiner starts; it syncs the honest state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hivetrain.peer.averaging.context import PROTOCOL_VERSION
from hivetrain.peer.state.serve import MAX_SERVING
from hivetrain.peer.state.serve import PROTOCOL_VERSION as STATE_VERSION

from .conftest import PeerProc, wait_until

pytestmark = pytest.mark.timeout(420)
ROUNDS = 6
COMMON = ["--sync-every", "3", "--until-round", str(ROUNDS), "--wait-for-peers", "3"]


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the p2p daemon), in MB."""
    total = 0.0
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def test_an_outsider_with_stock_hivemind_cannot_take_over_split_or_stall_the_run(swarm, tmp_path: Path) -> None:
    owner = swarm("p0", "--new-run", "outsider", "--target-group-size", "3", "--matchmaking-timeout", "6",
                  "--allreduce-timeout", "15", *COMMON)
    info = owner.wait_info()
    peers: list[PeerProc] = [owner] + [swarm(f"p{i}", "--run", info["run_key"], "--initial-peers", info["maddrs"][0],
                                             *COMMON) for i in (1, 2)]
    ids = [owner.wait_info()["peer_id"]] + [p.wait_info()["peer_id"] for p in peers[1:]]
    wait_until(lambda: all(p.records() for p in peers), peers, 240, "round 0 on every peer")
    baseline = [rss_mb(p.proc.pid) for p in peers]
    out = tmp_path / "outsider.json"
    script = Path(__file__).with_name("outsider.py")
    attacker = subprocess.Popen([sys.executable, str(script), info["maddrs"][0], info["run_key"], info["spec_hash"],
                                 ",".join(ids), "40", str(out), str(PROTOCOL_VERSION)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    peak = list(baseline)
    try:
        while any(p.proc.poll() is None for p in peers):
            peak = [max(a, rss_mb(p.proc.pid)) for a, p in zip(peak, peers, strict=True)]
            try:
                peers[0].proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        assert attacker.wait(90) == 0, attacker.stderr.read().decode()[-3000:] if attacker.stderr else ""
    finally:
        if attacker.poll() is None:
            os.killpg(attacker.pid, 9)
    for p in peers:
        assert p.wait(60) == 0, p.log.read_text()[-3000:]
    log = json.loads(out.read_text())

    # the attack happened: valid stranger records were stored, the one in another's name was refused
    assert log["stored"]["hb sybil0"] and log["stored"]["hb sybil1"], log["stored"]
    assert log["stored"]["ready sybil0"], log["stored"]
    assert log["stored"]["hb in another's name"] is False, log["stored"]
    frames = log["frames"]  # every reply the peers gave (while they ran): refused on the header, nothing read
    assert "code 12" in frames["oversized header"], frames  # MALFORMED
    assert "code 12" in frames["foreign magic"], frames
    assert "code 12" in frames["part of an unknown group, 100 MB claimed"], frames  # beyond any body of the protocol
    assert {"code 3", "code 4"} & set(frames["part of an unknown group, 1 kB"]), frames  # NOT_READY, WRONG_GROUP
    assert "view_reply" in frames["view naming 64 made-up members"], frames  # answered; none of them became a member
    # review N1: its unsolicited "decided: {you, me}" was answered (the peers heard it) and never adopted
    replies = [r for r in log["decided"] if isinstance(r, dict) and r.get("type") == "view_reply"]
    assert replies, log["decided"]
    assert not [r for r in replies if r["decided"] and log["outsider"] in r["members"]], replies
    # refused on the prefix, the stream closed on it while it was still pushing
    assert set(frames["body pushed unasked"]) <= {"code 11", "code 12", "BrokenPipeError", "ConnectionResetError",
                                                 "ControlFailure", "IncompleteReadError"}, frames
    # the flood of silent streams hit the per-peer cap: the streams beyond it were refused at once with BUSY
    # (later frames may meet the daemon's own stream limit instead, while the attacker holds them all open)
    assert log["flood"]["opened"] >= 100 and "code 11" in log["flood"]["last reply"], log["flood"]

    # the honest peers trained on, together, and never took the forged state
    per_round = [[r for r in p.records() if r["round"] == n] for p in peers for n in range(ROUNDS)]
    assert all(len(rs) == 1 for rs in per_round), "every peer has one record per round"
    completed = 0
    for n in range(ROUNDS):
        records = [next(r for r in p.records() if r["round"] == n) for p in peers]
        assert len({r["state_hash"] for r in records}) == 1, f"round {n}: {records}"
        completed += all(not r["void"] for r in records)
        assert not {*log["sybils"], log["outsider"]} & {m for r in records for m in r["group"]}
    assert completed >= ROUNDS - 1, [(r["round"], r["why"]) for r in peers[0].records()]
    honest_states = {r["state_hash"] for p in peers for r in p.records()}
    for p in peers:
        assert all(s["state_hash"] in honest_states for s in p.records("sync")), p.records("sync")
        text = p.log.read_text()
        assert "refused the heartbeat of" in text, text[-2000:]  # fork choice saw the claims and refused them
    growth = [b - a for a, b in zip(baseline, peak, strict=True)]
    print(f"RSS per peer (MB): baseline {[round(x) for x in baseline]}, peak {[round(x) for x in peak]}")
    assert max(growth) < 300, growth


def test_a_joiner_syncs_the_honest_state_while_an_outsider_holds_silent_state_streams(swarm, tmp_path: Path) -> None:
    """Review N2 with real processes: 10 outsider identities hold 4 silent streams each (as many as a
    requester may) on every honest peer's state server, 40 in all, more than the 32 slots its
    non-members share. Before 2026-12-05 they held every slot and a joiner trained alone; a stream
    now takes a slot only once its request header is here, so the joiner's request is served."""
    rounds = ["--sync-every", "3", "--until-round", "10", "--quiet"]
    owner = swarm("p0", "--new-run", "lockout", "--target-group-size", "4", "--matchmaking-timeout", "6",
                  "--allreduce-timeout", "15", "--wait-for-peers", "3", *rounds)
    info = owner.wait_info()
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], *rounds]
    peers: list[PeerProc] = [owner] + [swarm(f"p{i}", *join, "--wait-for-peers", "3") for i in (1, 2)]
    ids = [p.wait_info()["peer_id"] for p in peers]
    wait_until(lambda: all(len(p.records()) >= 2 for p in peers), peers, 240, "two rounds on every peer")
    out = tmp_path / "lockout.json"
    holding, stop = Path(f"{out}.holding"), Path(f"{out}.stop")
    attacker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("outsider.py")), "lockout",
                                 info["maddrs"][0], info["spec_hash"], ",".join(ids), "10", "300", str(out),
                                 str(STATE_VERSION), str(MAX_SERVING)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    try:
        wait_until(lambda: holding.exists() or attacker.poll() is not None, peers, 120, "the lockout in place")
        assert attacker.poll() is None, attacker.stderr.read().decode()[-3000:] if attacker.stderr else ""
        joiner = swarm("p3", *join)
        wait_until(lambda: bool(joiner.records("sync")), [*peers, joiner], 180, "the joiner's first sync")
        held_through_the_sync = attacker.poll() is None
        stop.touch()
        assert attacker.wait(60) == 0, attacker.stderr.read().decode()[-3000:] if attacker.stderr else ""
    finally:
        if attacker.poll() is None:
            os.killpg(attacker.pid, 9)
    for p in [*peers, joiner]:
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    log = json.loads(out.read_text())

    # the attack happened: from the moment it held as many silent streams as the shared slots at every
    # honest peer to the joiner's sync, it kept them (a dropped stream is reopened at once); before the
    # fix these were every slot, now they wait for their header apart (all 40 held)
    assert held_through_the_sync, "the lockout ended before the joiner synced"
    samples = log["samples"]
    lockout = samples[next(i for i, s in enumerate(samples) if min(s) >= MAX_SERVING):]
    held = sorted(min(s) for s in lockout)
    assert len(held) >= 8 and held[len(held) // 2] == 40, held
    assert sum(x >= MAX_SERVING for x in held) >= 0.9 * len(held), held

    # the joiner synced the honest state during the lockout and trained with the others, bit-identical
    honest = {(r["round"], r["state_hash"]) for r in owner.records()}
    for sync in joiner.records("sync"):
        assert (sync["round"] - 1, sync["state_hash"]) in honest, (sync, sorted(honest))
    syncs = joiner.records("sync")
    # (on a busy machine the joiner's ready record can reach the others' boards after they derived the
    # round's groups: it is then a group of one for that round, and in the others' group the next, as in
    # test_churn; seen once in CI)
    first = [r for r in joiner.records() if r["round"] in (syncs[-1]["round"], syncs[-1]["round"] + 1)]
    assert any(not r["void"] and r["group_size"] == 4 for r in first), joiner.records()
    assert joiner.records()[-1]["state_hash"] == owner.records()[-1]["state_hash"]
    assert not set(log["identities"]) & {m for p in peers for r in p.records() for m in r["group"]}
