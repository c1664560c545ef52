"""An event loop with virtual time: a whole swarm in one process, deterministic for its seed.

``VirtualLoop`` is asyncio's selector loop with a selector that never waits: when no callback is
ready, asyncio asks the selector to wait until the next timer, and this one moves the loop's clock
there at once instead (as FoundationDB's and TigerBeetle's simulators do). Nothing outside the loop
can wake it, so everything simulated runs on this loop's thread: the peers' synchronous training
code (peer/sim/green.py), and work a peer hands to a thread (``run_in_executor``, run inline). A wait that no timer will ever end (every task waits for
something nobody will do) raises ``Stalled`` instead of hanging.

Protocol code reads time through the loop (dht/clock.py), so it sees virtual time: ``time()`` is
monotonic seconds from 0, ``wall()`` the unix time of the simulated world.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Mapping
from typing import Any

EPOCH = 1.9e9  # unix seconds at virtual time 0 (any fixed value: records carry expirations in it)


class Stalled(RuntimeError):
    """Every task of the simulation waits and no timer is set: nothing can ever happen again."""


class _Warp(selectors.BaseSelector):
    """A selector that holds file objects (asyncio registers its self-pipe) and, asked to wait,
    moves the virtual clock instead."""

    def __init__(self, loop: VirtualLoop):
        self._loop = loop
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stalled(f"at virtual time {self._loop.time():.3f} s every task waits and no timer is set")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock only moves when nothing is ready to run."""

    def __init__(self, epoch: float = EPOCH, cpu_scale: float = 0.0) -> None:
        self._virtual = 0.0
        self.cpu_scale = cpu_scale
        self._epoch = epoch
        super().__init__(_Warp(self))

    def time(self) -> float:
        return self._virtual

    def wall(self) -> float:
        return self._epoch + self._virtual

    def advance(self, seconds: float) -> None:
        self._virtual += seconds

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:  # type: ignore[override]
        """Runs ``func`` at once, on this thread (``asyncio.to_thread`` lands here): work that a
        peer does off its loop (encoding, reducing, auditing) costs no virtual time, and no thread
        can finish in a different order. With ``cpu_scale`` > 0 it costs its measured wall time
        times that (for calibrating against real processes; timings then vary from run to run)."""
        future = self.create_future()
        t0 = time.perf_counter()
        try:
            outcome: tuple[bool, Any] = (True, func(*args))
        except BaseException as e:  # delivered to whoever awaits it, as an executor would
            outcome = (False, e)
        delay = (time.perf_counter() - t0) * self.cpu_scale

        def deliver() -> None:
            if future.done():
                return
            if outcome[0]:
                future.set_result(outcome[1])
            else:
                future.set_exception(outcome[1])

        if delay > 0:
            self.call_later(delay, deliver)
        else:
            deliver()
        return future


def run(main: Any, epoch: float = EPOCH, cpu_scale: float = 0.0) -> Any:
    """Runs the coroutine ``main`` on a fresh ``VirtualLoop`` and closes it; returns its result."""
    loop = VirtualLoop(epoch, cpu_scale)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            for _ in range(100):  # cancelling a task may start others (a crashed peer's cleanup): until none is left
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                if not pending:
                    break
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()
