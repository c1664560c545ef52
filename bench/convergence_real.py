"""Does the simulation flatter the real system? The int8 DiLoCo variant through real peers, several times.

    python -m bench.convergence_real --results DIR/results.json [--H 25] [--peers 4] [--steps 400] [--runs 3]

runs ``peer demo`` (real peer processes on 127.0.0.1, libp2p, the network averager) ``--runs`` times
with the settings of ``bench.convergence`` (tiny preset, batch 4 x 128 per peer, the same held-out
windows) and the aggregation the simulation used (``config.json`` next to ``results.json``; the run
spec's default, robust, unless it says otherwise), and compares the real runs' final held-out loss
(mean, std, range) with the simulated ``diloco_int8_H<H>`` mean and seed spread. Each real run draws
its data from its peers' fresh ids, so the runs are samples of the same distribution as the seeds.
The verdict: whether the simulated mean falls within the real runs' spread (mean +- 2 std).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any


def real_run(args: argparse.Namespace, rounds: int, aggregation: str, row: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``peer demo`` run with the simulated ``row``'s outer step and warmup (where it records them);
    returns its JSON summary (raises on failure)."""
    with tempfile.TemporaryDirectory(prefix="hivetrain-real-") as workdir:
        cmd = [sys.executable, "-m", "hivetrain.peer.cli", "demo", "--peers", str(args.peers), "--rounds",
               str(rounds), "--sync-every", str(args.H), "--batch-size", str(args.batch_size), "--aggregation",
               aggregation, "--eval-batches", str(args.eval_batches), "--json", "--dir", workdir]
        for key in ("outer_lr", "outer_momentum", "inner_warmup"):
            if (row or {}).get(key) is not None:
                cmd += [f"--{key.replace('_', '-')}", str(row[key])]  # type: ignore[index]
        print("running:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"peer demo failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def compare(simulated: dict[str, Any], finals: list[float]) -> dict[str, Any]:
    """The verdict: is the simulated mean inside the real runs' spread (mean +- 2 std)?"""
    mean = statistics.fmean(finals)
    std = statistics.stdev(finals) if len(finals) > 1 else 0.0
    sim_mean, sim_std = simulated["final_eval_loss_mean"], simulated["final_eval_loss_std"]
    return {"real_mean": mean, "real_std": std, "real_min": min(finals), "real_max": max(finals),
            "simulated_mean": sim_mean, "simulated_std": sim_std, "gap": mean - sim_mean,
            "gap_pct": 100 * (mean - sim_mean) / sim_mean,
            "simulation_within_real_spread": abs(mean - sim_mean) <= 2 * std,
            "simulation_within_real_range": min(finals) <= sim_mean <= max(finals)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.convergence_real", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, help="results.json written by bench.convergence")
    parser.add_argument("--H", type=int, default=25, help="inner steps per round (default 25)")
    parser.add_argument("--peers", type=int, default=4, help="real peer processes (default 4)")
    parser.add_argument("--steps", type=int, default=400, help="inner steps per peer, as in bench.convergence (default 400)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per peer and step (default 4)")
    parser.add_argument("--eval-batches", type=int, default=32,
                        help="held-out batches (default 32: 32 x 4 windows = bench.convergence's 8 x 16)")
    parser.add_argument("--runs", type=int, default=3, help="real runs (default 3)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    with open(args.results) as f:
        simulated = {r["variant"]: r for r in json.load(f)}
    config_path = os.path.join(os.path.dirname(os.path.abspath(args.results)), "config.json")
    config: dict[str, Any] = {}
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
    aggregation = config.get("aggregation", "robust")  # results older than the field were run with robust
    variant = f"diloco_int8_H{args.H}"
    if variant not in simulated:
        print(f"error: {args.results} has no {variant}; run bench.convergence with --H {args.H}", file=sys.stderr)
        return 2
    if simulated[variant].get("inner_schedule", "constant") != "constant":
        print(f"error: {variant} in {args.results} ran a {simulated[variant]['inner_schedule']} schedule; the real "
              "check runs a constant one (run bench.convergence without --schedule)", file=sys.stderr)
        return 2
    rounds = args.steps // args.H
    runs = []
    for i in range(args.runs):
        try:
            summary = real_run(args, rounds, aggregation, simulated[variant])
        except (RuntimeError, subprocess.SubprocessError) as e:
            print(f"error: real run {i + 1}: {e}", file=sys.stderr)
            return 1
        runs.append({"final_eval_loss": summary["final_eval_loss"], "rounds_completed": summary["rounds_completed"],
                     "identical_hashes": summary["identical_hashes"]})
        print(f"real run {i + 1}/{args.runs}: held-out {summary['final_eval_loss']:.4f}, "
              f"{summary['rounds_completed']}/{rounds} rounds, identical hashes: {summary['identical_hashes']}",
              file=sys.stderr, flush=True)
    verdict = compare(simulated[variant], [r["final_eval_loss"] for r in runs])
    out = {"variant": variant, "aggregation": aggregation, "rounds": rounds, "runs": runs, **verdict}
    print(f"{variant} ({aggregation}): real {verdict['real_mean']:.4f} ± {verdict['real_std']:.4f} over "
          f"{len(runs)} runs (range {verdict['real_min']:.4f}-{verdict['real_max']:.4f}) vs simulated "
          f"{verdict['simulated_mean']:.4f} ± {verdict['simulated_std']:.4f}: gap {verdict['gap']:+.4f} "
          f"({verdict['gap_pct']:+.1f} %), the simulation is "
          f"{'within' if verdict['simulation_within_real_spread'] else 'OUTSIDE'} the real runs' spread (2 std)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
