"""The round's concurrent work (peer/averaging/allreduce.py ``first_failure``): the first error ends
the round, and the others' errors, raised as they are cancelled, are retrieved (never "Task
exception was never retrieved" with a traceback in a peer's log; seen in the search, seed 2,000,009)."""

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
