"""Synchronous peer code (the training loop, its state hooks) run inside the simulator's event loop.

A real peer's training thread blocks on the network loop through ``run(coro, timeout)`` and
``submit(coro).result(timeout)`` (dht/node.py's facade). In the simulator every peer runs on one
loop and one thread, so its synchronous code runs in a greenlet instead: ``GreenRunner`` offers the
same two calls, and where the training thread would block, the greenlet switches back to the loop,
which awaits the coroutine and switches back in with its result. So the real ``Trainer`` and
``StateKeeper`` run unchanged, one swarm is one thread, and the order of everything is decided by
the loop alone (deterministic for a seed). The pattern is the one SQLAlchemy's asyncio bridge uses.

A peer that crashes has its green task cancelled: the greenlet then gets ``Crashed`` at the call
it is blocked in, and again at every later call, until it has unwound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from greenlet import getcurrent, greenlet

T = TypeVar("T")


class Crashed(BaseException):
    """Raised in a green peer's synchronous code when the simulator kills the peer."""


class _Green(greenlet):  # type: ignore[misc]
    crashed = False


async def spawn(fn: Callable[..., T], *args: Any) -> T:
    """Runs the synchronous ``fn(*args)`` in a greenlet on this loop, awaiting whatever it waits
    for with ``wait``; returns its result. Cancelling this task crashes the greenlet."""
    child = _Green(fn, getcurrent())
    step: Any = child.switch(*args)
    while not child.dead:
        try:
            value = await step
        except asyncio.CancelledError:
            child.crashed = True
            while not child.dead:
                try:
                    pending = child.throw(Crashed())
                except Crashed:
                    break
                if asyncio.iscoroutine(pending):  # it caught Crashed and waits again: nothing runs for it now
                    pending.close()
            raise
        except BaseException as e:  # delivered to the synchronous code, which decides what it means
            step = child.throw(e)
        else:
            step = child.switch(value)
    return step  # type: ignore[no-any-return]


def wait(awaitable: Awaitable[T]) -> T:
    """Blocks the calling green code until ``awaitable`` is done on the loop; returns its result."""
    current = getcurrent()
    if not isinstance(current, _Green):
        raise RuntimeError("wait() outside a green peer: use the loop directly")
    if current.crashed:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise Crashed()
    return current.parent.switch(awaitable)  # type: ignore[no-any-return]


class GreenFuture:
    """What ``GreenRunner.submit`` returns: the part of ``concurrent.futures.Future`` peers use."""

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task

    def result(self, timeout: float | None = None) -> Any:
        if not self.task.done():
            wait(asyncio.wait_for(asyncio.shield(self.task), timeout))
        return self.task.result()

    def cancel(self) -> bool:
        return self.task.cancel()

    def cancelled(self) -> bool:
        return self.task.cancelled()

    def done(self) -> bool:
        return self.task.done()

    def exception(self) -> BaseException | None:
        return self.task.exception()

    def add_done_callback(self, fn: Callable[[GreenFuture], Any]) -> None:
        self.task.add_done_callback(lambda _: fn(self))


class GreenRunner:
    """``run``/``submit`` of the DHT facade (dht/node.py) for green code on the simulator's loop."""

    def __init__(self, timeout_error: Callable[[str], Exception] = TimeoutError):
        self.timeout_error = timeout_error
        self.tasks: set[asyncio.Task[Any]] = set()  # started by ``submit`` and not done: cancelled on a crash

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        current = getcurrent()
        if isinstance(current, _Green) and current.crashed:
            coro.close()
            raise Crashed()
        try:
            return wait(asyncio.wait_for(coro, timeout))
        except TimeoutError:
            raise self.timeout_error(f"operation timed out after {timeout:.1f} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> GreenFuture:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return GreenFuture(task)

    def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
