"""Ready records: "I am forming round r's group from base state b", signed by the peer's libp2p key.

A peer announces a round ahead, when its inner steps start (``done`` false, with the time it
expects to be ready, ``eta``, and the base if it knows it yet), and again when it is ready
(``done`` true). Matchmaking reads them to find candidates (done, at our base) and to know whom it
is worth waiting for (announced, not yet done); a record counts only for the peer id its signature
binds it to. Two boards: the DHT (real peers) and a dict in memory (tests and simulation).

Buckets: a round's records are spread over 2^L keys (``ready_key``), so that no key, and no reader,
holds the whole run. L comes from the population of the round's base state (how many peers' parts
made it: peer/state/snapshot.py), so every peer at a base computes the same L; a peer's bucket is
the top L bits of a hash of its peer id, so buckets are nested (bucket b at level L is buckets 2b
and 2b+1 at level L+1) and the same every round (a bucket's peers meet again). A bucket holds about
BUCKET_GROUPS target-size groups (between 1x and 2x that many peers): matchmaking reads its own
bucket only and partitions it (peer/averaging/matchmaking.py); the cross-group stage reads one more,
the round's top bucket (cross.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hivetrain.dht import clock
from hivetrain.dht.errors import InvalidRecord
from hivetrain.dht.facade import aget_each
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import (
    MAX_READY_LEVEL,
    Envelope,
    bucket_of,
    decode_bound,
    encode_payload,
    ready_key,
)

READ_TIMEOUT = 5.0  # seconds for one read of the board
BUCKET_GROUPS = 4  # target-size groups a bucket holds, about (its peers are matchmaking's input)
READS_AT_ONCE = 16  # bucket keys one reader fetches at a time
GROWTH = 4  # the most a state's population grows in one round (``grown``)


def grown(population: int, weight: int, target: int) -> int:
    """The population of the state a round makes from a base of ``population``, when its means
    came from ``weight`` peers: at most GROWTH x the base's (and at least enough for GROWTH
    buckets), because the weights are the groups' own claims: a run grows by a few levels a round,
    however large a weight an attacker claims (SECURITY.md)."""
    return min(weight, GROWTH * max(population, BUCKET_GROUPS * max(1, target)))


def level(population: int, target: int) -> int:
    """log2 of the number of ready buckets of a round whose base state has ``population``: the
    largest L with population >= 2^(L+1) x BUCKET_GROUPS x target (0 for a population unknown)."""
    per = BUCKET_GROUPS * max(1, target)
    level_ = 0
    while level_ < MAX_READY_LEVEL and population >= per << (level_ + 1):
        level_ += 1
    return level_


@dataclass(frozen=True)
class Ready:
    peer_id: str  # bound to the signer's key
    round: int
    base: str  # ZERO in an announcement made before the base was known
    spec: str
    done: bool = True  # false: announced ahead, still computing
    eta: float = 0.0  # unix time it expects to be ready (a claim: readers bound what they wait)
    closed: bool = False  # nobody can dial it: an outbound-only member (peer/averaging/views.py)
    up: int = 0  # its uplink claim for the round, kB/s (peer/averaging/rates.py; 0: unknown)
    out: bool = False  # its round failed: it voids (published again over its ready record; cross.py)
    group: tuple[str, ...] = ()  # ... and the group it failed in: designees stop waiting for them


class ReadyBoard(Protocol):
    async def publish(self, identity: Identity, ready: Ready, ttl: float, level: int = 0) -> bool:
        """Stores our signed ready record in our bucket of 2^level; returns whether it was stored."""
        ...

    async def read(self, round_: int, level: int = 0, buckets: Sequence[int] | None = None) -> list[Ready]:
        """The valid ready records of ``round_`` (any base: the caller filters) in ``buckets`` of
        2^level (None: all of them)."""
        ...


def sign(identity: Identity, run_key: str, ready: Ready, ttl: float, level_: int = 0) -> Envelope:
    """The signed record. An announcement expires before the ready record that follows it, so the
    DHT (which keeps the later expiration under one subkey) never lets it replace that one."""
    fields = dict(peer_id=ready.peer_id, round=ready.round, base_hash=ready.base, spec_hash=ready.spec,
                  done=ready.done, eta=float(ready.eta), closed=ready.closed, up=ready.up)
    if ready.out:
        fields.update(out=True, group=list(ready.group))
    payload = encode_payload("ready", fields)
    key = ready_key(run_key, ready.round, level_, bucket_of(ready.round, ready.peer_id, level_))
    return Envelope.sign(identity, "ready", key, payload, clock.wall() + ttl)


def verified(envelope: Envelope, level_: int = 0, bucket: int = 0) -> Ready | None:
    """The record's content if its ``peer_id`` is its signer's libp2p id and belongs in ``bucket``
    of 2^level_; None otherwise."""
    try:
        fields = decode_bound("ready", envelope)
    except InvalidRecord:
        return None
    if bucket_of(fields["round"], fields["peer_id"], level_) != bucket:
        return None
    return Ready(fields["peer_id"], fields["round"], fields["base_hash"], fields["spec_hash"], fields["done"],
                 fields["eta"], fields.get("closed", False), fields.get("up", 0), fields.get("out", False),
                 tuple(fields.get("group", ())))


class DHTReadyBoard:
    """Ready records in the run's DHT (on the DHT's loop)."""

    def __init__(self, dht: Any, run_key: str):
        self.dht, self.run_key = dht, run_key

    async def publish(self, identity: Identity, ready: Ready, ttl: float, level: int = 0) -> bool:
        return bool(await self.dht.astore(sign(identity, self.run_key, ready, ttl, level)))

    async def read(self, round_: int, level: int = 0, buckets: Sequence[int] | None = None) -> list[Ready]:
        """Reads the buckets READS_AT_ONCE at a time; a bucket whose read fails is left out (the
        caller reads again), unless every one failed: then the error is raised."""
        chosen = list(range(1 << level) if buckets is None else buckets)
        found = await aget_each(self.dht, [ready_key(self.run_key, round_, level, b) for b in chosen], READ_TIMEOUT,
                                READS_AT_ONCE)
        out: list[Ready] = []
        for bucket, envelopes in zip(chosen, found, strict=True):
            out += [r for r in (verified(e, level, bucket) for e in envelopes or ()) if r is not None and r.round == round_]
        return out


@dataclass
class MemoryReadyBoard:
    """Ready records in a dict, for in-process swarms; signed and verified like the DHT's."""

    run_key: str = "memory"
    records: dict[tuple[int, int, int], dict[str, Envelope]] = field(default_factory=dict)  # (round, level, bucket)

    async def publish(self, identity: Identity, ready: Ready, ttl: float, level: int = 0) -> bool:
        envelope = sign(identity, self.run_key, ready, ttl, level)
        held = self.records.setdefault((ready.round, level, bucket_of(ready.round, ready.peer_id, level)), {})
        if envelope.subkey in held and held[envelope.subkey].expiration > envelope.expiration:
            return False  # like the DHT: the record that expires later stays
        held[envelope.subkey] = envelope
        for old in [k for k in self.records if k[0] < ready.round - 2]:  # bounded: recent rounds only
            del self.records[old]
        return True

    async def read(self, round_: int, level: int = 0, buckets: Sequence[int] | None = None) -> list[Ready]:
        chosen = range(1 << level) if buckets is None else buckets
        return [r for b in chosen for r in (verified(e, level, b) for e in self.records.get((round_, level, b), {}).values())
                if r is not None]
