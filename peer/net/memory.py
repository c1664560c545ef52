"""An in-process ``Link``: peers on one event loop, streams as in-memory pipes.

The same request/reply code (peer/net/link.py) and the same services run over it as over libp2p,
so protocol tests and the simulator (peer/sim/) exercise exactly what peers run. The network is the
world the peers live in, set from outside the protocol code, per peer:

- ``rates`` / ``down``: uplink / downlink caps in bytes/s, each shared by all of that peer's streams
  (first written, first carried); a write crosses the sender's uplink and the receiver's downlink at
  once (cut-through: it arrives when the slower of the two has carried it; each link's capacity is
  taken for it when it is written, so a write queued behind a slow uplink does not hold a fast
  downlink for the others);
- ``latency``: one-way seconds of the peer's access link (a byte from a to b arrives latency[a] +
  latency[b] after it crossed the links); ``delays``: seconds added to every write of a peer
  (a slow writer, for tests);
- ``cut``: peers whose traffic is dropped both ways; ``partition``: peers in different components
  cannot reach each other; ``loss``: the probability that a stream a peer opens or takes fails at
  once (a lost connection; drawn from ``rng``, so a seeded run is repeatable);
- ``behind_nat``: a peer that is dialed only over connections it opened itself; ``addrs``: the
  address others see a peer at (the per-prefix Sybil cap and a joiner's votes read it), which is
  also where a plain TCP dial reaches it (``connects``, the dial-back check).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hivetrain.peer.net.link import Server

Item = bytes | None  # None: the end of a stream
SMALL = 1500  # bytes: a write this small passes bulk bytes queued on a link (one packet)
SEND_BUFFER = 65536  # bytes a writer may have queued on its uplink before ``drain`` waits (a socket's buffer)


class _Capped:
    """A capped link: it carries one byte after another at ``rate`` bytes/s, whatever stream they
    belong to, in the order they were written (FIFO: a real fq_codel link interleaves concurrent
    streams instead; what a set of transfers takes in all is the same), except that a write of at
    most SMALL bytes passes the queue (fq_codel serves a sparse flow's packet first: an ack does
    not wait behind a megabyte)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.free = 0.0  # loop time the link is free again

    def carry(self, nbytes: int, start: float) -> float:
        """Reserves the link for ``nbytes`` from ``start`` on; returns when the last byte has crossed.
        A small write (a header, an ack: at most SMALL bytes) does not queue behind bulk bytes, as
        on a fair-queuing link; its time is added to what is queued."""
        if nbytes <= SMALL and self.free > start:
            self.free += nbytes / self.rate
            return start + nbytes / self.rate
        self.free = max(self.free, start) + nbytes / self.rate
        return self.free


class _PipeWriter:
    """The writing end of a one-way in-memory pipe into ``reader``, from ``src`` to ``dst``: each
    write crosses the sender's uplink and the receiver's downlink (cut-through), then the latency
    of both access links, and is fed to the reader at that virtual instant (one timer per write)."""

    def __init__(self, reader: asyncio.StreamReader, net: MemoryNetwork, src: str, dst: str):
        self.reader, self._net, self._src, self._dst = reader, net, src, dst
        self._closed = self._aborted = False
        self.uplink, self.downlink = net.capped(net.rates, net._up, src), net.capped(net.down, net._down, dst)
        self.latency = net.latency_of(src) + net.latency_of(dst)
        self.sent_at = 0.0  # loop time our last write has crossed our uplink (``drain`` waits for most of it)
        self._due: deque[tuple[float, Item]] = deque()  # written, arriving at these times

    def write(self, data: bytes) -> None:
        if self._closed or self._net.is_cut(self._src, self._dst):
            raise ConnectionResetError("stream closed")
        if not data:
            return
        self._net.bytes_moved[self._src] = self._net.bytes_moved.get(self._src, 0) + len(data)
        self._send(bytes(data))

    def _send(self, item: Item) -> None:
        if self.uplink is None and self.downlink is None and self.latency <= 0 and not self._due:
            self._feed(item)
            return
        loop = asyncio.get_running_loop()
        at = loop.time()
        size = len(item) if item is not None else 0
        now = at
        if self.uplink is not None:
            at = self.sent_at = self.uplink.carry(size, at)
        if self.downlink is not None:  # cut-through: the write arrives when the slower link has carried it
            at = max(at, self.downlink.carry(size, now))
        due = at + self.latency
        if self._due and self._due[-1][0] > due:
            due = self._due[-1][0]  # never before what was written earlier on this stream
        self._due.append((due, item))
        loop.call_at(due, self._deliver)

    def _deliver(self) -> None:
        now = asyncio.get_running_loop().time() + 1e-9  # (a timer may fire a rounding error early)
        while self._due and self._due[0][0] <= now:  # in order, whatever order the timers fire in
            self._feed(self._due.popleft()[1])

    def _feed(self, item: Item) -> None:
        if self._aborted:
            return
        if item is None:
            self.reader.feed_eof()
        elif self._net.is_cut(self._src, self._dst):
            self.reader.feed_eof()  # the connection broke under the stream: what was in flight is lost
        else:
            self.reader.feed_data(item)

    async def drain(self) -> None:
        """Returns once at most SEND_BUFFER bytes of ours are still queued on the uplink (plus the
        writer's own ``delays``)."""
        wait = self._net.delays.get(self._src, 0.0) + self._net.delays.get(self._dst, 0.0)
        if self.uplink is not None:
            wait += max(0.0, self.sent_at - SEND_BUFFER / self.uplink.rate - asyncio.get_running_loop().time())
        if wait > 0:  # (as a socket's drain, it does not yield when the buffer has room)
            await asyncio.sleep(wait)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._send(None)  # after the bytes still on their way

    def is_closing(self) -> bool:
        return self._closed

    @property
    def transport(self) -> _PipeWriter:
        return self  # as ``asyncio.StreamWriter.transport``: ``abort`` is there

    def abort(self) -> None:
        """Drops the stream with whatever is still on its way: the reader sees it end at once."""
        if not self._aborted:
            self._closed = self._aborted = True
            self.reader.feed_eof()


@dataclass
class MemoryNetwork:
    """Peers that reach each other in memory; create one ``MemoryLink`` per peer id."""

    links: dict[str, MemoryLink] = field(default_factory=dict)
    cut: set[str] = field(default_factory=set)  # peers whose traffic is dropped, both ways
    partition: dict[str, int] = field(default_factory=dict)  # peer -> component (absent: 0)
    delays: dict[str, float] = field(default_factory=dict)  # peer -> seconds added to each of its writes
    latency: dict[str, float] = field(default_factory=dict)  # peer -> one-way seconds of its access link
    addrs: dict[str, str] = field(default_factory=dict)  # peer -> the address others see it at
    bytes_moved: dict[str, int] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)  # peer -> bytes/s of its uplink, shared by its streams
    down: dict[str, float] = field(default_factory=dict)  # peer -> bytes/s of its downlink, shared likewise
    loss: dict[str, float] = field(default_factory=dict)  # peer -> probability a stream it opens or takes fails
    behind_nat: set[str] = field(default_factory=set)  # dialed only over connections they opened themselves
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _up: dict[str, _Capped] = field(default_factory=dict)
    _down: dict[str, _Capped] = field(default_factory=dict)
    _conns: set[tuple[str, str]] = field(default_factory=set)  # (dialer, dialed): connections, kept open
    _adjacent: dict[str, dict[str, None]] = field(default_factory=dict)  # peer -> peers connected, in order

    def link(self, peer_id: str, addr: str | None = None) -> MemoryLink:
        link = MemoryLink(self, peer_id)
        self.links[peer_id] = link
        self.addrs[peer_id] = addr or "/ip4/127.0.0.1/tcp/1"
        self.bytes_moved[peer_id] = 0
        return link

    def drop(self, peer_id: str) -> None:
        """A peer that crashed: its link, its servers and its connections are gone."""
        self.links.pop(peer_id, None)
        for other in self._adjacent.pop(peer_id, {}):
            self._adjacent.get(other, {}).pop(peer_id, None)
            self._conns -= {(peer_id, other), (other, peer_id)}

    def is_cut(self, a: str, b: str) -> bool:
        return a in self.cut or b in self.cut or self.partition.get(a, 0) != self.partition.get(b, 0)

    def dial(self, a: str, b: str) -> bool:
        """Whether ``a`` can open a stream to ``b``: as a NAT does, a peer behind one takes streams
        only over a connection it opened; any successful dial keeps its connection."""
        if self.is_cut(a, b) or (b in self.behind_nat and (b, a) not in self._conns):
            return False
        if (b, a) not in self._conns and (a, b) not in self._conns:
            self._conns.add((a, b))
            self._adjacent.setdefault(a, {})[b] = None
            self._adjacent.setdefault(b, {})[a] = None
        return True

    def lost(self, a: str, b: str) -> bool:
        """Whether a stream between ``a`` and ``b`` fails at once (``loss``)."""
        p = 1 - (1 - self.loss.get(a, 0.0)) * (1 - self.loss.get(b, 0.0))
        return p > 0 and self.rng.random() < p

    def connected(self, a: str) -> list[str]:
        """The peers ``a`` holds a connection to (either side opened it), in the order they came."""
        return [p for p in self._adjacent.get(a, {}) if p in self.links and not self.is_cut(a, p)]

    def connects(self, a: str, host: str, port: int) -> bool:
        """Whether a plain TCP dial from ``a`` to ``host``:``port`` is answered (the dial-back check)."""
        for peer, addr in self.addrs.items():
            parts = addr.split("/")
            if len(parts) >= 5 and parts[2] == host and parts[4] == str(port):
                return peer in self.links and not self.is_cut(a, peer) and peer not in self.behind_nat
        return False

    def latency_of(self, peer: str) -> float:
        return self.latency.get(peer, 0.0)

    def capped(self, rates: dict[str, float], links: dict[str, _Capped], peer: str) -> _Capped | None:
        """``peer``'s capped link (None if ``rates`` does not cap it), shared by all its streams."""
        rate = rates.get(peer)
        if not rate:
            return None
        link = links.get(peer)
        if link is None or link.rate != rate:
            link = links[peer] = _Capped(rate)
        return link


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
        if self.net.lost(self.me, peer):
            raise ConnectionResetError(f"the connection to {peer} was lost")
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        server_writer = _PipeWriter(to_client, self.net, peer, self.me)
        task = asyncio.create_task(remote._servers[protocol].handle(self.me, to_server, server_writer,
                                                                    self.net.addrs.get(self.me, "")))
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

    async def connected(self) -> list[str]:
        return self.net.connected(self.me)

    async def connects(self, host: str, port: int, timeout: float) -> bool:
        return self.net.connects(self.me, host, port)

    async def close(self) -> None:
        self.shut()

    def shut(self) -> None:
        """Stops serving at once: the streams being served are cancelled."""
        for task in list(self._tasks):
            task.cancel()
        self._servers.clear()
