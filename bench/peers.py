"""Bench processes: real ``peer start`` peers and anchor members, each in its own process group, reaped always.

A :class:`Proc` logs to a file in the work directory, dies with the bench (the parent-death signal, kept
across the exec of ``ip netns exec``) and is stopped by ``stop()``: SIGTERM, then SIGKILL of its whole
group (p2pd included). :func:`follow_rounds` follows the peers' metrics files and stamps every round
record with the monotonic time the bench first saw it (``arrived_s``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.1  # seconds between looks at the metrics files (rounds take seconds)


def _die_with_parent() -> None:  # in the child between fork and exec: SIGKILL when the bench dies
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Proc:
    """One child process in its own session, stdout and stderr to ``<workdir>/<name>.log``."""

    def __init__(self, name: str, workdir: Path, prefix: list[str], cmd: list[str]):
        self.name = name
        self.log = workdir / f"{name}.log"
        self.metrics = workdir / f"{name}.jsonl"
        env = dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="ERROR", GOLOG_LOG_LEVEL="fatal",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*prefix, *cmd], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent)

    def tail(self, n: int = 2500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)  # a peer shuts its DHT down on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def wait_info(proc: Proc, path: Path, deadline: float) -> dict[str, Any]:
    """The JSON a process writes (atomically) to ``path`` once it is up; raises RuntimeError if it exits
    first or the deadline passes."""
    while not path.exists():
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early (rc {proc.proc.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not come up in time:\n{proc.tail()}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.proc.wait(POLL_S)
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def peer_cmd(args: argparse.Namespace, workdir: Path, name: str, host: str, max_rounds: int,
             run: list[str]) -> list[str]:
    """``peer start`` as the integration tests run it, listening on ``host`` inside its namespace."""
    return [sys.executable, "-m", "hivetrain.peer.cli", "start", "--threads", "1",
            "--metrics-file", str(workdir / f"{name}.jsonl"), "--info-file", str(workdir / f"{name}.json"),
            "--state-dir", str(workdir / f"{name}-state"), "--host-maddrs", f"/ip4/{host}/tcp/0",
            "--until-round", str(max_rounds), "--wait-for-peers", "3", "--wait-timeout", "120",
            "--eval-batches", "0", *run]


def anchor_cmd(args: argparse.Namespace, index: int, host: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "bench.hivemind_anchor", "--index", str(index), "--group", "3",
            "--numel", str(args.numel), "--host", host, "--warmup", str(args.anchor_warmup),
            "--steps", str(args.anchor_steps), *extra]


def overlap_supported() -> tuple[bool, str]:
    """Whether ``peer start`` has the ``--overlap`` run-spec flag; if not, why the overlap rows are missing."""
    out = subprocess.run([sys.executable, "-m", "hivetrain.peer.cli", "start", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    if "--overlap" in out.stdout:
        return True, ""
    return False, "`peer start` has no --overlap flag in this checkout (overlap mode not built yet)"


class MetricsFollower:
    """Reads the complete lines appended to one metrics file since the last look."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""
        self.rounds: list[dict[str, Any]] = []

    def poll(self, now: float) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            if line.strip():
                rec = json.loads(line)
                if rec.get("event") == "round":
                    self.rounds.append(dict(rec, arrived_s=now))


def follow_rounds(procs: list[Proc], want: int, deadline: float,
                  progress: Callable[[list[int], dict[str, Any]], None]) -> list[list[dict[str, Any]]]:
    """Follows every peer's metrics file until each has ``want`` round records; returns them (file order).

    Raises RuntimeError if a peer exits before that or the deadline passes. ``progress`` is called with
    the record counts and the first peer's last record whenever a new record arrives."""
    followers = [MetricsFollower(p.metrics) for p in procs]
    seen = 0
    while True:
        now = time.monotonic()
        for f in followers:
            f.poll(now)
        counts = [len(f.rounds) for f in followers]
        if sum(counts) > seen:
            seen = sum(counts)
            progress(counts, followers[0].rounds[-1] if followers[0].rounds else {})
        if min(counts) >= want:
            return [f.rounds[:want] for f in followers]
        for p, c in zip(procs, counts, strict=True):
            if c < want and p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited (rc {p.proc.returncode}) after {c} rounds:\n{p.tail()}")
        if now > deadline:
            raise RuntimeError(f"rounds {counts} of {want} when the time ran out:\n" +
                               "\n".join(f"--- {p.name}\n{p.tail(1200)}" for p in procs))
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].proc.wait(POLL_S)  # wakes early if the first peer exits
