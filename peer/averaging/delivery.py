"""Delivering one round's messages to the members of its group, within the round's deadline."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivetrain.dht import clock
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.rates import Meter
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import request
from hivetrain.peer.net.wire import Code, reason

logger = logging.getLogger(__name__)
STREAMS_PER_PEER = 2  # messages in flight to one member at once: the next one starts while a body streams
SEND_ATTEMPTS = 3  # deliveries of one message that fail in transport, within the deadline
RETRY_PAUSE = (0.05, 0.3)  # seconds: first and longest pause before sending again to a peer not ready yet


async def send_all(ctx: PeerContext, round_: int, deadline: float, sends: list[tuple[str, dict[str, Any], bytes]],
                   strict: bool) -> None:
    """Delivers every (peer, header, body) at once. ``strict``: the first failure fails the round;
    otherwise failures are logged (a member that misses our message voids its own round)."""
    results = await asyncio.gather(*(deliver(ctx, deadline, p, h, b) for p, h, b in sends), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors and strict:
        raise errors[0] if isinstance(errors[0], RoundFailed) else RoundFailed(repr(errors[0]))
    for err in errors:
        logger.info("round %d: delivery failed: %r", round_, err)


class Lost(RoundFailed):
    """A member that will not complete this round with us: it refused our message (it decided
    another group, or has no session for it), or could not be reached at all."""

    def __init__(self, message: str, peer: str):
        super().__init__(message)
        self.peer = peer


async def deliver(ctx: PeerContext, deadline: float, peer: str, header: dict[str, Any], body: bytes) -> None:
    """Delivers one message; waits (briefly, repeatedly) for a member that has not decided its group
    yet (NOT_READY) or is busy. Raises RoundFailed if it is refused or the deadline passes."""
    kind = header["type"]
    pause, failures = RETRY_PAUSE[0], 0
    while True:
        remaining = deadline - clock.now()
        if remaining <= 0:
            raise RoundFailed(f"deadline passed delivering our {kind} to {peer}")
        try:
            reply, _ = await request(ctx.link, peer, ctx.protocol, header, body, remaining, traffic=ctx.traffic)
        except Exception as e:  # a lost stream or a dial error: try again while the deadline allows
            failures += 1
            if failures >= SEND_ATTEMPTS:
                raise Lost(reason(f"could not deliver our {kind} to {peer}: {e!r}"), peer) from None
            if clock.now() + 0.5 >= deadline:
                raise RoundFailed(reason(f"could not deliver our {kind} to {peer}: {e!r}")) from None
            await asyncio.sleep(0.2 * failures)
            continue
        code = reply["code"] if reply.get("type") == "ack" else int(Code.MALFORMED)
        if code in (Code.OK, Code.DUPLICATE):
            return
        if code in (Code.NOT_READY, Code.BUSY) and clock.now() + pause < deadline:
            await asyncio.sleep(pause)
            pause = min(RETRY_PAUSE[1], 2 * pause)
            continue
        name = Code(code).name if code in Code._value2member_map_ else str(code)
        why = reason(f"{peer} refused our {kind}: {name} {reply.get('reason', '')}")
        if code in (Code.NOT_READY, Code.BUSY):  # it may still be with us: the deadline ran out meanwhile
            raise RoundFailed(why)
        raise Lost(why, peer)


class Outbox:
    """Delivers a round's messages to each member in the order they were put, at most
    STREAMS_PER_PEER at a time per member, to all members at once. Results and verdicts are put
    while parts still stream, so they queue behind the parts already put for the same member.

    ``strict_done`` is set once every strict message (our parts) is delivered, or at the first one
    that cannot be (then ``error`` says why, and the round fails). Other failures are logged (a
    member that misses our message voids its own round).
    """

    def __init__(self, ctx: PeerContext, round_: int, deadline: float):
        self.ctx, self.round, self.deadline = ctx, round_, deadline
        self.queues: dict[str, asyncio.Queue[tuple[dict[str, Any], bytes, bool] | None]] = {}
        self.workers: list[asyncio.Task[None]] = []
        self.error: RoundFailed | None = None
        self.lost: dict[str, str] = {}  # members that refused a message or could not be reached: why
        self.strict_left = 0  # strict messages not delivered yet
        self.strict_done = asyncio.Event()
        self.strict_done.set()
        self.meter = Meter()  # when our parts went out: our uplink (peer/averaging/rates.py)

    def put(self, peer: str, header: dict[str, Any], body: bytes, strict: bool) -> None:
        queue = self.queues.get(peer)
        if queue is None:
            queue = self.queues[peer] = asyncio.Queue()
            self.workers += [asyncio.ensure_future(self._work(peer, queue)) for _ in range(STREAMS_PER_PEER)]
        if strict:
            self.meter.begin()
            self.strict_left += 1
            self.strict_done.clear()
        queue.put_nowait((header, body, strict))

    async def _work(self, peer: str, queue: asyncio.Queue[tuple[dict[str, Any], bytes, bool] | None]) -> None:
        while (item := await queue.get()) is not None:
            header, body, strict = item
            try:
                if peer in self.lost:  # it refused us or cannot be reached: the rest cannot change that
                    raise RoundFailed(self.lost[peer])
                await deliver(self.ctx, self.deadline, peer, header, body)
                if strict:
                    self.meter.delivered(len(body))
            except RoundFailed as e:
                if isinstance(e, Lost):
                    self.lost.setdefault(e.peer, str(e))
                if not strict:
                    logger.info("round %d: delivery failed: %r", self.round, e)
                elif self.error is None:
                    self.error = e
                    self.strict_done.set()
            if strict:
                self.strict_left -= 1
                if self.strict_left == 0:
                    self.strict_done.set()

    async def flush(self) -> None:
        """Waits until everything put so far is delivered (or failed); the outbox takes no more."""
        for queue in self.queues.values():
            for _ in range(STREAMS_PER_PEER):
                queue.put_nowait(None)
        await asyncio.gather(*self.workers, return_exceptions=True)

    def stop(self) -> None:
        for worker in self.workers:
            worker.cancel()
