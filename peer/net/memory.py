"""An in-process ``Link``: peers on one event loop, streams as in-memory pipes.

The same request/reply code (peer/net/link.py) and the same services run over it as over libp2p,
so protocol tests and simulations exercise exactly what peers run, in milliseconds. The network
can cut a peer off, delay its traffic, cap its uplink (bytes/s shared by all its streams, like a
tbf-shaped link), or give it an address (for the per-prefix Sybil cap), to inject faults from
outside the protocol code.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hivetrain.peer.net.link import Server

SLICE = 16384  # bytes a capped uplink carries of one stream before the next stream's turn


class _Uplink:
    """A sender's capped uplink: its streams take turns, SLICE bytes at a time (fair queuing, as
    Linux's default fq_codel shares a link), at ``rate`` bytes/s in all."""

    def __init__(self, rate: float):
        self.rate = rate
        self.queues: dict[_PipeWriter, deque[bytes | None]] = {}  # in turn order; None: end of stream
        self.pump: asyncio.Task[None] | None = None
        self.clock = 0.0  # loop time the uplink is free again

    def put(self, writer: _PipeWriter, data: bytes | None) -> None:
        queue = self.queues.setdefault(writer, deque())
        if data is None:
            queue.append(None)
        else:
            queue.extend(data[i:i + SLICE] for i in range(0, len(data), SLICE))
        writer.sent.clear()
        if self.pump is None or self.pump.done():
            self.pump = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self.clock = max(self.clock, loop.time())  # busy from now on: a late wake-up is caught up, not lost
        while self.queues:
            for writer in list(self.queues):
                queue = self.queues[writer]
                chunk = queue.popleft()
                if chunk is None:
                    writer.reader.feed_eof()
                else:
                    self.clock += len(chunk) / self.rate
                    await asyncio.sleep(self.clock - loop.time())
                    writer.reader.feed_data(chunk)
                if not queue:
                    del self.queues[writer]
                    writer.sent.set()


class _PipeWriter:
    """The writing end of a one-way in-memory pipe into ``reader``."""

    def __init__(self, reader: asyncio.StreamReader, net: MemoryNetwork, src: str, dst: str):
        self.reader, self._net, self._src, self._dst = reader, net, src, dst
        self._closed = False
        self.uplink = net.uplink(src)
        self.sent = asyncio.Event()  # everything written has crossed the capped uplink
        self.sent.set()

    def write(self, data: bytes) -> None:
        if self._closed or self._net.is_cut(self._src, self._dst):
            raise ConnectionResetError("stream closed")
        if not data:
            return
        self._net.bytes_moved[self._src] += len(data)
        if self.uplink is None:
            self.reader.feed_data(bytes(data))
        else:  # the bytes arrive as the sender's uplink carries them
            self.uplink.put(self, bytes(data))

    async def drain(self) -> None:
        await self.sent.wait()
        await asyncio.sleep(self._net.delay_of(self._src, self._dst))  # also yields, like a real drain

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.uplink is not None and not self.sent.is_set():
                self.uplink.put(self, None)  # after the bytes still queued
            else:
                self.reader.feed_eof()

    def is_closing(self) -> bool:
        return self._closed


@dataclass
class MemoryNetwork:
    """Peers that reach each other in memory; create one ``MemoryLink`` per peer id."""

    links: dict[str, MemoryLink] = field(default_factory=dict)
    cut: set[str] = field(default_factory=set)  # peers whose traffic is dropped, both ways
    delays: dict[str, float] = field(default_factory=dict)  # peer -> seconds added to each of its writes
    addrs: dict[str, str] = field(default_factory=dict)  # peer -> the address others see it at
    bytes_moved: dict[str, int] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)  # peer -> bytes/s of its uplink, shared by its streams
    behind_nat: set[str] = field(default_factory=set)  # dialed only over connections they opened themselves
    _uplinks: dict[str, _Uplink] = field(default_factory=dict)
    _conns: set[tuple[str, str]] = field(default_factory=set)  # (dialer, dialed): connections, kept open

    def link(self, peer_id: str, addr: str | None = None) -> MemoryLink:
        link = MemoryLink(self, peer_id)
        self.links[peer_id] = link
        self.addrs[peer_id] = addr or "/ip4/127.0.0.1/tcp/1"
        self.bytes_moved[peer_id] = 0
        return link

    def is_cut(self, a: str, b: str) -> bool:
        return a in self.cut or b in self.cut

    def dial(self, a: str, b: str) -> bool:
        """Whether ``a`` can open a stream to ``b``: as a NAT does, a peer behind one takes streams
        only over a connection it opened; any successful dial keeps its connection."""
        if self.is_cut(a, b) or (b in self.behind_nat and (b, a) not in self._conns):
            return False
        if (b, a) not in self._conns:
            self._conns.add((a, b))
        return True

    def delay_of(self, a: str, b: str) -> float:
        return self.delays.get(a, 0.0) + self.delays.get(b, 0.0)

    def uplink(self, src: str) -> _Uplink | None:
        """``src``'s capped uplink (None if ``rates`` does not cap it), shared by all its streams."""
        rate = self.rates.get(src)
        if not rate:
            return None
        uplink = self._uplinks.get(src)
        if uplink is None or uplink.rate != rate:
            uplink = self._uplinks[src] = _Uplink(rate)
        return uplink


class MemoryLink:
    """A ``Link`` inside a ``MemoryNetwork``."""

    def __init__(self, net: MemoryNetwork, me: str):
        self.net, self.me = net, me
        self._servers: dict[str, Server] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self, peer: str, protocol: str, timeout: float) -> tuple[asyncio.StreamReader, Any]:
        remote = self.net.links.get(peer)
        if remote is None or protocol not in remote._servers or not self.net.dial(self.me, peer):
            raise ConnectionRefusedError(f"cannot reach {peer} ({protocol})")
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        server_writer = _PipeWriter(to_client, self.net, peer, self.me)
        task = asyncio.create_task(remote._servers[protocol].handle(self.me, to_server, server_writer))
        remote._tasks.add(task)
        task.add_done_callback(remote._tasks.discard)
        return to_client, _PipeWriter(to_server, self.net, self.me, peer)

    async def serve(self, protocol: str, server: Server) -> None:
        self._servers[protocol] = server

    async def observed_addrs(self, peers: Sequence[str]) -> dict[str, list[str]]:
        return {p: [self.net.addrs[p]] if p in self.net.addrs and not self.net.is_cut(self.me, p) else []
                for p in peers}

    async def own_addrs(self) -> list[str]:
        return [self.net.addrs[self.me]]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._servers.clear()
