"""The one seam between the DiLoCo loop and the averaging protocol: ``Averager``, and the group
arithmetic every member derives from shared data (shards, order, group hash)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.wire import MAX_PIECES as MAX_PIECES  # shards of one round, in all (re-exported)


@dataclass(frozen=True)
class AverageResult:
    averaged: torch.Tensor  # (n,) fp32: identical bytes on every member of the group that applies it
    group: tuple[str, ...]  # member peer ids, in the group's fixed order
    applied: str  # hex digest of what was applied (group, per-shard result hashes): the state's lineage
    bytes_sent: int = 0  # bytes this peer wrote for the round (requests and replies, headers included)
    bytes_received: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)  # member -> why its part was left out (by reducers)
    void_ranges: tuple[tuple[int, int], ...] = ()  # [start, end) of shards voided by their audit: not applied
    # peers we saw this round that averaged without us (we went alone) and when they must be done
    # (clock.now()): fork choice at the next boundary should see where they ended (RoundFailed too)
    awaiting: tuple[str, ...] = ()
    awaiting_until: float = 0.0
    # with the cross-group stage: peers ready at our base this round, beyond our group, whose groups'
    # results went into the same means (as far as we know: the candidates our matchmaking saw)
    companions: tuple[str, ...] = ()
    # with the cross-group stage: the total weight of the round's means (the peers whose parts are in
    # them), the same for every peer that applies them: the new state's population (ready.level)
    population: int = 0


class Pending(Protocol):
    def result(self) -> AverageResult:
        """Waits for the averaging (at most the run's deadlines); raises RoundFailed like ``average``."""
        ...


class Averager(Protocol):
    def average(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> AverageResult:
        """Averages ``delta`` (n,) fp32 with a group of peers that start round ``round_`` from the
        state ``base_hash`` (whose population is ``population``: peer/state/snapshot.py). Called by
        the training thread; blocks at most the run's deadlines. Raises RoundFailed if the round
        cannot complete for this peer: then nothing was averaged and the caller must void the round."""
        ...

    def begin(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> Pending:
        """``average`` without waiting: the caller keeps ``delta`` unchanged until ``result()`` returned."""
        ...

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None, population: int = 0) -> None:
        """Tells the run, without waiting, that we will be ready for round ``round_`` in about ``eta_s``
        seconds (None: unknown), from ``base_hash`` (None: not known yet) of ``population``."""
        ...


@dataclass(frozen=True)
class Finished:
    """A ``Pending`` that is already over: what a synchronous averager's ``begin`` returns."""

    outcome: AverageResult | RoundFailed

    def result(self) -> AverageResult:
        if isinstance(self.outcome, RoundFailed):
            raise self.outcome
        return self.outcome


def begin_now(averager: Averager, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> Finished:
    """``begin`` for averagers that can only run synchronously."""
    try:
        return Finished(averager.average(round_, base_hash, delta, population))
    except RoundFailed as e:
        return Finished(e)


MIN_PIECES = 4  # pieces per member asked for where each still holds MIN_PIECE_VALUES values
MIN_PIECE_VALUES = 1 << 17


def pieces_per_member(numel: int, group_size: int, piece_values: int) -> int:
    """Into how many pieces each member's share of the vector is cut: at most ``piece_values``
    values each, and at least MIN_PIECES where the pieces keep MIN_PIECE_VALUES values (a share in
    one piece is not pipelined: its result, audit and cross-group upload start only after its last
    part; bench.swarm --slow-member: 1.35x -> 1.19x the bound at 8M values and 8 members); at least
    one, at most MAX_PIECES in the whole group."""
    share = -(-numel // group_size)
    wanted = max(-(-share // piece_values), min(MIN_PIECES, share // MIN_PIECE_VALUES))
    return max(1, min(wanted, MAX_PIECES // group_size))


def shard_bounds(numel: int, group_size: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [start, end) shards, one per member (or per piece: ``group_size``
    members x pieces per member)."""
    base, extra = divmod(numel, group_size)
    bounds, start = [], 0
    for k in range(group_size):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def group_order(members: Sequence[str], round_: int, base_hash: str) -> tuple[str, ...]:
    """The group's fixed order, derived by every member from shared data: of its members that can be
    dialed (not closed), the k-th reduces the shards (pieces) j with j mod n = k and audits those
    with j mod n = k - 1. Ordering by a hash of
    (round, base state, peer id) rotates the roles every round without letting any peer choose its place."""
    def key(peer_id: str) -> bytes:
        return hashlib.sha256(f"{round_}/{base_hash}/{peer_id}".encode()).digest()

    return tuple(sorted(set(members), key=key))


def group_hash(members: Sequence[str], round_: int, base_hash: str, closed: Collection[str] = (),
               claims: Mapping[str, int] | None = None) -> str:
    """The group's name; it commits to which members are closed (outbound-only) and to the uplink
    each member claimed (peer/averaging/rates.py), since those decide the roles: members that
    derived different roles must not take each other's messages."""
    lines = [str(round_), base_hash, *members]
    if closed:
        lines += ["closed", *sorted(closed)]
    if claims and any(claims.get(p, 0) for p in members):
        lines += ["up", *(f"{p}={claims.get(p, 0)}" for p in members)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
