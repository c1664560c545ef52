"""``peer status`` against a real 2-peer swarm on 127.0.0.1: it sees both peers, their rounds and
their agreement, and is a member of nothing (it publishes nothing). The join string round trip: the
owner prints one, a joiner joins with it alone, status takes it and prints a fresh one that lists
both peers, export takes that."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .conftest import run_cli


def _status_stream(join: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hivetrain.peer.cli", "status", "--join", join,
           "--json", "--watch", "--interval", "0.5", "--count", "400"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_status_sees_the_swarm_and_is_no_member(swarm, tmp_path: Path) -> None:
    common = ["--sync-every", "4", "--until-round", "8", "--quiet", "--wait-for-peers", "2", "--target-group-size", "2"]
    owner = swarm("p0", "--new-run", "status", *common)
    info = owner.wait_info()
    assert info["join"] == f"hivetrain://{info['run_key']}@{info['maddrs'][0]}", info  # (loopback only here)
    other = swarm("p1", "--join", info["join"], *common)
    watcher = _status_stream(info["join"])
    seen: list[dict[str, Any]] = []
    try:
        assert watcher.stdout is not None
        deadline = time.monotonic() + 180
        for line in watcher.stdout:
            status = json.loads(line)
            seen.append(status)
            if status["round"] >= 2 and len(status["peers"]) == 2 and status["agreement"] == 1.0 \
                    and status["join"] and status["join"].count("/p2p/") == 2:
                break
            assert time.monotonic() < deadline, seen[-3:]
        # the table, once, while the run trains, from the fresh join string (its key in upper case)
        fresh = seen[-1]["join"]
        table = run_cli("status", "--join", fresh.replace(info["run_key"], info["run_key"].upper()))
    finally:
        if watcher.poll() is None:
            os.killpg(watcher.pid, signal.SIGINT)
        stderr = watcher.communicate(timeout=30)[1]
    assert "Traceback" not in stderr, stderr[-2000:]
    last = seen[-1]
    assert last["round"] >= 2 and last["agreement"] == 1.0, seen[-3:]
    assert last["spec"]["sync_every"] == 4 and last["run"] == info["run_key"]
    for p in last["peers"]:
        assert p["round"] == last["round"] and p["state_hash"] == last["state_hash"] and p["tokens_per_s"] > 0
        assert p["reachability"] in ("direct", "unknown") and 0 <= p["last_seen_s"] < 60
        # its totals since it started, as its heartbeat says (peer/totals.py): whole rounds of tokens
        assert p["rounds_completed"] >= 1 and p["tokens"] == p["rounds_completed"] * last["spec"]["tokens_per_round_per_peer"]
    assert table.returncode == 0, table.stderr
    assert " 2 peers, 100% hold state" in table.stdout or " 2 peers" in table.stdout, table.stdout
    assert "tokens/s" in table.stdout and "held-out loss" in table.stdout
    # (the same peers' addresses; their order is the most recently seen first, which moves between two reads)
    said = [line.removeprefix("join with: peer start --join ") for line in table.stdout.splitlines()
            if line.startswith("join with: peer start --join ")]
    key, _, addrs = fresh.partition("@")
    assert len(said) == 1 and said[0].startswith(key + "@"), table.stdout
    assert set(said[0].partition("@")[2].split(",")) == set(addrs.split(",")), table.stdout
    for p in (owner, other):
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    ids = {p.records("start")[0]["peer_id"] for p in (owner, other)}
    assert {p["peer_id"] for p in last["peers"]} == ids
    assert {a.rpartition("/p2p/")[2] for a in fresh.partition("@")[2].split(",")} == ids, fresh  # both live peers
    done = run_cli("export", "--join", fresh, "--out", str(tmp_path / "hf"), "--state-dir", str(tmp_path / "p1-state"))
    assert done.returncode == 0 and "exported round 8" in done.stdout, done.stderr[-2000:]
    observers = {s["observer"] for s in seen}
    assert len(observers) == 1 and not observers & ids
    # a member of nothing: no group of any round names it (the groups hold the two peers, or one of them)
    for p in (owner, other):
        rounds = p.records()
        assert len(rounds) == 8 and all(set(r["group"]) <= ids for r in rounds), [r["group"] for r in rounds]
        assert sum(set(r["group"]) == ids for r in rounds) >= 6, [r["group"] for r in rounds]


def test_status_without_initial_peers_is_one_line(tmp_path: Path) -> None:
    result = run_cli("status", "--run", "demo." + "a" * 32)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "needs the run's join string" in lines[0], result.stderr
