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

Both the ledger and the bans outlive the process (``LedgerFile``: ``<run key>.trust.json`` next to
the run's checkpoint, rewritten at every round boundary): a restarted peer is not a newcomer to its
own run. Without that, every restart (and every peer at once, after a power cut) weighed the run's
state by counting identities again, and forgot whom it had caught (review N2).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hivetrain.dht.identity import PEER_ID_RE

RAMP = 1  # rounds together for full weight (see the module doc for why not more)
WINDOW = 100  # rounds: trust earned longer ago than this has decayed to nothing
MAX_KNOWN = 10_000  # peers remembered (~100 bytes each); the least recently seen is forgotten first


@dataclass
class _Record:
    first: int  # first round completed together
    last: int  # last round completed together
    together: int  # rounds completed together


class Trust:
    """``banned``: whom we caught (``Bans.__contains__``): a banned peer weighs nothing, whatever it
    did before, and a round completed with it earns it nothing (review N9)."""

    def __init__(self, max_known: int = MAX_KNOWN, banned: Callable[[str], bool] | None = None):
        if max_known < 1:
            raise ValueError(f"max_known must be >= 1, got {max_known}")
        self.max_known = max_known
        self.banned = banned or (lambda peer: False)
        self._peers: dict[str, _Record] = {}  # least recently seen first
        self._our_first: int | None = None  # first round we completed with anyone but ourselves

    def __len__(self) -> int:
        return len(self._peers)

    def record_completed(self, round_: int, group: Iterable[str], me: str) -> None:
        """Round ``round_`` completed (audited where the run audits) with ``group`` (ours included)."""
        others = [p for p in group if p != me and not self.banned(p)]
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
        if rec is None or round_ - rec.last > WINDOW or self.banned(peer):
            return 0.0
        return min(rec.together, RAMP) / RAMP

    def trusted(self, round_: int) -> dict[str, float]:
        """Every peer with a positive weight at ``round_``."""
        return {p: w for p in self._peers if (w := self.weight(p, round_)) > 0}

    def state(self) -> dict[str, Any]:
        """The ledger as plain data (``restore`` reads it back)."""
        return {"our_first": self._our_first,
                "peers": [[p, r.first, r.last, r.together] for p, r in self._peers.items()]}

    def restore(self, data: Any) -> None:
        """Replaces the ledger with ``state()``'s data; ValueError (and nothing changed) if malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("peers"), list):
            raise ValueError("no peers list")
        our_first = data.get("our_first")
        if our_first is not None and not _round(our_first):
            raise ValueError("bad first round")
        peers: dict[str, _Record] = {}
        for row in data["peers"][-self.max_known:]:
            if not (isinstance(row, list) and len(row) == 4 and _peer(row[0]) and all(_round(v) for v in row[1:])
                    and row[1] <= row[2] and row[3] >= 1):
                raise ValueError(f"bad entry {str(row)[:80]}")
            peers.pop(row[0], None)
            peers[row[0]] = _Record(row[1], row[2], row[3])
        self._peers, self._our_first = peers, our_first


MAX_BANS = 4096  # peers we remember catching; the oldest ban is forgotten first


class Bans:
    """Peers we caught breaking the protocol, and why: never grouped with, nothing they send is used.
    Bounded (fresh identities are free, so the oldest ban makes room); any thread that owns it."""

    def __init__(self, max_bans: int = MAX_BANS):
        self.max_bans = max_bans
        self._why: dict[str, str] = {}
        self._strikes: dict[str, tuple[int, str]] = {}  # peer -> (round, why) of a failure we could not attribute

    def strike(self, peer: str, why: str, round_: int) -> bool:
        """A failure that an honest peer can cause by crashing (it accused and then could not show its
        evidence): the first round's is remembered, one in a later round bans (a crash fails every
        shard of its round at once: one strike). True if ``peer`` is banned now. Bounded as the
        bans are (the oldest strike makes room); not persisted."""
        if peer in self._why:
            return True
        first = self._strikes.get(peer)
        if first is not None and first[0] != round_:
            del self._strikes[peer]
            self.ban(peer, f"round {round_}: {why} (and in round {first[0]}: {first[1]})")
            return True
        if first is None:
            self._strikes[peer] = (round_, why)
        while len(self._strikes) > self.max_bans:
            del self._strikes[next(iter(self._strikes))]
        return False

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

    def state(self) -> list[list[str]]:
        return [[p, why] for p, why in list(self._why.items())]  # (one C call: safe against another thread's ban)

    def restore(self, data: Any) -> None:
        """Replaces the bans with ``state()``'s data; ValueError (and nothing changed) if malformed."""
        if not isinstance(data, list):
            raise ValueError("no bans list")
        why: dict[str, str] = {}
        for row in data[-self.max_bans:]:
            if not (isinstance(row, list) and len(row) == 2 and _peer(row[0]) and isinstance(row[1], str)):
                raise ValueError(f"bad ban {str(row)[:80]}")
            why.pop(row[0], None)
            why[row[0]] = row[1][:MAX_WHY]
        self._why = why


MAX_WHY = 300  # characters of a ban's reason kept
LEDGER_VERSION = 1
MAX_LEDGER_BYTES = 8 * 1024 * 1024  # a full ledger and full bans take about 1.5 MB


def _peer(value: Any) -> bool:
    return isinstance(value, str) and PEER_ID_RE.fullmatch(value) is not None


def _round(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


class LedgerFile:
    """Keeps a peer's trust ledger and bans of one run in ``path`` (JSON): ``load`` at start, then
    ``save`` at each round boundary (the training thread snapshots them; a thread of its own writes,
    atomically: a crash leaves the previous file). An unreadable file is said through ``log`` and
    left alone (the peer starts as a newcomer, as it would have without it)."""

    def __init__(self, path: str, run_key: str, log: Callable[[str], None]):
        self.path, self.run_key, self.log = path, run_key, log
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trust-ledger")

    def load(self, trust: Trust, bans: Bans) -> None:
        """Fills ``trust`` and ``bans`` from the file, if there is a good one."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_LEDGER_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as e:
            self.log(f"warning: cannot read the trust ledger {self.path} ({e.strerror or e}); starting without it")
            return
        try:
            if len(raw) > MAX_LEDGER_BYTES:
                raise ValueError(f"over {MAX_LEDGER_BYTES} bytes")
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != LEDGER_VERSION or data.get("run") != self.run_key:
                raise ValueError("not a ledger of this run")
            fresh_trust, fresh_bans = Trust(trust.max_known), Bans(bans.max_bans)  # (checked before any change)
            fresh_trust.restore(data.get("trust"))
            fresh_bans.restore(data.get("bans"))
        except ValueError as e:  # (json's errors are ValueErrors too)
            self.log(f"warning: ignoring the trust ledger {self.path} ({str(e)[:120]}); starting without it")
            return
        trust.restore(fresh_trust.state())
        bans.restore(fresh_bans.state())
        self.log(f"trust ledger: {len(trust)} peers we completed rounds with, {len(bans)} banned")

    def save(self, trust: Trust, bans: Bans) -> None:
        data = {"version": LEDGER_VERSION, "run": self.run_key, "trust": trust.state(), "bans": bans.state()}
        self._pool.submit(self._write, json.dumps(data, separators=(",", ":")))

    def _write(self, text: str) -> None:
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError as e:
            self.log(f"warning: could not write the trust ledger ({e})")

    def flush(self) -> None:
        """Waits for the writes submitted so far."""
        self._pool.submit(lambda: None).result()
