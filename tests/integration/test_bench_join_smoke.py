"""Smoke test of ``python -m bench.join``: a small state over loopback, 1 and 2 donors, verified."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_join_quick_loopback() -> None:
    cmd = [sys.executable, "-m", "bench.join", "--quick", "--no-netns", "--json", "--size-mb", "8"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench removes its peers on SIGTERM
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its peers die with it (parent-death signal)
            out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"bench.join did not finish within 90 s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["verified"] is True
    assert report["bytes"] == 8 * int(8e6 / 8)
    rows = {r["donors"]: r for r in report["results"] if r["setting"] == "loopback"}
    assert set(rows) == {1, 2}, report["results"]
    for row in rows.values():
        assert row["verified"] is True and row["failures"] == 0
        assert row["seconds"] > 0 and all(t > 0 for t in row["times"])
        assert row["mb_s"] > 0
    assert sum(rows[2]["served"].values()) == -(-report["bytes"] // (1 << 20))  # every piece came from a donor
