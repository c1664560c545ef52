"""This peer's totals for the life of its process: what a volunteer has given the run so far.

``Totals`` adds up the round records the training loop writes (peer/train/loop.py ``_finish``), one
``add`` per record, on the training thread; the dashboard (peer/dashboard.py) reads them with
``view`` from its own threads. Each total only grows, so each is a Prometheus counter (``/metrics``)
for as long as the process lives: unlike the charts, which keep only the latest records, nothing is
ever dropped from them.

    rounds_completed  rounds whose outer step applied its group's mean (a group of 1, alone, too)
    rounds_void       rounds voided (parameters restored): their inner steps went nowhere
    tokens            tokens trained in the completed rounds: inner steps x batch_size x seq_len each
    round_tokens      tokens all the members of those rounds trained (``round_members`` x the same),
                      across groups: the run's tokens in the rounds this peer completed
    bytes_sent        bytes sent averaging, as the round records count them (a void round's: 0)
    bytes_received    bytes received averaging, likewise
    seconds           wall-clock seconds of the completed rounds (inner steps, averaging and their
                      waits; not evaluation): the time contributed

``share`` is ``tokens / round_tokens``: this peer's share of the run's tokens over the rounds it
completed. Heartbeats carry each peer's ``tokens`` and ``rounds`` (since its process started), so
``peer status`` shows every live peer's; the run's tokens before a peer started are known to no one,
so no share of the run's whole history is claimed.
"""

from __future__ import annotations

import threading
from typing import Any

from hivetrain.peer.config import RunSpec
from hivetrain.peer.train.loop import MetricsWriter

COUNTERS = ("rounds_completed", "rounds_void", "tokens", "round_tokens", "bytes_sent", "bytes_received", "seconds")


class Totals:
    """Process-lifetime sums of this peer's round records (module doc). ``add`` is called by one
    thread (the training thread); ``view`` by any."""

    def __init__(self, peer_id: str, tokens_per_step: int):
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be at least 1, got {tokens_per_step}")
        self.peer_id, self.tokens_per_step = peer_id, tokens_per_step
        self._counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()  # a view is one consistent round boundary

    @classmethod
    def of(cls, peer_id: str, spec: RunSpec) -> Totals:
        return cls(peer_id, spec.batch_size * spec.seq_len)  # tokens of one inner step

    def add(self, record: dict[str, Any]) -> None:
        """Counts one record of the metrics stream: a round record (``event`` "round") adds to the
        totals, any other (start, sync) is ignored. Never subtracts: a negative amount counts as 0."""
        if record.get("event") != "round":
            return
        with self._lock:
            counts = self._counts
            if record.get("void"):
                counts["rounds_void"] += 1
                return
            tokens = max(0, int(record.get("inner_steps") or 0)) * self.tokens_per_step
            members = max(1, int(record.get("group_size") or 0), int(record.get("round_members") or 0))
            counts["rounds_completed"] += 1
            counts["tokens"] += tokens
            counts["round_tokens"] += tokens * members
            counts["bytes_sent"] += max(0, int(record.get("bytes_sent") or 0))
            counts["bytes_received"] += max(0, int(record.get("bytes_received") or 0))
            counts["seconds"] += max(0.0, float(record.get("round_s") or 0.0))

    def view(self) -> dict[str, Any]:
        """``peer_id``, every counter of ``COUNTERS`` and ``share`` (None before a completed round)."""
        with self._lock:
            counts = dict(self._counts)
        share = counts["tokens"] / counts["round_tokens"] if counts["round_tokens"] else None
        return {"peer_id": self.peer_id, **counts, "share": share}


class TotalsWriter(MetricsWriter):
    """The metrics stream (``MetricsWriter``: the JSON-lines file and the latest records) that also
    adds every record it writes to ``totals``."""

    def __init__(self, path: str | None, totals: Totals):
        super().__init__(path)
        self.totals = totals
        self.heartbeat: dict[str, Any] | None = None  # fields every heartbeat carries: our totals go there too

    def write(self, record: dict[str, Any]) -> None:
        super().write(record)
        self.totals.add(record)
        if self.heartbeat is not None:  # (``peer status`` shows each peer's: dht/records.py ``tokens``, ``rounds``)
            view = self.totals.view()
            self.heartbeat.update(tokens=int(view["tokens"]), rounds=int(view["rounds_completed"]))
