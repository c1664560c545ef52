"""``peer demo``: N real peer processes on 127.0.0.1 train the tiny preset together.

The demo is a thin supervisor: it starts peer 0 with ``--new-run``, the others with ``--run`` and
peer 0's address, follows their metrics files to show progress, and summarises them at the end.
Every child runs in its own process group and is killed with it, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from hivetrain.peer.errors import ConfigError, PeerError


def _peer_cmd(i: int, workdir: str, args: argparse.Namespace, join: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "hivetrain.peer.cli", "start", "--quiet", "--threads", "1",
           "--until-round", str(args.rounds), "--metrics-file", os.path.join(workdir, f"peer{i}.jsonl"),
           "--state-dir", os.path.join(workdir, f"state{i}"), "--wait-for-peers", str(args.peers),
           "--eval-batches", str(args.eval_batches), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if join is None:
        cmd += ["--new-run", "demo", "--preset", args.preset,
                "--target-group-size", str(getattr(args, "target_group_size", None) or args.peers),
                "--info-file", os.path.join(workdir, "peer0.json")]
        for flag, value in (("--sync-every", args.sync_every), ("--batch-size", args.batch_size),
                            ("--aggregation", args.aggregation), ("--overlap", args.overlap),
                            ("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum),
                            ("--inner-warmup", args.inner_warmup)):
            if value is not None:
                cmd += [flag, str(value)]
    else:
        cmd += ["--join", join]
    return cmd


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


class Swarm:
    def __init__(self, workdir: str):
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, i: int, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.workdir, f"peer{i}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def log_tail(self, i: int, lines: int = 5) -> str:
        with open(os.path.join(self.workdir, f"peer{i}.log"), errors="replace") as f:
            return "".join(f.readlines()[-lines:])


def _wait_info(swarm: Swarm, path: str, deadline: float) -> dict[str, Any]:
    proc = swarm.procs[0]
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise PeerError(f"peer 0 exited with code {proc.returncode}:\n{swarm.log_tail(0)}")
        if time.monotonic() > deadline:
            raise PeerError("peer 0 did not come up in time")
        try:
            proc.wait(0.2)  # wakes early if the peer dies
        except subprocess.TimeoutExpired:
            pass
    with open(path) as f:
        info: dict[str, Any] = json.load(f)
    return info


def summarize(workdir: str, n_peers: int) -> dict[str, Any]:
    records = [_read_jsonl(os.path.join(workdir, f"peer{i}.jsonl")) for i in range(n_peers)]
    starts = [next((r for r in recs if r["event"] == "start"), None) for recs in records]
    rounds = [[r for r in recs if r["event"] == "round"] for recs in records]
    hashes: dict[str, list[str]] = {}
    for peer_rounds in rounds:
        for r in peer_rounds:
            hashes.setdefault(str(r["round"]), []).append(r["state_hash"])
    completed = min((sum(not r["void"] for r in pr) for pr in rounds), default=0)
    finals = [pr[-1]["eval_loss"] for pr in rounds if pr and pr[-1]["eval_loss"] is not None]
    numel = starts[0]["numel"] if starts[0] else 0
    sent = {f"peer{i}": sum(r["bytes_sent"] for r in pr) for i, pr in enumerate(rounds)}
    from hivetrain.peer.train.loop import ring_allreduce_bytes

    ddp = sum(r["inner_steps"] * ring_allreduce_bytes(numel, r["group_size"]) for r in rounds[0] if not r["void"])
    return {
        "peers": n_peers,
        "rounds_completed": completed,
        "initial_eval_loss": starts[0]["eval_loss"] if starts[0] else None,
        "final_eval_loss": max(finals) if finals else None,
        "bytes_sent_per_peer": sent,
        "ddp_equivalent_bytes": ddp,
        "state_hashes": hashes,
        "identical_hashes": all(len(set(v)) == 1 and len(v) == n_peers for v in hashes.values()),
        "void_rounds": sum(r["void"] for pr in rounds for r in pr),
        "parameters": numel,
        "seconds_per_round": statistics.median(r["round_s"] for r in rounds[0]) if rounds[0] else None,
        # time in inner steps / wall time of peer 0, the first round (start-up) and a drain left out
        "utilization": (sum(r["compute_s"] for r in rounds[0][1:] if not r["drain"])
                        / max(1e-9, sum(r["round_s"] for r in rounds[0][1:] if not r["drain"]))
                        if len(rounds[0]) > 1 else None),
    }


def run_demo(args: argparse.Namespace) -> int:
    if not 1 <= args.peers <= 16:
        raise ConfigError("--peers must be between 1 and 16 on one machine")
    if not 1 <= args.rounds <= 10_000:
        raise ConfigError("--rounds must be between 1 and 10000")
    target = getattr(args, "target_group_size", None)
    if target is not None and not 1 <= target <= 64:
        raise ConfigError("--target-group-size must be between 1 and 64")
    made = not args.dir  # a folder of our own: removed when the demo succeeds (kept, and named, if not)
    workdir = args.dir or tempfile.mkdtemp(prefix="hivetrain-demo-")
    os.makedirs(workdir, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    groups = f" in groups of {target}" if target and target < args.peers else ""
    say(f"demo: {args.peers} peers x {args.rounds} rounds of the {args.preset!r} preset on 127.0.0.1{groups} "
        f"(logs in {workdir}{', removed if it succeeds' if made else ''})")
    deadline = time.monotonic() + args.timeout
    swarm = Swarm(workdir)
    try:
        swarm.spawn(0, _peer_cmd(0, workdir, args, None))
        info = _wait_info(swarm, os.path.join(workdir, "peer0.json"), deadline)
        say(f"run key {info['run_key']}; the others join with {info['join']}")
        for i in range(1, args.peers):
            swarm.spawn(i, _peer_cmd(i, workdir, args, info["join"]))
        shown: set[tuple[int, int]] = set()
        while any(p.poll() is None for p in swarm.procs):
            if time.monotonic() > deadline:
                raise PeerError(f"the demo did not finish within {args.timeout:.0f} s")
            for i in range(args.peers):
                for r in _read_jsonl(os.path.join(workdir, f"peer{i}.jsonl")):
                    if r["event"] == "round" and (i, r["round"]) not in shown:
                        shown.add((i, r["round"]))
                        status = f"VOID ({r['why']})" if r["void"] else f"group {r['group_size']}"
                        eval_loss = "n/a" if r["eval_loss"] is None else f"{r['eval_loss']:.3f}"
                        say(f"peer{i} round {r['round']}: {r['inner_steps']} inner steps, train {r['train_loss']:.3f}, "
                            f"held-out {eval_loss}, {status}, sent {r['bytes_sent'] / 1e6:.2f} MB, "
                            f"state {r['state_hash'][:12]}")
            try:
                swarm.procs[0].wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        failed = [i for i, p in enumerate(swarm.procs) if p.returncode != 0]
        if failed:
            raise PeerError(f"peer{failed[0]} exited with code {swarm.procs[failed[0]].returncode}:\n"
                            f"{swarm.log_tail(failed[0])}")
    finally:
        swarm.stop()
    summary = summarize(workdir, args.peers)
    sent = summary["bytes_sent_per_peer"]
    mean_sent = sum(sent.values()) / max(1, len(sent))
    say(f"\nrounds completed: {summary['rounds_completed']} of {args.rounds}")
    say(f"held-out loss: {summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}")
    say(f"bytes sent per peer: {mean_sent / 1e6:.2f} MB; fp32 data-parallel would have sent "
        f"{summary['ddp_equivalent_bytes'] / 1e6:.1f} MB ({summary['ddp_equivalent_bytes'] / max(mean_sent, 1):.0f}x more)")
    say(f"identical state hashes in every round: {'yes' if summary['identical_hashes'] else 'NO'}")
    if summary["utilization"] is not None:
        say(f"peer0: {summary['seconds_per_round']:.1f} s per round, {summary['utilization']:.0%} of it in inner steps "
            "(first round left out)")
    if args.json:
        print(json.dumps(summary), flush=True)
    ok = summary["rounds_completed"] == args.rounds and summary["identical_hashes"]
    if made and ok:
        shutil.rmtree(workdir, ignore_errors=True)
    elif made:
        say(f"logs kept in {workdir}")
    return 0 if ok else 1
