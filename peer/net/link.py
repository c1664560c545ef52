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
from collections.abc import Callable, Sequence
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
MAX_PENDING = 256  # streams still waiting for their header, from all peers together
STALL_S = 2.0  # a non-member's reply that drained nothing for this long may lose its slot to a newcomer
CHUNK = 1 << 16  # bytes per write of a non-member's reply (its progress is measured per chunk)

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
class _Waiting:
    """An inbound stream whose header has not arrived yet."""

    sender: str
    reading: asyncio.Future[tuple[dict[str, Any], int]]
    evicted: bool = False


@dataclass
class _Slot:
    """An inbound stream from a non-member that holds one of the shared slots, from its header on."""

    sender: str
    writer: Any
    moved: float  # clock.now() of its header, then of the last chunk of its reply the requester took
    writing: bool = False
    evicted: bool = False


@dataclass
class Server:
    """Serves one ``Service`` on inbound streams, with caps on concurrent streams: per peer, for
    streams still waiting for their header, and for all non-members together once their header is
    here (a flood from many fresh identities cannot crowd out our group, nor one requester another).

    Who gets a scarce place is never first-come (review 2026-12-02 N2: 8 identities x 4 silent
    streams held every slot of a state server before sending a header, and every joiner got BUSY):

    - a stream counts against the shared cap only once its header is here, so a silent stream holds
      only a place among the ``max_pending`` waiting ones;
    - when those are full, a newcomer takes the place of the oldest waiting stream of the peer that
      holds the most of them, unless that would make the newcomer's peer the one holding the most
      (then it is refused BUSY): an honest header, which arrives in milliseconds, is read whatever
      number of silent streams others hold;
    - when the shared slots are full, a reply whose write has taken nothing for ``STALL_S`` seconds
      (a requester that asked and does not read) loses its slot to the newcomer; otherwise the
      newcomer is refused BUSY, which a requester retries later.
    """

    service: Service
    max_others: int = MAX_STREAMS_OTHERS
    max_per_peer: int = MAX_STREAMS_PER_PEER
    write_timeout: float = IO_TIMEOUT  # seconds to write one reply
    max_pending: int = MAX_PENDING
    open_streams: Counter[str] = field(default_factory=Counter)  # per peer, from the stream's start
    others: int = 0  # non-members' streams holding a shared slot (their header is here)
    refused_busy: int = 0  # streams refused for the caps (seen by tests and logs)
    evicted: int = 0  # waiting streams and stalled replies that gave their place to a newcomer
    traffic: Traffic = field(default_factory=Traffic)
    _pending: dict[int, _Waiting] = field(default_factory=dict)  # in arrival order
    _slots: dict[int, _Slot] = field(default_factory=dict)
    _ticket: int = 0

    @property
    def pending(self) -> int:
        """Streams whose header has not arrived yet."""
        return len(self._pending)

    async def handle(self, sender: str, reader: asyncio.StreamReader, writer: Any, remote: str = "") -> None:
        """Serves one inbound stream from the authenticated ``sender`` (seen at ``remote``); never raises."""
        if self.open_streams[sender] >= self.max_per_peer or not self._room_to_wait(sender):
            self.refused_busy += 1
            await _write(writer, self.service.refusal({}, Code.BUSY, "too many streams"), self.write_timeout)
            return
        self.open_streams[sender] += 1
        try:
            await self._serve(sender, reader, writer, remote)
        finally:
            self.open_streams[sender] -= 1
            if self.open_streams[sender] <= 0:
                del self.open_streams[sender]

    def _room_to_wait(self, sender: str) -> bool:
        """Whether a new stream of ``sender`` may wait for its header, making room if it must."""
        if len(self._pending) < self.max_pending:
            return True
        held = Counter(w.sender for w in self._pending.values())  # (in order of each peer's oldest stream)
        heaviest, most = max(held.items(), key=lambda kv: kv[1])
        if held[sender] + 1 > most:
            return False
        token = next(t for t, w in self._pending.items() if w.sender == heaviest)
        waiting = self._pending.pop(token)
        waiting.evicted = True
        waiting.reading.cancel()
        self.evicted += 1
        return True

    async def _read_header(self, sender: str, reader: asyncio.StreamReader) -> tuple[dict[str, Any], int] | None:
        """The stream's header, or None if its place was given to a newcomer first."""
        self._ticket += 1
        token = self._ticket
        waiting = _Waiting(sender, asyncio.ensure_future(read_header(reader, IO_TIMEOUT, self.service.max_body)))
        self._pending[token] = waiting
        try:
            return await waiting.reading
        except asyncio.CancelledError:
            if not waiting.evicted:
                raise
            return None
        finally:
            self._pending.pop(token, None)

    def _take_slot(self, sender: str, writer: Any) -> _Slot | None:
        """A shared slot for a non-member's stream whose header is here, or None (refuse it BUSY)."""
        if self.others >= self.max_others:
            now = clock.now()
            stalled = [(s.moved, t) for t, s in self._slots.items() if s.writing and now - s.moved >= STALL_S]
            if not stalled:
                return None
            victim = self._slots.pop(min(stalled)[1])
            victim.evicted = True
            self.others -= 1
            self.evicted += 1
            _abort(victim.writer)
        self._ticket += 1
        slot = self._slots[self._ticket] = _Slot(sender, writer, clock.now())
        self.others += 1
        return slot

    def _give_back(self, slot: _Slot | None) -> None:
        if slot is not None and not slot.evicted:
            slot.evicted = True
            self._slots = {t: s for t, s in self._slots.items() if s is not slot}
            self.others -= 1

    async def _serve(self, sender: str, reader: asyncio.StreamReader, writer: Any, remote: str) -> None:
        header: dict[str, Any] = {}
        slot: _Slot | None = None
        try:
            try:
                read = await self._read_header(sender, reader)
                if read is None:
                    self.refused_busy += 1
                    reply = self.service.refusal({}, Code.BUSY, "too many streams waiting for their header")
                    await _write(writer, reply, self.write_timeout)
                    return
                header, body_len = read
                self.traffic.count(header["type"], received=64)  # a header; a body counts once it is read
                if not self.service.is_member(sender):
                    slot = self._take_slot(sender, writer)
                    if slot is None:
                        self.refused_busy += 1
                        await _write(writer, self.service.refusal(header, Code.BUSY, "too many streams"),
                                     self.write_timeout)
                        return
                outcome = self.service.admit(sender, header, body_len, remote)
                if isinstance(outcome, tuple):  # answered on the header: a body, if any, stays unread
                    reply = outcome
                elif not body_len:
                    reply = await outcome.complete(b"")
                else:
                    try:
                        await _write(writer, self.service.refusal(header, Code.CONTINUE, ""), self.write_timeout,
                                     close=False)
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
            if slot is None:
                await _write(writer, reply, self.write_timeout)
                return
            taking = slot
            taking.writing, taking.moved = True, clock.now()
            await _write(writer, reply, self.write_timeout, moved=lambda: setattr(taking, "moved", clock.now()))
        finally:
            self._give_back(slot)


def _abort(writer: Any) -> None:
    """Drops a stream at once, with whatever is still buffered."""
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()
    else:
        writer.close()


async def _write(writer: Any, reply: Reply, timeout: float, close: bool = True,
                 moved: Callable[[], None] | None = None) -> None:
    """Writes one reply frame within ``timeout`` seconds; past it, the stream is aborted with
    whatever is still buffered (a peer that never reads pins no memory here). With ``moved``, the
    frame goes in ``CHUNK``-byte writes and ``moved`` is called each time one has drained (the
    server's measure of a stalled reply)."""
    header, body = reply
    frame = encode_header(header, len(body)) + body
    try:
        async with asyncio.timeout(timeout):
            if moved is None:
                writer.write(frame)
                await writer.drain()
            else:
                view = memoryview(frame)
                for at in range(0, len(view), CHUNK):
                    writer.write(view[at:at + CHUNK])
                    await writer.drain()
                    moved()
    except TimeoutError:
        _abort(writer)
        close = True
    except (OSError, ConnectionError):
        close = True
    finally:
        if close:
            writer.close()
