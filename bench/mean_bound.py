"""How far an honest cross-group mean lies from each member's own pseudo-gradient, on a real model.

Usage (from the repository root)::

    python -m bench.mean_bound [--json] [--preset tiny] [--peers 8] [--groups 2,4] [--rounds 4]

A designee's mean of a sub-piece is not audited, so every reducer and member checks it before applying
it: ``peer/averaging/cross.py`` ``off`` (||mean - own|| over the larger norm of our own pseudo-gradient
and our group's values there) must stay within ``MEAN_BOUND``. This measures that ratio where it
matters, on the run's real language model and corpus: ``--peers`` learners from the same initial
weights each train one round (``sync_every`` inner steps) on their own shard; their pseudo-gradients
are reduced in groups of G (the robust mean, as reducers do) and across groups (the weighted robust
mean, as designees do); the ratio is taken per member and per sub-piece of ``--sub`` values (the
designees' unit). Every round then applies the plain mean with the run's outer learning rate, so
later rounds start from a trained state. Per G it prints the median, p99 and largest honest ratio,
and the same for two lying designees: the mean times -1 (the update reversed) and times -1000; the
margin is MEAN_BOUND over the largest honest ratio. ``--json`` prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from hivetrain.peer.averaging.aggregation import robust_mean, weighted_robust_mean
from hivetrain.peer.averaging.cross import MEAN_BOUND, off
from hivetrain.peer.config import PRESETS, RunSpec
from hivetrain.peer.train.data import load_sotu
from hivetrain.peer.train.learner import LMLearner


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _load(model: torch.nn.Module, flat: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()


def _quantiles(values: list[float]) -> dict[str, float]:
    q = sorted(values)
    return {"median": round(statistics.median(q), 4), "p99": round(q[min(len(q) - 1, int(0.99 * len(q)))], 4),
            "max": round(q[-1], 4)}


def measure(preset: str, peers: int, groups: list[int], rounds: int, sub: int, log: Any) -> dict[str, Any]:
    spec = RunSpec.from_preset("mean-bound", preset)
    corpus = load_sotu()
    learners = [LMLearner(spec, f"peer-{i}", corpus) for i in range(peers)]
    base = _flat(learners[0].model)
    ratios: dict[int, dict[str, list[float]]] = {g: {"honest": [], "flipped": [], "x1000": []} for g in groups}
    t0 = time.perf_counter()
    for r in range(rounds):
        deltas = []
        for i, learner in enumerate(learners):
            _load(learner.model, base)
            learner.inner_steps(r * spec.sync_every, lambda **_: None)
            deltas.append(base - _flat(learner.model))  # (numel,) the pseudo-gradient
            print(f"round {r}: peer {i} trained ({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
        numel = base.numel()
        for g in groups:
            members = [list(range(a, min(a + g, peers))) for a in range(0, peers, g)]
            for a in range(0, numel, sub):
                b = min(numel, a + sub)
                rows = [robust_mean([deltas[i][a:b] for i in group]) for group in members]
                mean = weighted_robust_mean(rows, [len(group) for group in members])
                for row, group in zip(rows, members, strict=True):
                    for i in group:
                        own = deltas[i][a:b]
                        ratios[g]["honest"].append(off(mean, own, row))
                        ratios[g]["flipped"].append(off(-mean, own, row))
                        ratios[g]["x1000"].append(off(-1000.0 * mean, own, row))
        base = base - spec.outer_lr * torch.stack(deltas).mean(dim=0)
    rows_out = []
    for g in groups:
        row: dict[str, Any] = {"group": g, **{k: _quantiles(v) for k, v in ratios[g].items()}}
        row["margin"] = round(MEAN_BOUND / row["honest"]["max"], 2)
        row["flipped_refused"] = round(sum(v > MEAN_BOUND for v in ratios[g]["flipped"]) / len(ratios[g]["flipped"]), 4)
        rows_out.append(row)
    return {"preset": preset, "peers": peers, "rounds": rounds, "sub_values": sub, "numel": int(base.numel()),
            "bound": MEAN_BOUND, "rows": rows_out, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mean_bound", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--groups", default="2,4", help="group sizes, comma-separated (default 2,4)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sub", type=int, default=1 << 15, help="values per sub-piece (default 32768)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        groups = [int(g) for g in args.groups.split(",") if g]
    except ValueError:
        print(f"--groups: {args.groups!r} is not a list of integers", file=sys.stderr)
        return 2
    if args.peers < 2 or args.rounds < 1 or args.sub < 1 or not groups or min(groups) < 1:
        print("--peers must be at least 2, --rounds, --sub and every group size at least 1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    out = measure(args.preset, args.peers, groups, args.rounds, args.sub, sys.stderr)
    print(f"{out['preset']}: {out['peers']} peers, {out['rounds']} rounds, sub-pieces of {out['sub_values']} "
          f"values; refused past {out['bound']}")
    print(f"{'group':>5}  {'honest median/p99/max':>24}  {'flipped median/max':>20}  {'x-1000 min':>10}  margin")
    for row in out["rows"]:
        h, f = row["honest"], row["flipped"]
        print(f"{row['group']:>5}  {h['median']:>8.3f} {h['p99']:>7.3f} {h['max']:>7.3f}  "
              f"{f['median']:>9.3f} {f['max']:>9.3f}  {row['x1000']['median']:>10.1f}  {row['margin']:.2f}x")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
