"""What time it is, for protocol code: read through the running event loop, never from the machine directly.

A real peer's loop keeps the machine's monotonic clock (``asyncio``'s default), and its training
thread has no loop, so there both functions are ``time.monotonic()`` and ``time.time()``. The
simulator (peer/sim/loop.py) runs every peer of a swarm on one loop whose clock is virtual, and the
synchronous training code of its peers inside that loop's thread (peer/sim/green.py): then every
reading below is virtual time, and a whole run is deterministic for its seed.
"""

from __future__ import annotations

import asyncio
import time

# A wait shorter than this is no wait: asyncio runs a timer due within its clock resolution (1 ns)
# at once, without the clock reaching it, so on a virtual clock (peer/sim/loop.py), which only moves
# to reach timers, a loop "while now() < end: wait(end - now())" would spin forever a hair before
# ``end`` (seen in the search, seed 2,000,123: a designee's wait for its groups).
EPSILON = 1e-6


def now() -> float:
    """Monotonic seconds: the running loop's clock, or the machine's where no loop runs."""
    loop = asyncio._get_running_loop()
    return loop.time() if loop is not None else time.monotonic()


def wall() -> float:
    """Unix seconds (record expirations, ETAs): the running loop's own if it keeps one (virtual
    time), else the machine's."""
    loop = asyncio._get_running_loop()
    virtual = getattr(loop, "wall", None) if loop is not None else None
    return virtual() if virtual is not None else time.time()
