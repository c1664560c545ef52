"""Throughput and error of the int8 pseudo-gradient codec, against the memory limit measured in the same run.

Usage (from the repository root)::

    python -m bench.codec [--json] [--sizes 10M,100M] [--threads 1,2] [--reps 7] [--quick]

Each thread count runs in its own subprocess, which calls ``torch.set_num_threads(T)`` before anything
is imported or compiled. Per size it measures (median of ``--reps`` timed samples, each sample a loop of
calls lasting at least 50 ms, alternating with a sample of the read baseline; on Linux a pair of samples is
retaken while other processes use > 0.15 core):

* ``read``: ``sum()`` of a float32 buffer of max(numel, 100M) elements (400 MB, far beyond any
  last-level cache, so that R is the *memory's* bandwidth; at 10M elements a 40 MB buffer would be
  read partly from the 32 MB L3 of the test EPYC and inflate R up to 2.6x with 2 threads), the memory
  read bandwidth R: the memory limit of this run (plus, for reference, torch's float32 -> int8
  ``copy_``, a streaming op with the same traffic as encode);
* ``encode``: :func:`hivetrain.kernels.fast_cpu.encode_into` into a preallocated payload (the public
  ``int8.encode``, which returns a fresh ``bytes``, is reported apart as ``encode_bytes``);
* ``decode_accumulate``: public ``int8.decode_accumulate(payload_bytes, n, acc)`` into a preallocated acc;
* ``reduce4``: a 4-peer reduce in one process: encode 4 inputs, ``acc.zero_()``, decode-accumulate the 4
  payloads with weight 1/4, re-encode ``acc``;
* the averager's own path (marked ``*`` in the table): ``encode_bytes``, the public ``int8.encode``
  that returns a fresh ``bytes`` (every part and result the averager sends), and ``decode``, the
  public ``int8.decode`` into a fresh tensor (every part a reducer or auditor combines, every result
  a member applies). The robust combination itself is ``bench.robust``'s.

GB/s is fp32-equivalent: ``numel * 4 B / time`` (for ``reduce4``: ``4 * numel * 4 B / time``, the 4
peers' inputs). The memory limit of an op is R scaled by the DRAM bytes it must read per element
(read-for-ownership of written lines included, as in shared/research/codec.md): encode and
decode-accumulate read 4 + 1 B per element, so their limit is ``R * 4 / 5``; reduce4 reads
4*5 + 4 (zero fill) + 4*5 + 5 = 49 B per element for 16 B of input, so its limit is ``R * 16 / 49``.
``ratio_to_memory_limit`` = GB/s / that limit, as the median over the pairs of samples (so a change of
background load between samples of an op and of the read baseline cannot distort it much). ``--json`` prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

READ_MIN_NUMEL = 100_000_000  # the read baseline streams at least this many float32 (see the module doc)
REFERENCE_OPS = {"convert_i8": "torch_convert_f32_to_i8", "inplace_add": "torch_inplace_add"}
LIMIT_FACTOR = {"encode": 4 / 5, "decode_accumulate": 4 / 5, "reduce4": 16 / 49, "encode_bytes": 4 / 5, "decode": 4 / 5}
AVERAGER_PATH = ("encode_bytes", "decode")  # what peer/averaging/ calls per piece: Codec.encode, Codec.decode
MAX_OTHER_CORES = 0.15  # a sample is valid when other processes used less than this many cores meanwhile


def parse_counts(text: str) -> list[int]:
    """``"10M,100M"`` -> [10_000_000, 100_000_000]; K, M, G suffixes."""
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        out.append(int(float(part[:-1]) * mult[part[-1]]) if part[-1] in mult else int(part))
    return out


def _busy_seconds() -> float | None:
    """CPU seconds all processes spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            v = [int(a) for a in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _sample(fn: Callable[[], object], k: int) -> tuple[float, float]:
    """(seconds per call over ``k`` calls, cores used by other processes meanwhile; 0 if unknown)."""
    b0, p0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
    for _ in range(k):
        fn()
    t1 = time.perf_counter()
    b1, p1 = _busy_seconds(), time.process_time()
    other = 0.0 if b0 is None or b1 is None else ((b1 - b0) - (p1 - p0)) / (t1 - t0)
    return (t1 - t0) / k, other


def _calls_per_sample(fn: Callable[[], object], window: float) -> int:
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    return max(1, int(window / max(time.perf_counter() - t0, 1e-7)))


def _time_paired(fn: Callable[[], object], read: Callable[[], object], reps: int, window: float,
                 tries: int) -> tuple[float, float, float, bool]:
    """Alternate samples of ``fn`` and of the memory-read baseline ``read``; a pair counts when neither
    sample saw other processes use more than MAX_OTHER_CORES. Returns the medians of fn's seconds per
    call, of read's seconds per call and of t_read / t_fn over ``reps`` pairs, and whether the guard
    gave up (then the least loaded pairs are used). Pairing makes the ratio robust to slow load drift."""
    k_fn, k_read = _calls_per_sample(fn, window), _calls_per_sample(read, window)
    good: list[tuple[float, float]] = []
    loaded: list[tuple[float, float, float]] = []
    for _ in range(tries):
        t_read, o1 = _sample(read, k_read)
        t_fn, o2 = _sample(fn, k_fn)
        if max(o1, o2) <= MAX_OTHER_CORES:
            good.append((t_fn, t_read))
            if len(good) == reps:
                break
        else:
            loaded.append((max(o1, o2), t_fn, t_read))
            time.sleep(0.05)
    noisy = len(good) < reps
    good += [(f, r) for _, f, r in sorted(loaded)[: reps - len(good)]]  # least loaded of the rest
    return (statistics.median(f for f, _ in good), statistics.median(r for _, r in good),
            statistics.median(r / f for f, r in good), noisy)


def _worker(threads: int, sizes: list[int], reps: int, window: float, tries: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)  # before the kernels are imported (and built)
    from hivetrain.kernels import fast_cpu
    from hivetrain.kernels import int8 as codec

    results: list[dict[str, Any]] = []
    limits: dict[str, dict[str, float]] = {}
    noisy: list[str] = []
    for numel in sizes:
        timings, bad = _measure_size(numel, reps, window, tries)
        noisy += [f"{name}@{numel}" for name in bad]
        read_numel = max(numel, READ_MIN_NUMEL)
        read = read_numel * 4 / statistics.median(t_read for _, t_read, _ in timings.values()) / 1e9
        limits[str(numel)] = {"read": read, **{op: read * f for op, f in LIMIT_FACTOR.items()}}
        for op, (t_op, _, read_over_op) in timings.items():
            read_over_op *= numel / read_numel  # per element: t_read covers read_numel elements
            gbps = (4 if op == "reduce4" else 1) * numel * 4 / t_op / 1e9
            if op in REFERENCE_OPS:
                limits[str(numel)][REFERENCE_OPS[op]] = gbps
                continue
            # ratio from the paired samples: (op GB/s) / (read GB/s * factor), robust to load drift
            ratio = (4 if op == "reduce4" else 1) * read_over_op / LIMIT_FACTOR[op]
            results.append({"op": op, "threads": threads, "numel": numel, "gbps": gbps,
                            "ratio_to_memory_limit": ratio, "ratio_to_read": ratio * LIMIT_FACTOR[op],
                            "ms": t_op * 1e3})
    return {"threads": threads, "results": results, "limits": limits, "noisy": noisy,
            "active_path": codec.active_path(), "build": fast_cpu.BUILD_INFO or fast_cpu.UNAVAILABLE_REASON}


def _measure_size(numel: int, reps: int, window: float, tries: int) -> tuple[dict[str, tuple[float, float, float]], list[str]]:
    """Per op on ``numel`` elements: (seconds per call, seconds per read-baseline call in the paired samples,
    median t_read / t_op), and the ops whose samples stayed noisy."""
    import torch

    from hivetrain.kernels import fast_cpu
    from hivetrain.kernels import int8 as codec

    fast = codec.active_path() == fast_cpu.NAME
    g = torch.Generator().manual_seed(numel)
    xs = [torch.randn(numel, generator=g) * (1 + 0.25 * i) for i in range(4)]  # (numel,) float32 each
    x = xs[0]
    big = x if numel >= READ_MIN_NUMEL else torch.randn(READ_MIN_NUMEL, generator=g)  # (>= 100M,) the read baseline
    nbytes = codec.encoded_nbytes(numel)
    outs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(5)]  # preallocated, pre-faulted
    acc = torch.zeros(numel)

    def encode(src: torch.Tensor, out: torch.Tensor) -> None:
        if fast:
            fast_cpu.encode_into(src, out)
        else:
            out.copy_(torch.frombuffer(bytearray(codec.encode(src)), dtype=torch.uint8))

    payload = codec.encode(x)  # bytes, as received from the network

    def reduce4() -> None:
        for src, out in zip(xs, outs[:4], strict=True):
            encode(src, out)
        acc.zero_()
        for out in outs[:4]:
            codec.decode_accumulate(out.numpy(), numel, acc, 0.25)
        encode(acc, outs[4])

    i8 = torch.zeros(numel, dtype=torch.int8)
    rw = torch.zeros(numel)  # (numel,) for the read-write reference
    ops: dict[str, Callable[[], object]] = {
        "convert_i8": lambda: i8.copy_(x),  # torch's f32 -> int8 streaming convert: same traffic as encode
        "inplace_add": lambda: rw.add_(1.0),  # torch's in-place stream: reads and writes 4 B per element
        "encode": lambda: encode(x, outs[0]),
        "decode_accumulate": lambda: codec.decode_accumulate(payload, numel, acc),
        "reduce4": reduce4,
        "encode_bytes": lambda: codec.encode(x),
        "decode": lambda: codec.decode(payload, numel),
    }
    timings: dict[str, tuple[float, float, float]] = {}
    noisy = []
    for name, fn in ops.items():
        t_op, t_read, ratio, bad = _time_paired(fn, lambda: big.sum(), reps, window, tries)
        timings[name] = (t_op, t_read, ratio)
        if bad:
            noisy.append(name)
    return timings, noisy


def _errors(numel: int) -> dict[str, float]:
    """Relative L2 error ||decode(encode(x)) - x|| / ||x|| for three kinds of data."""
    import torch

    from hivetrain.kernels import int8 as codec

    g = torch.Generator().manual_seed(0)
    seg = 100_000
    scales = 10 ** (-3 * torch.rand(-(-numel // seg), generator=g))  # log-uniform in [1e-3, 1]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        t3 = torch.distributions.StudentT(3.0).sample((numel,)).float()
    data = {
        "gauss": torch.randn(numel, generator=g),
        "student_t3": t3,
        "mixed_scales": torch.randn(numel, generator=g) * scales.repeat_interleave(seg)[:numel],
    }
    out = {}
    for name, x in data.items():
        y = codec.quantize_roundtrip(x)
        out[name] = float((y.double() - x.double()).norm() / x.double().norm())
    return out


def _fmt_n(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else str(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--sizes", default=None, help="comma list, e.g. 10M,100M (default; --quick: 1M,10M)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=None, help="timed samples per op (default 7; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="small sizes and fewer samples: well under a minute")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = parse_counts(args.sizes or ("1M,10M" if args.quick else "10M,100M"))
    reps = args.reps or (3 if args.quick else 7)
    window = 0.03 if args.quick else 0.05
    if args.worker is not None:
        print(json.dumps(_worker(args.worker, sizes, reps, window, tries=reps * (2 if args.quick else 4))))
        return 0

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for t in [int(s) for s in args.threads.split(",")]:
        cmd = [sys.executable, "-m", "bench.codec", "--worker", str(t), "--sizes", ",".join(map(str, sizes)),
               "--reps", str(reps)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    errors = _errors(min(max(sizes), 10_027_008))

    all_rows = [r for run in runs for r in run["results"]]
    print(f"int8 codec benchmark: path={runs[0]['active_path']} ({runs[0]['build']})")
    print(f"cpu: {_cpu_name()}, {os.cpu_count()} logical CPUs; median of {reps} samples; GB/s = fp32-equivalent")
    print("\nmemory read bandwidth R (sum() of >= 100M float32), GB/s [and torch int8.copy_(f32), which streams like encode]:")
    for run in runs:
        print(f"  T={run['threads']}: " + ", ".join(f"{_fmt_n(int(n))}: {v['read']:.1f} [{v['torch_convert_f32_to_i8']:.1f}]"
                                                  for n, v in run["limits"].items()))
    print(f"\n{'op':<18}{'T':>3}{'numel':>8}{'GB/s':>9}{'limit':>8}{'ratio':>7}{'/read':>7}{'ms':>9}")
    for r in all_rows:
        lim = r["gbps"] / r["ratio_to_memory_limit"]
        op = r["op"] + ("*" if r["op"] in AVERAGER_PATH else "")
        print(f"{op:<18}{r['threads']:>3}{_fmt_n(r['numel']):>8}{r['gbps']:>9.2f}{lim:>8.1f}"
              f"{r['ratio_to_memory_limit']:>7.2f}{r['ratio_to_read']:>7.2f}{r['ms']:>9.2f}")
    print("limit: R*4/5 (encode, decode_accumulate, encode_bytes, decode), R*16/49 (reduce4); ratio = GB/s / limit")
    print("*: the path the averager runs (peer/averaging/: Codec.encode per part and result, Codec.decode per part and result)")
    # The limit above counts reads only. Dequantize-accumulate also writes 4 B per element back; where
    # writes are not free (this EPYC VM with 2 threads), torch's own in-place add, 8 B per element, is
    # the ceiling a 9 B-per-element op can be held to: GB/s / (in-place add GB/s * 8/9).
    # Only out of cache (>= READ_MIN_NUMEL elements): a smaller in-place add runs partly in the LLC.
    ceiling = [f"T={run['threads']} {_fmt_n(r['numel'])}: "
               f"{r['gbps'] / (run['limits'][str(r['numel'])]['torch_inplace_add'] * 8 / 9):.2f}"
               for run in runs for r in run["results"] if r["op"] == "decode_accumulate" and r["numel"] >= READ_MIN_NUMEL]
    if ceiling:
        print("decode_accumulate against the read-write ceiling (torch in-place add, scaled to 9 B/element): "
              + ", ".join(ceiling))
    noisy = [f"T={run['threads']}:{n}" for run in runs for n in run["noisy"]]
    if noisy:
        print("noisy (other load never dropped below 0.15 core during the sample): " + ", ".join(noisy))
    print("\nround-trip error, relative L2 (per-64K-chunk min/max int8):")
    for name, e in errors.items():
        print(f"  {name:<14}{100 * e:.3f}%")
    if args.json:
        main_ops = ("encode", "decode_accumulate", "reduce4")
        print(json.dumps({
            "results": [{k: r[k] for k in ("op", "threads", "numel", "gbps", "ratio_to_memory_limit")}
                        for r in all_rows if r["op"] in main_ops],
            "memory_limit_gbps": {str(run["threads"]): run["limits"] for run in runs},
            "error": errors,
            "extra": {"other_ops": [r for r in all_rows if r["op"] not in main_ops], "noisy": noisy,
                      "active_path": runs[0]["active_path"], "build": runs[0]["build"], "cpu": _cpu_name()},
        }))
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(main())
