"""Peers behind NAT routers in network namespaces (natnet.py): the step 8 starting point."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from .natnet import NatNet

FAST = ["--sync-every", "4", "--allreduce-timeout", "12", "--matchmaking-timeout", "6", "--dht-timeout", "8"]


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_behind_nat_trains_with_a_public_owner(swarm, nat: NatNet) -> None:
    """An owner on the public segment and one peer behind an endpoint-independent masquerade router: the
    NATed peer dials out, and every stream between them runs over that outbound connection."""
    own_ns = nat.public("owner")
    router = nat.router("r1")
    lan_ns = nat.behind(router, "a")
    own_ip, router_ip = nat.ip_of(own_ns), nat.ip_of(router)
    common = [*FAST, "--max-rounds", "5", "--wait-for-peers", "2"]
    owner = swarm("owner", "--new-run", "nat", "--target-group-size", "2",
                  "--host-maddrs", f"/ip4/{own_ip}/tcp/0", *common, prefix=nat.exec_prefix(own_ns))
    info = owner.wait_info()
    owner_maddr = next(m for m in info["maddrs"] if m.startswith(f"/ip4/{own_ip}/"))
    nated = swarm("a", "--run", info["run_key"], "--initial-peers", owner_maddr,
                  "--host-maddrs", "/ip4/0.0.0.0/tcp/0", *common, prefix=nat.exec_prefix(lan_ns))

    # While they run, note every established TCP peer the owner has (the only host that reaches it).
    remotes: set[str] = set()
    peers = [owner, nated]
    deadline = time.monotonic() + 180
    while any(p.proc.poll() is None for p in peers):
        remotes |= {remote.rsplit(":", 1)[0] for local, remote in nat.established(own_ns)
                    if local.startswith(f"{own_ip}:")}
        assert time.monotonic() < deadline, "peers still running after 180 s:\n" + "\n".join(
            p.log.read_text()[-1500:] for p in peers)
        try:
            next(p for p in peers if p.proc.poll() is None).proc.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
    for p in peers:
        assert p.wait(1) == 0, p.log.read_text()[-3000:]

    # the NAT really happened: the owner only ever saw the router's public address
    assert remotes == {router_ip}, (remotes, router_ip)

    owner_id = owner.records("start")[0]["peer_id"]
    together = [r for r in nated.records() if not r["void"] and r["group_size"] == 2 and owner_id in r["group"]]
    assert len(together) >= 3, nated.records()
    owner_rounds = {r["round"]: r for r in owner.records() if not r["void"]}
    both = [r for r in nated.records() if not r["void"] and r["round"] in owner_rounds]
    assert both, (nated.records(), owner.records())
    for r in both:
        assert r["state_hash"] == owner_rounds[r["round"]]["state_hash"], (r, owner_rounds[r["round"]])
