"""How a round waits. Its concurrent work (peer/averaging/allreduce.py ``first_failure``): the first
error ends the round, and the others' errors, raised as they are cancelled, are retrieved (never
"Task exception was never retrieved" with a traceback in a peer's log; seen in the search, seed
2,000,009). Its deadlines: a wait that ends within a hair of now ends, on a virtual clock too."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from hivetrain.peer.averaging.allreduce import first_failure
from hivetrain.peer.errors import RoundFailed


def test_the_first_error_is_raised_and_an_error_raised_on_cancellation_is_retrieved() -> None:
    unretrieved: list[dict[str, Any]] = []

    async def fails() -> None:
        await asyncio.sleep(0)
        raise RoundFailed("the first")

    async def fails_when_cancelled() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)
            raise RoundFailed("deadline passed waiting for the result of shard 1") from None

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        with pytest.raises(RoundFailed, match="the first"):
            await first_failure(fails(), fails_when_cancelled())
        for _ in range(5):  # the cancelled one ends with its own error
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(go())
    gc.collect()
    assert not unretrieved, unretrieved


@pytest.mark.timeout(30)
def test_a_wait_that_ends_a_hair_after_now_ends_on_a_virtual_clock() -> None:
    """asyncio runs a timer due within its clock resolution at once, without the clock reaching it:
    on the simulator's virtual clock a wait for the last nanosecond before a deadline spun forever
    (the search's seed 2,000,123, a designee waiting for its groups; dht/clock.py EPSILON)."""
    from hivetrain.dht import clock
    from hivetrain.peer.averaging.session import RoundSession
    from hivetrain.peer.config import RunSpec
    from hivetrain.peer.sim.loop import VirtualLoop

    session = RoundSession("run", 3, "b" * 64, ("a", "b"), "a", 2048, RunSpec("t").codec(), True, 0.0)
    loop = VirtualLoop()

    async def go() -> None:
        await asyncio.sleep(100.0)  # (a clock far from 0: its float steps are coarser)
        with pytest.raises(RoundFailed, match="deadline passed"):
            await session.wait_for(lambda: False, clock.now() + 1e-10, "nothing")

    try:
        loop.run_until_complete(go())
    finally:
        loop.close()
