"""The dashboard's pieces (peer/dashboard.py) without a network: the bind rule, what it serves
locally and publicly, "you" in the page's data, its Prometheus exposition, and this peer's totals
(peer/totals.py) as counters that only grow for as long as the process lives."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hivetrain.peer import dashboard as dashboard_module
from hivetrain.peer.config import RunSpec
from hivetrain.peer.dashboard import Dashboard, RunWatcher, parse_bind, snapshot
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.status import PeerRow, summarize
from hivetrain.peer.totals import COUNTERS, Totals, TotalsWriter

SPEC = RunSpec.from_preset("demo", "tiny")
ME = "12D3KooWpeerA"  # this peer, one of the run's two


def run_status() -> dict[str, Any]:
    peers = [PeerRow(ME, 3, "aa" * 32, 1500.0, "direct", 2.0, 4.1, 3.9),
             PeerRow("12D3KooWpeerB", 3, "aa" * 32, 500.0, "outbound_only", 4.0, 4.2, 3.9)]
    return summarize("demo.key", SPEC, peers, {"ready": 0, "announced": 1}, observer="12D3KooWme")


ROUNDS = [{"event": "start", "round": 0},
          {"event": "round", "round": 0, "void": False, "group_size": 2, "train_loss": 4.5, "eval_loss": 4.4,
           "bytes_sent": 1_000_000, "bytes_received": 900_000, "utilization": 0.5, "tokens_per_s": 1000.0,
           "inner_steps": SPEC.sync_every, "round_s": 2.5},
          {"event": "round", "round": 1, "void": True, "group_size": 0, "train_loss": 4.3, "eval_loss": None,
           "bytes_sent": 0, "bytes_received": 0, "utilization": 0.4, "tokens_per_s": 1100.0},
          {"event": "sync", "round": 2}]


def test_bind_addresses() -> None:
    assert parse_bind("127.0.0.1:8080", False) == ("127.0.0.1", 8080)
    assert parse_bind("[::1]:0", False) == ("::1", 0) and parse_bind("localhost:1", False) == ("localhost", 1)
    with pytest.raises(ConfigError, match="--dashboard-public"):
        parse_bind("0.0.0.0:8080", False)
    assert parse_bind("0.0.0.0:8080", True) == ("0.0.0.0", 8080)
    assert parse_bind("0.0.0.0:8080", False, private=True) == ("0.0.0.0", 8080)  # (in a container: step 15)
    with pytest.raises(ConfigError, match="pass one"):
        parse_bind("0.0.0.0:8080", True, private=True)
    for bad in ("8080", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "example.com:80"):
        with pytest.raises(ConfigError):
            parse_bind(bad, True)


def totals_of(records: list[dict[str, Any]]) -> Totals:
    totals = Totals.of(ME, SPEC)
    for record in records:
        totals.add(record)
    return totals


def test_local_and_public_snapshots() -> None:
    watcher = RunWatcher(run_status)
    watcher.poll()
    local = snapshot(watcher, ROUNDS, public=False)
    assert local["run"]["observer"] == "12D3KooWme" and [r["round"] for r in local["rounds"]] == [0, 1]
    assert local["samples"][0]["peers"] == 2 and local["samples"][0]["eval_loss"] == pytest.approx(3.9)
    public = snapshot(watcher, ROUNDS, public=True, totals=totals_of(ROUNDS))
    assert "rounds" not in public and "observer" not in public["run"]  # this peer's own records stay local
    assert "you" not in public and all("you" not in p for p in public["run"]["peers"])  # ... and its id
    assert public["run"]["peers"] == local["run"]["peers"]


def test_the_page_data_marks_you_and_aligns_held_out_losses_by_state_round() -> None:
    watcher = RunWatcher(run_status)
    watcher.poll()
    data = snapshot(watcher, ROUNDS, public=False, totals=totals_of(ROUNDS))
    assert [(p["peer_id"], p["you"]) for p in data["run"]["peers"]] == [(ME, True), ("12D3KooWpeerB", False)]
    tokens = SPEC.sync_every * SPEC.batch_size * SPEC.seq_len  # round 0 completed in a group of 2; round 1 void
    assert data["you"] == {"peer_id": ME, "rounds_completed": 1, "rounds_void": 1, "tokens": tokens,
                           "round_tokens": 2 * tokens, "bytes_sent": 1_000_000, "bytes_received": 900_000,
                           "seconds": 2.5, "share": 0.5}
    # a round record's held-out loss is measured at the state its round ends in, which heartbeats (and
    # so the run's samples) name by the next round: the page plots both at that round
    assert [(r["round"], r["state_round"]) for r in data["rounds"]] == [(0, 1), (1, 2)]
    observer = snapshot(watcher, ROUNDS, public=False)  # `peer status --dashboard`: nobody is "you"
    assert observer["you"] is None and all("you" not in p for p in observer["run"]["peers"])
    json.dumps(data)  # what /api/status serves
    page = dashboard_module.PAGE
    assert 'id="you"' in page and "state_round" in page and '"you"' in page and "tr class" in page


def test_prometheus_exposition_parses_with_conventional_names() -> None:
    watcher = RunWatcher(run_status)
    watcher.poll()
    board = Dashboard(("127.0.0.1", 0), watcher, lambda: ROUNDS, totals=totals_of(ROUNDS))
    try:
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
    assert samples[("hivetrain_tokens_trained_total", ())] == SPEC.sync_every * SPEC.batch_size * SPEC.seq_len
    assert samples[("hivetrain_contributed_seconds_total", ())] == 2.5
    assert samples[("hivetrain_tokens_share_ratio", ())] == 0.5


COUNTED = {"rounds_completed": "hivetrain_rounds_completed_total", "rounds_void": "hivetrain_rounds_void_total",
           "tokens": "hivetrain_tokens_trained_total", "round_tokens": "hivetrain_round_tokens_total",
           "bytes_sent": "hivetrain_sent_bytes_total", "bytes_received": "hivetrain_received_bytes_total",
           "seconds": "hivetrain_contributed_seconds_total"}


def test_counters_only_grow_and_are_exact_over_thousands_of_rounds(tmp_path: Any) -> None:
    """2,600 rounds (void ones, syncs, bytes that shrink as the run goes on) through the metrics stream
    the training loop writes: the dashboard keeps only the latest 2,000 records, and a counter summed
    over them (as /metrics once did) fell when an old, larger round dropped out. Each counter must be
    the exact process-lifetime sum, and never smaller than at the scrape before."""
    assert set(COUNTED) == set(COUNTERS)
    rng = random.Random(7)
    writer = TotalsWriter(str(tmp_path / "metrics.jsonl"), Totals.of(ME, SPEC))
    board = Dashboard(("127.0.0.1", 0), None, writer.recent, totals=writer.totals)
    expected: dict[str, float] = dict.fromkeys(COUNTERS, 0)
    last: dict[str, float] = dict.fromkeys(COUNTERS, 0)
    tokens = SPEC.sync_every * SPEC.batch_size * SPEC.seq_len
    try:
        writer.write({"event": "start", "round": 0})
        for r in range(2600):
            void = rng.random() < 0.15
            group = 0 if void else rng.choice([1, 2, 2, 3])
            sent = 0 if void else max(0, 3_000_000 - 1000 * r + rng.randrange(1000))  # (shrinks: a window sum fell)
            record = {"event": "round", "round": r, "void": void, "group_size": group, "inner_steps": SPEC.sync_every,
                      "bytes_sent": sent, "bytes_received": sent // 2, "round_s": rng.uniform(0.5, 3.0),
                      "round_members": float(group + (r % 3 == 0 and group > 0)), "utilization": 0.5,
                      "train_loss": None if void else 4.0, "eval_loss": None, "tokens_per_s": 1000.0}
            writer.write(record)
            if r % 97 == 5:
                writer.write({"event": "sync", "round": r + 1})
            if void:
                expected["rounds_void"] += 1
            else:
                expected["rounds_completed"] += 1
                expected["tokens"] += tokens
                expected["round_tokens"] += tokens * (group + (r % 3 == 0))
                expected["bytes_sent"] += sent
                expected["bytes_received"] += sent // 2
                expected["seconds"] += record["round_s"]
            if r % 13 == 0 or r >= 1990:  # scrapes, all of them once rounds start falling out of the window
                text = generate_latest(board.registry).decode()
                families = {f.name: f for f in text_string_to_metric_families(text)}
                for key, name in COUNTED.items():
                    family = families[name.removesuffix("_total")]
                    assert family.type == "counter"
                    value = family.samples[0].value
                    assert value >= last[key], (r, name, value, last[key])
                    assert value == pytest.approx(expected[key], rel=1e-12), (r, name)
                    last[key] = value
        assert len(writer.recent()) == 2000 < 2600  # the window did drop rounds ...
        view = writer.totals.view()
        assert {k: view[k] for k in COUNTERS if k != "seconds"} == {k: expected[k] for k in COUNTERS if k != "seconds"}
        assert view["share"] == expected["tokens"] / expected["round_tokens"]
        assert expected["rounds_void"] > 300 and expected["rounds_completed"] > 2000  # ... and voids were counted
    finally:
        board.stop()
        writer.close()
    assert sum(1 for _ in open(tmp_path / "metrics.jsonl")) == 1 + 2600 + len(range(5, 2600, 97))  # every record kept


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


def test_a_private_dashboard_on_any_address_shows_our_own_data_only_to_loopback_host_names() -> None:
    """--dashboard-private (a container's 0.0.0.0, published on the host's 127.0.0.1): our own data,
    and the Host check of a loopback dashboard, on an address that is not loopback."""
    board = Dashboard(parse_bind("0.0.0.0:0", False, private=True), None, totals=totals_of(ROUNDS)).start()
    try:
        port = board.server.server_address[1]
        assert _get(port, f"127.0.0.1:{port}") == 200 and _get(port, "attacker.example") == 421
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/status", headers={"Host": f"localhost:{port}"})
        assert json.loads(conn.getresponse().read())["you"]["peer_id"] == ME
        conn.close()
    finally:
        board.stop()


def test_a_privileged_dashboard_port_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """UX review case 33, as the listen port (31) already says it: a port below 1024 needs root."""
    import errno

    from hivetrain.peer import dashboard

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(dashboard, "_BoundedServer", refused)
    with pytest.raises(ConfigError, match=r"127.0.0.1:80: cannot listen there \(Permission denied\); ports below "
                                          r"1024 need root"):
        Dashboard(("127.0.0.1", 80), None)
