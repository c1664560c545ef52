"""Helpers for in-process protocol tests: a LocalSwarm of real averagers, deltas with known
averages, outsiders that speak the wire protocol directly, and the checks every test repeats."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from hivetrain.dht.identity import Identity
from hivetrain.peer.averaging.api import AverageResult
from hivetrain.peer.averaging.simulation import LocalSwarm
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import Reply, request
from hivetrain.peer.net.memory import MemoryLink

NUMEL = 6000
PIECES = 1024  # piece_values: 2-3 pieces per member, so that every protocol test runs the pipelined all-reduce
BASE = "ab" * 32


def spec(n: int, **over: Any) -> RunSpec:
    fields: dict[str, Any] = dict(name="proto", chunk_size=256, target_group_size=n, matchmaking_timeout=3.0,
                                  allreduce_timeout=4.0, piece_values=PIECES)
    fields.update(over)
    return RunSpec(**fields)


def deltas(n: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g) * 0.01
    return [common + torch.randn(numel, generator=g) * 0.003 for _ in range(n)]


def completed(results: Sequence[AverageResult | RoundFailed]) -> list[AverageResult]:
    return [r for r in results if isinstance(r, AverageResult)]


def story(results: Sequence[AverageResult | RoundFailed]) -> str:
    """One line per member, for assertion messages: a failure must say what happened."""
    lines = []
    for i, r in enumerate(results):
        if isinstance(r, AverageResult):
            lines.append(f"{i}: ok group {len(r.group)} excluded {r.excluded} voids {r.void_ranges}")
        else:
            lines.append(f"{i}: VOID {r} excluded {r.excluded}")
    return "\n".join(lines)


def assert_identical(results: Sequence[AverageResult | RoundFailed], members: int | None = None) -> list[AverageResult]:
    """Every completed member applied the same bytes and the same digest (and, if given, how many completed)."""
    done = completed(results)
    if members is not None:
        assert len(done) == members, story(results)
    assert len({r.applied for r in done}) <= 1, story(results)
    for r in done[1:]:
        assert torch.equal(r.averaged, done[0].averaged), story(results)
    return done


class Outsider:
    """A peer with a valid identity and link on the swarm's network, outside the protocol code:
    it sends whatever frames a test scripts."""

    def __init__(self, swarm: LocalSwarm, addr: str | None = None):
        self.swarm = swarm
        self.identity = Identity.generate()
        self.link: MemoryLink = swarm.net.link(self.identity.peer_id, addr)
        self.ctx = swarm.peers[0].ctx

    def header(self, kind: str, round_: int, base: str = BASE, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "run": self.ctx.run, "round": round_, "base": base, **fields}

    def send(self, peer: int | str, header: dict[str, Any], body: bytes = b"", timeout: float = 3.0) -> Reply:
        target = peer if isinstance(peer, str) else self.swarm.peers[peer].ctx.me
        return self.swarm.loop.run(request(self.link, target, self.ctx.protocol, header, body, timeout), timeout + 1)

    def send_async(self, peer: str, header: dict[str, Any], body: bytes = b"", timeout: float = 3.0) -> Any:
        return request(self.link, peer, self.ctx.protocol, header, body, timeout)


def run_on(swarm: LocalSwarm, coro: Any, timeout: float = 30.0) -> Any:
    return swarm.loop.run(coro, timeout)


async def gather(*coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros, return_exceptions=True))


def replace(spec_: RunSpec, **over: Any) -> RunSpec:
    return dataclasses.replace(spec_, **over)


class FilteringLink:
    """Wraps a peer's link from outside the protocol: outbound messages whose header matches
    ``drop`` fail as if the stream broke, or (``blackhole``) vanish while the sender is told they
    arrived. The peer's own code never knows why."""

    def __init__(self, inner: MemoryLink, drop: Any, blackhole: bool = False):
        self.inner, self.drop, self.me, self.blackhole = inner, drop, inner.me, blackhole
        self.dropped: list[dict[str, Any]] = []

    async def open(self, peer: str, protocol: str, timeout: float) -> Any:
        reader, writer = await self.inner.open(peer, protocol, timeout)
        return reader, _FilteringWriter(writer, self, peer, reader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FilteringWriter:
    def __init__(self, inner: Any, link: FilteringLink, peer: str, reader: asyncio.StreamReader):
        self.inner, self.link, self.peer, self.reader = inner, link, peer, reader
        self.first, self.swallow = True, False

    def write(self, data: bytes) -> None:
        if self.swallow:
            return
        if self.first:
            self.first = False
            import msgpack

            from hivetrain.peer.net.wire import PREFIX, Code, encode_frame

            _, header_len, body_len = PREFIX.unpack(data[:PREFIX.size])
            header = msgpack.unpackb(data[PREFIX.size:PREFIX.size + header_len], raw=False)
            if self.link.drop(self.peer, header):
                self.link.dropped.append(header)
                if not self.link.blackhole:
                    self.inner.close()
                    raise ConnectionResetError("dropped by the test")
                self.swallow = True  # the receiver never hears of it; the sender is told all went well
                ack = {k: header[k] for k in ("run", "round", "base")}
                for code in ([Code.CONTINUE] if body_len else []) + [Code.OK]:
                    self.reader.feed_data(encode_frame({"type": "ack", **ack, "code": int(code), "reason": ""}))
                return
        self.inner.write(data)

    async def drain(self) -> None:
        await self.inner.drain()

    def close(self) -> None:
        self.inner.close()


def filter_outbound(swarm: LocalSwarm, index: int, drop: Any, blackhole: bool = False) -> FilteringLink:
    ctx = swarm.peers[index].ctx
    wrapped = FilteringLink(ctx.link, drop, blackhole)  # type: ignore[arg-type]
    ctx.link = wrapped  # type: ignore[assignment]
    return wrapped
