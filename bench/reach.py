"""Whether peers behind NAT contribute every round, and what outbound-only membership costs.

Usage (from the repository root; needs root for ``ip netns``, ``nft`` and ``tc``)::

    python -m bench.reach [--json] [--rounds 6] [--preset small] [--rate 100mbit]
                          [--topologies direct,home,symmetric] [--workdir DIR]

Real ``peer start`` processes (``--threads 1``), each in its own network namespace (bench/natnet.py):
one public owner and two more peers per topology, no port forwarding anywhere.

- ``direct``: the two others are public too (the baseline: everyone reduces and audits).
- ``home``: each of the two behind its own endpoint-independent masquerade router that drops
  unsolicited inbound traffic, like a home router (all but the owner behind NAT).
- ``symmetric``: one behind a home router, one behind a symmetric NAT (a random source port per
  destination).

Every uplink (a public host's, a router's) is capped with ``tc tbf`` at ``--rate``. The run is
``--preset`` with H = 4, a group of 3 (``--min-group-size 1``: a peer that cannot join trains
alone and shows as such), no held-out evaluation. Round 0 (start-up) is not measured.

Per peer: the mode it reported (its log's reachability line: ``direct`` / ``outbound_only``; no
relays and no hole punching are used, so never ``relayed`` or ``hole_punched``), the fraction of
measured rounds in which it completed in one group with every peer of the run, the median
all-reduce seconds, and the bound: per round, the most bytes any member of the run sent x 8 /
``--rate`` (nobody's upload is faster), median over rounds. ``relay_bytes`` is 0: nothing is relayed.
``--json``: one JSON object on the last line, its ``results`` one row per (topology, peer) with keys
``topology, peer, behind_nat, mode, rounds_in_group_fraction, allreduce_s, bound_s, relay_bytes``.

Every process started here is killed and every namespace removed, on errors and Ctrl+C too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.natnet import NatNet
from bench.netns import parse_rate
from bench.peers import Proc, follow_rounds, wait_info

TOPOLOGIES = {"direct": (None, None), "home": (False, False), "symmetric": (False, True)}  # per joiner: NAT?
START_TIMEOUT = 120.0
MODES = {"reachable directly": "direct", "behind NAT": "outbound_only", "not known yet": "unknown"}


def _cmd(workdir: Path, name: str, host: str, args: argparse.Namespace, run: list[str]) -> list[str]:
    return [sys.executable, "-m", "hivetrain.peer.cli", "start", "--threads", "1",
            "--metrics-file", str(workdir / f"{name}.jsonl"), "--info-file", str(workdir / f"{name}.json"),
            "--state-dir", str(workdir / f"{name}-state"), "--host-maddrs", f"/ip4/{host}/tcp/0",
            "--until-round", str(args.rounds + 1), "--wait-for-peers", "3", "--wait-timeout", "120",
            "--eval-batches", "0", *run]


def mode_of(log: str) -> str:
    """The last reachability line a peer printed, as a mode."""
    found = "unknown"
    for line in log.splitlines():
        if line.startswith("reachability: "):
            found = next((m for text, m in MODES.items() if text in line), found)
    return found


def run_topology(name: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    net = NatNet()
    procs: list[Proc] = []
    try:
        own_ns = net.public("owner")
        net.shape(own_ns, args.rate)
        own_ip = net.ip_of(own_ns)
        spec = ["--new-run", f"reach-{name}", "--preset", args.preset, "--sync-every", "4",
                "--target-group-size", "3", "--min-group-size", "1", "--max-per-prefix", "0",
                "--matchmaking-timeout", "6", "--allreduce-timeout", "30"]
        procs.append(Proc("owner", workdir, net.exec_prefix(own_ns), _cmd(workdir, "owner", own_ip, args, spec)))
        info = wait_info(procs[0], workdir / "owner.json", time.monotonic() + START_TIMEOUT)
        maddr = next(m for m in info["maddrs"] if m.startswith(f"/ip4/{own_ip}/"))
        behind = {"owner": False}
        for i, symmetric in enumerate(TOPOLOGIES[name]):
            peer = f"p{i}"
            if symmetric is None:
                ns, host = net.public(peer), ""
                net.shape(ns, args.rate)
                host = net.ip_of(ns)
            else:
                router = net.router(f"r{i}", symmetric=symmetric)
                net.shape(router, args.rate)
                ns, host = net.behind(router, peer), "0.0.0.0"
            behind[peer] = symmetric is not None
            procs.append(Proc(peer, workdir, net.exec_prefix(ns),
                              _cmd(workdir, peer, host, args, ["--run", info["run_key"], "--initial-peers", maddr])))
        t0 = time.monotonic()

        def progress(counts: list[int], last: dict[str, Any]) -> None:
            print(f"[{name} {time.monotonic() - t0:5.0f}s] rounds per peer {counts}", file=sys.stderr, flush=True)

        records = follow_rounds(procs, args.rounds + 1, time.monotonic() + args.rounds * 90 + START_TIMEOUT, progress)
        return rows(name, procs, records, behind, parse_rate(args.rate) / 8)
    finally:
        for p in procs:
            p.stop()
        net.down()


def rows(topology: str, procs: list[Proc], records: list[list[dict[str, Any]]], behind: dict[str, bool],
         rate_bytes: float) -> list[dict[str, Any]]:
    ids = {p.name: json.loads((p.metrics.parent / f"{p.name}.json").read_text())["peer_id"]
           if (p.metrics.parent / f"{p.name}.json").exists() else "" for p in procs}
    everyone = set(ids.values())
    by_round: dict[int, list[dict[str, Any]]] = {}
    for recs in records:
        for r in recs:
            if r["round"] >= 1:
                by_round.setdefault(r["round"], []).append(r)
    bounds = {rnd: max(r["bytes_sent"] for r in rs) / rate_bytes for rnd, rs in by_round.items()}
    out = []
    for p, recs in zip(procs, records, strict=True):
        measured = [r for r in recs if r["round"] >= 1]
        together = [r for r in measured if not r["void"] and set(r["group"]) == everyone]
        times = [r["allreduce_s"] for r in together]
        out.append({"topology": topology, "peer": p.name, "behind_nat": behind[p.name], "mode": mode_of(p.tail(10**6)),
                    "rounds_in_group_fraction": len(together) / len(measured) if measured else 0.0,
                    "allreduce_s": statistics.median(times) if times else None,
                    "bound_s": statistics.median(bounds[r["round"]] for r in measured) if measured else None,
                    "relay_bytes": 0})
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| topology | peer | behind NAT | mode | rounds in full group | all-reduce s | bound s | ratio | relay bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, b = r["allreduce_s"], r["bound_s"]
        ratio = f"{a / b:.2f}" if a and b else "-"
        lines.append(f"| {r['topology']} | {r['peer']} | {'yes' if r['behind_nat'] else 'no'} | {r['mode']} | "
                     f"{r['rounds_in_group_fraction']:.0%} | {a if a is None else f'{a:.2f}'} | "
                     f"{b if b is None else f'{b:.2f}'} | {ratio} | {r['relay_bytes']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.reach", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per topology (default 6)")
    ap.add_argument("--preset", default="small", help="model preset (default small: 3.3M parameters)")
    ap.add_argument("--rate", default="100mbit", help="upload cap of every host and router (default 100mbit)")
    ap.add_argument("--topologies", default="direct,home,symmetric", help="comma-separated (default all three)")
    ap.add_argument("--workdir", help="keep logs and metrics here (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = ap.parse_args(argv)
    unknown = [t for t in args.topologies.split(",") if t not in TOPOLOGIES]
    if unknown:
        ap.error(f"unknown topology {unknown[0]!r}; choose from {', '.join(TOPOLOGIES)}")
    if not re.fullmatch(r"\d+(\.\d+)?([kmg]?bit)", args.rate):
        ap.error(f"--rate {args.rate!r}: use tc units such as 100mbit")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = NatNet.available()
    if reason:
        print(f"bench.reach: cannot run here: {reason}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for name in args.topologies.split(","):
            sub = workdir / name
            sub.mkdir(parents=True, exist_ok=True)
            try:
                results += run_topology(name, args, sub)
            except RuntimeError as e:
                print(f"bench.reach: topology {name} failed: {e}", file=sys.stderr)
                return 1
    print(table(results))
    if args.json:
        print(json.dumps({"bench": "reach", "rate": args.rate, "preset": args.preset, "rounds": args.rounds,
                          "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
