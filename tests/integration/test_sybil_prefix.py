"""observed_addrs (peer/net/libp2p.py) and the prefixes it gives, against two real p2pd daemons on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

from multiaddr import Multiaddr

from hivetrain.peer.net.libp2p import observed_addrs
from hivetrain.peer.net.prefixes import first_prefix

from .daemons import two_daemons

STRANGER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a valid peer id nobody here has


async def _observe() -> dict[str, Any]:
    async with two_daemons() as (a, b):
        await asyncio.wait_for(a.wait_for_at_least_n_peers(1, attempts=20, delay=0.25), timeout=10)
        a_id, b_id = a.peer_id.to_base58(), b.peer_id.to_base58()
        return {
            "a_listens": [str(m) for m in await a.get_visible_maddrs()],
            "b_sees_a": (await observed_addrs(b, [a_id, STRANGER]))[a_id],
            "a_sees_b": (await observed_addrs(a, [b_id]))[b_id],
            "b_stranger": (await observed_addrs(b, [STRANGER]))[STRANGER],
            "prefixes": {p: first_prefix(a) for p, a in (await observed_addrs(b, [a_id, STRANGER])).items()},
            "a_id": a_id,
        }


def test_observed_address_of_a_local_peer_is_loopback_and_exempt() -> None:
    seen = asyncio.run(_observe())
    print(seen)  # shown with -s: the raw addresses hivemind gives
    for key in ("b_sees_a", "a_sees_b"):
        assert seen[key], seen
        for addr in seen[key]:
            m = Multiaddr(addr)
            assert m.value_for_protocol("ip4") == "127.0.0.1", seen
            assert "tcp" in {p.name for p in m.protocols()}
    # b dialed a: the remote end is a's listening port (an inbound connection shows an ephemeral one)
    a_port = {Multiaddr(m).value_for_protocol("tcp") for m in seen["a_listens"]}
    assert {Multiaddr(m).value_for_protocol("tcp") for m in seen["b_sees_a"]} & a_port, seen
    assert seen["b_stranger"] == []
    assert seen["prefixes"] == {seen["a_id"]: None, STRANGER: None}  # loopback is exempt; unknown is None
