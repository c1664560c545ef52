"""The dashboard's pieces (peer/dashboard.py) without a network: the bind rule, what it serves
locally and publicly, and its Prometheus exposition."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hivetrain.peer import dashboard as dashboard_module
from hivetrain.peer.config import RunSpec
from hivetrain.peer.dashboard import Dashboard, RunWatcher, parse_bind, snapshot
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.status import PeerRow, summarize

SPEC = RunSpec.from_preset("demo", "tiny")


def run_status() -> dict[str, Any]:
    peers = [PeerRow("12D3KooWpeerA", 3, "aa" * 32, 1500.0, "direct", 2.0, 4.1, 3.9),
             PeerRow("12D3KooWpeerB", 3, "aa" * 32, 500.0, "outbound_only", 4.0, 4.2, 3.9)]
    return summarize("demo.key", SPEC, peers, {"ready": 0, "announced": 1}, observer="12D3KooWme")


ROUNDS = [{"event": "start", "round": 0},
          {"event": "round", "round": 0, "void": False, "group_size": 2, "train_loss": 4.5, "eval_loss": 4.4,
           "bytes_sent": 1_000_000, "bytes_received": 900_000, "utilization": 0.5, "tokens_per_s": 1000.0},
          {"event": "round", "round": 1, "void": True, "group_size": 0, "train_loss": 4.3, "eval_loss": None,
           "bytes_sent": 0, "bytes_received": 0, "utilization": 0.4, "tokens_per_s": 1100.0},
          {"event": "sync", "round": 2}]


def test_bind_addresses() -> None:
    assert parse_bind("127.0.0.1:8080", False) == ("127.0.0.1", 8080)
    assert parse_bind("[::1]:0", False) == ("::1", 0) and parse_bind("localhost:1", False) == ("localhost", 1)
    with pytest.raises(ConfigError, match="--dashboard-public"):
        parse_bind("0.0.0.0:8080", False)
    assert parse_bind("0.0.0.0:8080", True) == ("0.0.0.0", 8080)
    for bad in ("8080", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "example.com:80"):
        with pytest.raises(ConfigError):
            parse_bind(bad, True)


def test_local_and_public_snapshots() -> None:
    watcher = RunWatcher(run_status)
    watcher.poll()
    local = snapshot(watcher, ROUNDS, public=False)
    assert local["run"]["observer"] == "12D3KooWme" and [r["round"] for r in local["rounds"]] == [0, 1]
    assert local["samples"][0]["peers"] == 2 and local["samples"][0]["eval_loss"] == pytest.approx(3.9)
    public = snapshot(watcher, ROUNDS, public=True)
    assert "rounds" not in public and "observer" not in public["run"]  # this peer's own records stay local
    assert public["run"]["peers"] == local["run"]["peers"]


def test_prometheus_exposition_parses_with_conventional_names() -> None:
    watcher = RunWatcher(run_status)
    watcher.poll()
    board = Dashboard(("127.0.0.1", 0), watcher, lambda: ROUNDS)
    try:
        from prometheus_client import generate_latest

        text = generate_latest(board.registry).decode()
    finally:
        board.stop()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("hivetrain_run_peers", ())] == 2 and samples[("hivetrain_run_round", ())] == 3
    assert samples[("hivetrain_run_tokens_per_second", ())] == 2000.0
    assert samples[("hivetrain_run_peers_by_reachability", (("reachability", "outbound_only"),))] == 1
    assert samples[("hivetrain_rounds_completed_total", ())] == 1 and samples[("hivetrain_rounds_void_total", ())] == 1
    assert samples[("hivetrain_sent_bytes_total", ())] == 1_000_000 and samples[("hivetrain_group_size", ())] == 0
    assert samples[("hivetrain_eval_loss", ())] == pytest.approx(4.4)


def test_a_port_in_use_is_one_clear_error() -> None:
    first = Dashboard(("127.0.0.1", 0), None)
    try:
        with pytest.raises(ConfigError, match="cannot listen there"):
            Dashboard(("127.0.0.1", first.server.server_address[1]), None)
    finally:
        first.stop()


def _get(port: int, host: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/api/status", headers={"Host": host})
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_local_dashboard_answers_only_to_loopback_host_names() -> None:
    """DNS rebinding (review N11): a page served as attacker.example, its name rebound to 127.0.0.1,
    sends that name as Host; a loopback dashboard refuses it, a public one has nothing private."""
    local, public = Dashboard(("127.0.0.1", 0), None).start(), Dashboard(("127.0.0.1", 0), None, public=True).start()
    try:
        port = local.server.server_address[1]
        for host in (f"127.0.0.1:{port}", "localhost", f"localhost:{port}", "[::1]:80", "app.localhost"):
            assert _get(port, host) == 200, host
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io", ""):
            assert _get(port, host) == 421, host
        assert _get(public.server.server_address[1], "attacker.example") == 200
    finally:
        local.stop()
        public.stop()


def test_idle_connections_hold_a_bounded_number_of_threads_for_a_bounded_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """60 idle sockets (300 in the review) once pinned as many threads of the training process for good (review N11)."""
    monkeypatch.setattr(dashboard_module, "IDLE_S", 2.0)
    board = Dashboard(("127.0.0.1", 0), None).start()
    port = board.server.server_address[1]
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(60)]
    try:
        deadline = time.monotonic() + 10
        while board.server.refused < 60 - dashboard_module.MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.server.refused >= 60 - dashboard_module.MAX_CONNECTIONS  # the flood happened, and was cut
        assert threading.active_count() - before <= dashboard_module.MAX_CONNECTIONS
        while time.monotonic() < deadline:  # the idle ones time out; a real request is served again
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _get(port, "localhost") == 200:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the dashboard never answered again after the idle connections")
        assert all(s.recv(1) == b"" for s in idle)  # every idle socket was closed by the server
    finally:
        for s in idle:
            s.close()
        board.stop()
