"""A network partition between namespaces: both sides keep going; after healing, one state wins."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from .conftest import wait_until
from .netns import Net, namespaces


@pytest.fixture
def net() -> Iterator[Net]:
    with namespaces(4) as network:
        yield network


_wait = wait_until


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_partition_then_heal_converges_to_one_state(swarm, net: Net) -> None:
    common = ["--sync-every", "4", "--allreduce-timeout", "10", "--until-round", "60", "--dht-timeout", "8",
              "--wait-for-peers", "4"]
    owner = swarm("p0", "--new-run", "split", "--target-group-size", "4", "--matchmaking-timeout", "8",
                  "--host-maddrs", f"/ip4/{net.addrs[0]}/tcp/0", *common, prefix=net.exec_prefix(0))
    info = owner.wait_info()
    peers = [owner] + [
        swarm(f"p{i}", "--run", info["run_key"], "--initial-peers", info["maddrs"][0],
              "--host-maddrs", f"/ip4/{net.addrs[i]}/tcp/0", *common, prefix=net.exec_prefix(i))
        for i in range(1, 4)
    ]
    _wait(lambda: all(len(p.records()) >= 2 for p in peers), peers, 180, "2 rounds together")
    net.partition([0, 1], [2, 3])
    cut_at = max(len(p.records()) for p in peers)
    # each side keeps training (or voids safely) on its own
    _wait(lambda: all(len(p.records()) >= cut_at + 3 for p in peers), peers, 240, "3 rounds apart")
    during = [p.records()[cut_at + 1] for p in peers]
    assert all(r["void"] or r["group_size"] <= 2 for r in during), during
    net.heal()
    healed_at = max(p.records()[-1]["round"] for p in peers)

    def converged() -> bool:
        last = [p.records()[-1] for p in peers]
        return (len({(r["round"], r["state_hash"]) for r in last}) == 1
                and all(not r["void"] and r["group_size"] == 4 for r in last))

    _wait(converged, peers, 300, "one state for all four after the heal")
    for p in peers:
        p.proc.send_signal(signal.SIGTERM)
    for p in peers:
        assert p.wait(30) in (0, 130), p.log.read_text()[-3000:]
    syncs = [r for p in peers for r in p.records("sync") if r["round"] > healed_at - 1]
    assert syncs, "no side re-synced after the heal"
