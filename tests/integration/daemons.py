"""Two real p2p daemons on 127.0.0.1, connected to each other, shut down however the test ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from hivemind.p2p import P2P

from hivetrain.dht.process import children_die_with_us

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@asynccontextmanager
async def two_daemons() -> AsyncIterator[tuple[P2P, P2P]]:
    """(a, b): b bootstrapped from a; yields once b holds a connection to a."""
    daemons: list[P2P] = []
    try:
        with children_die_with_us():
            a = await P2P.create(host_maddrs=LOCAL, nat_port_map=False)
            daemons.append(a)
            b = await P2P.create(host_maddrs=LOCAL, nat_port_map=False, initial_peers=await a.get_visible_maddrs())
            daemons.append(b)
        await asyncio.wait_for(b.wait_for_at_least_n_peers(1, attempts=20, delay=0.25), timeout=10)
        yield a, b
    finally:
        for daemon in reversed(daemons):
            await daemon.shutdown()
