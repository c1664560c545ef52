"""The dashboard of a peer in a real 2-peer swarm on 127.0.0.1: its JSON, this peer's totals against
the rounds it ran, its Prometheus /metrics scraped and parsed, and the page rendered by a real
headless Chromium ("you" marked; a screenshot is saved)."""

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


def _consistent(data: dict[str, Any]) -> bool:
    """Whether ``data``'s totals are its rounds' sums (a round may end between the two reads)."""
    you, done = data.get("you"), [r for r in data.get("rounds", []) if not r["void"]]
    return you is not None and you["rounds_completed"] == len(done) and \
        you["rounds_void"] == len(data["rounds"]) - len(done)


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
        if sum(not r["void"] for r in data.get("rounds", [])) >= 2 and data["run"] and len(data["run"]["peers"]) == 2 \
                and _consistent(data):
            break
        time.sleep(0.5)
    assert sum(not r["void"] for r in data["rounds"]) >= 2 and len(data["run"]["peers"]) == 2, data
    assert data["run"]["run"] == info["run_key"] and data["samples"]

    # this peer's totals against what it ran: every round of this process is still in its records (< 2,000)
    you, done = data["you"], [r for r in data["rounds"] if not r["void"]]
    assert you["peer_id"] == info["peer_id"] and _consistent(data), (you, data["rounds"])
    per_round = data["run"]["spec"]["tokens_per_round_per_peer"]  # sync_every x batch_size x seq_len
    assert per_round == 4 * data["run"]["spec"]["batch_size"] * data["run"]["spec"]["seq_len"]
    assert you["tokens"] == len(done) * per_round
    assert you["bytes_sent"] == sum(r["bytes_sent"] for r in done) > 0
    assert you["bytes_received"] == sum(r["bytes_received"] for r in done) > 0
    assert you["seconds"] == pytest.approx(sum(r["round_s"] for r in done), rel=1e-9)
    # this peer's share of its rounds' tokens: 1/2 in each round both trained, 1 in one it ended alone
    together = sum(r["group_size"] == 2 for r in done)
    assert you["round_tokens"] >= (2 * together + len(done) - together) * per_round
    assert 0 < you["share"] <= 1 and (together < len(done) or you["share"] == pytest.approx(0.5))
    marked = [p for p in data["run"]["peers"] if p["you"]]
    assert [p["peer_id"] for p in marked] == [info["peer_id"]]  # "you" is this peer's row, and only it
    states = {r["state_hash"]: r["state_round"] for r in data["rounds"]}
    if marked[0]["state_hash"] in states:  # (its heartbeat's state came from a round, not a sync)
        assert states[marked[0]["state_hash"]] == marked[0]["round"]  # held-out lines aligned by that round

    families = {f.name: f for f in text_string_to_metric_families(_get(base + "/metrics").decode())}
    after = json.loads(_get(base + "/api/status"))["you"]  # counters only grow: scraped between the two reads
    for key, name in (("rounds_completed", "hivetrain_rounds_completed"), ("tokens", "hivetrain_tokens_trained"),
                      ("bytes_sent", "hivetrain_sent_bytes"), ("seconds", "hivetrain_contributed_seconds")):
        assert families[name].type == "counter" and families[name].samples[0].name == name + "_total"
        assert you[key] <= families[name].samples[0].value <= after[key], name
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
    table = re.search(r'<table id="table">(.*?)</table>', dom.stdout, re.S)
    assert table and table.group(1).count('<span class="tag">you</span>') == 1, dom.stdout[-3000:]  # one row: this peer's
    assert re.search(r'<tr class="[^"]*\byou\b"><td>' + info["peer_id"][-16:], table.group(1))
    card = re.search(r'<div class="card" id="you" data-tokens="(\d+)" data-rounds-completed="(\d+)"', dom.stdout)
    assert card and int(card.group(2)) >= you["rounds_completed"] and int(card.group(1)) == int(card.group(2)) * per_round
    assert info["peer_id"] in dom.stdout  # the card names this peer
    joined = re.search(r'<code id="join-line">peer start --join (hivetrain://[^<]+)</code>', dom.stdout)
    assert joined and info["peer_id"] in joined.group(1), dom.stdout[:3000]  # the run's fresh join string, shown
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
