"""A daemon whose start failed is reaped on the loop that spawned it (dht/node.py ``_reap``): once
that loop is closed, asyncio's child watcher would print "Loop ... that handles pid ... is closed"
into the user's one-line error (seen in CI after a bootstrap failure)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest

from hivetrain.dht.node import _reap
from hivetrain.dht.process import children_die_with_us


def test_a_failed_daemon_is_reaped_before_its_loop_closes(caplog: pytest.LogCaptureFixture) -> None:
    started: list = []

    async def spawn_and_reap() -> None:
        with children_die_with_us(started):  # hivemind spawns p2pd through this call
            await asyncio.subprocess.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(0.3)")
            await asyncio.subprocess.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
            for _ in range(6):  # exit at once, as p2pd does on a bootstrap failure: reaped by the watcher alone
                await asyncio.subprocess.create_subprocess_exec("true")
        await _reap(started)

    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        t0 = time.monotonic()
        loop.run_until_complete(spawn_and_reap())
        loop.close()
        time.sleep(0.5)  # a child the watcher still had would be reported now
    assert len(started) == 8 and all(p.returncode is not None for p in started)
    assert started[1].returncode == -15  # one still running is terminated (SIGTERM), then awaited
    assert [p.returncode for p in started[2:]] == [0] * 6  # not 255: nobody reaped them behind the watcher's back
    assert time.monotonic() - t0 < 10
    assert not [r for r in caplog.records if "is closed" in r.getMessage()], caplog.text
    # a signal sent through Popen polls (reaps) the pid first; asyncio's watcher thread then says so
    assert not [r for r in caplog.records if "Unknown child process" in r.getMessage()], caplog.text
