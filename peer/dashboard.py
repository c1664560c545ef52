"""The dashboard: a small local web server for one peer (``peer start --dashboard``) or an observer
(``peer status --dashboard``).

    /             a page with live charts (loss, tokens/s per peer, peers over time, bytes and
                  utilization per round, reachability): plain SVG drawn by inline script, no asset
                  from anywhere else (the machine may be offline)
    /api/status   what the page draws, as JSON
    /metrics      the same numbers for Prometheus (text exposition format, prometheus-client)

It binds to loopback unless told otherwise (``public``). On another address it shows only what the
run's peers publish anyway (heartbeats): this peer's own records (its losses, bytes, utilization)
and its id stay local. The server is bounded: at most MAX_CONNECTIONS open at once (one more is
closed at once), each closed after IDLE_S without a complete request, and on loopback a request
whose ``Host`` is not a loopback name is refused (a web page that rebinds its own name to
127.0.0.1 cannot read a local dashboard). The run's numbers come from ``RunWatcher``, which reads the DHT every few
seconds on its own thread; the training thread is never asked for anything but its round records.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hivetrain.dht.errors import DHTError
from hivetrain.peer.errors import ConfigError, PeerError

MAX_CONNECTIONS = 16  # served at once; each is one thread of the training process
IDLE_S = 5.0  # seconds a connection may take to send its request (and to read the answer)
HISTORY = 2000  # round records and run samples kept for the charts (oldest dropped first)
REFRESH = 5.0  # seconds between DHT reads of the run's records


def parse_bind(value: str, public: bool) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too); a host that is not loopback needs ``public``."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--dashboard must be HOST:PORT, e.g. 127.0.0.1:8080; got {value!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError(f"--dashboard: {host!r} is not an IP address (use 127.0.0.1 or an address of "
                          "this machine)") from None
    if not loopback and not public:
        raise ConfigError(f"--dashboard {value}: not a loopback address; add --dashboard-public to serve the "
                          "run's public data on it (this peer's own records stay local)")
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


def snapshot(watcher: RunWatcher | None, rounds: Iterable[dict[str, Any]], public: bool) -> dict[str, Any]:
    """What /api/status serves: the run (peers' public records) and, locally, this peer's rounds."""
    run, samples = watcher.view() if watcher is not None else (None, [])
    if run is not None and public:
        run.pop("observer", None)
    out: dict[str, Any] = {"time": time.time(), "run": run, "samples": samples}
    if not public:
        keep = ("round", "void", "group_size", "train_loss", "eval_loss", "bytes_sent", "bytes_received",
                "utilization", "tokens_per_s", "compute_s", "round_s", "state_hash")
        out["rounds"] = [{k: r.get(k) for k in keep} for r in rounds if r.get("event") == "round"]
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
        rounds = snap.get("rounds")
        if rounds:
            last = rounds[-1]
            yield _counter("hivetrain_rounds_completed", "Rounds this peer completed in a group or alone",
                           sum(not r["void"] for r in rounds))
            yield _counter("hivetrain_rounds_void", "Rounds this peer voided (parameters restored)",
                           sum(bool(r["void"]) for r in rounds))
            yield _counter("hivetrain_sent_bytes", "Bytes this peer sent averaging",
                           sum(r["bytes_sent"] or 0 for r in rounds))
            yield _counter("hivetrain_received_bytes", "Bytes this peer received averaging",
                           sum(r["bytes_received"] or 0 for r in rounds))
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
                 rounds: Callable[[], Iterable[dict[str, Any]]] = lambda: (), public: bool = False):
        self.watcher, self.rounds, self.public = watcher, rounds, public
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
            raise ConfigError(f"--dashboard {bind[0]}:{bind[1]}: cannot listen there ({e.strerror or e})") from None
        self._thread = threading.Thread(target=self.server.serve_forever, name="hivetrain-dashboard", daemon=True)

    @property
    def url(self) -> str:
        host, port = str(self.server.server_address[0]), int(self.server.server_address[1])
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def data(self) -> dict[str, Any]:
        return snapshot(self.watcher, list(self.rounds()), self.public)

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


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hivetrain</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:18px;margin:0 0 4px} #head{color:#555;margin-bottom:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 10px}
.card h2{font-size:13px;margin:0 0 6px;color:#333} svg{width:100%;height:180px}
table{border-collapse:collapse;font-size:12px;width:100%} td,th{padding:2px 6px;text-align:right}
td:first-child,th:first-child{text-align:left;font-family:monospace} .off{color:#b00}
.legend span{margin-right:10px;font-size:12px} .none{color:#999;font-size:12px}
</style></head><body>
<h1>hivetrain</h1><div id="head">loading&hellip;</div>
<div class="grid">
<div class="card"><h2>loss by round</h2><svg id="loss"></svg><div class="legend" id="loss-legend"></div></div>
<div class="card"><h2>tokens/s per peer</h2><svg id="speed"></svg></div>
<div class="card"><h2>peers over time</h2><svg id="peers"></svg></div>
<div class="card"><h2>MB sent per round (this peer)</h2><svg id="bytes"></svg></div>
<div class="card"><h2>utilization per round (this peer)</h2><svg id="util"></svg></div>
<div class="card"><h2>reachability</h2><svg id="reach"></svg></div>
</div>
<div class="card" style="margin-top:12px"><h2>peers</h2><table id="table"></table></div>
<script>
"use strict";
const COLORS=["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b"];
const NS="http://www.w3.org/2000/svg";
function el(tag,attrs,parent){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function fmt(v){return Number.isInteger(+v)||Math.abs(v)>=1000?Math.round(v).toLocaleString():(+v).toPrecision(3);}
function frame(svg){svg.innerHTML="";const w=svg.clientWidth||400,h=svg.clientHeight||180;return {w,h,l:48,r:8,t:8,b:22};}
function axes(svg,f,x0,x1,y0,y1,xl){
  el("line",{x1:f.l,y1:f.h-f.b,x2:f.w-f.r,y2:f.h-f.b,stroke:"#999"},svg);
  el("line",{x1:f.l,y1:f.t,x2:f.l,y2:f.h-f.b,stroke:"#999"},svg);
  for(const [v,y] of [[y1,f.t+8],[y0,f.h-f.b]]){const t=el("text",{x:f.l-4,y:y,"text-anchor":"end","font-size":10},svg);t.textContent=fmt(v);}
  for(const [v,x,a] of [[x0,f.l,"start"],[x1,f.w-f.r,"end"]]){const t=el("text",{x:x,y:f.h-6,"text-anchor":a,"font-size":10},svg);t.textContent=xl?xl(v):fmt(v);}
}
function empty(svg,msg){const f=frame(svg);const t=el("text",{x:f.w/2,y:f.h/2,"text-anchor":"middle",class:"none"},svg);t.textContent=msg;}
function lines(id,series,xl,range){
  const svg=document.getElementById(id);const pts=series.flatMap(s=>s.points);
  if(pts.length<1){empty(svg,"no data yet");return;}
  const f=frame(svg);let x0=Math.min(...pts.map(p=>p[0])),x1=Math.max(...pts.map(p=>p[0]));
  let y0=Math.min(...pts.map(p=>p[1])),y1=Math.max(...pts.map(p=>p[1]));
  if(range){y0=range[0];y1=range[1];}
  if(x1===x0)x1=x0+1; if(y1===y0){y1=y0+Math.abs(y0||1)*0.05;y0=y0-Math.abs(y0||1)*0.05;}
  axes(svg,f,x0,x1,y0,y1,xl);
  const X=x=>f.l+(x-x0)/(x1-x0)*(f.w-f.l-f.r),Y=y=>f.h-f.b-(y-y0)/(y1-y0)*(f.h-f.t-f.b);
  series.forEach((s,i)=>{if(!s.points.length)return;
    el("polyline",{points:s.points.map(p=>X(p[0])+","+Y(p[1])).join(" "),fill:"none",stroke:s.color||COLORS[i],"stroke-width":1.8},svg);
    for(const p of s.points)el("circle",{cx:X(p[0]),cy:Y(p[1]),r:2.2,fill:s.color||COLORS[i]},svg);});
}
function bars(id,items){
  const svg=document.getElementById(id);if(!items.length){empty(svg,"no data yet");return;}
  const f=frame(svg);const y1=Math.max(...items.map(b=>b[1]),1e-9);axes(svg,f,0,items.length,0,y1,()=>"");
  const bw=(f.w-f.l-f.r)/items.length;
  items.forEach((b,i)=>{const h=(b[1]/y1)*(f.h-f.t-f.b);
    el("rect",{x:f.l+i*bw+bw*0.15,y:f.h-f.b-h,width:bw*0.7,height:h,fill:b[2]||COLORS[0]},svg);
    if(items.length<=12){const t=el("text",{x:f.l+i*bw+bw/2,y:f.h-f.b+11,"text-anchor":"middle","font-size":9},svg);t.textContent=b[0];}});
}
function draw(d){
  const run=d.run,rounds=d.rounds||[];
  if(run){const s=run.spec;
    document.getElementById("head").textContent=`run ${run.run}: ${s.model}, H=${s.sync_every}, ${s.compression} | round ${run.round} | ${run.peers.length} peers, ${Math.round(run.agreement*100)}% on state ${(run.state_hash||"-").slice(0,12)} | ${fmt(run.tokens_per_s)} tokens/s | held-out ${run.eval_loss==null?"-":run.eval_loss.toFixed(4)}`;
  }else document.getElementById("head").textContent="waiting for the run's records...";
  const ok=rounds.filter(r=>!r.void);
  const runLoss=d.samples.filter(s=>s.eval_loss!=null).map(s=>[s.round,s.eval_loss]);
  const series=[{name:"train (this peer)",points:ok.filter(r=>r.train_loss!=null).map(r=>[r.round,r.train_loss])},
    {name:"held-out (this peer)",points:ok.filter(r=>r.eval_loss!=null).map(r=>[r.round,r.eval_loss])},
    {name:"held-out (run)",points:runLoss}];
  lines("loss",series);
  document.getElementById("loss-legend").innerHTML=series.filter(s=>s.points.length).map((s,i)=>`<span style="color:${COLORS[series.indexOf(s)]}">&#9632; ${s.name}</span>`).join("");
  bars("speed",run?run.peers.map(p=>[p.peer_id.slice(-6),p.tokens_per_s]):[]);
  lines("peers",[{points:d.samples.map(s=>[s.t,s.peers])}],v=>new Date(v*1000).toLocaleTimeString(),
        [0,Math.max(1,...d.samples.map(s=>s.peers))]);
  bars("bytes",rounds.slice(-40).map(r=>[r.round,(r.bytes_sent||0)/1e6,r.void?"#d62728":COLORS[0]]));
  lines("util",[{points:ok.filter(r=>r.utilization!=null).map(r=>[r.round,r.utilization])}],null,[0,1]);
  bars("reach",run?Object.entries(run.reachability):[]);
  const t=document.getElementById("table");
  t.innerHTML="<tr><th>peer</th><th>round</th><th>state</th><th>tokens/s</th><th>train</th><th>held-out</th><th>seen</th><th>reach</th></tr>"+
    (run?run.peers.map(p=>`<tr class="${p.state_hash===run.state_hash?"":"off"}"><td>${p.peer_id.slice(-16)}</td><td>${p.round}</td><td>${p.state_hash.slice(0,12)}</td><td>${fmt(p.tokens_per_s)}</td><td>${p.train_loss==null?"-":p.train_loss.toFixed(3)}</td><td>${p.eval_loss==null?"-":p.eval_loss.toFixed(3)}</td><td>${Math.round(p.last_seen_s)}s</td><td>${p.reachability}</td></tr>`).join(""):"");
  document.body.dataset.rounds=String(Math.max(rounds.length,new Set(d.samples.map(s=>s.round)).size));
}
async function tick(){try{const r=await fetch("/api/status",{cache:"no-store"});draw(await r.json());}catch(e){document.getElementById("head").textContent="dashboard unreachable: "+e;}}
tick();setInterval(tick,2000);
</script></body></html>
"""
