"""What robust aggregation costs a reducer per round, against the plain mean, measured in the same run.

Usage (from the repository root)::

    python -m bench.robust [--json] [--quick] [--params 25M,100M] [--groups 4,8,16] [--reps 5] [--threads T]

For each model size P (fp32 parameter count) and group size n, the reducer of shard 0 receives n int8
parts of ``d = P / n`` elements (seeded Gaussian pseudo-gradients, each member at its own scale, all within
the outlier limit, so robust aggregation keeps all n). One round is what ``P2PAverager._reduce`` does with
them: decode the n parts, ``outliers()`` (robust only), ``aggregate(parts, how)``, re-encode once. The
``mean`` and ``robust`` rounds alternate, ``--reps`` of each after one warm-up; we report medians, and
the ratio robust / mean as the median over the pairs (so a change of background load cannot distort it much).

Per row also:

* ``extra_s``: robust minus mean, seconds per round per reducer;
* ``transfer_s``: the shard's int8 bytes that cross the reducer's link at ``--mbit`` (default 100):
  the n - 1 other members' parts in and n - 1 results out, ``2 (n - 1) * encoded_nbytes(d)`` (the
  reducer's own part stays local); this is also each member's whole upload per round;
* memory: ``robust_mean`` stacks the parts into (n, d) fp32 (``n d 4`` bytes = the model's fp32 size
  whatever n), and from its second CenteredClip iteration holds the stack, the previous ``diff`` and the
  new ``x - v`` at once: analytic peak extra over the mean path ``3 n d 4 + 3 d 4`` bytes. On Linux the
  peak RSS of one round of each (``/proc/self/clear_refs``) is measured too (approximate: the allocator
  may reuse freed pages);
* where robust's time goes: one round of ``outliers`` + ``robust_mean`` timed stage by stage
  (:func:`robust_stages`, checked to return exactly what ``aggregate`` returns).

``--json`` prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench.codec import parse_counts
from hivetrain.kernels.int8 import Codec, active_path, get_codec
from hivetrain.peer.averaging.aggregation import CLIP, ITERS, _clip_weights, aggregate, outliers
from hivetrain.peer.averaging.api import shard_bounds

HOWS = ("mean", "robust")
COMPUTE_S_ASSUMED = 150.0  # seconds of compute per round: H = 500 inner steps x ~0.3 s (an assumption)
Phases = dict[str, float]  # phase name -> seconds


def make_parts(params: int, n: int, codec: Codec, seed: int) -> tuple[list[bytes], int]:
    """The n encoded parts of shard 0 as its reducer receives them, and the shard's numel d.

    Member i sends ``randn(d) * s_i`` with s_i log-uniform in [0.5, 2]: different scales, but within
    ``OUTLIER`` x the median norm, so the robust path keeps every part (as in an honest group)."""
    start, end = shard_bounds(params, n)[0]
    d = end - start
    g = torch.Generator().manual_seed(seed)
    scales = 2.0 ** (2 * torch.rand(n, generator=g) - 1)  # (n,) in [0.5, 2]
    parts = [codec.encode(torch.randn(d, generator=g) * float(s)) for s in scales]  # one fp32 shard at a time
    return parts, d


def reduce_round(payloads: list[bytes], d: int, how: str, codec: Codec) -> tuple[bytes, Phases, int]:
    """One reducer round as in ``P2PAverager._reduce``: the result, seconds per phase, parts left out."""
    t0 = time.perf_counter()
    decoded = [codec.decode(p, d) for p in payloads]  # n x (d,) fp32
    t1 = time.perf_counter()
    left_out = outliers(decoded) if how == "robust" else []
    valid = [x for i, x in enumerate(decoded) if i not in left_out]
    combined = aggregate(valid, how)  # (d,) fp32
    t2 = time.perf_counter()
    result = codec.encode(combined)
    t3 = time.perf_counter()
    return result, {"decode": t1 - t0, "combine": t2 - t1, "encode": t3 - t2}, len(left_out)


def time_rounds(payloads: list[bytes], d: int, codec: Codec, reps: int) -> dict[str, list[Phases]]:
    """``reps`` timed rounds per aggregation, alternating mean and robust, after one warm-up of each."""
    out: dict[str, list[Phases]] = {how: [] for how in HOWS}
    for how in HOWS:
        _, _, left_out = reduce_round(payloads, d, how, codec)
        assert left_out == 0, "the synthetic parts must all be within the outlier limit"
    for _ in range(reps):
        for how in HOWS:
            _, phases, _ = reduce_round(payloads, d, how, codec)
            out[how].append(phases)
    return out


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB -> bytes
    except OSError:
        pass
    return None


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Peak RSS while ``fn`` runs minus RSS before it (Linux; None elsewhere or if peaks cannot be reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    before = _status_bytes("VmRSS")
    fn()
    peak = _status_bytes("VmHWM")
    return None if before is None or peak is None else peak - before


def robust_stages(parts: list[torch.Tensor]) -> tuple[torch.Tensor, Phases]:
    """``outliers`` then ``robust_mean`` step by step, with seconds per stage (iterations summed).

    A replica, because torch.profiler's op tree proved unreliable on a loaded machine (ops attributed to
    the wrong parent); :func:`measure` checks that it returns exactly ``aggregate(parts, "robust")``."""
    t: Phases = {}
    t0 = time.perf_counter()
    outliers(parts)
    t1 = time.perf_counter()
    x = torch.stack(parts)  # (n, d) fp32
    t2 = time.perf_counter()
    norms = torch.linalg.vector_norm(x, dim=1)  # (n,)
    x.mul_(_clip_weights(norms, CLIP * norms.median())[:, None])
    t3 = time.perf_counter()
    v = x.median(dim=0).values  # (d,)
    t4 = time.perf_counter()
    t.update(outliers=t1 - t0, stack=t2 - t1, norm_clip=t3 - t2, median_dim0=t4 - t3)
    for k in ("iter_sub", "iter_dist_clip", "iter_mean_add"):
        t[k] = 0.0
    for _ in range(ITERS):
        t0 = time.perf_counter()
        diff = x - v  # (n, d)
        t1 = time.perf_counter()
        dist = torch.linalg.vector_norm(diff, dim=1)  # (n,)
        diff.mul_(_clip_weights(dist, CLIP * dist.median())[:, None])
        t2 = time.perf_counter()
        v = v + diff.mean(dim=0)
        t3 = time.perf_counter()
        t["iter_sub"] += t1 - t0
        t["iter_dist_clip"] += t2 - t1
        t["iter_mean_add"] += t3 - t2
    return v, t


def robust_peak_extra_bytes(n: int, d: int) -> int:
    """Analytic peak memory of ``robust_mean`` beyond the mean path's, in bytes.

    From the second CenteredClip iteration on, ``diff = x - v`` is computed while the previous ``diff`` is
    still bound: the stack x and two (n, d) fp32 diffs live at once, plus v, ``diff.mean`` and the new v."""
    live_nd = 3 if ITERS >= 2 else 2
    return live_nd * n * d * 4 + 3 * d * 4


def measure(params: int, n: int, codec: Codec, reps: int, mbit: float, seed: int) -> dict[str, Any]:
    """One row: medians, ratios, transfer time and memory for model size ``params`` and group size ``n``."""
    payloads, d = make_parts(params, n, codec, seed)
    runs = time_rounds(payloads, d, codec, reps)
    total = {how: [sum(p.values()) for p in runs[how]] for how in HOWS}  # seconds per round
    med = {how: statistics.median(total[how]) for how in HOWS}
    ratio = statistics.median(r / m for m, r in zip(total["mean"], total["robust"], strict=True))
    transfer_bytes = 2 * (n - 1) * codec.encoded_nbytes(d)
    transfer_s = transfer_bytes * 8 / (mbit * 1e6)
    extra_s = med["robust"] - med["mean"]
    decoded = [codec.decode(p, d) for p in payloads]  # n x (d,) fp32
    combined, stages = robust_stages(decoded)
    exact = torch.equal(combined, aggregate(decoded, "robust"))
    del decoded, combined
    peak_mean, peak_robust = (peak_extra_bytes(partial(reduce_round, payloads, d, how, codec)) for how in HOWS)
    measured = None if peak_mean is None or peak_robust is None else peak_robust - peak_mean
    return {
        "params": params, "group": n, "shard_numel": d,
        "mean_ms": med["mean"] * 1e3, "robust_ms": med["robust"] * 1e3, "ratio": ratio,
        "extra_s": extra_s, "transfer_s": transfer_s, "extra_over_transfer": extra_s / transfer_s,
        "transfer_bytes": transfer_bytes,
        "phases_ms": {how: {k: statistics.median(p[k] for p in runs[how]) * 1e3 for k in runs[how][0]}
                      for how in HOWS},
        "stack_bytes": n * d * 4,
        "peak_extra_bytes_analytic": robust_peak_extra_bytes(n, d),
        "peak_extra_bytes_measured": measured,
        "robust_stages_ms": {k: v * 1e3 for k, v in stages.items()},
        "stages_match_aggregate": exact,
    }


def _fmt_n(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}K" if n >= 10**3 else str(n)


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:.0f}"


def print_rows(rows: list[dict[str, Any]], mbit: float) -> None:
    print(f"\n{'P':>6}{'n':>4}{'shard':>8}{'mean ms':>10}{'robust ms':>11}{'ratio':>7}{'extra s':>9}"
          f"{'xfer s':>8}{'extra/xfer':>11}{'stack MB':>10}{'peak+ MB':>10}{'meas MB':>9}")
    for r in rows:
        print(f"{_fmt_n(r['params']):>6}{r['group']:>4}{_fmt_n(r['shard_numel']):>8}{r['mean_ms']:>10.1f}"
              f"{r['robust_ms']:>11.1f}{r['ratio']:>7.1f}{r['extra_s']:>9.3f}{r['transfer_s']:>8.2f}"
              f"{r['extra_over_transfer']:>11.3f}{_mb(r['stack_bytes']):>10}"
              f"{_mb(r['peak_extra_bytes_analytic']):>10}{_mb(r['peak_extra_bytes_measured']):>9}")
    print(f"xfer: 2 (n-1) int8 shards across the reducer's link at {mbit:g} Mbit/s. peak+: analytic peak extra "
          "memory of robust over mean (3 n d 4 + 3 d 4 B); meas: measured peak RSS difference (Linux).")
    print("\nwhere robust's combine time goes (ms; one round, stage by stage; iter_* summed over iterations):")
    for r in rows:
        ph = r["phases_ms"]["robust"]
        st = ", ".join(f"{k} {v:.0f}" for k, v in r["robust_stages_ms"].items())
        match = "" if r["stages_match_aggregate"] else " (replica differs from aggregate!)"
        print(f"  P={_fmt_n(r['params'])} n={r['group']}: decode {ph['decode']:.0f}, combine {ph['combine']:.0f}, "
              f"encode {ph['encode']:.0f} | {st}{match}")
    worst = max(rows, key=lambda r: r["extra_s"])
    print(f"\nA round at H = 500 inner steps is minutes of compute (e.g. 500 x 0.3 s = {COMPUTE_S_ASSUMED:.0f} s): "
          f"the largest extra here, {worst['extra_s']:.2f} s, is {100 * worst['extra_s'] / COMPUTE_S_ASSUMED:.2f} % "
          "of that.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--quick", action="store_true", help="P = 2M only, 3 reps: a few seconds")
    ap.add_argument("--params", default=None, help="fp32 parameter counts, e.g. 25M,100M (default; --quick: 2M)")
    ap.add_argument("--groups", default="4,8,16", help="group sizes n")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per aggregation (default 5; --quick: 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--mbit", type=float, default=100.0, help="link rate for the transfer time, Mbit/s")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    params = parse_counts(args.params or ("2M" if args.quick else "25M,100M"))
    groups = [int(s) for s in args.groups.split(",")]
    if min(groups) < 3:
        ap.error("--groups: robust_mean is the plain mean below 3 members; use group sizes >= 3")
    reps = args.reps or (3 if args.quick else 5)
    codec = get_codec("int8", 65536)

    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = [measure(p, n, codec, reps, args.mbit, args.seed + 1000 * i + n)
            for i, p in enumerate(params) for n in groups]
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"robust vs mean aggregation per reducer round: codec int8 path={active_path()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"median of {reps}, load {load0} -> {load1}, robust = clip + CenteredClip x {ITERS}")
    print_rows(rows, args.mbit)
    if args.json:
        print(json.dumps({"rows": rows, "extra": {"threads": torch.get_num_threads(), "reps": reps,
                                                  "mbit": args.mbit, "load": [load0, load1],
                                                  "path": active_path(), "torch": torch.__version__}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
