"""The numbers of ``bench.utilization``, from the peers' round records: pure functions, no processes.

A peer's metrics file holds one ``{"event": "round", ...}`` record per round (peer/train/loop.py). The
contract this reads, per record: ``compute_s`` (this round's inner steps), ``matchmaking_s`` (forming
the group of this round's all-reduce), ``allreduce_s`` (the decided group to the result), ``idle_s``,
``round_s`` (wall time of the training thread since the previous round record), ``utilization``
(compute_s / round_s), ``bytes_sent``, ``group_size``, ``void``, ``inner_steps`` (H).

Utilization alone can flatter overlap on a machine where the all-reduce needs the CPU the inner steps
use: the steps get slower and still fill the wall time. ``steps_per_s`` (inner steps / round wall time)
is the throughput it stands for, and both are reported.

Older peers write no ``round_s``/``idle_s``/``utilization``, and their ``allreduce_s`` is matchmaking +
all-reduce + outer step. For those (``legacy``), the bench stamps each record with ``arrived_s``, the
monotonic time it first saw the line (the file is flushed per record), and this module takes
round_s = the time between consecutive records, and all-reduce = ``allreduce_s - matchmaking_s`` (the
outer step stays in it). The new fields win whenever a record has them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MODES = ("sync", "overlap")
NEW_FIELDS = ("round_s", "idle_s")  # present only in records of peers that write the full contract


@dataclass(frozen=True)
class PeerRun:
    """One peer's round records (file order) from one (mode, link) run."""

    mode: str  # "sync" or "overlap"
    link: str  # e.g. "100mbit", "20mbit": the variant's name
    peer: str  # e.g. "p0"
    rate_bps: float  # this peer's upload cap, bits per second
    records: list[dict[str, Any]] = field(default_factory=list)


def is_legacy(record: dict[str, Any]) -> bool:
    return not any(k in record for k in NEW_FIELDS)


def round_times(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round record: the fields the rows are made of (seconds; None where unknown).

    ``round_s`` comes from the record, else from the arrival stamps of this and the previous record
    (None for the first record); ``utilization`` from the record, else compute_s / round_s."""
    out: list[dict[str, Any]] = []
    prev_arrival: float | None = None
    for rec in records:
        legacy = is_legacy(rec)
        arrival = rec.get("arrived_s")
        round_s = rec.get("round_s")
        if round_s is None and arrival is not None and prev_arrival is not None:
            round_s = arrival - prev_arrival
        prev_arrival = arrival
        compute = rec.get("compute_s")
        util = rec.get("utilization")
        if util is None and compute is not None and round_s:
            util = compute / round_s
        steps = rec.get("inner_steps")
        steps_per_s = steps / round_s if steps and round_s else None  # throughput: what utilization stands for
        void = bool(rec.get("void"))
        mm = None if void else rec.get("matchmaking_s")
        ar = None if void else rec.get("allreduce_s")
        if legacy and ar is not None:
            ar = ar - (mm or 0.0)  # the old allreduce_s also held matchmaking (and the outer step)
        out.append({"round": rec.get("round"), "void": void, "compute_s": compute, "round_s": round_s,
                    "utilization": util, "steps_per_s": steps_per_s, "matchmaking_s": mm, "allreduce_s": ar,
                    "idle_s": rec.get("idle_s"), "bytes_sent": None if void else rec.get("bytes_sent"),
                    "group_size": rec.get("group_size"), "legacy": legacy})
    return out


def median(values: Sequence[float | None]) -> float | None:
    """The median of the known values; None if there is none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def peer_row(run: PeerRun, warmup: int, hivemind_s: float | None = None) -> dict[str, Any]:
    """One table row: medians over the rounds after the first ``warmup`` records.

    Utilization, compute and round seconds count every measured round (a void round is wall time
    too); matchmaking, all-reduce and bytes only the rounds that completed. bound_s is the bytes this
    peer sent, over its upload rate: the all-reduce cannot be faster at that peer's uplink."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    measured = round_times(run.records)[warmup:]
    done = [r for r in measured if not r["void"]]
    sent = median([r["bytes_sent"] for r in done])
    allreduce = median([r["allreduce_s"] for r in done])
    bound = sent * 8 / run.rate_bps if sent is not None and run.rate_bps > 0 else None
    return {"mode": run.mode, "link": run.link, "peer": run.peer, "rate_bps": run.rate_bps,
            "rounds": len(measured), "void_rounds": len(measured) - len(done),
            "utilization": median([r["utilization"] for r in measured]),
            "steps_per_s": median([r["steps_per_s"] for r in measured]),
            "compute_s": median([r["compute_s"] for r in measured]),
            "round_s": median([r["round_s"] for r in measured]),
            "idle_s": median([r["idle_s"] for r in measured]),
            "matchmaking_s": median([r["matchmaking_s"] for r in done]),
            "allreduce_s": allreduce, "bytes_sent": sent, "bound_s": bound,
            "ratio": allreduce / bound if allreduce is not None and bound else None,
            "group_size": median([r["group_size"] for r in done]),
            "hivemind_allreduce_s": hivemind_s,
            "legacy_metrics": any(r["legacy"] for r in measured), "missing": None}


def missing_row(mode: str, link: str, peer: str, rate_bps: float, why: str,
                hivemind_s: float | None = None) -> dict[str, Any]:
    """A row for a (mode, link, peer) that was not measured, saying why; every number is None."""
    return {"mode": mode, "link": link, "peer": peer, "rate_bps": rate_bps, "rounds": 0, "void_rounds": 0,
            "utilization": None, "steps_per_s": None, "compute_s": None, "round_s": None, "idle_s": None,
            "matchmaking_s": None, "allreduce_s": None, "bytes_sent": None, "bound_s": None, "ratio": None, "group_size": None,
            "hivemind_allreduce_s": hivemind_s, "legacy_metrics": False, "missing": why}


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table (one line per row; a missing row says why)."""
    head = (f"{'mode':<8}{'link':<9}{'peer':<5}{'rate':>8}{'rounds':>7}{'void':>5}{'util':>6}{'steps/s':>8}{'compute':>8}"
            f"{'round':>7}{'mm s':>6}{'ar s':>7}{'bound':>7}{'ratio':>6}{'MB sent':>8}{'hivemind':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = f"{r['rate_bps'] / 1e6:g}M"
        line = f"{r['mode']:<8}{r['link']:<9}{r['peer']:<5}{rate:>8}"
        if r["missing"]:
            lines.append(f"{line}  not measured: {r['missing']}")
            continue
        sent = None if r["bytes_sent"] is None else r["bytes_sent"] / 1e6
        lines.append(f"{line}{r['rounds']:>7}{r['void_rounds']:>5}{_fmt(r['utilization'], '.2f'):>6}"
                     f"{_fmt(r['steps_per_s'], '.3f'):>8}"
                     f"{_fmt(r['compute_s'], '.1f'):>8}{_fmt(r['round_s'], '.1f'):>7}"
                     f"{_fmt(r['matchmaking_s'], '.2f'):>6}{_fmt(r['allreduce_s'], '.2f'):>7}"
                     f"{_fmt(r['bound_s'], '.2f'):>7}{_fmt(r['ratio'], '.2f'):>6}{_fmt(sent, '.1f'):>8}"
                     f"{_fmt(r['hivemind_allreduce_s'], '.2f'):>9}")
    return "\n".join(lines)
