"""Does the simulation flatter the real system? The int8 DiLoCo variant through real peers.

    python -m bench.convergence_real --results DIR/results.json [--H 25] [--peers 4] [--steps 400]

runs ``peer demo`` (real peer processes on 127.0.0.1, libp2p, the network averager) with the
settings of ``bench.convergence`` (tiny preset, batch 4 x 128 per peer, plain-mean aggregation as
the simulation uses, the same held-out windows), and compares its final held-out loss with the
simulated ``diloco_int8_H<H>`` mean and seed spread from results.json. The real peers draw their
data from their own peer ids, so the run is one more sample of the same distribution.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.convergence_real", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, help="results.json written by bench.convergence")
    parser.add_argument("--H", type=int, default=25)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400, help="inner steps per peer (as in bench.convergence)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-batches", type=int, default=32, help="32 x 4 windows = bench.convergence's 8 x 16")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        simulated = {r["variant"]: r for r in json.load(f)}
    variant = f"diloco_int8_H{args.H}"
    if variant not in simulated:
        print(f"error: {args.results} has no {variant}; run bench.convergence with --H {args.H}", file=sys.stderr)
        return 2
    rounds = args.steps // args.H
    with tempfile.TemporaryDirectory(prefix="hivetrain-real-") as workdir:
        cmd = [sys.executable, "-m", "hivetrain.peer.cli", "demo", "--peers", str(args.peers), "--rounds",
               str(rounds), "--sync-every", str(args.H), "--batch-size", str(args.batch_size), "--aggregation",
               "mean", "--eval-batches", str(args.eval_batches), "--json", "--dir", workdir]
        print("running:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    real = json.loads(done.stdout.strip().splitlines()[-1])
    sim = simulated[variant]
    mean, std = sim["final_eval_loss_mean"], sim["final_eval_loss_std"]
    gap = real["final_eval_loss"] - mean
    within = abs(gap) <= max(2 * std, 1e-9)
    out = {"variant": variant, "rounds": rounds, "real_final_eval_loss": real["final_eval_loss"],
           "simulated_mean": mean, "simulated_std": std, "gap": gap, "within_2_std": within,
           "identical_hashes": real["identical_hashes"], "rounds_completed": real["rounds_completed"]}
    print(f"{variant}: real {real['final_eval_loss']:.4f} vs simulated {mean:.4f} ± {std:.4f} "
          f"(gap {gap:+.4f}, {'within' if within else 'OUTSIDE'} 2 std); "
          f"{real['rounds_completed']}/{rounds} rounds, identical hashes: {real['identical_hashes']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
