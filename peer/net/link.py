"""The transport seam: a ``Link`` opens authenticated byte streams to peers; one request/reply
exchange per stream runs on top of it, the same code over libp2p (peer/net/libp2p.py) and over
in-process pipes (peer/net/memory.py).

A request with a body is sent in two steps, so a receiver never reads a body it does not want::

    requester                               server
    prefix + header  ─────────────────────►  checks the header, asks the ``Service`` (``admit``)
                     ◄─────────────────────  ack CONTINUE (or the final answer: the body is never sent)
    body (exactly body_len bytes) ────────►  read within the ticket's deadline
                     ◄─────────────────────  the reply frame (``Ticket.complete``)

The server caps concurrent streams in all and per peer (refusing the excess at once with BUSY) and
puts a deadline on every read and on the reply's write. The peer id a ``Service`` sees is the one
the link authenticated (for libp2p, the stream's remote peer id), never a field of the message, and
the address is the stream's remote end as our side of the connection sees it. Every protocol of a
peer is a ``Service`` on this seam: averaging (peer/averaging/averager.py), state serving
(peer/state/serve.py) and the dial-back check (peer/net/dialback.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hivetrain.dht import clock
from hivetrain.peer.net.wire import (
    Code,
    ProtocolError,
    encode_header,
    read_body,
    read_header,
)

logger = logging.getLogger(__name__)
IO_TIMEOUT = 10.0  # seconds for a header, a small reply, or a reply's write
MAX_STREAMS_PER_PEER = 12  # inbound streams served at once from one peer (a member has a handful in flight)
MAX_STREAMS_OTHERS = 64  # ... and from all peers that are not members of our current round, together

Reply = tuple[dict[str, Any], bytes]


class Ticket(Protocol):
    """An admitted message whose body (exactly ``body_len`` bytes) the server now reads."""

    @property
    def deadline(self) -> float:
        """``clock.now()`` seconds: the body must have arrived by then."""
        ...

    async def complete(self, body: bytes) -> Reply:
        """The reply, once the body is here."""
        ...

    def abort(self) -> None:
        """The body never came: release whatever ``admit`` reserved."""
        ...


class Service(Protocol):
    """What a protocol served over a link implements (averaging, state sync)."""

    @property
    def max_body(self) -> int:
        """No message of this protocol has a longer body: a longer claim is refused on the prefix."""
        ...

    def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str) -> Reply | Ticket:
        """Decides on the header alone: a ``Reply`` ends the exchange (any body stays unread), a
        ``Ticket`` asks for the body. ``remote``: the stream's remote address as our side sees it
        ("" if unknown). Called on the link's loop; must not block."""
        ...

    def refusal(self, header: dict[str, Any], code: Code, why: str) -> Reply:
        """The reply that refuses ``header`` (or a header that did not parse: then ``header`` is {})."""
        ...

    def is_member(self, peer: str) -> bool:
        """Whether ``peer`` takes part in our current round (its streams skip the shared cap)."""
        ...


@dataclass(frozen=True)
class Done:
    """A ticket for a body-less message that is already answered."""

    reply: Reply
    deadline: float = 0.0

    async def complete(self, body: bytes) -> Reply:
        return self.reply

    def abort(self) -> None:
        pass


class Link(Protocol):
    """Streams between authenticated peers. All methods run on the link's event loop."""

    me: str  # our peer id

    async def open(self, peer: str, protocol: str, timeout: float) -> tuple[asyncio.StreamReader, Any]:
        """An outbound stream to ``peer``: (reader, writer). Raises OSError/TimeoutError if unreachable."""
        ...

    async def serve(self, protocol: str, server: Server) -> None:
        """Routes inbound streams of ``protocol`` to ``server.handle(sender, reader, writer, remote)``."""
        ...

    async def observed_addrs(self, peers: Sequence[str]) -> dict[str, list[str]]:
        """For each peer, the remote addresses of our own connections to it ([] if none)."""
        ...

    async def own_addrs(self) -> list[str]:
        """The addresses we listen on or announce."""
        ...

    async def connected(self) -> list[str]:
        """The peers we hold a direct (not relayed) connection to."""
        ...

    async def connects(self, host: str, port: int, timeout: float) -> bool:
        """Whether a plain TCP connection to ``host``:``port`` opens within ``timeout`` seconds."""
        ...


@dataclass
class Traffic:
    """Bytes this peer wrote and read in requests and replies (headers included), in all and by
    the type of the request they belong to."""

    sent: int = 0
    received: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)  # request type -> bytes both ways
    requests: Counter[str] = field(default_factory=Counter)  # request type -> requests sent

    def count(self, kind: str, sent: int = 0, received: int = 0) -> None:
        self.sent += sent
        self.received += received
        self.by_kind[kind] += sent + received


async def request(link: Link, peer: str, protocol: str, header: dict[str, Any], body: bytes, timeout: float,
                  max_reply_body: int = 0, traffic: Traffic | None = None) -> Reply:
    """One exchange with ``peer``: sends ``header`` (and ``body`` once the receiver asks for it),
    returns the reply. A refusal is a reply too (an ``ack`` with its code). Raises TimeoutError past
    ``timeout`` seconds, ProtocolError for a malformed reply, OSError/IncompleteReadError (or the
    transport's own errors) if the peer cannot be reached or drops the stream."""
    head = encode_header(header, len(body))
    sent = 0  # bytes written, counted even when the exchange fails afterwards (a lost reply: they were sent)
    try:
        async with asyncio.timeout(timeout):  # bounds every step below (they set no deadline of their own)
            reader, writer = await link.open(peer, protocol, timeout)
            try:
                writer.write(head)
                await writer.drain()
                sent = len(head)
                if body:
                    go, _ = await read_header(reader, None, max_body=0)
                    if go.get("type") != "ack" or go["code"] != Code.CONTINUE:
                        return go, b""  # refused on the header: the body stays here
                    writer.write(body)
                    await writer.drain()
                    sent += len(body)
                reply, reply_len = await read_header(reader, None, max_reply_body)
                reply_body = await read_body(reader, reply_len, None)
            finally:
                writer.close()
    finally:
        if traffic is not None:
            traffic.count(header["type"], sent=sent)
            traffic.requests[header["type"]] += 1
    if traffic is not None:
        traffic.count(header["type"], received=len(reply_body) + 64)
    return reply, reply_body


@dataclass
class Server:
    """Serves one ``Service`` on inbound streams, with caps on concurrent streams: per peer, and for
    all non-members together (a flood from many fresh identities cannot crowd out our group)."""

    service: Service
    max_others: int = MAX_STREAMS_OTHERS
    max_per_peer: int = MAX_STREAMS_PER_PEER
    write_timeout: float = IO_TIMEOUT  # seconds to write one reply
    open_streams: Counter[str] = field(default_factory=Counter)
    others: int = 0  # open streams from non-members
    refused_busy: int = 0  # streams refused for the caps (seen by tests and logs)
    traffic: Traffic = field(default_factory=Traffic)

    async def handle(self, sender: str, reader: asyncio.StreamReader, writer: Any, remote: str = "") -> None:
        """Serves one inbound stream from the authenticated ``sender`` (seen at ``remote``); never raises."""
        member = self.service.is_member(sender)
        if self.open_streams[sender] >= self.max_per_peer or (not member and self.others >= self.max_others):
            self.refused_busy += 1
            await _write(writer, self.service.refusal({}, Code.BUSY, "too many streams"), self.write_timeout)
            return
        self.open_streams[sender] += 1
        self.others += not member
        try:
            await self._serve(sender, reader, writer, remote)
        finally:
            self.others -= not member
            self.open_streams[sender] -= 1
            if self.open_streams[sender] <= 0:
                del self.open_streams[sender]

    async def _serve(self, sender: str, reader: asyncio.StreamReader, writer: Any, remote: str) -> None:
        header: dict[str, Any] = {}
        try:
            header, body_len = await read_header(reader, IO_TIMEOUT, self.service.max_body)
            self.traffic.count(header["type"], received=64)  # a header; a body counts once it is read
            outcome = self.service.admit(sender, header, body_len, remote)
            if isinstance(outcome, tuple):  # answered on the header: a body, if any, stays unread
                reply = outcome
            elif not body_len:
                reply = await outcome.complete(b"")
            else:
                try:
                    await _write(writer, self.service.refusal(header, Code.CONTINUE, ""), self.write_timeout, close=False)
                    body = await read_body(reader, body_len, max(0.01, outcome.deadline - clock.now()))
                    self.traffic.count(header["type"], received=body_len)
                except BaseException:
                    outcome.abort()
                    raise
                reply = await outcome.complete(body)
        except ProtocolError as e:
            reply = self.service.refusal(header, Code.MALFORMED, str(e))
        except (TimeoutError, asyncio.IncompleteReadError, OSError, ConnectionError):
            writer.close()
            return
        except Exception as e:  # a bug must not silently drop the stream: answer, and say what it was
            logger.exception("handler failed on a message from %s", sender)
            reply = self.service.refusal(header, Code.INTERNAL, f"internal error: {type(e).__name__}")
        self.traffic.count(header.get("type", "?"), sent=len(reply[1]) + 64)
        await _write(writer, reply, self.write_timeout)


async def _write(writer: Any, reply: Reply, timeout: float, close: bool = True) -> None:
    """Writes one reply frame within ``timeout`` seconds; past it, the stream is aborted with
    whatever is still buffered (a peer that never reads pins no memory here)."""
    header, body = reply
    try:
        async with asyncio.timeout(timeout):
            writer.write(encode_header(header, len(body)) + body)
            await writer.drain()
    except TimeoutError:
        transport = getattr(writer, "transport", None)
        if transport is not None:
            transport.abort()
        close = True
    except (OSError, ConnectionError):
        close = True
    finally:
        if close:
            writer.close()
