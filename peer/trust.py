"""Earned trust: the peers this peer completed rounds with, and how much that is worth.

Identities are free, so nothing may be decided by counting identities. What costs an identity
something is work with us: a round completed together in one group (audited, when the run audits)
means it sent a part that passed validation, robust aggregation and the audit, for every shard.

- ``weight(peer, r)`` in [0, 1]: 0 for a stranger; ``rounds together / RAMP`` (at most 1) for a
  peer we last completed a round with at most ``WINDOW`` rounds before r; 0 again after that
  (trust decays: an identity that stopped working with us stops counting). Fork choice
  (peer/state/choose.py) sums these weights; a stranger's attestation counts for nothing.
  RAMP is 1: after a partition each side has worked longer with its own members than with the
  other side's, and a weight that kept growing with rounds together would make both sides prefer
  themselves forever; with equal weights the two sides apply the same tie-break and reunite.
- ``on_probation(peer, r)``: we completed a round before r, but never one with ``peer``. Reducers
  give such a peer's part weight 0 and groups keep such peers a minority (peer/averaging/).
  A peer without any history trusts everyone: the first round of a run has nobody to vet.

Owned by the training thread; the averager reads it while the training thread waits for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

RAMP = 1  # rounds together for full weight (see the module doc for why not more)
WINDOW = 100  # rounds: trust earned longer ago than this has decayed to nothing
MAX_KNOWN = 10_000  # peers remembered (~100 bytes each); the least recently seen is forgotten first


@dataclass
class _Record:
    first: int  # first round completed together
    last: int  # last round completed together
    together: int  # rounds completed together


class Trust:
    def __init__(self, max_known: int = MAX_KNOWN):
        if max_known < 1:
            raise ValueError(f"max_known must be >= 1, got {max_known}")
        self.max_known = max_known
        self._peers: dict[str, _Record] = {}  # least recently seen first
        self._our_first: int | None = None  # first round we completed with anyone but ourselves

    def __len__(self) -> int:
        return len(self._peers)

    def record_completed(self, round_: int, group: Iterable[str], me: str) -> None:
        """Round ``round_`` completed (audited where the run audits) with ``group`` (ours included)."""
        others = [p for p in group if p != me]
        if not others:
            return  # a round alone vets nobody
        if self._our_first is None or round_ < self._our_first:
            self._our_first = round_
        for peer in others:
            rec = self._peers.pop(peer, None)  # re-inserted last: most recently seen
            if rec is None:
                rec = _Record(round_, round_, 0)
            rec.first, rec.last, rec.together = min(rec.first, round_), max(rec.last, round_), rec.together + 1
            self._peers[peer] = rec
        while len(self._peers) > self.max_known:
            del self._peers[next(iter(self._peers))]

    def has_history(self, round_: int) -> bool:
        """Whether we completed a round with anybody before ``round_``."""
        return self._our_first is not None and self._our_first < round_

    def on_probation(self, peer: str, round_: int) -> bool:
        """A peer we never completed a round with before ``round_``, once we have a history."""
        if not self.has_history(round_):
            return False
        rec = self._peers.get(peer)
        return rec is None or rec.first >= round_

    def weight(self, peer: str, round_: int) -> float:
        """What ``peer``'s word is worth to us at round ``round_``: see the module doc."""
        rec = self._peers.get(peer)
        if rec is None or round_ - rec.last > WINDOW:
            return 0.0
        return min(rec.together, RAMP) / RAMP

    def trusted(self, round_: int) -> dict[str, float]:
        """Every peer with a positive weight at ``round_``."""
        return {p: w for p in self._peers if (w := self.weight(p, round_)) > 0}


MAX_BANS = 4096  # peers we remember catching; the oldest ban is forgotten first


class Bans:
    """Peers we caught breaking the protocol, and why: never grouped with, nothing they send is used.
    Bounded (fresh identities are free, so the oldest ban makes room); any thread that owns it."""

    def __init__(self, max_bans: int = MAX_BANS):
        self.max_bans = max_bans
        self._why: dict[str, str] = {}

    def __contains__(self, peer: object) -> bool:
        return peer in self._why

    def __len__(self) -> int:
        return len(self._why)

    def ban(self, peer: str, why: str) -> None:
        self._why.pop(peer, None)
        self._why[peer] = why
        while len(self._why) > self.max_bans:
            del self._why[next(iter(self._why))]

    def why(self, peer: str) -> str | None:
        return self._why.get(peer)
