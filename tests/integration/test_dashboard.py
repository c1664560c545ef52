"""The dashboard of a peer in a real 2-peer swarm on 127.0.0.1: its JSON, its Prometheus /metrics
scraped and parsed, and the page rendered by a real headless Chromium (a screenshot is saved)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import run_cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 (a loopback URL we built)
        return bytes(reply.read())


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--hide-scrollbars", *args], capture_output=True, text=True, timeout=120)


def test_dashboard_json_metrics_and_page_in_a_headless_browser(swarm, tmp_path: Path) -> None:
    port = _free_port()
    common = ["--sync-every", "4", "--until-round", "40", "--quiet", "--wait-for-peers", "2", "--target-group-size", "2",
              "--eval-every", "1"]
    owner = swarm("p0", "--new-run", "dash", "--dashboard", f"127.0.0.1:{port}", *common)
    info = owner.wait_info()
    swarm("p1", "--run", info["run_key"], "--initial-peers", info["maddrs"][0], *common)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    data: dict[str, Any] = {}
    while time.monotonic() < deadline:
        assert owner.proc.poll() is None, owner.log.read_text()[-3000:]
        try:
            data = json.loads(_get(base + "/api/status"))
        except OSError:  # not serving yet (it starts once the run is open)
            time.sleep(0.5)
            continue
        # (two completed rounds: a round may void on a loaded machine, and the counter below counts completed ones)
        if sum(not r["void"] for r in data.get("rounds", [])) >= 2 and data["run"] and len(data["run"]["peers"]) == 2:
            break
        time.sleep(0.5)
    assert sum(not r["void"] for r in data["rounds"]) >= 2 and len(data["run"]["peers"]) == 2, data
    assert data["run"]["run"] == info["run_key"] and data["samples"]

    families = {f.name: f for f in text_string_to_metric_families(_get(base + "/metrics").decode())}
    assert families["hivetrain_run_peers"].samples[0].value == 2
    assert families["hivetrain_rounds_completed"].type == "counter"
    assert families["hivetrain_rounds_completed"].samples[0].value >= 2
    assert families["hivetrain_sent_bytes"].samples[0].value > 0
    assert 0 < families["hivetrain_utilization_ratio"].samples[0].value <= 1
    assert _get(base + "/").startswith(b"<!doctype html>") and b"src=\"http" not in _get(base + "/")  # no CDN

    if CHROMIUM is None:
        pytest.skip("no chromium here: .ci/run installs Debian's chromium; the JSON and /metrics were checked")
    dom = _chromium("--virtual-time-budget=8000", "--dump-dom", base + "/")
    assert dom.returncode == 0, dom.stderr[-2000:]
    shown = re.search(r'data-rounds="(\d+)"', dom.stdout)
    assert shown and int(shown.group(1)) >= 2, dom.stdout[-3000:]  # the charts drew at least 2 rounds
    assert dom.stdout.count("<polyline") >= 2 and info["run_key"] in dom.stdout
    shot = tmp_path / "dashboard.png"
    taken = _chromium("--virtual-time-budget=8000", "--window-size=1280,1100", f"--screenshot={shot}", base + "/")
    assert taken.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    if os.environ.get("HIVETRAIN_ARTIFACTS"):  # CI keeps the screenshot
        os.makedirs(os.environ["HIVETRAIN_ARTIFACTS"], exist_ok=True)
        shutil.copy(shot, os.path.join(os.environ["HIVETRAIN_ARTIFACTS"], "dashboard.png"))
    print(f"dashboard screenshot: {shot}")


def test_a_dashboard_on_a_public_address_needs_the_flag(tmp_path: Path) -> None:
    result = run_cli("start", "--new-run", "dash", "--dashboard", "0.0.0.0:8080", "--state-dir", str(tmp_path))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "--dashboard-public" in lines[0], result.stderr
    assert not (tmp_path / "owners").exists()  # refused before anything started
