"""Peers behind NAT routers in network namespaces (bench/natnet.py), no port forwarding: each finds out
that nobody can dial it (peer/net/dialback.py) and trains as an outbound-only member."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench.natnet import NatNet

FAST = ["--sync-every", "4", "--allreduce-timeout", "12", "--matchmaking-timeout", "6", "--dht-timeout", "8"]
ROUNDS = 6


@pytest.fixture
def nat() -> Iterator[NatNet]:
    reason = NatNet.available()
    if reason:
        pytest.skip(reason)
    net = NatNet()
    try:
        yield net
    finally:
        net.down()


def _train(swarm: Any, nat: NatNet, symmetric: list[bool]) -> tuple[Any, list[Any], set[str], str]:
    """An owner on the public segment and one peer behind its own router per entry of ``symmetric``
    (True: a symmetric NAT, a random source port per destination; False: endpoint-independent,
    like a home router); all trade until the end. Returns (owner, NATed peers, the addresses the
    owner saw connections from, the routers' addresses)."""
    own_ns = nat.public("owner")
    own_ip = nat.ip_of(own_ns)
    n = 1 + len(symmetric)
    common = [*FAST, "--until-round", str(ROUNDS), "--wait-for-peers", str(n), "--target-group-size", str(n)]
    owner = swarm("owner", "--new-run", "nat", "--host-maddrs", f"/ip4/{own_ip}/tcp/0", *common,
                  prefix=nat.exec_prefix(own_ns))
    info = owner.wait_info()
    owner_maddr = next(m for m in info["maddrs"] if m.startswith(f"/ip4/{own_ip}/"))
    nated, routers = [], set()
    for i, sym in enumerate(symmetric):
        router = nat.router(f"r{i}", symmetric=sym)
        routers.add(nat.ip_of(router))
        nated.append(swarm(f"p{i}", "--run", info["run_key"], "--initial-peers", owner_maddr,
                           "--host-maddrs", "/ip4/0.0.0.0/tcp/0", *common,
                           prefix=nat.exec_prefix(nat.behind(router, f"p{i}"))))
    remotes: set[str] = set()  # every address the owner held a TCP connection with
    peers = [owner, *nated]
    deadline = time.monotonic() + 240
    while any(p.proc.poll() is None for p in peers):
        remotes |= {remote.rsplit(":", 1)[0] for local, remote in nat.established(own_ns)
                    if local.startswith(f"{own_ip}:")}
        assert time.monotonic() < deadline, "peers still running after 240 s:\n" + "\n".join(
            p.log.read_text()[-1500:] for p in peers)
        running = next((p for p in peers if p.proc.poll() is None), None)
        if running is None:  # the last one exited since the loop's check
            break
        try:
            running.proc.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
    for p in peers:
        assert p.wait(1) == 0, p.log.read_text()[-3000:]
    return owner, nated, remotes, " ".join(sorted(routers))


def _check_rounds(owner: Any, nated: list[Any], min_together: int) -> None:
    """Every NATed peer knew it was behind NAT, trained in groups with all the others, and agreed
    with the owner's state in every round both completed."""
    ids = [p.records("start")[0]["peer_id"] for p in (owner, *nated)]
    owner_rounds = {r["round"]: r for r in owner.records() if not r["void"]}
    for p in nated:
        log = p.log.read_text()
        assert "reachability: behind NAT: joined as an outbound-only member" in log, log[-3000:]
        together = [r for r in p.records() if not r["void"] and set(r["group"]) == set(ids)]
        assert len(together) >= min_together, p.records()
        both = [r for r in p.records() if not r["void"] and r["round"] in owner_rounds]
        assert both, (p.records(), owner.records())
        for r in both:
            assert r["state_hash"] == owner_rounds[r["round"]]["state_hash"], (r, owner_rounds[r["round"]])
    owner_log = owner.log.read_text()
    assert "reachability: behind NAT" not in owner_log
    # every peer publishes how it is reached: the owner counts the NATed ones from their heartbeats
    assert f"{len(nated)} outbound-only (behind NAT)" in owner_log, owner_log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_peers_behind_home_routers_train_with_the_owner_every_round(swarm, nat: NatNet) -> None:
    """All but the owner behind NAT, two endpoint-independent masquerade routers that drop unsolicited
    inbound traffic: the two NATed peers cannot reach each other, yet all three train in one group."""
    owner, nated, remotes, routers = _train(swarm, nat, [False, False])
    assert remotes == set(routers.split()), (remotes, routers)  # the NAT really happened
    _check_rounds(owner, nated, min_together=ROUNDS - 2)
    assert "reachability: reachable directly" in owner.log.read_text()  # its re-check, once peers came


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_peer_behind_a_symmetric_nat_trains_with_the_owner(swarm, nat: NatNet) -> None:
    """A symmetric NAT (a random source port per destination, no inbound): the peer still takes part."""
    owner, nated, remotes, routers = _train(swarm, nat, [True])
    assert remotes == {routers}, (remotes, routers)
    _check_rounds(owner, nated, min_together=ROUNDS - 2)
