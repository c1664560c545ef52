"""Churn soak: 5 peers for a dozen rounds while peers are killed and added every round or two."""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections import defaultdict
from typing import Any

import pytest

from .conftest import wait_until


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_churn_soak(swarm) -> None:
    rounds = 12  # of churn; then the run goes on until the survivors share one state
    common = ["--sync-every", "4", "--allreduce-timeout", "8", "--until-round", "60", "--quiet"]
    owner = swarm("p0", "--new-run", "soak", "--target-group-size", "5", "--matchmaking-timeout", "5", *common,
                  "--wait-for-peers", "5", "--eval-every", "3")
    info = owner.wait_info()
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common]
    peers: list[Any] = [owner] + [swarm(f"p{i}", *join, "--wait-for-peers", "5") for i in range(1, 5)]
    rng = random.Random(7)
    killed: list[Any] = []
    events = {2: "kill", 3: "add", 5: "kill", 6: "add", 8: "kill", 9: "add"}
    deadline = time.monotonic() + 420
    while events or len(owner.records()) < rounds:
        assert owner.proc.poll() is None and time.monotonic() < deadline, owner.log.read_text()[-3000:]
        done = len(owner.records())
        action = events.pop(done, None) if done in events else None
        if action == "kill":
            victim = rng.choice([p for p in peers[1:] if p.proc.poll() is None and p not in killed])
            os.killpg(victim.proc.pid, signal.SIGKILL)
            killed.append(victim)
        elif action == "add":
            peers.append(swarm(f"p{len(peers)}", *join))
        try:
            owner.proc.wait(0.2)
        except Exception:
            pass
    survivors = [p for p in peers if p not in killed]

    def one_state() -> bool:
        last = [p.records()[-1] for p in survivors if p.records()]
        return (len(last) == len(survivors) and len({(r["round"], r["state_hash"]) for r in last}) == 1
                and all(r["group_size"] == len(survivors) for r in last))

    wait_until(one_state, survivors, 300, "the survivors on one state in one group")
    for p in survivors:
        p.proc.send_signal(signal.SIGTERM)
    for p in survivors:
        assert p.wait(30) in (0, 130), p.log.read_text()[-3000:]
    assert len(killed) == 3 and len(peers) == 8

    by_group: dict[tuple[int, tuple[str, ...]], set[str]] = defaultdict(set)
    for p in peers:
        for r in p.records():
            assert math.isfinite(r["train_loss"]) and (r["eval_loss"] is None or math.isfinite(r["eval_loss"]))
            if not r["void"]:
                by_group[(r["round"], tuple(sorted(r["group"])))].add(r["state_hash"])
    diverged = {k: v for k, v in by_group.items() if len(v) != 1}
    assert not diverged, diverged  # every member of every completed round applied the same bytes
    assert sum(len(k[1]) > 1 for k in by_group) >= rounds // 2  # real groups, not everyone alone
    first, last = owner.records("start")[0], [r for r in owner.records() if r["eval_loss"] is not None][-1]
    assert last["eval_loss"] < first["eval_loss"]
