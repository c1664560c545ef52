"""Process hygiene for the p2p daemon: it dies with us, and dead daemons' sockets are removed.

hivemind starts ``p2pd`` as a child process. If our process is SIGKILLed, nothing tells the
daemon, and it was measured still running a minute later, holding ports and sockets; the unix
socket files of dead daemons are never removed either. Both are fixed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def children_die_with_us(started: list[Any] | None = None) -> Iterator[None]:
    """While active, subprocesses started through asyncio get SIGKILL when their parent thread exits.

    hivemind spawns p2pd with ``asyncio.subprocess.create_subprocess_exec`` and offers no hook, so
    the call is wrapped for the duration of the daemon's start (on the DHT loop thread, which
    lives as long as the daemon is needed). Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        yield
        return
    original = asyncio.subprocess.create_subprocess_exec

    async def create(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", _die_with_parent)
        process = await original(*args, **kwargs)
        if started is not None:  # the caller's handle on them (e.g. to reap one whose start failed)
            started.append(process)
        return process

    asyncio.subprocess.create_subprocess_exec = create  # type: ignore[assignment]
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original  # type: ignore[assignment]


def remove_stale_sockets(directory: str | None = None) -> int:
    """Removes hivemind daemon/client sockets nobody listens on any more; returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(directory or tempfile.gettempdir(), "hivemind-p2p*.sock")):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.2)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                os.remove(path)
                removed += 1
        except OSError:
            pass  # someone else's, or busy: leave it
        finally:
            probe.close()
    return removed
