"""What a simulated run shows: one row of numbers from its honest peers' round records and counters.

Lineage is read off the records: a completed or void round turns its base state into the state it
records (its parent is the base); a sync moves a peer to a state someone else made. The *main
lineage* is the chain of states behind the final state most honest peers hold; a peer-round whose
state is on it was kept, one whose state is not was thrown away (its peer later synced to the
main lineage, or still sits on another one: a fork).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from typing import Any

from hivetrain.peer.sim.swarm import Result

DATA_KINDS = ("part", "relay", "result", "state_req")  # requests whose bodies are the vector or the state


def lineage(result: Result) -> dict[str, str]:
    """state hash -> the state it was computed from (as honest peers' round records tell it)."""
    parent: dict[str, str] = {}
    for _, rec in result.records:
        if rec.get("event") == "round" and rec.get("base_hash") and rec.get("state_hash"):
            parent.setdefault(rec["state_hash"], rec["base_hash"])
    return parent


def ancestors(state: str, parent: dict[str, str]) -> set[str]:
    """``state`` and every state it descends from."""
    out = {state}
    while state in parent and parent[state] not in out:
        state = parent[state]
        out.add(state)
    return out


def final_states(result: Result) -> dict[int, str]:
    """Each honest peer's last state (after its last round or sync)."""
    honest = {p.index for p in result.honest()}
    last: dict[int, str] = {}
    for index, rec in result.records:
        if index in honest and rec.get("event") in ("start", "round", "sync") and rec.get("state_hash"):
            last[index] = rec["state_hash"]
    return last


def tips(states: Iterable[str], parent: dict[str, str]) -> set[str]:
    """The states of ``states`` that no other of them descends from (one per lineage alive)."""
    states = set(states)
    behind: set[str] = set()
    for s in states:
        behind |= ancestors(s, parent) - {s}
    return states - behind


def _traffic(result: Result) -> tuple[Counter[str], int, int, int, int]:
    """Requester-side bytes by request type (each exchange counted once, both directions), the
    honest peers' DHT reads and bytes (reads and writes), and the requests they sent."""
    by_kind: Counter[str] = Counter()
    reads = dht_bytes = requests = 0
    for peer in result.honest():
        for incarnation in peer.incarnations:
            by_kind.update(incarnation.averager.ctx.traffic.by_kind)
            by_kind.update(incarnation.sync.traffic.by_kind)
            requests += sum(incarnation.averager.ctx.traffic.requests.values())
            requests += sum(incarnation.sync.traffic.requests.values())
        costs = result.dht.costs.get(peer.id)
        if costs is not None:
            reads += costs.reads
            dht_bytes += costs.read_bytes + costs.write_bytes
    return by_kind, reads, dht_bytes, len(result.honest()), requests


def bandwidth_bound(ups: list[float], downs: list[float], nbytes: int, audit: bool) -> float:
    """The least seconds a group's all-reduce can take over its members' links (bytes/s up and
    down), each member reducing a share s_i of the vector (sum 1, any split): it uploads its parts
    of the others' shards (to reducer and auditor) and its shards' results to the n - 1 others,
    and downloads the parts of the shards it reduces and audits and the others' results. Members
    that reduce nothing (the z slowest uplinks, any z that leaves two reducers) send their parts
    once, to the reducers, which relay them to the auditors (protocol 8): a reducer also uploads z
    parts of its share. Found by bisection on the time, the least over z; the split is continuous,
    so no real assignment does better."""
    n, a = len(ups), (2 if audit and len(ups) > 2 else 1)
    if n < 2:
        return 0.0
    b = float(nbytes)
    down = (b, a * b * (n - 1) - b)  # bytes = c0 + c1 * s
    by_up = sorted(range(n), key=lambda i: ups[i])

    def share_range(up: tuple[float, float], cap_up: float, cap_down: float) -> tuple[float, float] | None:
        lo, hi = 0.0, 1.0
        for (c0, c1), cap in ((up, cap_up), (down, cap_down)):
            if c1 > 0:
                hi = min(hi, (cap - c0) / c1)
            elif c1 < 0:
                lo = max(lo, (cap - c0) / c1)
            elif c0 > cap:
                return None
        return (lo, hi) if lo <= hi else None

    def feasible(t: float, z: int) -> bool:
        senders = set(by_up[:z])
        if any(t * ups[i] < b or t * downs[i] < b for i in senders):  # its parts once; the results
            return False
        up = (a * b, b * (n - 1) - a * b + z * b)  # (+ the senders' parts of our share, relayed)
        ranges = [share_range(up, t * ups[i], t * downs[i]) for i in range(n) if i not in senders]
        if any(r is None for r in ranges):
            return False
        return sum(r[0] for r in ranges if r) <= 1.0 <= sum(r[1] for r in ranges if r)

    def least(z: int) -> float:
        lo, hi = 0.0, 4 * b * n / min(min(ups), min(downs))
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if feasible(mid, z) else (mid, hi)
        return hi

    return min(least(z) for z in range(0, (n - 2 if a == 2 else 0) + 1))


def over_bandwidth_bound(result: Result) -> float | None:
    """The median, over completed group-rounds, of the group's all-reduce time (its median
    member's) over ``bandwidth_bound`` for its members' links."""
    sc, net = result.scenario, result.net
    spec = sc.run_spec()
    nbytes = spec.codec().encoded_nbytes(sc.numel)
    ids = {p.id for p in result.honest()}
    groups: dict[tuple[int, tuple[str, ...]], list[float]] = {}
    for _, rec in result.records:
        if rec.get("event") == "round" and not rec.get("void") and rec.get("allreduce_s") and rec.get("group"):
            members = tuple(rec["group"])
            if len(members) > 1 and set(members) <= ids:
                groups.setdefault((rec["round"], members), []).append(rec["allreduce_s"])
    ratios = []
    for (_, members), times in groups.items():
        ups = [net.rates.get(p, 0.0) for p in members]
        downs = [net.down.get(p, 0.0) for p in members]
        if min(ups) > 0 and min(downs) > 0:
            bound = bandwidth_bound(ups, downs, nbytes, spec.audit)
            if bound > 0:
                ratios.append(statistics.median(times) / bound)
    return round(statistics.median(ratios), 3) if ratios else None


def row(result: Result) -> dict[str, Any]:
    """The bench.swarm row of one run (keys as the issue names them, then a few more)."""
    sc = result.scenario
    honest = {p.index for p in result.honest()}
    rounds = [rec for i, rec in result.records if i in honest and rec.get("event") == "round"]
    syncs = [rec for i, rec in result.records if i in honest and rec.get("event") == "sync"]
    parent = lineage(result)
    finals = final_states(result)
    alive = tips(finals.values(), parent)
    held = Counter(finals.values())
    main = max(alive, key=lambda s: (sum(n for f, n in held.items() if s in ancestors(f, parent)), s)) \
        if alive else ""
    kept = ancestors(main, parent) if main else set()
    per_round: dict[int, set[str]] = {}
    for rec in rounds:
        per_round.setdefault(rec["round"], set()).add(rec["state_hash"])
    completed = [rec for rec in rounds if not rec.get("void")]
    on_main = sum(rec["state_hash"] in kept for rec in completed)
    peer_rounds = max(1, len(rounds))
    by_kind, reads, dht_bytes, n_honest, requests = _traffic(result)
    per = max(1, n_honest * sc.rounds)
    data = sum(by_kind[k] for k in DATA_KINDS)
    control = sum(by_kind.values()) - data + dht_bytes
    rates = {p.index: result.net.rates.get(p.id, 0.0) for p in result.peers}
    over = [rec["allreduce_s"] / (rec["bytes_sent"] / rates[i]) for i, rec in result.records
            if i in honest and rec.get("event") == "round" and not rec.get("void") and rec.get("allreduce_s")
            and rec.get("bytes_sent") and rates.get(i)]
    mm = [rec["matchmaking_s"] for rec in completed if rec.get("matchmaking_s") is not None]
    util = [rec["utilization"] for rec in rounds if rec.get("utilization") is not None]
    return {
        "peers": sc.peers, "target": sc.target, "jitter_s": sc.jitter_s, "slow_fraction": sc.slow_fraction,
        "rounds": sc.rounds,
        "states_per_round": round(statistics.mean(len(v) for v in per_round.values()), 3) if per_round else 0.0,
        "lineages": len(alive),
        "single_state_fraction": round(on_main / peer_rounds, 4),
        "discarded_fraction": round((len(completed) - on_main) / peer_rounds, 4),
        "data_bytes_per_peer_round": round(data / per),
        "control_bytes_per_peer_round": round(control / per),
        "dht_reads_per_peer_round": round(reads / per, 2),
        "hot_holder_bytes_per_round": round(max(result.dht.served.values(), default=0) / max(1, sc.rounds)),
        # the busiest holder of one round's ready records, in the worst round after the first (the first
        # has one key: its base has no population yet; peer/averaging/ready.py)
        "hot_ready_holder_bytes": max((max(c.values()) for r, c in result.dht.served_ready.items() if r > 0),
                                      default=0),
        # heartbeats: what fork choice and the keeper read of them (peer/state/heartbeats.py), and the
        # busiest holder of heartbeat keys
        "heartbeat_bytes_per_peer_round": round(result.dht.heartbeat_read_bytes / per),
        "hot_heartbeat_holder_bytes_per_round": round(max(result.dht.served_heartbeats.values(), default=0)
                                                      / max(1, sc.rounds)),
        "matchmaking_s": round(statistics.mean(mm), 3) if mm else None,
        "allreduce_over_bound": round(statistics.median(over), 3) if over else None,
        "allreduce_over_bw_bound": over_bandwidth_bound(result),
        "utilization": round(statistics.mean(util), 4) if util else None,
        "wall_s": round(result.wall_s, 2), "virtual_s": round(result.virtual_s, 2),
        "trace_hash": result.trace_hash,
        "void_fraction": round(sum(bool(rec.get("void")) for rec in rounds) / peer_rounds, 4),
        "syncs_per_round": round(len(syncs) / max(1, sc.rounds), 2),
        "requests_per_peer_round": round(requests / per, 1),  # what a peer-round costs the simulator
        "seed": sc.seed, "stalled": result.stalled,
    }
