"""How fast this peer sends, measured from its own transfers, and how a group divides its reduce
work by the rates its members claim.

Measuring: the ``Outbox`` of each round records when each of our parts was delivered (``Meter``).
``Rates`` keeps the median of recent rounds and claims it in kB/s with two significant digits, fixed for a round (the ready record and the view messages of a
round carry the same claim, so every member derives the same roles).

Dividing: the group's open members whose claim is at least SLOW_SHARE of the members' median
reduce; the others only send (like closed members), as long as two members reduce (every shard
needs an auditor that is not its reducer). Each reducer gets shards in proportion to its
claim (unknown claims count as the median, a claim counts at most MAX_OVER_MEDIAN x the median: a
peer that lies high only takes a bounded share, and every shard it reduces is still audited),
dealt by smooth weighted round robin so the pipelined shards alternate between reducers. With equal
claims this is member k mod n, as before.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hivetrain.dht import clock

SLOW_SHARE = 0.5  # members below this fraction of the median claim only send
MAX_OVER_MEDIAN = 4.0  # a claim counts at most this many times the median
MIN_BODY = 4096  # bytes: smaller bodies (verdicts, statements) say nothing about the uplink
ROUNDS = 5  # measured rounds the estimate is the median of
MAX_SENDS = 4096  # deliveries a round's meter keeps (a round has at most MAX_PIECES x 2 parts)
MAX_CLAIM = 10**8  # kB/s (800 Gbit/s): claims above are not a rate


def quantize(bytes_per_s: float) -> int:
    """kB/s with two significant digits (0: unknown)."""
    kb = int(bytes_per_s / 1000)
    if kb <= 0:
        return 0
    scale = 10 ** max(0, len(str(kb)) - 2)
    return min(MAX_CLAIM, max(1, round(kb / scale)) * scale)


@dataclass
class Meter:
    """When our parts of one round were delivered (the ``Outbox`` calls ``delivered``).

    Every member puts all its parts at once when the round starts, so they leave at the speed of
    our uplink, unless a receiver's downlink is slower: the uplink is the bytes delivered by the
    time half of the bytes were, over that time. A slow receiver only holds up the last of them."""

    started: float = -1.0
    done: list[tuple[float, int]] = field(default_factory=list)  # (clock.now() when delivered, bytes)

    def begin(self) -> None:
        if self.started < 0:
            self.started = clock.now()

    def delivered(self, nbytes: int) -> None:
        if self.started >= 0 and nbytes >= MIN_BODY and len(self.done) < MAX_SENDS:
            self.done.append((clock.now(), nbytes))

    def uplink(self) -> float:
        """Bytes per second (0.0: nothing measurable was sent)."""
        total, got = sum(n for _, n in self.done), 0
        for when, n in sorted(self.done):
            got += n
            if 2 * got >= total:
                return got / (when - self.started) if when > self.started else 0.0
        return 0.0


@dataclass
class Rates:
    """This peer's uplink estimate: the median of its last ROUNDS measured rounds (one odd round,
    a busy receiver or a round spent waiting, does not move it). ``enabled`` false: never claims
    (equal shares, as before rates were measured)."""

    enabled: bool = True
    recent: list[float] = field(default_factory=list)  # bytes/s of the last rounds, oldest first

    def observe(self, meter: Meter) -> None:
        rate = meter.uplink()
        if rate > 0:
            self.recent = [*self.recent, rate][-ROUNDS:]

    @property
    def up(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def claim(self) -> int:
        return quantize(self.up) if self.enabled else 0


def weights(reducers: Sequence[str], claims: Mapping[str, int]) -> dict[str, float]:
    """Each reducer's weight: its claim, unknown as the median, at most MAX_OVER_MEDIAN x the median."""
    known = [claims[p] for p in reducers if claims.get(p, 0) > 0]
    if not known:
        return {p: 1.0 for p in reducers}
    median = statistics.median(known)
    return {p: float(min(claims.get(p, 0) or median, MAX_OVER_MEDIAN * median)) for p in reducers}


def slow(members: Sequence[str], claims: Mapping[str, int]) -> frozenset[str]:
    """Members whose claim is below SLOW_SHARE of the median of the known claims: they only send;
    but two members reduce whenever two can (a shard needs an auditor besides its reducer), the
    fastest of the slow ones first (ties: the earlier in ``members``)."""
    known = [claims[p] for p in members if claims.get(p, 0) > 0]
    if len(known) < 2:
        return frozenset()
    median = statistics.median(known)
    out = [p for p in members if 0 < claims.get(p, 0) < SLOW_SHARE * median]
    out.sort(key=lambda p: -claims[p])
    keep = max(0, min(2, len(members)) - (len(members) - len(out)))
    return frozenset(out[keep:])


def deal(reducers: Sequence[str], weight: Mapping[str, float], units: int) -> list[str]:
    """The reducer of each of ``units`` shards: smooth weighted round robin (ties to the earlier
    reducer), so each gets about its weight's share and consecutive shards alternate."""
    total = sum(weight[p] for p in reducers)
    current = dict.fromkeys(reducers, 0.0)
    out = []
    for _ in range(units):
        for p in reducers:
            current[p] += weight[p]
        best = max(reducers, key=lambda p: current[p])  # max keeps the first of equal values
        current[best] -= total
        out.append(best)
    return out
