"""Real peer processes on 127.0.0.1: spawn, wait on conditions, always reap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


class PeerProc:
    def __init__(self, name: str, workdir: Path, args: list[str], prefix: list[str] | None = None):
        self.name, self.workdir = name, workdir
        self.metrics = workdir / f"{name}.jsonl"
        self.info = workdir / f"{name}.json"
        self.log = workdir / f"{name}.log"
        cmd = [*(prefix or []), sys.executable, "-m", "hivetrain.peer.cli", "start", "--threads", "1",
               "--metrics-file", str(self.metrics), "--info-file", str(self.info),
               "--state-dir", str(workdir / f"{name}-state"), *args]
        if not {"--host-maddrs", "--port"} & set(args):  # (see run_cli)
            cmd += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_info(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.info.exists():
            assert self.proc.poll() is None, f"{self.name} exited early:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name} did not come up:\n{self.log.read_text()[-3000:]}"
            try:
                self.proc.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        info: dict[str, Any] = json.loads(self.info.read_text())
        return info

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout} s:\n{self.log.read_text()[-3000:]}") from None

    def records(self, event: str = "round") -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        lines = [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]
        return [r for r in lines if r["event"] == event]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Any]:
    procs: list[PeerProc] = []

    def spawn(name: str, *args: str, prefix: list[str] | None = None) -> PeerProc:
        proc = PeerProc(name, tmp_path, list(args), prefix)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.proc.poll() is None:
            os.killpg(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait(10)
        else:  # the peer's own children (p2pd) must not outlive it either
            try:
                os.killpg(proc.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_until(cond: Any, peers: list[PeerProc], timeout: float, what: str) -> None:
    """Waits for ``cond()`` (a condition on the peers' metrics, not a sleep), failing early if a peer
    exits and with the peers' log tails if ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not cond():
        for p in peers:
            assert p.proc.poll() is None, f"{p.name} exited:\n{p.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + "\n".join(
            p.log.read_text()[-1500:] for p in peers)
        try:
            peers[0].proc.wait(0.2)  # wakes early if the first peer exits
        except subprocess.TimeoutExpired:
            pass


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``peer ARGS``; a ``start`` that names no port listens on loopback at any free one (a peer's
    default, all interfaces at 31337, would depend on what else this machine runs)."""
    argv = list(args)
    if argv[:1] == ["start"] and not {"--port", "--host-maddrs", "--ephemeral"} & set(argv):
        argv += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    return subprocess.run([sys.executable, "-m", "hivetrain.peer.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)
