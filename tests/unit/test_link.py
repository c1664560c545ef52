"""The transport seam (peer/net/link.py) over in-process pipes (peer/net/memory.py): the two-step
exchange that lets a receiver refuse a body unread, and the caps on concurrent streams."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from hivetrain.dht.identity import Identity
from hivetrain.peer.net import link as link_mod
from hivetrain.peer.net.link import Done, Reply, Server, Ticket, request
from hivetrain.peer.net.memory import MemoryNetwork
from hivetrain.peer.net.wire import MAGIC, PREFIX, Code

RUN = "ab" * 32
PROTO = "test/1"
A, B = (Identity.generate().peer_id for _ in range(2))


def header(kind: str = "part", **fields: Any) -> dict[str, Any]:
    base = {"type": kind, "run": RUN, "round": 1, "base": RUN}
    if kind == "part":
        base.update(group=RUN, shard=0, digest="0" * 32, sig="")
    return {**base, **fields}


def ack(code: Code, why: str = "") -> Reply:
    return {"type": "ack", "run": RUN, "round": 1, "base": RUN, "code": int(code), "reason": why}, b""


@dataclass
class Sink:
    """A Service that wants bodies of exactly ``size`` bytes and keeps them."""

    size: int
    max_body: int = 1 << 20
    members: set[str] = field(default_factory=set)
    bodies: list[bytes] = field(default_factory=list)
    hold: asyncio.Event | None = None  # when set: complete() waits for it (a slow handler)

    def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Reply | Ticket:
        if body_len != self.size:
            return ack(Code.WRONG_SIZE, f"{body_len} != {self.size}")
        sink = self

        class _T:
            deadline = asyncio.get_running_loop().time() + 5

            async def complete(self, body: bytes) -> Reply:
                if sink.hold is not None:
                    await sink.hold.wait()
                sink.bodies.append(body)
                return ack(Code.OK)

            def abort(self) -> None:
                pass

        return _T()

    def refusal(self, header: dict[str, Any], code: Code, why: str) -> Reply:
        return ack(code, why)

    def is_member(self, peer: str) -> bool:
        return peer in self.members


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_body_is_sent_only_after_the_receiver_asks_for_it() -> None:
    async def go() -> tuple[Reply, list[bytes], int]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        sink = Sink(size=1000)
        await b.serve(PROTO, Server(sink))
        reply = await request(a, B, PROTO, header(), b"x" * 1000, timeout=5)
        return reply, sink.bodies, net.bytes_moved[A]

    (reply, _), bodies, moved = run(go())
    assert reply["code"] == Code.OK and bodies == [b"x" * 1000]
    assert moved > 1000


def test_a_body_of_the_wrong_size_is_refused_unread() -> None:
    async def go() -> tuple[Reply, list[bytes], int]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        sink = Sink(size=1000, max_body=1 << 30)  # within the protocol's cap: the service decides on the header
        await b.serve(PROTO, Server(sink))
        reply = await request(a, B, PROTO, header(), b"x" * 10_000_000, timeout=5)
        return reply, sink.bodies, net.bytes_moved[A]

    (reply, _), bodies, moved = run(go())
    assert reply["code"] == Code.WRONG_SIZE and bodies == []
    assert moved < 1000  # the requester sent its header only: 10 MB stayed home


def test_a_body_beyond_the_protocols_cap_is_refused_on_the_prefix() -> None:
    async def go() -> Reply:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        await b.serve(PROTO, Server(Sink(size=1000, max_body=4096)))
        return await request(a, B, PROTO, header(), b"x" * 5000, timeout=5)

    reply, _ = run(go())
    assert reply["code"] == Code.MALFORMED and "exceeds" in reply["reason"]


def test_streams_beyond_the_per_peer_cap_are_refused_busy_and_members_are_not_crowded_out() -> None:
    async def go() -> tuple[list[int], Server, int]:
        net = MemoryNetwork()
        flooders = [net.link(Identity.generate().peer_id) for _ in range(10)]
        member = net.link(A)
        b = net.link(B)
        sink = Sink(size=1, members={A}, hold=asyncio.Event())
        server = Server(sink, max_others=16, max_per_peer=4)
        await b.serve(PROTO, server)
        # every flooder opens 6 streams that its handler holds open: 4 per peer, 16 for all non-members
        flood = [asyncio.create_task(request(f, B, PROTO, header(), b"x", timeout=5)) for f in flooders for _ in range(6)]
        await asyncio.sleep(0.1)
        held = sum(server.open_streams.values())
        member_call = asyncio.create_task(request(member, B, PROTO, header(), b"x", timeout=5))
        await asyncio.sleep(0.1)
        sink.hold.set()
        codes = [r[0]["code"] for r in await asyncio.gather(*flood)]
        (member_reply, _) = await member_call
        return [held, member_reply["code"], codes.count(Code.BUSY), codes.count(Code.OK)], server, len(sink.bodies)

    (held, member_code, busy, ok), server, stored = run(go())
    assert held == 16 and ok == 16 and busy == 44 and server.refused_busy == 44
    assert member_code == Code.OK and stored == 17


def test_a_silent_stream_is_closed_at_the_header_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_mod, "IO_TIMEOUT", 0.2)

    async def go() -> tuple[int, int]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        server = Server(Sink(size=1))
        await b.serve(PROTO, server)
        reader, writer = await a.open(B, PROTO, 1.0)
        writer.write(PREFIX.pack(MAGIC, 10, 0))  # a prefix, then nothing
        await asyncio.sleep(0.05)
        during = sum(server.open_streams.values())
        await asyncio.sleep(0.5)
        return during, sum(server.open_streams.values())

    assert run(go()) == (1, 0)


def test_silent_streams_wait_apart_from_the_slots_and_give_their_place_to_a_newcomer() -> None:
    """Review 2026-12-02 N2: silent streams held every shared slot before their header came. Now they
    hold only places among the waiting streams, and the heaviest holder's oldest gives way."""

    async def go() -> tuple[Reply, Reply, Server, list[bytes]]:
        net = MemoryNetwork()
        flooders = [net.link(Identity.generate().peer_id) for _ in range(2)]
        a, b = net.link(A), net.link(B)
        sink = Sink(size=1)
        server = Server(sink, max_others=2, max_per_peer=4, max_pending=8)
        await b.serve(PROTO, server)
        silent = [await f.open(B, PROTO, 1.0) for f in flooders for _ in range(4)]  # 8 waiting: all places
        await asyncio.sleep(0.05)
        assert server.pending == 8 and server.others == 0
        honest = await request(a, B, PROTO, header(), b"x", timeout=2)  # takes the first flooder's oldest place
        reader, _ = silent[0]
        evicted, _ = await link_mod.read_header(reader, 1.0)
        for _, writer in silent:
            writer.close()
        return honest, evicted, server, sink.bodies

    honest, evicted, server, bodies = run(go())
    assert honest[0]["code"] == Code.OK and bodies == [b"x"]
    assert evicted["code"] == Code.BUSY and server.evicted == 1


def test_the_newcomer_that_would_hold_the_most_waiting_streams_is_refused() -> None:
    async def go() -> tuple[int, Server]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        server = Server(Sink(size=1), max_per_peer=8, max_pending=4)
        await b.serve(PROTO, server)
        silent = [await a.open(B, PROTO, 1.0) for _ in range(5)]
        await asyncio.sleep(0.05)
        reader, _ = silent[4]
        refused, _ = await link_mod.read_header(reader, 1.0)
        for _, writer in silent:
            writer.close()
        return refused["code"], server

    code, server = run(go())
    assert code == Code.BUSY and server.evicted == 0 and server.refused_busy == 1


class _Writer:
    """A stream writer; ``stuck``: its requester never reads (``drain`` never returns until aborted)."""

    def __init__(self, stuck: bool) -> None:
        self.stuck, self.written, self.aborted, self._gone = stuck, 0, False, asyncio.Event()

    def write(self, data: bytes) -> None:
        if self.aborted:
            raise ConnectionResetError("aborted")
        self.written += len(data)

    async def drain(self) -> None:
        if self.stuck:
            await self._gone.wait()
            raise ConnectionResetError("aborted")

    @property
    def transport(self) -> _Writer:
        return self

    def abort(self) -> None:
        self.aborted = True
        self._gone.set()

    def close(self) -> None:
        self._gone.set()


def test_a_reply_that_nobody_reads_gives_its_slot_to_a_newcomer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_mod, "STALL_S", 0.1)
    from hivetrain.peer.net.wire import encode_header

    class Big(Sink):
        def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Reply | Ticket:
            return ack(Code.OK)[0], b"y" * (1 << 20)

    def asking() -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        reader.feed_data(encode_header({"type": "state_req", "run": RUN, "round": 1, "base": RUN, "index": 0}, 0))
        return reader

    async def go() -> tuple[_Writer, _Writer, _Writer, Server]:
        server = Server(Big(size=0), max_others=1)
        stuck, early, late = _Writer(True), _Writer(False), _Writer(True)
        hog = asyncio.create_task(server.handle("hog", asking(), stuck))
        await asyncio.sleep(0.01)
        await server.handle("early", asking(), early)  # the slot is taken, its write not yet stalled: BUSY
        await asyncio.sleep(0.2)
        newcomer = asyncio.create_task(server.handle("late", asking(), late))
        await asyncio.wait_for(hog, 1.0)  # the hog's stream was aborted
        newcomer.cancel()
        return stuck, early, late, server

    stuck, early, late, server = run(go())
    assert stuck.aborted and server.evicted == 1
    assert 0 < early.written < 1000  # a refusal: a header only
    assert late.written >= 1 << 16  # the newcomer's reply is being written in the freed slot


def test_an_oversized_header_is_refused_before_it_is_read() -> None:
    async def go() -> dict[str, Any]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        await b.serve(PROTO, Server(Sink(size=1)))
        reader, writer = await a.open(B, PROTO, 1.0)
        writer.write(PREFIX.pack(MAGIC, 1 << 30, 0))
        from hivetrain.peer.net.wire import read_header

        reply, _ = await read_header(reader, 2.0)
        return reply

    reply = run(go())
    assert reply["code"] == Code.MALFORMED and "exceeds" in reply["reason"]


def test_unreachable_peer_raises() -> None:
    async def go() -> None:
        net = MemoryNetwork()
        a = net.link(A)
        net.link(B)
        net.cut.add(B)
        await request(a, B, PROTO, header(), b"", timeout=1)

    with pytest.raises(ConnectionError):
        run(go())


def test_done_ticket_answers_body_less_messages() -> None:
    class Echo(Sink):
        def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Reply | Ticket:
            return Done(ack(Code.OK, sender))

    async def go() -> Reply:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        await b.serve(PROTO, Server(Echo(size=0)))
        return await request(a, B, PROTO, header("view", members=[], excluded=[], closed=False, decided=False, up=0, derived=True), b"", timeout=2)

    reply, _ = run(go())
    assert reply["reason"] == A  # the sender the service saw is the link's authenticated peer id


def test_a_capped_uplink_delivers_at_its_rate_shared_by_all_streams() -> None:
    """MemoryNetwork.rates: two concurrent 20 kB bodies over a 100 kB/s uplink take ~0.4 s together,
    not 0.2 s each in parallel; the uncapped reverse direction (acks) adds nothing measurable."""
    async def go() -> tuple[float, list[bytes]]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        net.rates[A] = 100_000.0
        sink = Sink(size=20_000)
        await b.serve(PROTO, Server(sink))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        replies = await asyncio.gather(*(request(a, B, PROTO, header(), bytes([i]) * 20_000, timeout=5)
                                         for i in range(2)))
        assert all(r["code"] == Code.OK for r, _ in replies)
        return loop.time() - t0, sink.bodies

    took, bodies = run(go())
    assert sorted(bodies) == [bytes([0]) * 20_000, bytes([1]) * 20_000]
    assert 0.4 <= took < 1.5, took  # 40 kB (+ headers) at 100 kB/s: never faster than the cap


def test_bytes_written_count_even_when_the_reply_is_lost() -> None:
    """A body delivered whose ack never comes back was still sent: the traffic counter says so (a retry
    that the receiver then refuses as DUPLICATE sends the header only, so nothing is counted twice)."""
    async def go() -> tuple[int, int, str]:
        net = MemoryNetwork()
        a, b = net.link(A), net.link(B)
        sink = Sink(size=1000, hold=asyncio.Event())  # takes the body, never answers in time
        await b.serve(PROTO, Server(sink))
        traffic = link_mod.Traffic()
        try:
            await request(a, B, PROTO, header(), b"x" * 1000, timeout=0.5, traffic=traffic)
            outcome = "answered"
        except TimeoutError:
            outcome = "timed out"
        return traffic.sent, net.bytes_moved[A], outcome

    counted, moved, outcome = run(go())
    assert outcome == "timed out"
    assert counted > 1000 and counted <= moved  # header and body, as they went over the wire
