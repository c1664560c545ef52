"""How much of a peer's wall time goes into inner steps, synchronous against overlapped rounds, on capped links.

Usage (from the repository root; needs root for ``ip netns`` and ``tc``)::

    python -m bench.utilization [--quick] [--json] [--links 100mbit,20mbit] [--modes sync,overlap]
                                [--rounds 5] [--warmup 1] [--sync-every 8] [--no-anchor] [--workdir DIR]

Three real ``peer start`` processes (``--threads 1`` each, on however many cores there are), each in its own
network namespace whose upload is capped with ``tc tbf`` (bench/netns.py). Link variants: ``100mbit`` (every
peer at 100 Mbit/s) and ``20mbit`` (p2 at 20 Mbit/s, the others at 100). For each variant, first the anchor:
the same all-reduce through hivemind's DecentralizedAverager (fp16, bench/hivemind_anchor.py) over a tensor
of the model's size on the same links; then one run per mode: ``sync`` (``--overlap none``: the inner steps
wait for the round's all-reduce) and ``overlap`` (``--overlap delayed``: the round's all-reduce runs during
the next round's inner steps).

The model is the ``medium`` preset (26M parameters) with a small batch (4 x 64 tokens), so that on a
2-core machine H = 8 inner steps (~1.6 s each with three peers on the cores) take about as long as one
synchronous all-reduce of the model at 100 Mbit/s (int8 with audits: ~2 bytes per parameter per member,
4.2 s at the bound, ~12 s measured). The run spec is otherwise the default (robust aggregation, audits),
with a group of exactly 3 (``--min-group-size 3``), ``--max-per-prefix 0`` (all peers share one /24) and
no held-out evaluation (``--eval-batches 0``). The peers are stopped once each has written the rounds
needed: ``--warmup`` skipped (one more in overlap mode, whose first round overlaps nothing), then
``--rounds`` measured; ``--until-round`` is one more, so the measured rounds are never the last.

Per peer, medians over the measured rounds (bench/utilization_rows.py): utilization = time in inner steps /
wall time, matchmaking seconds, all-reduce seconds, bound = bytes the peer sent x 8 / its upload rate,
and the anchor's all-reduce seconds at that peer (only steps that averaged the whole tensor count).
``--json``: one JSON object on the last line, its ``results`` one row per (mode, link, peer). Without
``--overlap`` in ``peer start --help`` the overlap rows are reported as not measured, with the reason.
``--quick``: the 100mbit link only, 3 measured rounds, 2 timed anchor steps (about 5 minutes).

Every process started here is killed (its process group, and the parent-death signal if the bench is
SIGKILLed) and every namespace removed, on errors, Ctrl+C and SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.netns import Netns, parse_rate
from bench.peers import Proc, anchor_cmd, follow_rounds, overlap_supported, peer_cmd, wait_info
from bench.utilization_rows import MODES, PeerRun, format_table, median, missing_row, peer_row

N_PEERS = 3
LINKS = {"100mbit": ("100mbit", "100mbit", "100mbit"), "20mbit": ("100mbit", "100mbit", "20mbit")}
OVERLAP_FLAG = {"sync": "none", "overlap": "delayed"}
START_TIMEOUT = 90.0  # seconds for a peer to come up (DHT, corpus, model)


def skipped(mode: str, warmup: int) -> int:
    """Round records skipped before measuring: the warm-up, and in overlap mode one more (round 0's
    all-reduce overlaps nothing; the round after it is the first in the steady state)."""
    return warmup + (1 if mode == "overlap" else 0)


def _say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:6.0f} s] {text}", flush=True)


def run_mode(mode: str, link: str, args: argparse.Namespace, net: Netns, workdir: Path, t0: float,
             overlap_flag: bool) -> list[PeerRun]:
    """Trains one run of 3 peers in ``mode`` on the current links; returns each peer's round records."""
    want = skipped(mode, args.warmup) + args.rounds
    name = f"util-{mode}-{link}"
    procs: list[Proc] = []
    try:
        extra = ["--overlap", OVERLAP_FLAG[mode]] if overlap_flag else []
        owner = Proc(f"{name}-p0", workdir, net.prefix(0),
                     peer_cmd(args, workdir, f"{name}-p0", net.addrs[0], want + 1,
                              ["--new-run", name, *args.spec_flags, *extra]))
        procs.append(owner)
        info = wait_info(owner, workdir / f"{name}-p0.json", time.monotonic() + START_TIMEOUT)
        for i in range(1, N_PEERS):
            procs.append(Proc(f"{name}-p{i}", workdir, net.prefix(i),
                              peer_cmd(args, workdir, f"{name}-p{i}", net.addrs[i], want + 1,
                                       ["--run", info["run_key"], "--initial-peers", info["maddrs"][0]])))
        _say(t0, f"{mode} {link}: 3 peers started (run {info['run_key'][:24]}...), waiting for {want} rounds")

        def progress(counts: list[int], last: dict[str, Any]) -> None:
            _say(t0, f"{mode} {link}: rounds {'/'.join(map(str, counts))} of {want} (p0: compute "
                     f"{last.get('compute_s', 0):.1f} s, matchmaking {last.get('matchmaking_s') or 0:.1f} s, "
                     f"all-reduce {last.get('allreduce_s') or 0:.1f} s{', VOID' if last.get('void') else ''})")

        budget = args.round_budget * (want + 1) + START_TIMEOUT
        records = follow_rounds(procs, want, time.monotonic() + budget, progress)
    finally:
        for p in reversed(procs):
            p.stop()
    return [PeerRun(mode, link, f"p{i}", parse_rate(net.rates[i] or "0"), records[i]) for i in range(N_PEERS)]


def run_anchor(link: str, args: argparse.Namespace, net: Netns, workdir: Path, t0: float) -> dict[str, Any]:
    """hivemind's all-reduce on the current links; returns {peer: median seconds} and the raw steps."""
    procs: list[Proc] = []
    try:
        info_file = workdir / f"anchor-{link}-p0.json"
        procs.append(Proc(f"anchor-{link}-p0", workdir, net.prefix(0),
                          anchor_cmd(args, 0, net.addrs[0], ["--info-file", str(info_file)])))
        info = wait_info(procs[0], info_file, time.monotonic() + START_TIMEOUT)
        for i in range(1, N_PEERS):
            procs.append(Proc(f"anchor-{link}-p{i}", workdir, net.prefix(i),
                              anchor_cmd(args, i, net.addrs[i], ["--initial-peers", info["maddrs"][0]])))
        _say(t0, f"hivemind {link}: 3 averagers started, {args.anchor_warmup} + {args.anchor_steps} steps")
        budget = START_TIMEOUT + (args.anchor_warmup + args.anchor_steps) * args.round_budget
        deadline = time.monotonic() + budget
        for p in procs:
            try:
                p.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{p.name} did not finish within {budget:.0f} s:\n{p.tail()}") from None
            if p.proc.returncode != 0:
                raise RuntimeError(f"{p.name} failed (rc {p.proc.returncode}):\n{p.tail()}")
        steps = {f"p{i}": [json.loads(line[6:]) for line in p.tail(10**7).splitlines() if line.startswith("BENCH ")]
                 for i, p in enumerate(procs)}
    finally:
        for p in reversed(procs):
            p.stop()
    timed = {peer: [s for s in ss if not s["warmup"] and s["averaged"]] for peer, ss in steps.items()}
    wrong = {peer: sum(not s["averaged"] for s in ss) for peer, ss in steps.items()}
    seconds = {peer: median([s["allreduce_s"] for s in ss]) for peer, ss in timed.items()}
    sent = {peer: median([s["bytes_sent"] for s in ss]) for peer, ss in timed.items()}
    _say(t0, f"hivemind {link}: all-reduce " + ", ".join(f"{p} {_f(s)} s" for p, s in seconds.items())
         + (f"; steps NOT averaged (left out): {wrong}" if any(wrong.values()) else ""))
    return {"seconds": seconds, "bytes_sent": sent, "not_averaged": wrong, "steps": steps}


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


class _Interrupted(BaseException):
    pass


def _on_signal(signum: int, frame: Any) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100mbit only, 3 measured rounds, 2 anchor steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--links", default=None, help=f"link variants, of {','.join(LINKS)} (default all)")
    ap.add_argument("--modes", default=",".join(MODES), help="sync,overlap (default both)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per run (5; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds skipped first (1; overlap mode skips one more)")
    ap.add_argument("--preset", default="medium", help="model preset (default medium, 26M parameters)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--sync-every", type=int, default=8, help="H: inner steps per round (default 8)")
    ap.add_argument("--round-budget", type=float, default=90.0, help="seconds one round may take before giving up")
    ap.add_argument("--anchor-steps", type=int, default=None, help="timed hivemind steps (3; 2 with --quick)")
    ap.add_argument("--no-anchor", action="store_true", help="skip the hivemind all-reduce")
    ap.add_argument("--workdir", default=None, help="keep the peers' logs and metrics here (default: a temp dir)")
    args = ap.parse_args(argv)
    args.links = [s for s in (args.links or ("100mbit" if args.quick else ",".join(LINKS))).split(",") if s]
    args.modes = [s for s in args.modes.split(",") if s]
    if bad := [s for s in args.links if s not in LINKS] + [m for m in args.modes if m not in MODES]:
        ap.error(f"unknown link or mode: {bad}")
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.anchor_steps = args.anchor_steps or (2 if args.quick else 3)
    args.anchor_warmup = 1
    if args.warmup < 1 or args.rounds < 1:
        ap.error("--warmup and --rounds must be >= 1 (the first round has no previous one to time it from)")
    args.spec_flags = ["--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                       "--sync-every", str(args.sync_every), "--target-group-size", str(N_PEERS),
                       "--min-group-size", str(N_PEERS), "--max-per-prefix", "0",  # all peers share one /24
                       "--matchmaking-timeout", "30", "--allreduce-timeout", "150"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if stale := Netns.remove_stale():
            print(f"removed namespaces left by a killed earlier run: {' '.join(stale)}", flush=True)
    if (why := Netns.available()) is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    overlap_flag, overlap_why = overlap_supported()
    import torch

    from hivetrain.peer.config import PRESETS
    from hivetrain.peer.train.model import Llama, count_parameters

    with torch.device("meta"):
        args.numel = count_parameters(Llama(PRESETS[args.preset].model))
    _say(t0, f"{args.preset}: {args.numel / 1e6:.1f}M parameters, H = {args.sync_every}, batch {args.batch_size} x "
             f"{args.seq_len}; {args.warmup} warm-up + {args.rounds} measured rounds; links {args.links}; "
             f"modes {args.modes}" + ("" if overlap_flag else f" (overlap: {overlap_why})"))
    rows: list[dict[str, Any]] = []
    anchors: dict[str, Any] = {}
    errors: dict[str, str] = {}
    notes: list[str] = []
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    net = Netns(N_PEERS)
    try:
        with contextlib.ExitStack() as stack:
            workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-utilization-")))
            workdir.mkdir(parents=True, exist_ok=True)
            net.up()
            for link in args.links:
                for i, rate in enumerate(LINKS[link]):
                    net.shape(i, rate)
                anchor: dict[str, float | None] = {}
                if not args.no_anchor:
                    try:
                        anchors[link] = run_anchor(link, args, net, workdir, t0)
                        anchor = anchors[link]["seconds"]
                        if any(anchors[link]["not_averaged"].values()):
                            notes.append(f"hivemind {link}: steps that hivemind returned without averaging all "
                                         f"of the tensor (left out of its timing): {anchors[link]['not_averaged']}")
                    except RuntimeError as e:
                        errors[f"hivemind {link}"] = str(e)
                        _say(t0, f"hivemind {link} failed: {str(e)[:2000]}")
                for mode in args.modes:
                    rates = [parse_rate(r) for r in LINKS[link]]
                    if mode == "overlap" and not overlap_flag:
                        rows += [missing_row(mode, link, f"p{i}", rates[i], overlap_why, anchor.get(f"p{i}"))
                                 for i in range(N_PEERS)]
                        continue
                    try:
                        runs = run_mode(mode, link, args, net, workdir, t0, overlap_flag)
                    except RuntimeError as e:
                        errors[f"{mode} {link}"] = str(e)
                        _say(t0, f"{mode} {link} failed: {str(e)[:2000]}")
                        rows += [missing_row(mode, link, f"p{i}", rates[i], "failed: " + str(e).splitlines()[0],
                                             anchor.get(f"p{i}")) for i in range(N_PEERS)]
                        continue
                    rows += [peer_row(run, skipped(mode, args.warmup), anchor.get(run.peer)) for run in runs]
    except (KeyboardInterrupt, _Interrupted) as e:
        print(f"interrupted ({type(e).__name__} {e}); all peers and namespaces were removed", file=sys.stderr)
        return 130
    finally:  # a second Ctrl+C must not cut the clean-up short
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            net.down()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            for s, h in old.items():
                signal.signal(s, h)
    print()
    print(format_table(rows))
    print(f"\nutil = inner-step seconds / wall seconds; mm = matchmaking; ar = all-reduce alone; bound = MB sent x 8 / "
          f"the peer's upload rate; ratio = ar / bound; hivemind = DecentralizedAverager fp16 all-reduce of "
          f"{args.numel / 1e6:.1f}M values on the same links; medians over {args.rounds} rounds after "
          f"{args.warmup} warm-up; {os.cpu_count()} CPUs; total {time.monotonic() - t0:.0f} s")
    if any(r["legacy_metrics"] for r in rows):
        print("note: some peers wrote the old round record (no round_s): round time from the records' arrival, "
              "all-reduce = allreduce_s - matchmaking_s (outer step included)")
    for note in notes:
        print(note)
    for what, why in errors.items():
        print(f"{what}: {why.splitlines()[0]}")
    if args.json:
        print(json.dumps({"preset": args.preset, "numel": args.numel, "sync_every": args.sync_every,
                          "batch_size": args.batch_size, "seq_len": args.seq_len, "rounds": args.rounds,
                          "warmup": args.warmup, "links": {k: list(LINKS[k]) for k in args.links},
                          "cpus": os.cpu_count(), "results": rows,
                          "hivemind": {k: {"seconds": v["seconds"], "bytes_sent": v["bytes_sent"],
                                           "not_averaged": v["not_averaged"]}
                                       for k, v in anchors.items()},
                          "overlap_missing": None if overlap_flag else overlap_why, "notes": notes,
                          "errors": errors}))
    return 0 if not errors and rows and all(r["missing"] is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
