"""The one seam between the DiLoCo loop and the transport: ``Averager``.

The reduce semantics are shared by every implementation (``reduce_parts``): the group's flat
pseudo-gradient is split into one contiguous shard per member; each member encodes its shard-k
slice and sends it to the reducer of shard k; the reducer decodes and accumulates the parts in fp32
in the group's fixed member order, divides by the group size (equal weights: a peer's weight is set
by the protocol, never by the sender), and re-encodes the result once. Every member, the reducer
included, applies the decoded bytes of that one re-encoding, so every member ends the round with
bit-identical parameters.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.aggregation import aggregate
from hivetrain.peer.errors import RoundFailed


@dataclass(frozen=True)
class AverageResult:
    averaged: torch.Tensor  # (n,) fp32: identical bytes on every member of the group
    group: tuple[str, ...]  # member peer ids, in the group's fixed order
    bytes_sent: int = 0  # bytes this peer wrote for the round (all messages, headers included)
    bytes_received: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)  # member -> why its part was left out (by reducers)
    void_ranges: tuple[tuple[int, int], ...] = ()  # [start, end) of shards voided by their audit: not applied


class Averager(Protocol):
    def average(self, round_: int, base_hash: str, delta: torch.Tensor) -> AverageResult:
        """Averages ``delta`` (n,) fp32 with a group of peers that start round ``round_`` from the
        state ``base_hash``. Called by the training thread; blocks at most the run's deadlines.
        Raises RoundFailed if the round cannot complete for this peer: then nothing was averaged
        and the caller must void the round."""
        ...


def shard_bounds(numel: int, group_size: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [start, end) shards, one per member."""
    base, extra = divmod(numel, group_size)
    bounds, start = [], 0
    for k in range(group_size):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def group_order(members: Sequence[str], round_: int, base_hash: str) -> tuple[str, ...]:
    """The group's fixed order, derived by every member from shared data: member k reduces shard k.

    Ordering by a hash of (round, base state, peer id) rotates the shard assignment every round
    without letting any peer choose its place."""
    def key(peer_id: str) -> bytes:
        return hashlib.sha256(f"{round_}/{base_hash}/{peer_id}".encode()).digest()

    return tuple(sorted(set(members), key=key))


def group_hash(members: Sequence[str], round_: int, base_hash: str) -> str:
    return hashlib.sha256("\n".join([str(round_), base_hash, *members]).encode()).hexdigest()


def reduce_parts(parts: Sequence[bytes], numel: int, codec: Codec, how: str = "mean") -> bytes:
    """The reducer's work for one shard: the decoded parts (in the given order) combined in fp32
    (peer/aggregation.py), re-encoded once. Raises CodecError if any part is malformed."""
    if how == "mean":
        acc = torch.zeros(numel, dtype=torch.float32)  # (numel,) fp32 accumulator
        for part in parts:
            codec.decode_accumulate(part, numel, acc)
        return codec.encode(acc.mul_(1.0 / len(parts)))
    return codec.encode(aggregate([codec.decode(part, numel) for part in parts], how))


class InMemoryHub:
    """In-process group of ``size`` averagers for tests and simulation; every round uses all members.

    Runs exactly the reduce semantics of the network averager (encode, fp32 reduce, one re-encode)
    without a network. Members call ``average`` from their own threads; the call blocks until
    every member has submitted or ``timeout`` passes.
    """

    def __init__(self, size: int, codec: Codec, timeout: float = 60.0):
        self.size, self.codec, self.timeout = size, codec, timeout
        self._barrier = threading.Barrier(size)
        self._lock = threading.Lock()
        self._submitted: dict[str, tuple[int, str, torch.Tensor]] = {}
        self._outcome: tuple[int, tuple[str, ...], torch.Tensor] | None = None
        self.fail_rounds: set[int] = set()  # test hook: these rounds fail for every member

    def averager(self, peer_id: str) -> InMemoryAverager:
        return InMemoryAverager(self, peer_id)

    def all_reduce(self, round_: int, base_hash: str, deltas: dict[str, torch.Tensor]) -> tuple[tuple[str, ...], torch.Tensor]:
        """Single-threaded entry for simulation: reduces all members' deltas at once."""
        order = group_order(list(deltas), round_, base_hash)
        numel = next(iter(deltas.values())).numel()
        out = torch.empty(numel, dtype=torch.float32)
        for (start, end) in shard_bounds(numel, len(order)):
            parts = [self.codec.encode(deltas[p][start:end].contiguous()) for p in order]
            out[start:end] = self.codec.decode(reduce_parts(parts, end - start, self.codec), end - start)
        return order, out

    def _run(self, peer_id: str, round_: int, base_hash: str, delta: torch.Tensor) -> AverageResult:
        with self._lock:
            self._submitted[peer_id] = (round_, base_hash, delta.clone())
        try:
            if self._barrier.wait(self.timeout) == 0:  # exactly one member computes the outcome
                with self._lock:
                    subs, self._submitted = self._submitted, {}
                    keys = {(r, h) for r, h, _ in subs.values()}
                    if round_ in self.fail_rounds or len(keys) != 1:
                        self._outcome = None  # members disagree on the round or base: void for all
                    else:
                        self._outcome = (round_, *self.all_reduce(round_, base_hash,
                                                                  {p: d for p, (_, _, d) in subs.items()}))
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise RoundFailed(f"in-memory group for round {round_} did not assemble") from None
        outcome = self._outcome
        if outcome is None or outcome[0] != round_:
            raise RoundFailed(f"round {round_} failed for the whole in-memory group")
        _, order, averaged = outcome
        return AverageResult(averaged.clone(), order)


class InMemoryAverager:
    def __init__(self, hub: InMemoryHub, peer_id: str):
        self.hub, self.peer_id = hub, peer_id

    def average(self, round_: int, base_hash: str, delta: torch.Tensor) -> AverageResult:
        return self.hub._run(self.peer_id, round_, base_hash, delta)
