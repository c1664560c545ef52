"""What peer code uses of a DHT node: its records and the loop it runs on.

``DHT`` (dht/node.py, hivemind over p2pd) is the real one; the simulator's ``SimDHT``
(peer/sim/dht.py) is another, over a simulated DHT in virtual time. Synchronous callers (the
training thread) reach the loop with ``run`` and ``submit``; coroutines on the loop call the
``a``-methods directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from .identity import Identity
from .records import Envelope

T = TypeVar("T")


class FutureLike(Protocol):
    """The part of ``concurrent.futures.Future`` callers use."""

    def result(self, timeout: float | None = None) -> Any: ...

    def cancel(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None: ...


class LoopRunner(Protocol):
    """Runs coroutines on the loop that owns the network, from the training thread."""

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs ``coro`` and waits at most ``timeout`` seconds for it; raises on a timeout."""
        ...

    def submit(self, coro: Coroutine[Any, Any, T]) -> FutureLike:
        """Starts ``coro`` and returns at once."""
        ...


class DHTFacade(LoopRunner, Protocol):
    peer_id: str  # our libp2p peer id (the records we sign are bound to it)
    identity: Identity

    @property
    def timeout(self) -> float:
        """Seconds one DHT operation may take."""
        ...

    async def astore(self, envelope: Envelope) -> bool: ...

    async def aget(self, key: str, latest: bool = True) -> list[Envelope]:
        """All valid, unexpired envelopes under ``key`` (one per signer), in no particular order."""
        ...

    def store(self, envelope: Envelope, timeout: float | None = None) -> bool: ...

    def get(self, key: str, latest: bool = True, timeout: float | None = None) -> list[Envelope]: ...

    def remember(self, peer_ids: Iterable[str]) -> None:
        """Notes bound peer ids of the run for routing refreshes (loop thread)."""
        ...

    def remember_threadsafe(self, peer_ids: Iterable[str]) -> None: ...


async def aget_each(dht: Any, keys: Sequence[str], timeout: float, at_once: int = 16) -> list[list[Envelope] | None]:
    """Reads ``keys`` ``at_once`` at a time, each within ``timeout`` seconds (on the DHT's loop): per
    key, its envelopes, or None where its read failed (the caller reads again); if every read failed,
    the first error is raised (e.g. TimeoutError)."""
    gate = asyncio.Semaphore(at_once)

    async def one(key: str) -> list[Envelope]:
        async with gate, asyncio.timeout(timeout):
            return list(await dht.aget(key))

    results = await asyncio.gather(*(one(k) for k in keys), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors and len(errors) == len(results):
        raise errors[0]
    return [None if isinstance(r, BaseException) else r for r in results]
