"""The ``Link`` over hivemind's libp2p daemon (p2pd): streams are authenticated by the transport,
so the sender a service sees is the remote peer id of the stream, and the address it sees is the
remote end of the connection as our daemon holds it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from hivetrain.peer.net.link import Server

logger = logging.getLogger(__name__)
OBSERVE_TIMEOUT = 5.0  # seconds for the daemon's connection list; it is local, so this is generous
MAX_ADDRS_PER_PEER = 16  # connections listed per peer: bounds work if a peer opens many


class LibP2PLink:
    """A ``Link`` over a hivemind ``P2P`` instance; use on the loop that owns it (the DHT's)."""

    def __init__(self, p2p: Any):
        self.p2p = p2p
        self.me: str = p2p.peer_id.to_base58()

    async def open(self, peer: str, protocol: str, timeout: float) -> tuple[asyncio.StreamReader, Any]:
        from hivemind.p2p import PeerID

        async with asyncio.timeout(timeout):
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
        return reader, writer

    async def serve(self, protocol: str, server: Server) -> None:
        async def handler(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.handle(stream_info.peer_id.to_base58(), reader, writer, str(stream_info.addr))

        await self.p2p.add_binary_stream_handler(protocol, handler)

    async def observed_addrs(self, peers: Sequence[str]) -> dict[str, list[str]]:
        return await observed_addrs(self.p2p, peers)

    async def own_addrs(self) -> list[str]:
        async with asyncio.timeout(5.0):
            return [str(a) for a in await self.p2p.get_visible_maddrs()]

    async def connected(self) -> list[str]:
        async with asyncio.timeout(OBSERVE_TIMEOUT):
            infos = await self.p2p.list_peers()
        return list(dict.fromkeys(i.peer_id.to_base58() for i in infos
                                  if not any("/p2p-circuit" in str(a) for a in i.addrs)))

    async def connects(self, host: str, port: int, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True


async def observed_addrs(p2p: Any, peer_ids: Iterable[str]) -> dict[str, list[str]]:
    """For each requested peer id (base58), the remote multiaddrs of our live connections to it.

    ``p2p`` is a hivemind ``P2P``; its ``list_peers()`` returns the p2pd daemon's connection
    list, one ``PeerInfo`` per connection whose single address is that connection's remote end
    as our daemon sees it, e.g. ``/ip4/127.0.0.1/tcp/41235`` for a peer on this machine (an
    inbound connection shows the peer's ephemeral source port). A peer we are not connected to
    maps to []. Bounded by ``OBSERVE_TIMEOUT``; a daemon error or timeout is logged at debug
    level and every peer maps to [] (fail-open: nobody is capped by prefix for it, see
    peer/net/prefixes.py). Call on the loop that owns ``p2p``.
    """
    out: dict[str, list[str]] = {p: [] for p in peer_ids}
    try:
        async with asyncio.timeout(OBSERVE_TIMEOUT):
            infos = await p2p.list_peers()
    except Exception as e:  # any daemon failure (incl. an address it cannot decode): advisory only
        logger.debug("observed_addrs: list_peers failed: %s: %s", type(e).__name__, e)
        return out
    for info in infos:
        try:
            peer = info.peer_id.to_base58()
            addrs = [str(a) for a in info.addrs]
        except Exception as e:  # a malformed entry costs that entry only
            logger.debug("observed_addrs: skipping a peer entry: %s: %s", type(e).__name__, e)
            continue
        seen = out.get(peer)
        if seen is None:
            continue
        for addr in addrs:
            if addr not in seen and len(seen) < MAX_ADDRS_PER_PEER:
                seen.append(addr)
    return out
