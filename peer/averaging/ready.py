"""Ready records: "I am forming round r's group from base state b", signed by the peer's libp2p key.

A peer announces a round ahead, when its inner steps start (``done`` false, with the time it
expects to be ready, ``eta``, and the base if it knows it yet), and again when it is ready
(``done`` true). Matchmaking reads them to find candidates (done, at our base) and to know whom it
is worth waiting for (announced, not yet done); a record counts only for the peer id its signature
binds it to. Two boards: the DHT (real peers) and a dict in memory (tests and simulation).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from hivetrain.dht import clock
from hivetrain.dht.errors import InvalidRecord
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import Envelope, decode_bound, encode_payload, ready_key

READ_TIMEOUT = 5.0  # seconds for one read of the board


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
    async def publish(self, identity: Identity, ready: Ready, ttl: float) -> bool:
        """Stores our signed ready record; returns whether it was stored."""
        ...

    async def read(self, round_: int) -> list[Ready]:
        """The valid ready records of ``round_`` (any base: the caller filters)."""
        ...


def sign(identity: Identity, run_key: str, ready: Ready, ttl: float) -> Envelope:
    """The signed record. An announcement expires before the ready record that follows it, so the
    DHT (which keeps the later expiration under one subkey) never lets it replace that one."""
    fields = dict(peer_id=ready.peer_id, round=ready.round, base_hash=ready.base, spec_hash=ready.spec,
                  done=ready.done, eta=float(ready.eta), closed=ready.closed, up=ready.up)
    if ready.out:
        fields.update(out=True, group=list(ready.group))
    payload = encode_payload("ready", fields)
    return Envelope.sign(identity, "ready", ready_key(run_key, ready.round), payload, clock.wall() + ttl)


def verified(envelope: Envelope) -> Ready | None:
    """The record's content if its ``peer_id`` is its signer's libp2p id; None otherwise."""
    try:
        fields = decode_bound("ready", envelope)
    except InvalidRecord:
        return None
    return Ready(fields["peer_id"], fields["round"], fields["base_hash"], fields["spec_hash"], fields["done"],
                 fields["eta"], fields.get("closed", False), fields.get("up", 0), fields.get("out", False),
                 tuple(fields.get("group", ())))


class DHTReadyBoard:
    """Ready records in the run's DHT (on the DHT's loop)."""

    def __init__(self, dht: Any, run_key: str):
        self.dht, self.run_key = dht, run_key

    async def publish(self, identity: Identity, ready: Ready, ttl: float) -> bool:
        return bool(await self.dht.astore(sign(identity, self.run_key, ready, ttl)))

    async def read(self, round_: int) -> list[Ready]:
        async with asyncio.timeout(READ_TIMEOUT):
            envelopes = await self.dht.aget(ready_key(self.run_key, round_))
        return [r for r in map(verified, envelopes) if r is not None and r.round == round_]


@dataclass
class MemoryReadyBoard:
    """Ready records in a dict, for in-process swarms; signed and verified like the DHT's."""

    run_key: str = "memory"
    records: dict[int, dict[str, Envelope]] = field(default_factory=dict)

    async def publish(self, identity: Identity, ready: Ready, ttl: float) -> bool:
        envelope = sign(identity, self.run_key, ready, ttl)
        held = self.records.setdefault(ready.round, {})
        if envelope.subkey in held and held[envelope.subkey].expiration > envelope.expiration:
            return False  # like the DHT: the record that expires later stays
        held[envelope.subkey] = envelope
        for old in [r for r in self.records if r < ready.round - 2]:  # bounded: recent rounds only
            del self.records[old]
        return True

    async def read(self, round_: int) -> list[Ready]:
        return [r for r in map(verified, self.records.get(round_, {}).values()) if r is not None]
