"""The dashboard: a small local web server for one peer (``peer start --dashboard``) or an observer
(``peer status --dashboard``).

    /             a page with live charts (loss, tokens/s per peer, peers over time, bytes and
                  utilization per round, reachability): plain SVG drawn by inline script, no asset
                  from anywhere else (the machine may be offline)
    /api/status   what the page draws, as JSON
    /metrics      the same numbers for Prometheus (text exposition format, prometheus-client)

It binds to loopback unless told otherwise (``public``). On another address it shows only what the
run's peers publish anyway (heartbeats): this peer's own records (its losses, bytes, utilization,
its totals: peer/totals.py) and its id stay local. Locally, "you" (``you``: this peer's id and
totals) marks this peer in the run's table and charts. The server is bounded: at most MAX_CONNECTIONS open at once (one more is
closed at once), each closed after IDLE_S without a complete request, and on loopback a request
whose ``Host`` is not a loopback name is refused (a web page that rebinds its own name to
127.0.0.1 cannot read a local dashboard). The run's numbers come from ``RunWatcher``, which reads the DHT every few
seconds on its own thread; the training thread is never asked for anything but its round records.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hivetrain.dht.errors import DHTError
from hivetrain.peer.dashboard_page import PAGE
from hivetrain.peer.errors import ConfigError, PeerError

if TYPE_CHECKING:
    from hivetrain.peer.totals import Totals

MAX_CONNECTIONS = 16  # served at once; each is one thread of the training process
IDLE_S = 5.0  # seconds a connection may take to send its request (and to read the answer)
HISTORY = 2000  # round records and run samples kept for the charts (oldest dropped first)
REFRESH = 5.0  # seconds between DHT reads of the run's records


def parse_bind(value: str, public: bool, private: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too); a host that is not loopback needs ``public`` (the run's public
    data only) or ``private`` (this peer's own data too, to requests that name a loopback host: inside
    a container whose port the host publishes on its own loopback)."""
    if public and private:
        raise ConfigError("--dashboard-public and --dashboard-private: pass one")
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--dashboard must be HOST:PORT, e.g. 127.0.0.1:8080; got {value!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError(f"--dashboard: {host!r} is not an IP address (use 127.0.0.1 or an address of "
                          "this machine)") from None
    if not loopback and not public and not private:
        raise ConfigError(f"--dashboard {value}: not a loopback address; add --dashboard-public to serve the "
                          "run's public data on it (this peer's own records stay local), or --dashboard-private "
                          "(in a container: your own data, to the host's loopback)")
    return host, int(port)


def loopback_host(header: str | None) -> bool:
    """Whether a ``Host`` header names this machine by a loopback name (port optional)."""
    if not header:
        return False
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` of them: one more is closed unanswered."""

    daemon_threads = True
    request_queue_size = 64  # (listen backlog: a burst waits here, then is served or closed)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class RunWatcher:
    """Reads the run's status (``source``: peer/status.py's ``read_status``) every ``interval``
    seconds on a daemon thread and keeps a bounded history of it for the charts (``view``)."""

    def __init__(self, source: Callable[[], dict[str, Any]], interval: float = REFRESH,
                 warn: Callable[[str], None] = lambda msg: None):
        self.source, self.interval, self.warn = source, interval, warn
        self._latest: dict[str, Any] | None = None
        self._samples: deque[dict[str, Any]] = deque(maxlen=HISTORY)  # {t, round, peers, tokens_per_s, eval_loss}
        self._lock = threading.Lock()  # the server's threads read what this one writes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hivetrain-dashboard-watch", daemon=True)
        self._failing = False

    def start(self) -> RunWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> None:
        try:
            status = self.source()
        except (DHTError, PeerError, TimeoutError, OSError) as e:  # a slow DHT read: the charts keep what they have
            if not self._failing:
                self.warn(f"dashboard: could not read the run's records ({e}); trying again")
            self._failing = True
            return
        self._failing = False
        with self._lock:
            self._latest = status
            self._samples.append({"t": time.time(), "round": status["round"], "peers": len(status["peers"]),
                                  "tokens_per_s": status["tokens_per_s"], "eval_loss": status["eval_loss"]})

    def view(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The latest status and the samples so far (copies: safe from any thread)."""
        with self._lock:
            return (dict(self._latest) if self._latest is not None else None), list(self._samples)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)


def snapshot(watcher: RunWatcher | None, rounds: Iterable[dict[str, Any]], public: bool,
             totals: Totals | None = None) -> dict[str, Any]:
    """What /api/status serves: the run (peers' public records) and, locally, this peer's rounds and
    its process-lifetime ``totals`` as ``you`` (None without them: an observer), the run's peer that
    is this one flagged ``you``. A round record's ``state_round`` (its round + 1) is the round of the
    state it ends in, whose held-out loss it carries: the run's samples name states by that round."""
    run, samples = watcher.view() if watcher is not None else (None, [])
    if run is not None and public:
        run.pop("observer", None)
    out: dict[str, Any] = {"time": time.time(), "run": run, "samples": samples}
    if not public:
        keep = ("round", "void", "group_size", "train_loss", "eval_loss", "bytes_sent", "bytes_received",
                "utilization", "tokens_per_s", "compute_s", "round_s", "state_hash")
        out["rounds"] = [{**{k: r.get(k) for k in keep}, "state_round": r["round"] + 1}
                         for r in rounds if r.get("event") == "round"]
        out["you"] = totals.view() if totals is not None else None
        if run is not None and totals is not None:
            run["peers"] = [{**p, "you": p["peer_id"] == totals.peer_id} for p in run["peers"]]
    return out


class _Metrics(Collector):
    """The Prometheus view of ``snapshot`` (names per the usual conventions: ``hivetrain_`` prefix,
    base units, ``_total`` for counters, ``_ratio`` for fractions)."""

    def __init__(self, data: Callable[[], dict[str, Any]]):
        self.data = data

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.data()
        run = snap["run"]
        if run is not None:
            yield _gauge("hivetrain_run_round", "The run's round (median of its peers' rounds)", run["round"])
            yield _gauge("hivetrain_run_peers", "Peers with a live heartbeat", len(run["peers"]))
            yield _gauge("hivetrain_run_agreement_ratio", "Share of the peers that hold the run's state",
                         run["agreement"])
            yield _gauge("hivetrain_run_tokens_per_second", "Tokens per second of all peers, as they report",
                         run["tokens_per_s"])
            if run["eval_loss"] is not None:
                yield _gauge("hivetrain_run_eval_loss", "Held-out loss at the run's state", run["eval_loss"])
            reach = GaugeMetricFamily("hivetrain_run_peers_by_reachability", "Peers by how others reach them",
                                      labels=["reachability"])
            for mode, n in run["reachability"].items():
                reach.add_metric([mode], n)
            yield reach
            per_peer = GaugeMetricFamily("hivetrain_peer_reported_tokens_per_second",
                                         "Tokens per second each peer reports in its heartbeat", labels=["peer_id"])
            for p in run["peers"][:256]:
                per_peer.add_metric([p["peer_id"]], p["tokens_per_s"])
            yield per_peer
        you = snap.get("you")
        if you is not None:  # process-lifetime sums (peer/totals.py): never smaller than at the last scrape
            for name, doc, value in (
                    ("hivetrain_rounds_completed", "Rounds this peer completed in a group or alone",
                     you["rounds_completed"]),
                    ("hivetrain_rounds_void", "Rounds this peer voided (parameters restored)", you["rounds_void"]),
                    ("hivetrain_tokens_trained", "Tokens this peer trained in its completed rounds", you["tokens"]),
                    ("hivetrain_round_tokens", "Tokens all members of this peer's completed rounds trained",
                     you["round_tokens"]),
                    ("hivetrain_sent_bytes", "Bytes this peer sent averaging", you["bytes_sent"]),
                    ("hivetrain_received_bytes", "Bytes this peer received averaging", you["bytes_received"]),
                    ("hivetrain_contributed_seconds", "Wall-clock seconds of this peer's completed rounds",
                     you["seconds"])):
                yield _counter(name, doc, value)
            if you["share"] is not None:
                yield _gauge("hivetrain_tokens_share_ratio", "This peer's share of the tokens of the rounds it "
                             "completed", you["share"])
        rounds = snap.get("rounds")
        if rounds:
            last = rounds[-1]
            yield _gauge("hivetrain_round", "The last round this peer ended", last["round"])
            yield _gauge("hivetrain_group_size", "Members of this peer's last group (0: void)", last["group_size"])
            yield _gauge("hivetrain_utilization_ratio", "Share of the last round this peer spent computing",
                         last["utilization"] or 0.0)
            yield _gauge("hivetrain_tokens_per_second", "This peer's tokens per second in its last round",
                         last["tokens_per_s"] or 0.0)
            if last["train_loss"] is not None:
                yield _gauge("hivetrain_train_loss", "This peer's mean training loss in its last round",
                             last["train_loss"])
            evals = [r["eval_loss"] for r in rounds if r["eval_loss"] is not None]
            if evals:
                yield _gauge("hivetrain_eval_loss", "This peer's latest held-out loss", evals[-1])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class Dashboard:
    """Serves /, /api/status and /metrics on its own daemon thread until ``stop``."""

    def __init__(self, bind: tuple[str, int], watcher: RunWatcher | None,
                 rounds: Callable[[], Iterable[dict[str, Any]]] = lambda: (), public: bool = False,
                 totals: Totals | None = None):
        self.watcher, self.rounds, self.public, self.totals = watcher, rounds, public, totals
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(self.data))
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_S  # (StreamRequestHandler sets it on the socket: an idle connection ends)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if not dashboard.public and not loopback_host(self.headers.get("Host")):
                    self._send(421, "text/plain", b"this dashboard answers only to a loopback host name\n")
                elif path == "/":
                    self._send(200, "text/html; charset=utf-8", PAGE.encode())
                elif path == "/api/status":
                    self._send(200, "application/json", json.dumps(dashboard.data()).encode())
                elif path == "/metrics":
                    self._send(200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(dashboard.registry))
                else:
                    self._send(404, "text/plain", b"not found\n")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                pass  # no line per request in the peer's output

        try:
            self.server = _BoundedServer(bind, Handler)
        except OSError as e:
            hint = "; ports below 1024 need root (or CAP_NET_BIND_SERVICE): pick one above" \
                if 0 < bind[1] < 1024 and e.errno == errno.EACCES else ""
            raise ConfigError(f"--dashboard {bind[0]}:{bind[1]}: cannot listen there ({e.strerror or e}){hint}") from None
        self._thread = threading.Thread(target=self.server.serve_forever, name="hivetrain-dashboard", daemon=True)

    @property
    def url(self) -> str:
        host, port = str(self.server.server_address[0]), int(self.server.server_address[1])
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def data(self) -> dict[str, Any]:
        return snapshot(self.watcher, list(self.rounds()), self.public, self.totals)

    def start(self) -> Dashboard:
        self._thread.start()
        if self.watcher is not None:
            self.watcher.start()
        return self

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self._thread.is_alive():  # (shutdown waits for serve_forever: never call it on a server not started)
            self.server.shutdown()
        self.server.server_close()
