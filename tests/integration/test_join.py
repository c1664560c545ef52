"""A volunteer's join (step 15): two real peers in their own network namespaces, each listening on
all interfaces at the default port. The owner's join string gives out its interface address, not
loopback, and a joiner in another namespace needs that string alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hivetrain.peer.flags import DEFAULT_PORT

from .netns import Net, namespaces


@pytest.fixture
def net() -> Iterator[Net]:
    with namespaces(2) as network:
        yield network


@pytest.mark.timeout(300)
def test_a_joiner_in_another_namespace_joins_with_the_owners_join_string_alone(swarm, net: Net) -> None:
    common = ["--sync-every", "4", "--until-round", "2", "--wait-for-peers", "2", "--target-group-size", "2",
              "--eval-batches", "0", "--port", str(DEFAULT_PORT)]  # (the default, named: the swarm fixture
    # listens on loopback unless told where)
    owner = swarm("p0", "--new-run", "netjoin", *common, prefix=net.exec_prefix(0))
    info = owner.wait_info()
    addresses = info["join"].partition("@")[2].split(",")
    assert info["join"].startswith(f"hivetrain://{info['run_key']}@"), info
    assert addresses == [f"/ip4/{net.addrs[0]}/tcp/{DEFAULT_PORT}/p2p/{info['peer_id']}"], info  # not 127.0.0.1
    joiner = swarm("p1", "--join", info["join"], *common, prefix=net.exec_prefix(1))
    for p in (owner, joiner):
        assert p.wait(240) == 0, p.log.read_text()[-3000:]
    log = owner.log.read_text()
    assert f"listening on all interfaces, TCP port {DEFAULT_PORT} (--port chooses another)" in log, log[-2000:]
    assert "(a private address: only peers on your network can use it" in log, log[-2000:]  # 10.78.x: said so
    mine = joiner.wait_info()["join"].partition("@")[2].split(",")
    assert mine == [f"/ip4/{net.addrs[1]}/tcp/{DEFAULT_PORT}/p2p/{joiner.wait_info()['peer_id']}", addresses[0]]
    together = [r for r in joiner.records() if not r["void"] and r["group_size"] == 2]
    assert together and together[-1]["round"] == 1, joiner.records()
