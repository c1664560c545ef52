"""The DHT loop's exception handler (dht/node.py): p2pd's dropped streams stay out of user logs,
everything else still reaches asyncio's default handler."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hivetrain.dht.node import _quiet_dropped_streams


def test_dropped_stream_is_debug_and_other_errors_still_reported(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        caplog.set_level(logging.DEBUG)
        dropped = asyncio.IncompleteReadError(b"", 1)
        _quiet_dropped_streams(loop, {"message": "Unhandled exception in client_connected_cb", "exception": dropped})
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("dropped an incoming stream" in r.getMessage() for r in caplog.records)
        _quiet_dropped_streams(loop, {"message": "Task exception was never retrieved", "exception": ValueError("x")})
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "Task exception was never retrieved" in errors[0].getMessage()
    finally:
        loop.close()
