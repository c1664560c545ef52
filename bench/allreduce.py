"""The audited all-reduce alone, on capped uplinks: pipelined pieces against whole shards, and the bound.

Usage (from the repository root)::

    python -m bench.allreduce [--json] [--quick] [--numel 25M] [--peers 3] [--mbit 100] [--rounds 5]

In one process, ``--peers`` real averagers (matchmaking, the audited all-reduce, the agreement after
it: peer/averaging/) run over in-process links whose uplinks are capped at ``--mbit`` (each peer's
streams share its cap, first come first served, like a tbf-shaped link; peer/net/memory.py). Every
round averages a fresh seeded pseudo-gradient of ``--numel`` fp32 values; the variants alternate
round by round, so a change of background load hits all alike:

* ``pieces``: the run's default (``piece_values`` 2^21): every member's shard is cut into pieces
  that stream, reduce, audit and return one after another;
* ``whole``: one piece per member (``piece_values`` 2^30), the protocol before pipelining: all parts
  cross, then the reduce, then the results, then the audit;
* ``floor``: pieces, plain mean, no audit: what the link and the codec alone cost.

Per variant we report medians over ``--rounds`` (after one warm-up round each) of the all-reduce
seconds (``allreduce_s``: after matchmaking, to the agreement), the bound (the most bytes one peer
wrote in the round, all messages and headers included, at the capped rate), their ratio, and the
process CPU seconds per peer per round. All peers share this machine's cores, as the peers of
``bench.utilization`` do; the real-process, real-libp2p numbers are that bench's.

``--json`` prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from bench.codec import parse_counts
from hivetrain.peer.averaging.api import AverageResult
from hivetrain.peer.averaging.simulation import LocalSwarm
from hivetrain.peer.config import RunSpec

VARIANTS: dict[str, dict[str, Any]] = {
    "pieces": {},
    "whole": {"piece_values": 1 << 30},
    "floor": {"aggregation": "mean", "audit": False},
}
BASE = "cd" * 32


def spec_for(variant: str, peers: int, timeout: float) -> RunSpec:
    return RunSpec(name=f"bench-{variant}", target_group_size=peers, matchmaking_timeout=5.0,
                   allreduce_timeout=timeout, **VARIANTS[variant])


def deltas(peers: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g) * 0.01
    return [common + torch.randn(numel, generator=g) * 0.003 for _ in range(peers)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rate = args.mbit * 1e6 / 8  # bytes/s
    timeout = max(60.0, 20 * args.numel * 3 / rate)
    swarms = {v: LocalSwarm(spec_for(v, args.peers, timeout), args.numel, args.peers) for v in args.variants}
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    try:
        for swarm in swarms.values():
            for peer in swarm.peers:
                swarm.net.rates[peer.ctx.me] = rate
        for r in range(args.rounds + 1):
            d = deltas(args.peers, args.numel, seed=r)
            for v, swarm in swarms.items():
                cpu0 = time.process_time()
                out = swarm.all_reduce(r, BASE, d)
                cpu = time.process_time() - cpu0
                done = [x for x in out if isinstance(x, AverageResult)]
                if len(done) != args.peers or len({x.applied for x in done}) != 1:
                    raise SystemExit(f"bench.allreduce: round {r} of {v} did not complete alike: {out}")
                wall = statistics.median(x.stats["allreduce_s"] for x in done)
                bound = max(x.bytes_sent for x in done) / rate
                row = {"allreduce_s": wall, "bound_s": bound, "ratio": wall / bound, "cpu_s": cpu / args.peers,
                       "sent_mb": max(x.bytes_sent for x in done) / 1e6}
                if r > 0:  # the first round of each warms up
                    samples[v].append(row)
                print(f"round {r} {v:6s} all-reduce {wall:6.2f} s  bound {bound:5.2f} s  ratio {wall / bound:4.2f}  "
                      f"cpu/peer {cpu / args.peers:5.2f} s{'  (warm-up)' if r == 0 else ''}", file=sys.stderr,
                      flush=True)
    finally:
        for swarm in swarms.values():
            swarm.close()
    rows = []
    for v, rs in samples.items():
        rows.append({"variant": v, **{k: statistics.median(x[k] for x in rs) for k in rs[0]}})
    base = {r["variant"]: r for r in rows}
    if "pieces" in base and "whole" in base:
        base["pieces"]["speedup_vs_whole"] = base["whole"]["allreduce_s"] / base["pieces"]["allreduce_s"]
    return {"numel": args.numel, "peers": args.peers, "mbit": args.mbit, "rounds": args.rounds,
            "threads": args.threads, "results": rows}


def table(out: dict[str, Any]) -> str:
    lines = [f"all-reduce of {out['numel'] / 1e6:g}M fp32 values, {out['peers']} peers, uplinks capped at "
             f"{out['mbit']:g} Mbit/s, medians of {out['rounds']} rounds",
             "| variant | all-reduce s | bound s | ratio | MB sent / peer | CPU s / peer |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in out["results"]:
        lines.append(f"| {r['variant']} | {r['allreduce_s']:.2f} | {r['bound_s']:.2f} | {r['ratio']:.2f} | "
                     f"{r['sent_mb']:.1f} | {r['cpu_s']:.2f} |")
    pieces = next((r for r in out["results"] if "speedup_vs_whole" in r), None)
    if pieces is not None:
        lines.append(f"pieces vs whole: {pieces['speedup_vs_whole']:.2f}x faster")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--quick", action="store_true", help="4M values, 3 rounds: about a minute")
    ap.add_argument("--numel", default=None, help="fp32 values averaged (default 25M; --quick: 4M)")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--mbit", type=float, default=100.0, help="uplink cap of every peer, Mbit/s")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per variant (default 5; --quick: 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the process's, shared by its peers)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    try:
        args.numel = parse_counts(args.numel or ("4M" if args.quick else "25M"))[0]
    except ValueError as e:
        ap.error(str(e))
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.peers < 2 or args.peers > 16 or args.rounds < 1 or args.mbit <= 0 or args.numel < 1:
        ap.error("need 2-16 peers, at least 1 round, a positive --mbit and --numel")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    print(table(out))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
