"""The protocol as it is today, at many peers, in the simulator (peer/sim/): forks, discarded work, costs.

Usage (from the repository root)::

    python -m bench.swarm [--quick] [--json] [--seed S] [--rounds R]       # the table
    python -m bench.swarm --peers N [--target T] [--jitter S] [--slow F]   # one configuration
    python -m bench.swarm --search --budget SECONDS [--seed S] [--workers N] [--json]    # the attack search
    python -m bench.swarm --replay SEED                                    # one schedule of the search, told
    python -m bench.swarm --slow-member [--numel N] [--rounds R] [--piece-values V]   # one member at 1/5 of the uplink

Every row is one simulated run (peer/sim/swarm.py): N real peers (averager, matchmaking, ready board,
heartbeats, dial-back, state serving and sync, fork choice, the round loop) on one virtual clock,
each on its own /24 with 100 Mbit/s up and down (``--slow`` of them at 20 Mbit/s), 20 ms one-way
latency, H = 4 inner steps of a 4096-value quadratic at ~1 s each (+-10% per peer). Readiness
jitter ``J`` adds U(J/3, J) seconds to each peer's inner steps each round (0: everyone ready together).
The rows: N in {8, 16, 32, 72, 128, 256, 1000} x target group size {4, 8} x jitter {0, 3 s} x slow
fraction {0, 0.2}, as far as the wall-clock budget of a 2-core machine allows: the default table runs
every combination up to 32 peers and fewer above (``--full`` runs them all: hours). The keys are
peer/sim/measure.py ``row``'s: states_per_round (distinct honest states per round, mean),
lineages (alive at the end), single_state_fraction (peer-rounds applied to the main lineage / all),
discarded_fraction (completed, then thrown away), bytes per peer-round (data: parts, results, state
pieces; control: everything else, the DHT included), DHT reads per peer-round, the hottest DHT node's
bytes served per round, hot_ready_holder_bytes (the busiest holder of one round's ready records, in the
worst round after the first: round 0's base has no population yet, so its records share one key),
heartbeat bytes per peer-round (what fork choice and the keeper read) and the busiest heartbeat
holder's bytes per round, matchmaking seconds, all-reduce seconds over the bound of the bytes sent at the uplink rate,
utilization, wall and virtual seconds and the run's trace_hash (same seed, same hash).

``--slow-member`` runs one group of 8 (100 Mbit/s, one member at 20 Mbit/s up and down, 8M values
unless ``--numel``) twice in the same seed: with equal shares (the roles before uplink claims) and
with shares by claimed uplink (peer/averaging/rates.py: the slow member only sends); it prints the
all-reduce time over the bandwidth-weighted bound (peer/sim/measure.py ``bandwidth_bound``) of
each, per round after the first (the first has no measured rates yet), and their ratio.
``--piece-values``: the run spec's ``piece_values`` (default the spec's, 2^21: at 8M values and 8
members that is one piece per member, so nothing is pipelined within a member's share).

``--search`` runs random attack schedules (peer/sim/search.py) until the budget is spent and
prints each broken invariant with the seed that reproduces it (``--workers N``: N processes at
once, rows in seed order); ``--replay SEED`` reruns one and
prints its event trace, shortened. ``--json``: one JSON object on the last line, ``{"results": [rows]}``
for the table, ``{"schedules": n, "violations": [...]}`` for the search.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

from hivetrain.dht import clock
from hivetrain.peer.sim.measure import bandwidth_bound, row
from hivetrain.peer.sim.swarm import Scenario, Swarm, simulate

PEERS = (8, 16, 32, 72, 128, 256, 1000)
TARGETS = (4, 8)
JITTERS = (0.0, 3.0)
SLOW = (0.0, 0.2)
COLUMNS = ("peers", "target", "jitter_s", "slow_fraction", "rounds", "states_per_round", "lineages",
           "single_state_fraction", "discarded_fraction", "void_fraction", "data_bytes_per_peer_round",
           "control_bytes_per_peer_round", "dht_reads_per_peer_round", "hot_holder_bytes_per_round", "hot_ready_holder_bytes",
           "heartbeat_bytes_per_peer_round", "hot_heartbeat_holder_bytes_per_round", "matchmaking_s", "allreduce_over_bound", "allreduce_over_bw_bound", "utilization", "wall_s",
           "virtual_s")


def configurations(quick: bool, full: bool, rounds: int) -> list[tuple[int, int, float, float, int]]:
    """(peers, target, jitter, slow fraction, rounds) of the table."""
    if quick:
        return [(8, 4, 0.0, 0.0, 3), (16, 4, 3.0, 0.2, 3)]
    out = []
    for n in PEERS:
        for target in TARGETS:
            for jitter in JITTERS:
                for slow in SLOW:
                    if full or n <= 32 or (n <= 128 and slow == 0.0) or (n == 256 and slow == 0.0 and jitter > 0):
                        out.append((n, target, jitter, slow, rounds if n <= 128 else max(1, rounds // 2)))
    return [c for c in out if full or c[0] < 1000]


def format_row(r: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3g}"
        return str(v)
    return " | ".join(cell(r.get(k)) for k in COLUMNS)


class Progress:
    """Says on stderr, at most every ``every`` wall seconds, how far a long simulated run is."""

    def __init__(self, every: float = 30.0):
        self.every, self.t0, self.last = every, time.perf_counter(), time.perf_counter()

    def __call__(self, swarm: Swarm) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        rounds = sum(1 for _, rec in swarm.records if rec.get("event") == "round")
        total = swarm.scenario.peers * swarm.scenario.rounds
        print(f"  [{now - self.t0:5.0f} s] {swarm.scenario.peers} peers: virtual {clock.now():.0f} s, "
              f"{rounds} of {total} peer-rounds recorded", file=sys.stderr, flush=True)


def run_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.peers:
        configs = [(args.peers, args.target, args.jitter, args.slow, args.rounds or 4)]
    else:
        configs = configurations(args.quick, args.full, args.rounds or 4)
    print("| " + " | ".join(COLUMNS) + " |", flush=True)
    print("|" + "---|" * len(COLUMNS), flush=True)
    rows = []
    for n, target, jitter, slow, rounds in configs:
        expected = (("expected_peers", n),) if args.expected else ()
        result = simulate(Scenario(peers=n, target=target, jitter_s=jitter, slow_fraction=slow, rounds=rounds,
                                   seed=args.seed, numel=args.numel, spec=expected), progress=Progress())
        r = row(result)
        rows.append(r)
        print(f"| {format_row(r)} |" + (" (stalled)" if r["stalled"] else ""), flush=True)
    return rows


def run_slow_member(args: argparse.Namespace) -> list[dict[str, Any]]:
    numel = args.numel if args.numel != 4096 else 8_000_000
    rounds = args.rounds or 4
    print("| shares | rounds | allreduce_s (median) | bound_s | over_bound | slow member's shards | wall_s |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for equal in (True, False):
        sc = Scenario(peers=8, target=8, slow_fraction=1 / 8, mbit=100.0, slow_mbit=20.0, numel=numel,
                      rounds=rounds, seed=args.seed, equal_shares=equal,
                      spec=(("piece_values", args.piece_values),) if args.piece_values else ())
        result = simulate(sc, progress=Progress())
        slow = min(result.peers, key=lambda p: result.net.rates.get(p.id, 0.0)).index
        later = [(i, rec) for i, rec in result.records if rec.get("event") == "round" and rec["round"] >= 1
                 and not rec.get("void")]
        times = [rec["allreduce_s"] for _, rec in later if rec.get("allreduce_s")]
        ups = [result.net.rates[p.id] for p in result.peers]
        bound = bandwidth_bound(ups, [result.net.down[p.id] for p in result.peers],
                                sc.run_spec().codec().encoded_nbytes(numel), sc.run_spec().audit)
        shards = [rec.get("shards_reduced") for i, rec in later if i == slow]
        median = statistics.median(times) if times else float("nan")
        r = {"shares": "equal" if equal else "by uplink", "rounds": rounds, "allreduce_s": round(median, 3),
             "bound_s": round(bound, 3), "over_bound": round(median / bound, 3) if bound else None,
             "slow_shards": shards, "wall_s": round(result.wall_s, 1), "trace_hash": result.trace_hash}
        rows.append(r)
        print(f"| {r['shares']} | {rounds} | {r['allreduce_s']} | {r['bound_s']} | {r['over_bound']} | {shards} "
              f"| {r['wall_s']} |", flush=True)
    print(f"by uplink / equal: {rows[1]['allreduce_s'] / rows[0]['allreduce_s']:.3f} of the all-reduce time")
    return rows


def run_search(args: argparse.Namespace) -> dict[str, Any]:
    from hivetrain.peer.sim.search import search

    def progress(r: dict[str, Any]) -> None:
        print(f"seed {r['seed']}: {r['peers']} peers, {r['attackers']} attackers on {r['prefixes']} /24s, "
              f"{'+'.join(r['attacks'])}{', churn' if r['churn'] else ''}: "
              f"{','.join(r['violations']) or 'held'} (states/round {r['I2_states_per_round']}, "
              f"completed {r['I4_completed_fraction']:.2f}, at deadline {r['I6_completed_at_deadline']}, "
              f"{r['wall_s']:.1f} s)", flush=True)

    n, violations, rows = search(args.budget, args.seed, progress, workers=args.workers)
    stories = {r["seed"]: r["story"] for r in rows if "story" in r}
    print(f"{n} schedules, {len(violations)} violations", flush=True)
    for v in violations:
        print(f"  {v.invariant} seed {v.seed} [{v.attack}]: {v.summary}   (python -m bench.swarm --replay {v.seed})")
        for line in stories.pop(v.seed, []):  # the run's faults and its last events, once per seed
            print(f"      {line}")
    return {"schedules": n, "violations": [v.as_dict() for v in violations]}


def run_replay(seed: int) -> dict[str, Any]:
    from hivetrain.peer.sim.search import run_one, story

    sc, result, found, measured = run_one(seed)
    print(f"seed {seed}: {sc.peers} peers (target {sc.target}, jitter {sc.jitter_s}), attackers {list(sc.dishonest)} "
          f"on {sc.attacker_prefixes} /24s, attacks {list(sc.attacks)}, events {list(sc.events)}")
    print(f"trace_hash {result.trace_hash}  ({len(result.trace)} events, {result.virtual_s:.1f} virtual s)")
    for line in story(result):
        print("  " + line)
    for v in found:
        print(f"{v.invariant}: {v.summary}")
    print(f"measured: {measured}; {'no invariant broken' if not found else f'{len(found)} broken'}")
    return {"seed": seed, "trace_hash": result.trace_hash, "violations": [v.as_dict() for v in found], **measured}


CALIBRATION_NUMEL = 25_960_960  # bench.utilization's model (the medium preset)
# bench.utilization --links 100mbit,20mbit --modes sync --no-anchor --rounds 3 (2026-12-03, docs/BENCHMARKS.md):
# per peer, the median all-reduce seconds of the real processes (--real-json FILE to compare with a new run)
REAL = {"100mbit:p0": {"allreduce_s": 5.90}, "100mbit:p1": {"allreduce_s": 5.82}, "100mbit:p2": {"allreduce_s": 5.82},
        "20mbit:p0": {"allreduce_s": 22.10}, "20mbit:p1": {"allreduce_s": 22.10}, "20mbit:p2": {"allreduce_s": 22.08}}


def run_calibration(args: argparse.Namespace) -> list[dict[str, Any]]:
    """bench.utilization's three peers (26.0M values, H = 8, a group of exactly 3, one /24) in the simulator:
    per link variant, the per-peer median all-reduce seconds against the bytes/rate bound, with CPU work
    free (``cpu_scale`` 0) and charged at its wall time x ``--cpu-scale`` (three peers on two cores)."""
    real = dict(REAL)
    if args.real_json:
        for r in json.loads(open(args.real_json).read().strip().splitlines()[-1])["results"]:
            if r.get("mode") == "sync" and r.get("allreduce_s"):
                real[f"{r['link']}:{r['peer']}"] = {"allreduce_s": r["allreduce_s"]}
    rows = []
    for link, slow in (("100mbit", 0.0), ("20mbit", 1 / 3)):
        for scale in sorted({0.0, args.cpu_scale}):
            sc = Scenario(peers=3, rounds=args.rounds or 4, target=3, seed=args.seed, numel=CALIBRATION_NUMEL,
                          sync_every=8, step_s=1.3, latency_s=0.0005, slow_fraction=slow, cpu_scale=scale,
                          down_mbit=10_000.0,  # bench.utilization caps uploads only (tc tbf on each namespace's egress)
                          spec=(("min_group_size", 3), ("max_per_prefix", 0), ("allreduce_timeout", 120.0),
                                ("matchmaking_timeout", 10.0)))
            result = simulate(sc)
            fastest_first = sorted(result.peers, key=lambda p: (-result.net.rates[p.id], p.index))
            for name, peer in zip(("p0", "p1", "p2"), fastest_first, strict=True):  # as bench.utilization: p2 slow
                recs = [rec for i, rec in result.records if i == peer.index and rec.get("event") == "round"
                        and not rec.get("void") and rec["round"] >= 1]
                rate = result.net.rates[peer.id]
                ar = [rec["allreduce_s"] for rec in recs]
                bound = [rec["bytes_sent"] / rate for rec in recs]
                ref = real.get(f"{link}:{name}")
                row_ = {"link": link, "peer": name, "upload_mbit": round(rate / 125_000), "cpu_scale": scale,
                        "rounds": len(recs), "allreduce_s": round(statistics.median(ar), 3) if ar else None,
                        "bound_s": round(statistics.median(bound), 3) if bound else None,
                        "real_allreduce_s": ref["allreduce_s"] if ref else None,
                        "wall_s": round(result.wall_s, 1)}
                if row_["allreduce_s"] and row_["real_allreduce_s"]:
                    row_["sim_over_real"] = round(row_["allreduce_s"] / row_["real_allreduce_s"], 3)
                rows.append(row_)
                print(" | ".join(f"{k} {v}" for k, v in row_.items()), flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small rows (CI)")
    ap.add_argument("--full", action="store_true", help="every combination, 1000 peers included (hours)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--seed", type=int, default=0,
                    help="first seed (--search: from 1000000 on, the large family: 24-40 peers, target 2, "
                         "buckets; from 2000000 on, the slow family: slow members, relayed audit copies)")
    ap.add_argument("--peers", type=int, default=0, help="run one configuration with this many peers")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per run (default 4; half above 128 peers)")
    ap.add_argument("--target", type=int, default=4, help="target group size (with --peers)")
    ap.add_argument("--jitter", type=float, default=0.0, help="readiness jitter in seconds (with --peers)")
    ap.add_argument("--slow", type=float, default=0.0, help="fraction of peers at 20 Mbit/s (with --peers)")
    ap.add_argument("--numel", type=int, default=4096,
                    help="values in the run's vector (default 4096: the links idle; 1M and up: bandwidth shows)")
    ap.add_argument("--expected", action="store_true",
                    help="the run spec expects its N peers (expected_peers): round 0 starts in ready buckets")
    ap.add_argument("--search", action="store_true", help="random attack schedules with invariants")
    ap.add_argument("--budget", type=float, default=60.0, help="wall seconds for --search (default 60)")
    ap.add_argument("--workers", type=int, default=1,
                    help="--search: schedules run in this many processes at once (default 1; the seeds run are "
                         "one range whatever the number)")
    ap.add_argument("--calibrate", action="store_true", help="bench.utilization's three peers, simulated")
    ap.add_argument("--cpu-scale", type=float, default=0.0,
                    help="--calibrate: a second run whose CPU work costs its wall time x this (0: none)")
    ap.add_argument("--real-json", default=None, help="--calibrate: bench.utilization --json output to compare with")
    ap.add_argument("--slow-member", action="store_true",
                    help="one group, one member at 1/5 of the uplink: equal shares against shares by uplink")
    ap.add_argument("--piece-values", type=int, default=0,
                    help="--slow-member: the run spec's piece_values (default: the spec's own)")
    ap.add_argument("--replay", type=int, default=None, metavar="SEED", help="rerun one schedule of the search")
    args = ap.parse_args(argv)
    if args.peers < 0 or args.rounds < 0 or args.numel < 1024 or args.budget <= 0 or args.target < 2 or not 0 <= args.slow <= 1 \
            or args.jitter < 0 or not (args.piece_values == 0 or 1024 <= args.piece_values <= 1 << 30) \
            or not 1 <= args.workers <= 256:
        ap.error("--peers/--rounds must be >= 0, --numel >= 1024, --target >= 2, --budget > 0, --slow in [0, 1], "
                 "--jitter >= 0, --piece-values in [1024, 2^30], --workers in [1, 256]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # thousands of simulated peers share this process's loggers: their lines (bans, void shards) are in
    # each peer's own log (SimPeer.log, shown by --replay), not on stderr
    logger = logging.getLogger("hivetrain")
    level = logger.level
    logger.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        if args.replay is not None:
            out: dict[str, Any] = run_replay(args.replay)
        elif args.calibrate:
            out = {"results": run_calibration(args)}
        elif args.slow_member:
            out = {"results": run_slow_member(args)}
        elif args.search:
            out = run_search(args)
        else:
            out = {"results": run_table(args)}
    finally:
        logger.setLevel(level)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
