"""Delivering one round's messages to the members of its group, within the round's deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import request
from hivetrain.peer.net.wire import Code, reason

logger = logging.getLogger(__name__)
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


async def deliver(ctx: PeerContext, deadline: float, peer: str, header: dict[str, Any], body: bytes) -> None:
    """Delivers one message; waits (briefly, repeatedly) for a member that has not decided its group
    yet (NOT_READY) or is busy. Raises RoundFailed if it is refused or the deadline passes."""
    kind = header["type"]
    pause, failures = RETRY_PAUSE[0], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RoundFailed(f"deadline passed delivering our {kind} to {peer}")
        try:
            reply, _ = await request(ctx.link, peer, ctx.protocol, header, body, remaining, traffic=ctx.traffic)
        except Exception as e:  # a lost stream or a dial error: try again while the deadline allows
            failures += 1
            if failures >= SEND_ATTEMPTS or time.monotonic() + 0.5 >= deadline:
                raise RoundFailed(reason(f"could not deliver our {kind} to {peer}: {e!r}")) from None
            await asyncio.sleep(0.2 * failures)
            continue
        code = reply["code"] if reply.get("type") == "ack" else int(Code.MALFORMED)
        if code in (Code.OK, Code.DUPLICATE):
            return
        if code in (Code.NOT_READY, Code.BUSY) and time.monotonic() + pause < deadline:
            await asyncio.sleep(pause)
            pause = min(RETRY_PAUSE[1], 2 * pause)
            continue
        name = Code(code).name if code in Code._value2member_map_ else str(code)
        raise RoundFailed(reason(f"{peer} refused our {kind}: {name} {reply.get('reason', '')}"))
