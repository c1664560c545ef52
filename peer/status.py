"""``peer status``: a read-only look at a run, from the records its peers publish in the DHT.

What it reads, all signed and bound to their signers (dht/records.py): the owner's run spec, every
peer's heartbeat (round, state hash, tokens/s, losses, reachability) and the ready records of the
current round (who is forming a group). It publishes nothing: it holds no state, sends no ready
record and no heartbeat, so no peer can count it as a member, a voter or a candidate.

The run's round is the median of the peers' rounds, and its state the one most of the peers at
that round hold: a few identities claiming round 10**9 move neither (they show in the table, each
with its own claim). Peers that hold the same state completed their last round together, or synced
to it: the state column is the run's groups, as the heartbeats tell them. ``last_seen_s`` is how long
ago the peer published its latest heartbeat, from the record's expiration (every honest peer uses
``heartbeat_ttl``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from hivetrain.dht.errors import DHTError, InvalidRecord
from hivetrain.dht.identity import Identity
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.dht.records import MAX_READY_LEVEL, decode_bound, heartbeat_bucket, heartbeat_key, ready_key
from hivetrain.peer import join
from hivetrain.peer.averaging.ready import level
from hivetrain.peer.config import RunSpec
from hivetrain.peer.dashboard import REFRESH, Dashboard, RunWatcher
from hivetrain.peer.errors import PeerError
from hivetrain.peer.runspec import fetch_spec
from hivetrain.peer.state.heartbeats import heartbeat_level, heartbeat_ttl

TREND = 32  # held-out losses remembered across refreshes (--watch)
MAX_ROWS = 40  # peers printed in the table (the JSON has them all: a DHT read holds at most 1024)
CLEAR = "\x1b[H\x1b[J"  # cursor home, clear to the end: --watch refreshes in place on a terminal


@dataclass(frozen=True)
class PeerRow:
    peer_id: str
    round: int
    state_hash: str
    tokens_per_s: float
    reachability: str
    last_seen_s: float
    train_loss: float | None
    eval_loss: float | None
    addrs: tuple[str, ...] = ()  # where to dial it, as it says (without /p2p/<id>: peer/join.py adds it)
    tokens: int | None = None  # tokens it trained since its process started, as it says (None: not said)
    rounds_completed: int | None = None  # ... and rounds it completed


def read_peers(dht: DHT, run_key: str, spec: RunSpec, now: float | None = None) -> list[PeerRow]:
    """The run's heartbeats, one row per peer (those that break the schema, speak for another peer
    or sit outside their bucket are skipped), most advanced first. A run whose spec expects many
    peers has 2^L heartbeat keys (peer/state/heartbeats.py): all are read."""
    now = time.time() if now is None else now
    ttl = heartbeat_ttl(spec)
    rows: dict[str, PeerRow] = {}
    level = heartbeat_level(spec)
    for bucket, envelope in ((b, e) for b in range(1 << level) for e in dht.get(heartbeat_key(run_key, level, b))):
        try:
            hb = decode_bound("hb", envelope)
        except InvalidRecord:
            continue
        if heartbeat_bucket(hb["peer_id"], level) != bucket:
            continue
        seen = min(ttl, max(0.0, ttl - (envelope.expiration - now)))
        row = PeerRow(hb["peer_id"], hb["round"], hb["state_hash"], hb["throughput"], hb.get("reach", "unknown"),
                      round(seen, 1), hb["train_loss"], hb["eval_loss"], tuple(hb.get("addrs", ())),
                      hb.get("tokens"), hb.get("rounds"))
        if row.peer_id not in rows or row.round > rows[row.peer_id].round:
            rows[row.peer_id] = row
    return sorted(rows.values(), key=lambda r: (-r.round, r.last_seen_s, r.peer_id))


def read_matching(dht: DHT, run_key: str, round_: int, peers: int = 0, target: int = 4) -> dict[str, int]:
    """Who is forming round ``round_``'s groups: ready (done) and announced (still computing).
    A large run spreads a round over 2^L buckets (peer/averaging/ready.py), L from its state's
    population, which a reader does not know: it tries the levels nearest the one ``peers``
    heartbeats would give, and counts the first whose bucket 0 holds records (and level 0, one key,
    which may also hold a joiner's announcement)."""
    counts = {"ready": 0, "announced": 0}
    envelopes = list(dht.get(ready_key(run_key, round_)))
    guess = level(peers, target)  # (0: a run this small has one key)
    for lvl in [x for x in (guess, guess - 1, guess + 1, guess - 2) if 1 <= x <= MAX_READY_LEVEL] if guess else []:
        first = list(dht.get(ready_key(run_key, round_, lvl, 0)))
        if first:
            envelopes += first + [e for b in range(1, 1 << lvl) for e in dht.get(ready_key(run_key, round_, lvl, b))]
            break
    for envelope in envelopes:
        try:
            ready = decode_bound("ready", envelope)
        except InvalidRecord:
            continue
        counts["ready" if ready["done"] else "announced"] += 1
    return counts


def summarize(run_key: str, spec: RunSpec, peers: list[PeerRow], matching: dict[str, int] | None = None,
              observer: str = "") -> dict[str, Any]:
    """The status object (``--json``): the run, its round and state, the peers, and the sums."""
    rounds = sorted(p.round for p in peers)
    round_ = rounds[(len(rounds) - 1) // 2] if rounds else 0  # the lower median: a few liars move it nowhere
    at_round = Counter(p.state_hash for p in peers if p.round == round_)
    state = min(at_round, key=lambda h: (-at_round[h], h)) if at_round else None
    states = Counter((p.round, p.state_hash) for p in peers)
    said = sum(p.tokens for p in peers if p.tokens is not None)
    evals = [p.eval_loss for p in peers if p.state_hash == state and p.eval_loss is not None]
    model = f"{spec.model.n_layers} layers x {spec.model.d_model}"
    if spec.hf_config:
        model = f"{spec.pretrained or 'Hugging Face model'} ({model})"
    return {
        "run": run_key,
        "observer": observer,
        "spec": {"name": spec.name, "model": model, "dataset": spec.dataset, "sync_every": spec.sync_every,
                 "batch_size": spec.batch_size, "seq_len": spec.seq_len, "compression": spec.compression,
                 "aggregation": spec.aggregation, "overlap": spec.overlap,
                 "target_group_size": spec.target_group_size,
                 "tokens_per_round_per_peer": spec.sync_every * spec.batch_size * spec.seq_len},
        "round": round_,
        "state_hash": state,
        "agreement": at_round[state] / len(peers) if state else 0.0,  # peers holding the run's state, of all
        "states": [{"round": r, "state_hash": h, "peers": n}
                   for (r, h), n in sorted(states.items(), key=lambda kv: (-kv[0][0], -kv[1], kv[0][1]))],
        # each peer's tokens since its process started, as its heartbeat says, and its share of those
        "peers": [{**vars(p), "share": p.tokens / said if said and p.tokens is not None else None} for p in peers],
        "tokens": said,
        "tokens_per_s": sum(p.tokens_per_s for p in peers if math.isfinite(p.tokens_per_s)),
        "eval_loss": sum(evals) / len(evals) if evals else None,
        "reachability": dict(sorted(Counter(p.reachability for p in peers).items())),
        "matching": matching or {"ready": 0, "announced": 0},
    }


def render(status: dict[str, Any], trend: list[tuple[int, float]] | None = None) -> str:
    """The status as text for a terminal."""
    spec, peers, trend = status["spec"], status["peers"], trend or []
    lines = [f"run {status['run']}: {spec['model']}, {spec['dataset']}, H={spec['sync_every']}, "
             f"{spec['compression']}, groups of up to {spec['target_group_size']}"]
    state = (status["state_hash"] or "-")[:12]
    lines.append(f"round {status['round']}: {len(peers)} peers, {status['agreement']:.0%} hold state {state}; "
                 f"{status['tokens_per_s']:,.0f} tokens/s in all; forming round {status['round']}: "
                 f"{status['matching']['ready']} ready, {status['matching']['announced']} still computing")
    reach = ", ".join(f"{n} {mode.replace('_', '-')}" for mode, n in status["reachability"].items())
    loss = "-" if status["eval_loss"] is None else f"{status['eval_loss']:.4f}"
    lines.append(f"held-out loss {loss}" + (f" (by round: {', '.join(f'{r}: {v:.3f}' for r, v in trend[-8:])})"
                                             if len(trend) > 1 else "") + (f"; reachability: {reach}" if reach else ""))
    lines.append("")
    lines.append(f"{'peer':<16} {'round':>6} {'state':<12} {'tokens/s':>10} {'tokens':>8} {'train':>7} "
                 f"{'held-out':>8} {'seen':>6}  reach")
    for p in peers[:MAX_ROWS]:
        mark = "" if p["state_hash"] == status["state_hash"] else " *"
        lines.append(f"{p['peer_id'][-16:]:<16} {p['round']:>6} {p['state_hash'][:12]:<12} {p['tokens_per_s']:>10,.0f} "
                     f"{_count(p.get('tokens')):>8} {_num(p['train_loss'], 7)} {_num(p['eval_loss'], 8)} "
                     f"{p['last_seen_s']:>5.0f}s  "
                     f"{p['reachability'].replace('_', '-')}{mark}")
    if len(peers) > MAX_ROWS:
        lines.append(f"... and {len(peers) - MAX_ROWS} more (--json lists them all)")
    if any(p["state_hash"] != status["state_hash"] for p in peers):
        lines.append("* another state than the run's: a round behind or ahead, syncing, or on another lineage")
    if status.get("join"):
        lines.append(f"join with: peer start --join {status['join']}")
    return "\n".join(lines)


def _count(value: int | None) -> str:
    """A count in a few characters: 950, 12.3k, 4.56M, 7.89G; '-' when not said."""
    if value is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return str(value)


def _num(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.4f}"


def watch(read: Callable[[], dict[str, Any]], as_json: bool, interval: float, count: int,
          out: TextIO = sys.stdout, sleep: Callable[[float], None] = time.sleep) -> int:
    """Prints the status ``count`` times (0: until interrupted), every ``interval`` seconds: in place
    on a terminal, one block (or one JSON line) after another otherwise. Returns how many it printed."""
    trend: deque[tuple[int, float]] = deque(maxlen=TREND)
    tty = out.isatty()
    done = 0
    while True:
        try:
            status = read()
        except (DHTError, PeerError) as e:  # a slow DHT read: say so and look again
            if count == 1:
                raise
            status = None
            print(f"could not read the run's records ({e}); trying again", file=out, flush=True)
        if status is not None:
            if status["eval_loss"] is not None and (not trend or trend[-1][0] != status["round"]):
                trend.append((status["round"], status["eval_loss"]))
            if as_json:
                print(json.dumps({**status, "trend": list(trend)}), file=out, flush=True)
            else:
                print((CLEAR if tty and count != 1 else "") + render(status, list(trend)), file=out, flush=True)
                if not tty and count != 1:
                    print("", file=out, flush=True)
            done += 1
        if count and done >= count:
            return done
        sleep(interval)


def run_status(run_key: str, initial_peers: tuple[str, ...], as_json: bool, interval: float, count: int,
               dht_timeout: float, dashboard: tuple[str, int] | None = None, public: bool = False) -> int:
    """``peer status``: joins the DHT with a fresh identity (it is nobody), reads, prints; with
    ``dashboard`` (host, port), also serves the dashboard (peer/dashboard.py) while it runs. The
    flags were checked before (peer/flags.py ``check_status``)."""
    dht = DHT(DHTOptions(initial_peers=initial_peers, identity=Identity.generate(), timeout=dht_timeout)).start()
    try:
        spec, _ = fetch_spec(dht, run_key, dht_timeout)

        board = None
        if dashboard is not None:
            watcher = RunWatcher(lambda: read_status(dht, run_key, spec), interval=min(interval, REFRESH))
            board = Dashboard(dashboard, watcher, public=public).start()
            print(f"dashboard at {board.url} (Ctrl+C stops)", flush=True)
        try:
            watch(lambda: read_status(dht, run_key, spec), as_json, interval, count)
        finally:
            if board is not None:
                board.stop()
        return 0
    finally:
        dht.shutdown()


def read_status(dht: DHT, run_key: str, spec: RunSpec) -> dict[str, Any]:
    """The run's status from its records in the DHT, as ``summarize`` makes it."""
    peers = read_peers(dht, run_key, spec)
    status = summarize(run_key, spec, peers, observer=dht.peer_id)
    status["join"] = join.fresh(run_key, peers, status["state_hash"])
    status["matching"] = read_matching(dht, run_key, status["round"], len(status["peers"]), spec.target_group_size)
    return status
