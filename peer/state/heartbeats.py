"""Heartbeats: each peer's signed attestation of the state it holds, published in the DHT.

A heartbeat is a ``hb`` record (dht/records.py) with the fields

    peer_id     the publisher's libp2p peer id; must be the id of the key that signed the record
    round       the round of the state it holds
    state_hash  that state's hash (peer/state/snapshot.py)
    parent      the hash of the state it came from (lineage: peer/state/choose.py links states by it)
    throughput  tokens per second of its last round (0.0 before the first)
    train_loss  mean training loss of its last round, or None
    eval_loss   held-out loss at this state, or None
    reach       how others reach it: direct, outbound_only or unknown (peer/net/dialback.py); may be absent
    addrs       where to dial it, its own best addresses without /p2p/<id> (peer/join.py); may be absent
    tokens      tokens it trained since its process started (peer/totals.py); may be absent
    rounds      rounds it completed since then; may be absent

A field a reader's schema does not know makes the whole heartbeat invalid to it: the optional fields
above need every peer of a run on a release that knows them (as the averaging protocol does anyway).

One libp2p identity publishes one heartbeat (the DHT keeps one value per signer), and readers keep
only heartbeats bound to their signer (``records.decode_bound``), so a heartbeat is one identity's
claim, never more. What a claim is worth is fork choice's business.

A DHT key holds at most 256 records (dht/quota.py), and every peer reads heartbeats every round.
A run whose spec expects more than ``PEERS_PER_BUCKET`` peers (``expected_peers``) spreads them
over 2^L bucket keys (``heartbeat_level``), a peer's bucket fixed by its id
(``records.heartbeat_bucket``; DHT nodes refuse a heartbeat outside it). Fork choice then reads a
random sample of ``SAMPLE_BUCKETS`` buckets, so what one read costs, and what one key's holders
serve, no longer grows with the run. The level comes from the run spec, which every peer of every
lineage shares: a level from a state's population would put two lineages of different sizes under
different keys, and neither would ever see the other.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hivetrain.dht import clock
from hivetrain.dht.errors import DHTError, DHTTimeout, InvalidRecord
from hivetrain.dht.facade import DHTFacade, FutureLike, aget_each
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import (
    MAX_HEARTBEAT_LEVEL,
    Envelope,
    decode_bound,
    encode_payload,
    heartbeat_bucket,
    heartbeat_key,
)
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import PeerError
from hivetrain.peer.state.choose import Attestation, State
from hivetrain.peer.state.snapshot import Snapshot

PEERS_PER_BUCKET = 64  # expected peers per heartbeat key: a quarter of a key's 256 records
SAMPLE_BUCKETS = 2  # heartbeat keys fork choice reads per round in a bucketed run
READS_AT_ONCE = 16  # heartbeat keys one reader fetches at a time


def heartbeat_level(spec: RunSpec) -> int:
    """The run's heartbeat level: the smallest L with at most ``PEERS_PER_BUCKET`` expected peers
    per bucket (0, one key, without ``expected_peers``)."""
    level = 0
    while spec.expected_peers > PEERS_PER_BUCKET << level and level < MAX_HEARTBEAT_LEVEL:
        level += 1
    return level


def sample_buckets(level: int, rng: random.Random, count: int = SAMPLE_BUCKETS) -> list[int]:
    """``count`` distinct buckets of 2^level drawn with ``rng`` (all of them when there are no more)."""
    if 1 << level <= count:
        return list(range(1 << level))
    return sorted(rng.sample(range(1 << level), count))


def buckets_of(peers: Iterable[str], level: int) -> list[int]:
    """The buckets that hold the heartbeats of ``peers``."""
    return sorted({heartbeat_bucket(p, level) for p in peers})


def heartbeat_ttl(spec: RunSpec) -> float:
    """Seconds a heartbeat lives in the DHT: two rounds' worth of waiting, plus a minute."""
    return 2 * (spec.matchmaking_timeout + spec.allreduce_timeout) + 60


def attestation_fields(snapshot: Snapshot) -> dict[str, Any]:
    """The heartbeat fields that attest ``snapshot``: round, state_hash, parent."""
    return {"round": snapshot.round, "state_hash": snapshot.hash, "parent": snapshot.parent}


def heartbeat_envelope(identity: Identity, run_key: str, ttl: float, *, level: int = 0, **fields: Any) -> Envelope:
    """A heartbeat signed by ``identity``, in its own name, under its bucket of 2^level: ``peer_id``
    defaults to the identity's libp2p id and must equal it. Raises InvalidRecord for a field the
    schema refuses."""
    fields.setdefault("peer_id", identity.peer_id)
    if fields["peer_id"] != identity.peer_id:
        raise InvalidRecord("a heartbeat may only name the peer that signs it")
    payload = encode_payload("hb", fields)
    key = heartbeat_key(run_key, level, heartbeat_bucket(identity.peer_id, level))
    return Envelope.sign(identity, "hb", key, payload, clock.wall() + ttl)


def publish_heartbeat(dht: DHTFacade, identity: Identity, run_key: str, ttl: float, *, level: int = 0,
                      **fields: Any) -> None:
    dht.store(heartbeat_envelope(identity, run_key, ttl, level=level, **fields))


class HeartbeatPublisher:
    """Publishes heartbeats on the DHT loop without making the caller wait.

    A heartbeat is best effort, but a DHT store can hang for its whole timeout (seen in CI); done in
    the training loop, that made a peer miss the next round's matchmaking and train alone. A newer
    heartbeat supersedes a pending older one; a failed store is reported through ``warn``.
    ``identity`` must be the DHT's own (the libp2p id), or readers refuse the heartbeats."""

    def __init__(self, dht: DHTFacade, identity: Identity, run_key: str, ttl: float, warn: Callable[[str], None],
                 level: int = 0):
        self.dht, self.identity, self.run_key, self.ttl, self.warn = dht, identity, run_key, ttl, warn
        self.level = level  # the run's heartbeat level (``heartbeat_level``)
        self._pending: FutureLike | None = None
        self.extra: dict[str, Any] = {}  # fields every heartbeat carries (``reach``: how others reach us)

    def __call__(self, **fields: Any) -> None:
        try:
            envelope = heartbeat_envelope(self.identity, self.run_key, self.ttl, level=self.level,
                                          **{**self.extra, **fields})
        except (DHTError, PeerError) as e:  # a field our schema refuses: training goes on, the next round publishes again
            self.warn(f"warning: heartbeat not published ({e})")
            return
        if self._pending is not None:
            self._pending.cancel()
        self._pending = self.dht.submit(self._store(envelope))
        self._pending.add_done_callback(self._report)

    async def _store(self, envelope: Envelope) -> bool:
        # the store is made here, on the loop: a publish cancelled before it ran leaves no coroutine unawaited
        return bool(await asyncio.wait_for(self.dht.astore(envelope), self.dht.timeout))

    def _report(self, future: FutureLike) -> None:
        if not future.cancelled() and (e := future.exception()) is not None:
            self.warn(f"warning: heartbeat not published ({type(e).__name__})")


def read_heartbeats(dht: DHTFacade, run_key: str, level: int = 0,
                    buckets: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The heartbeats in ``buckets`` of 2^level (None: all of them) whose ``peer_id`` is their
    signer's (training thread; raises DHTError on a DHT timeout). Heartbeats that break the schema,
    speak for another peer or sit outside their bucket are skipped."""
    if level == 0:
        return _bound(dht.get(heartbeat_key(run_key)), 0, 0)
    chosen = list(range(1 << level) if buckets is None else buckets)
    try:
        return dht.run(aread_heartbeats(dht, run_key, level, chosen),
                       timeout=dht.timeout * (1 + len(chosen) // READS_AT_ONCE))
    except TimeoutError:  # every bucket's read timed out
        raise DHTTimeout(f"no heartbeat bucket of {len(chosen)} could be read") from None


async def aread_heartbeats(dht: DHTFacade, run_key: str, level: int = 0,
                           buckets: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """``read_heartbeats`` on the DHT's loop, ``READS_AT_ONCE`` keys at a time, each within the DHT's
    timeout; a bucket whose read fails is left out, unless every one failed: then the error (e.g.
    TimeoutError) is raised."""
    chosen = list(range(1 << level) if buckets is None else buckets)
    found = await aget_each(dht, [heartbeat_key(run_key, level, b) for b in chosen], dht.timeout, READS_AT_ONCE)
    return [hb for bucket, envelopes in zip(chosen, found, strict=True) for hb in _bound(envelopes or [], level, bucket)]


def _bound(envelopes: list[Envelope], level: int, bucket: int) -> list[dict[str, Any]]:
    out = []
    for envelope in envelopes:
        try:
            hb = decode_bound("hb", envelope)
        except InvalidRecord:
            continue
        if heartbeat_bucket(hb["peer_id"], level) == bucket:  # else not a key's record: a DHT node's lie
            out.append(hb)
    return out


def reach_mix(heartbeats: list[dict[str, Any]]) -> dict[str, int]:
    """How many of the run's peers say they are reached how (``reach``; "unknown" when left out)."""
    mix: dict[str, int] = {}
    for hb in heartbeats:
        mode = hb.get("reach", "unknown")
        mix[mode] = mix.get(mode, 0) + 1
    return mix


def attestations(heartbeats: list[dict[str, Any]]) -> list[Attestation]:
    """Fork choice's view of verified heartbeats: (peer, round, hash, parent)."""
    return [Attestation(hb["peer_id"], State(hb["round"], hb["state_hash"], hb["parent"])) for hb in heartbeats]
