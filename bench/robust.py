"""What robust aggregation costs a round, against the plain mean: the reducer's and the auditor's work.

Usage (from the repository root)::

    python -m bench.robust [--json] [--quick] [--params 25M,100M] [--groups 4,8,16] [--reps 5] [--threads T]
    python -m bench.robust --jitter [--json]

For each model size P (fp32 parameter count) and group size n, the reducer of shard 0 receives n int8
parts of ``d = ceil(P / n)`` elements (seeded Gaussian pseudo-gradients, each member at its own scale,
all within the outlier limit, so robust aggregation keeps all n). Per round a member does, one after the
other, what ``peer/averaging/allreduce.py`` does:

* as reducer of its shard: ``reduce_shard`` (decode the n parts, ``outliers()`` for robust, the
  aggregation, re-encode once, digest every part);
* as auditor of the next shard: ``audit_shard`` (digest its own copies of the parts, recompute the
  shard with ``reduce_shard``, compare with the reducer's result).

``mean`` and ``robust`` rounds alternate, ``--reps`` of each after one warm-up; we report medians, and
the ratio robust / mean as the median over the pairs (so a change of background load cannot distort it
much). Per row also:

* ``extra_s``: robust minus mean for reduce + audit, seconds per round per member; reducers work in
  parallel, but each member's audit follows its reduction, so this is the round's added latency;
* ``transfer_s``: the bytes each member uploads per round at ``--mbit`` (default 100): its n - 1 parts
  to the reducers, n - 1 copies to the auditors and n - 1 results (3 (n - 1) bodies of the lengths
  measured here; headers, verdicts and the digest agreement are a few hundred bytes and left out);
* memory: ``robust_mean`` stacks the parts into (n, d) fp32 (``n d 4`` bytes = the model's fp32 size
  whatever n) and reuses one (n, d) ``diff`` buffer: analytic peak extra over the mean path
  ``2 n d 4 + 3 d 4`` bytes. Measured twice: the peak bytes of the tensors ``robust_mean`` allocates
  (exact, through a dispatch mode; op-internal scratch not seen), and on Linux the peak RSS of one
  ``reduce_shard`` of each (``/proc/self/clear_refs``; approximate: the allocator reuses freed pages);
* where robust's time goes: ``outliers`` + ``robust_mean`` timed stage by stage, ``--reps`` times
  (:func:`robust_stages`, checked to return exactly what ``aggregate`` returns).

``--jitter`` instead measures what honest float jitter does to the robust audit's statistics
(peer/averaging/reduce.py thresholds): the shard recomputed with the parts in reverse order, with
float64 norms, all in float64, and on one thread, compared with the reducer's bytes.

``--json`` prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.codec import parse_counts
from hivetrain.kernels.int8 import Codec, active_path, get_codec
from hivetrain.peer.averaging import aggregation
from hivetrain.peer.averaging.aggregation import (
    CLIP,
    ITERS,
    NORM_CLIP,
    _clip_weights,
    aggregate,
    outliers,
    row_norms,
)
from hivetrain.peer.averaging.reduce import ShardInputs, audit_shard, chunk_errors, reduce_shard

HOWS = ("mean", "robust")
COMPUTE_S_ASSUMED = 150.0  # seconds of compute per round: H = 500 inner steps x ~0.3 s (an assumption)
Phases = dict[str, float]  # phase name -> seconds


def make_parts(params: int, n: int, codec: Codec, seed: int) -> tuple[dict[str, bytes], list[str], int]:
    """The n encoded parts of shard 0 as its reducer (and its auditor) receive them, the group order,
    and the shard's numel d.

    Member i sends ``randn(d) * s_i`` with s_i log-uniform in [0.5, 2]: different scales, but within
    ``OUTLIER`` x the median norm, so the robust path keeps every part (as in an honest group)."""
    d = -(-params // n)  # shard 0 is the largest (peer/averaging/api.py shard_bounds)
    g = torch.Generator().manual_seed(seed)
    scales = 2.0 ** (2 * torch.rand(n, generator=g) - 1)  # (n,) in [0.5, 2]
    order = [f"member{i}" for i in range(n)]
    parts = {p: codec.encode(torch.randn(d, generator=g) * float(s)) for p, s in zip(order, scales, strict=True)}
    return parts, order, d


def member_round(inputs: ShardInputs) -> tuple[bytes, Phases]:
    """What one member computes per round for ``inputs.how``: the reducer's ``reduce_shard`` and the
    auditor's ``audit_shard`` (here of the same shard, as an honest auditor finds it). Seconds each."""
    t0 = time.perf_counter()
    shard = reduce_shard(inputs)
    t1 = time.perf_counter()
    finding = audit_shard(shard.result, shard.digests, inputs)
    t2 = time.perf_counter()
    assert finding is None and not shard.excluded, (finding, shard.excluded)
    return shard.result, {"reduce": t1 - t0, "audit": t2 - t1}


def time_rounds(inputs: dict[str, ShardInputs], reps: int) -> dict[str, list[Phases]]:
    """``reps`` timed rounds per aggregation, alternating mean and robust, after one warm-up of each."""
    out: dict[str, list[Phases]] = {how: [] for how in HOWS}
    for how in HOWS:
        member_round(inputs[how])
    for _ in range(reps):
        for how in HOWS:
            out[how].append(member_round(inputs[how])[1])
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


class _LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages that ops create while the mode is on, and their peak:
    a storage counts until the last tensor on it dies. Deterministic (no allocator in the way), but
    blind to an op's internal scratch memory."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}  # storage address -> live tensors on it
        self.sizes: dict[int, int] = {}  # storage address -> bytes
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.sizes[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)
        return out


def peak_tensor_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of the tensors ``fn`` allocates (see :class:`_LiveTensorBytes`)."""
    with _LiveTensorBytes() as mode:
        fn()
    return mode.peak


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
    norms = row_norms(x)  # (n,)
    x.mul_(_clip_weights(norms, NORM_CLIP * norms.median())[:, None])
    t3 = time.perf_counter()
    v = x.median(dim=0).values  # (d,)
    diff = torch.empty_like(x)  # (n, d) reused, as robust_mean does
    t4 = time.perf_counter()
    t.update(outliers=t1 - t0, stack=t2 - t1, norm_clip=t3 - t2, median_dim0=t4 - t3)
    for k in ("iter_sub", "iter_dist_clip", "iter_mean_add"):
        t[k] = 0.0
    for _ in range(ITERS):
        t0 = time.perf_counter()
        torch.sub(x, v, out=diff)
        t1 = time.perf_counter()
        dist = row_norms(diff)  # (n,)
        diff.mul_(_clip_weights(dist, CLIP * dist.median())[:, None])
        t2 = time.perf_counter()
        v = v + diff.mean(dim=0)
        t3 = time.perf_counter()
        t["iter_sub"] += t1 - t0
        t["iter_dist_clip"] += t2 - t1
        t["iter_mean_add"] += t3 - t2
    return v, t


def robust_peak_extra_bytes(n: int, d: int) -> int:
    """Analytic peak memory of ``robust_mean`` beyond the mean path's, in bytes: the (n, d) fp32 stack
    and the reused (n, d) ``diff``, plus v, ``diff.mean`` and the new v ((d,) each)."""
    return 2 * n * d * 4 + 3 * d * 4


def measure(params: int, n: int, codec: Codec, reps: int, mbit: float, seed: int) -> dict[str, Any]:
    """One row: medians, ratios, transfer time and memory for model size ``params`` and group size ``n``."""
    parts, order, d = make_parts(params, n, codec, seed)
    inputs = {how: ShardInputs(parts, {}, order, d, codec, how) for how in HOWS}
    runs = time_rounds(inputs, reps)
    total = {how: [sum(p.values()) for p in runs[how]] for how in HOWS}  # seconds per round
    med = {how: statistics.median(total[how]) for how in HOWS}
    ratio = statistics.median(r / m for m, r in zip(total["mean"], total["robust"], strict=True))
    result = member_round(inputs["robust"])[0]
    part_bytes = [len(b) for b in parts.values()]
    transfer_bytes = 2 * sum(part_bytes[1:]) + (n - 1) * len(result)  # parts to reducers and auditors, results
    transfer_s = transfer_bytes * 8 / (mbit * 1e6)
    extra_s = med["robust"] - med["mean"]
    decoded = [codec.decode(parts[p], d) for p in order]  # n x (d,) fp32
    staged = [robust_stages(decoded) for _ in range(reps)]
    combined = staged[0][0]
    stages = {k: statistics.median(st[k] for _, st in staged) for k in staged[0][1]}
    exact = torch.equal(combined, aggregate(decoded, "robust"))
    tensors = peak_tensor_bytes(partial(aggregate, decoded, "robust"))
    del decoded, combined, staged
    peak_mean, peak_robust = (peak_extra_bytes(partial(reduce_shard, inputs[how])) for how in HOWS)
    measured = None if peak_mean is None or peak_robust is None else peak_robust - peak_mean
    return {
        "params": params, "group": n, "shard_numel": d,
        "mean_ms": med["mean"] * 1e3, "robust_ms": med["robust"] * 1e3, "ratio": ratio,
        "extra_s": extra_s, "transfer_s": transfer_s, "extra_over_transfer": extra_s / transfer_s,
        "transfer_bytes": transfer_bytes, "part_bytes": part_bytes[0], "result_bytes": len(result),
        "phases_ms": {how: {k: statistics.median(p[k] for p in runs[how]) * 1e3 for k in runs[how][0]}
                      for how in HOWS},
        "stack_bytes": n * d * 4,
        "peak_extra_bytes_analytic": robust_peak_extra_bytes(n, d),
        "peak_extra_bytes_measured": measured,
        "peak_extra_bytes_tensors": tensors,
        "robust_stages_ms": {k: v * 1e3 for k, v in stages.items()},
        "stages_match_aggregate": exact,
    }


def _fp64_row_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.double(), dim=1).to(x.dtype)


def _recompute(parts: list[torch.Tensor], variant: str) -> torch.Tensor:
    """The robust combination of ``parts`` as another honest CPU might round it."""
    if variant == "reversed":
        return aggregation.robust_mean(parts[::-1])
    if variant == "one_thread":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return aggregation.robust_mean(parts)
        finally:
            torch.set_num_threads(threads)
    original = aggregation.row_norms
    aggregation.row_norms = _fp64_row_norms  # robust_mean looks it up at call time
    try:
        if variant == "fp64_norms":
            return aggregation.robust_mean(parts)
        return aggregation.robust_mean([p.double() for p in parts]).float()  # "all_fp64"
    finally:
        aggregation.row_norms = original


def _honest_parts(kind: str, n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    if kind == "gaussian":  # tests/unit/test_aggregation.py's model
        return [common + 0.5 * (1 + 0.3 * i) * torch.randn(numel, generator=g) for i in range(n)]
    scale = torch.exp(torch.randn(numel, generator=g))  # heavy tails, per-coordinate scales
    t3 = torch.distributions.StudentT(torch.tensor(3.0))
    return [(0.3 * common + t3.sample(torch.Size([numel]))) * scale * 1e-3 * (1 + i) for i in range(n)]


def jitter(numel: int = 300_007, seeds: int = 2) -> list[dict[str, Any]]:
    """Worst per-chunk audit statistics (steps; raw, before ALLOWED_FLIPS) of honest recomputations."""
    rows = []
    for name, chunk in (("int8", 65536), ("int8", 4096), ("fp32", 65536)):
        codec = get_codec(name, chunk)
        worst: dict[str, list[float]] = {}
        failed: dict[str, int] = {}
        for kind in ("gaussian", "heavy"):
            for n in (3, 4, 8, 16):
                for seed in range(seeds):
                    parts = [codec.decode(codec.encode(p), numel) for p in _honest_parts(kind, n, numel, seed)]
                    base = aggregation.robust_mean(parts)
                    ref = codec.decode(codec.encode(base), numel)
                    for variant in ("reversed", "fp64_norms", "all_fp64", "one_thread"):
                        got = codec.decode(codec.encode(_recompute(parts, variant)), numel)
                        stats = _raw_chunk_stats(got, ref, base, codec)
                        w = worst.setdefault(variant, [0.0] * 4)
                        worst[variant] = [max(a, b) for a, b in zip(w, stats, strict=True)]
                        if chunk_errors(got, ref, base, codec).failing():
                            failed[variant] = failed.get(variant, 0) + 1
        for variant, (value, bias, rms, flips) in worst.items():
            rows.append({"codec": name, "chunk": chunk, "variant": variant, "value": value, "bias": bias,
                         "rms": rms, "flip_fraction": flips, "audits_failed": failed.get(variant, 0),
                         "audits": 2 * 4 * seeds})
    return rows


def _raw_chunk_stats(got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, codec: Codec) -> list[float]:
    """[max |error|, max |signed mean|, max rms, max fraction of values half a step or more off] over
    the chunks, in steps of ``base``'s chunks (the reducer's combination before encoding)."""
    out = [0.0] * 4
    for s in range(0, ref.numel(), codec.chunk_size):
        c = base[s : s + codec.chunk_size].double()
        step = float(c.max() - c.min()) / 255 if codec.name == "int8" else 2.0**-16 * float(c.abs().max())
        err = (got[s : s + codec.chunk_size].double() - ref[s : s + codec.chunk_size].double()) / (step + 1e-30)
        raw = [float(err.abs().max()), abs(float(err.mean())), float(err.pow(2).mean().sqrt()),
               float((err.abs() >= 0.5).double().mean())]
        out = [max(x, y) for x, y in zip(out, raw, strict=True)]
    return out


def _fmt_n(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}K" if n >= 10**3 else str(n)


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:.0f}"


def print_rows(rows: list[dict[str, Any]], mbit: float) -> None:
    print(f"\n{'P':>6}{'n':>4}{'shard':>8}{'mean ms':>9}{'robust ms':>11}{'ratio':>7}{'(red/aud ms)':>16}"
          f"{'extra s':>9}{'xfer s':>8}{'extra/xfer':>11}{'stack MB':>10}{'peak+ MB':>10}{'tens MB':>10}{'rss MB':>9}")
    for r in rows:
        ph = r["phases_ms"]["robust"]
        split = f"{ph['reduce']:.0f}/{ph['audit']:.0f}"
        print(f"{_fmt_n(r['params']):>6}{r['group']:>4}{_fmt_n(r['shard_numel']):>8}{r['mean_ms']:>9.1f}"
              f"{r['robust_ms']:>11.1f}{r['ratio']:>7.1f}{split:>16}{r['extra_s']:>9.3f}{r['transfer_s']:>8.2f}"
              f"{r['extra_over_transfer']:>11.3f}{_mb(r['stack_bytes']):>10}"
              f"{_mb(r['peak_extra_bytes_analytic']):>10}{_mb(r['peak_extra_bytes_tensors']):>10}"
              f"{_mb(r['peak_extra_bytes_measured']):>9}")
    print(f"ms: reduce_shard + audit_shard per member per round. xfer: 3 (n-1) int8 bodies uploaded per member at "
          f"{mbit:g} Mbit/s. peak+: analytic peak extra memory of robust over mean (2 n d 4 + 3 d 4 B); "
          "tens: peak bytes of robust_mean's tensors; rss: peak RSS difference of one reduce_shard (Linux).")
    print("\nwhere robust's combine time goes (ms; median of the reps, stage by stage; iter_* summed over iterations):")
    for r in rows:
        st = ", ".join(f"{k} {v:.0f}" for k, v in r["robust_stages_ms"].items())
        match = "" if r["stages_match_aggregate"] else " (replica differs from aggregate!)"
        print(f"  P={_fmt_n(r['params'])} n={r['group']}: {st}{match}")
    worst = max(rows, key=lambda r: r["extra_s"])
    print(f"\nA round at H = 500 inner steps is minutes of compute (e.g. 500 x 0.3 s = {COMPUTE_S_ASSUMED:.0f} s, "
          f"assumed): the largest extra here, {worst['extra_s']:.2f} s, is "
          f"{100 * worst['extra_s'] / COMPUTE_S_ASSUMED:.2f} % of that.")


def print_jitter(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'codec':>6}{'chunk':>7}{'variant':>12}{'max |e|':>9}{'max |mean|':>12}{'max rms':>10}{'flips':>10}"
          f"{'failed':>8}")
    for r in rows:
        print(f"{r['codec']:>6}{r['chunk']:>7}{r['variant']:>12}{r['value']:>9.4f}{r['bias']:>12.2e}"
              f"{r['rms']:>10.2e}{r['flip_fraction']:>10.2e}{r['audits_failed']:>5}/{r['audits']}")
    print("per chunk, in quantization steps (fp32: 2^-16 x the chunk's largest magnitude), raw (before the "
          "ALLOWED_FLIPS allowance); flips: fraction of values half a step or more away")


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
    ap.add_argument("--jitter", action="store_true", help="measure honest jitter of the robust audit instead")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = {"threads": torch.get_num_threads(), "path": active_path(), "torch": torch.__version__}
    if args.jitter:
        jrows = jitter()
        print(f"honest jitter of the robust audit: codec path={active_path()}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        print_jitter(jrows)
        if args.json:
            print(json.dumps({"jitter": jrows, "extra": env}))
        return 0
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
    print(f"robust vs mean, reduce_shard + audit_shard per member round: codec int8 path={active_path()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"median of {reps}, load {load0} -> {load1}, robust = clip + CenteredClip x {ITERS}")
    print_rows(rows, args.mbit)
    if args.json:
        print(json.dumps({"rows": rows, "extra": {**env, "reps": reps, "mbit": args.mbit, "load": [load0, load1]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
