"""One member of the anchor all-reduce of ``bench.utilization``: hivemind's DecentralizedAverager (fp16).

Started by ``bench.utilization`` (``python -m bench.hivemind_anchor ...``) once per peer namespace, on the
same shaped links as the hivetrain peers, over one fp32 tensor of the model's numel. Member ``i`` of
``n`` fills its tensor with ``i + 1 + 10 s`` before step ``s``; after the step every value must be the
group's mean ``(n + 1) / 2 + 10 s`` (fp16 on the wire: to 1e-2). hivemind can return without having
averaged all of it (a part whose reducer failed keeps the local values, silently): such a step is
reported with the share of values left un-averaged (``averaged: false``), and ``bench.utilization``
leaves it out of the timing and counts it.

Each step runs matchmaking to completion first (``require_trigger``), then times the all-reduce alone,
from the trigger to the result, and the bytes eth0 sent meanwhile (its tx counter in this namespace's
/sys). One ``BENCH {json}`` line per step on stdout; the first ``--warmup`` steps are marked as such.
The first member writes its multiaddrs to ``--info-file`` for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

STAGE_TIMEOUT = 120.0  # seconds: matchmaking of one step must finish within this


def _tx_bytes() -> int | None:
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _emit(obj: dict[str, Any]) -> None:
    print("BENCH " + json.dumps(obj), flush=True)


def run(args: argparse.Namespace) -> int:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression

    torch.set_num_threads(1)
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    averager = None
    try:
        if args.info_file:
            tmp = args.info_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}, f)
            os.replace(tmp, args.info_file)
        averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros(args.numel)], dht, prefix=args.prefix, start=True, target_group_size=args.group,
            min_group_size=args.group, min_matchmaking_time=args.min_matchmaking_time, request_timeout=5.0,
            compression=Float16Compression(), allreduce_timeout=args.allreduce_timeout)
        expected_mean = (args.group + 1) / 2
        for s in range(args.warmup + args.steps):
            with averager.get_tensors() as tensors:
                tensors[0].fill_(args.index + 1 + 10 * s)
            t0 = time.monotonic()
            control = averager.step(wait=False, require_trigger=True, timeout=STAGE_TIMEOUT)
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                if time.monotonic() - t0 > STAGE_TIMEOUT:  # the step's own timeout should have fired
                    raise RuntimeError(f"step {s}: no group within {STAGE_TIMEOUT:.0f} s")
                time.sleep(0.005)  # the stage lives in shared memory: there is nothing to wait on
            t1, tx0 = time.monotonic(), _tx_bytes()
            control.allow_allreduce()
            gathered = control.result(timeout=args.allreduce_timeout + 30)
            t2, tx1 = time.monotonic(), _tx_bytes()
            want = expected_mean + 10 * s
            with averager.get_tensors() as tensors:
                lo, hi = float(tensors[0].min()), float(tensors[0].max())
                wrong = float(((tensors[0] - want).abs() > 1e-2).float().mean())  # share of values not averaged
            averaged = gathered is not None and wrong == 0.0
            _emit({"event": "step", "step": s, "warmup": s < args.warmup, "matchmaking_s": t1 - t0,
                   "allreduce_s": t2 - t1, "group_size": None if gathered is None else len(gathered),
                   "bytes_sent": None if tx0 is None or tx1 is None else tx1 - tx0,
                   "averaged": averaged, "wrong_fraction": wrong, "min": lo, "max": hi, "expected": want})
            if not averaged:  # reported, and left out of the timing by the bench; the next step starts afresh
                print(f"step {s}: {wrong:.1%} of the tensor was not averaged (min {lo}, max {hi}, expected "
                      f"{want}, group {None if gathered is None else len(gathered)})", file=sys.stderr, flush=True)
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--index", type=int, required=True, help="this member's index, 0..group-1")
    ap.add_argument("--group", type=int, default=3, help="group size (min and target)")
    ap.add_argument("--numel", type=int, required=True, help="fp32 values in the averaged tensor")
    ap.add_argument("--host", default="127.0.0.1", help="listen address")
    ap.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of the first member")
    ap.add_argument("--info-file", default=None, help="write this member's multiaddrs here")
    ap.add_argument("--prefix", default="bench-utilization", help="the averagers' DHT prefix")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--min-matchmaking-time", type=float, default=3.0, help="seconds (hivemind's knob)")
    ap.add_argument("--allreduce-timeout", type=float, default=180.0, help="seconds for one all-reduce")
    args = ap.parse_args(argv)
    if not 0 <= args.index < args.group:
        ap.error("--index must be in [0, --group)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
