"""A swarm of peers running the real averaging protocol in one process: tests and simulation.

Each peer is a ``P2PAverager`` with its own identity, trust ledger, bans and behaviour, over an
in-process ``MemoryLink``, all on one event loop in a background thread. Matchmaking, the audited
all-reduce, robust aggregation, probation and the agreement after the round are exactly what real
peers run; only the bytes travel through memory instead of libp2p.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from hivetrain.dht import clock
from hivetrain.dht.identity import Identity
from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.peer.averaging.api import AverageResult
from hivetrain.peer.averaging.averager import P2PAverager
from hivetrain.peer.averaging.behaviour import HONEST, Behaviour
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.ready import MemoryReadyBoard, Ready
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.memory import MemoryNetwork
from hivetrain.peer.trust import Bans, Trust

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` blocks the caller until a coroutine is done."""

    def __init__(self, name: str = "hivetrain-sim"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"simulation step did not finish within {timeout:.1f} s") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class LocalSwarm:
    """``size`` peers of one run; ``all_reduce`` runs one round for all (or some) of them at once."""

    def __init__(self, spec: RunSpec, numel: int, size: int, behaviours: dict[int, Behaviour] | None = None,
                 addrs: Sequence[str] | None = None, behind_nat: Sequence[int] = ()):
        self.spec, self.numel = spec, numel
        self.loop = LoopThread()
        self.net = MemoryNetwork()
        self.board = MemoryReadyBoard()
        self.peers: list[P2PAverager] = []
        for i in range(size):
            self.add_peer((behaviours or {}).get(i, HONEST), None if addrs is None else addrs[i], nat=i in behind_nat)

    def add_peer(self, behaviour: Behaviour = HONEST, addr: str | None = None, identity: Identity | None = None,
                 nat: bool = False) -> int:
        """A new peer; ``nat``: behind a NAT (nobody can dial it) and knows it, like a probed real peer."""
        identity = identity or Identity.generate()
        link = self.net.link(identity.peer_id, addr)
        if nat:
            self.net.behind_nat.add(identity.peer_id)
        ef = ErrorFeedback(self.numel) if self.spec.carries_residual else None
        bans = Bans()
        ctx = PeerContext(self.spec, self.numel, self.spec.codec(), link,
                          identity, Trust(banned=bans.__contains__), bans, behaviour, ef, closed=nat)
        self.peers.append(P2PAverager(ctx, self.board, self.loop).start())
        return len(self.peers) - 1

    def ids(self) -> list[str]:
        return [p.ctx.me for p in self.peers]

    def all_reduce(self, round_: int, bases: str | Sequence[str], deltas: Sequence[torch.Tensor],
                   members: Sequence[int] | None = None,
                   timeout: float | None = None) -> list[AverageResult | RoundFailed]:
        """Round ``round_`` for ``members`` (default: all) at once; one result (or the RoundFailed it
        raised) per member, in the order given. Completed rounds are recorded in the members' trust
        ledgers, as the training loop does."""
        who = list(range(len(self.peers))) if members is None else list(members)
        base_of = [bases] * len(who) if isinstance(bases, str) else list(bases)

        async def go() -> list[Any]:
            # as the training loop does: every member announces the round ahead, while "computing"
            for i, b in zip(who, base_of, strict=True):
                peer = self.peers[i].ctx
                await self.board.publish(peer.identity, Ready(peer.me, round_, b, peer.run, done=False,
                                                              eta=clock.wall(), closed=peer.closed), 1.0)
            return await asyncio.gather(*(self.peers[i].average_async(round_, b, d)
                                          for i, b, d in zip(who, base_of, deltas, strict=True)),
                                        return_exceptions=True)

        budget = timeout or self.peers[0].budget
        outcomes = self.loop.run(go(), budget)
        for i, out in zip(who, outcomes, strict=True):
            if isinstance(out, AverageResult):
                peer = self.peers[i].ctx
                peer.trust.record_completed(round_, out.group, peer.me)
            elif not isinstance(out, RoundFailed):
                raise out
        return outcomes

    def close(self) -> None:
        async def stop() -> None:
            for peer in self.peers:
                await peer.ctx.link.close()  # type: ignore[attr-defined]

        try:
            self.loop.run(stop(), 10)
        finally:
            self.loop.close()
