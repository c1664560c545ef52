"""The ``Link`` over hivemind's libp2p daemon (p2pd): streams are authenticated by the transport,
so the sender a service sees is the remote peer id of the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hivetrain.peer.averaging.sybil import observed_addrs
from hivetrain.peer.net.link import Server


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
            await server.handle(stream_info.peer_id.to_base58(), reader, writer)

        await self.p2p.add_binary_stream_handler(protocol, handler)

    async def observed_addrs(self, peers: Sequence[str]) -> dict[str, list[str]]:
        return await observed_addrs(self.p2p, peers)

    async def own_addrs(self) -> list[str]:
        async with asyncio.timeout(5.0):
            return [str(a) for a in await self.p2p.get_visible_maddrs()]
