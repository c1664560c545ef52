"""The console of ``peer start``: a live status line on a terminal (a real pseudo-terminal here),
plain lines when piped."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from .conftest import run_cli

ARGS = ["--new-run", "console", "--sync-every", "6", "--until-round", "2", "--threads", "1", "--ephemeral"]


def test_a_terminal_shows_the_phase_the_steps_and_their_eta(tmp_path: Path) -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "hivetrain.peer.cli", "start", *ARGS, "--state-dir",
                             str(tmp_path)], stdin=follower, stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the peer exited
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(30) == 0, out.decode(errors="replace")[-3000:]
    text = out.decode(errors="replace")
    assert "\r\x1b[K" in text and "Traceback" not in text, text[-3000:]  # redrawn in place
    assert "computing | [" in text and "/6" in text and "ETA " in text, text[-3000:]
    assert "averaging" in text and "round 1: train" in text and "done: 2 rounds completed" in text, text[-3000:]


def test_a_pipe_gets_plain_lines(tmp_path: Path) -> None:
    result = run_cli("start", *ARGS, "--state-dir", str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b[" not in result.stdout and "\r" not in result.stdout
    assert "round 0: train" in result.stdout and "round 1: train" in result.stdout
    assert "done: 2 rounds completed" in result.stdout
    assert "Traceback" not in result.stderr and "Task was destroyed" not in result.stderr, result.stderr[-3000:]
