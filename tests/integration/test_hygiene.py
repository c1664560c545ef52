"""A SIGKILLed peer leaves nothing running behind it; dead daemons' sockets are cleaned on start."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from pathlib import Path

from hivetrain.dht.process import remove_stale_sockets


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_peer_takes_p2pd_with_it(swarm) -> None:
    peer = swarm("lonely", "--new-run", "hygiene", "--sync-every", "2", "--quiet")
    peer.wait_info()
    daemons = [c for c in _children(peer.proc.pid) if "p2pd" in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(daemons) == 1
    os.kill(peer.proc.pid, signal.SIGKILL)  # the peer process only, not its group
    peer.proc.wait(10)
    deadline = time.monotonic() + 10
    while _alive(daemons[0]):
        assert time.monotonic() < deadline, "p2pd outlived its SIGKILLed parent"
        time.sleep(0.05)  # polling /proc: there is no event for another process's death


def test_stale_daemon_sockets_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "hivemind-p2pd-stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()  # the file stays, nobody listens: what a SIGKILLed daemon leaves
    live = tmp_path / "hivemind-p2pclient-live.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(live))
    server.listen()
    try:
        assert remove_stale_sockets(str(tmp_path)) == 1
        assert not stale.exists() and live.exists()
    finally:
        server.close()
    assert tempfile.gettempdir()
