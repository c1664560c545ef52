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

One libp2p identity publishes one heartbeat (the DHT keeps one value per signer), and readers keep
only heartbeats bound to their signer (``records.decode_bound``), so a heartbeat is one identity's
claim, never more. What a claim is worth is fork choice's business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hivetrain.dht import clock
from hivetrain.dht.errors import DHTError, InvalidRecord
from hivetrain.dht.facade import DHTFacade, FutureLike
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import Envelope, decode_bound, encode_payload, heartbeat_key
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import PeerError
from hivetrain.peer.state.choose import Attestation, State
from hivetrain.peer.state.snapshot import Snapshot


def heartbeat_ttl(spec: RunSpec) -> float:
    """Seconds a heartbeat lives in the DHT: two rounds' worth of waiting, plus a minute."""
    return 2 * (spec.matchmaking_timeout + spec.allreduce_timeout) + 60


def attestation_fields(snapshot: Snapshot) -> dict[str, Any]:
    """The heartbeat fields that attest ``snapshot``: round, state_hash, parent."""
    return {"round": snapshot.round, "state_hash": snapshot.hash, "parent": snapshot.parent}


def heartbeat_envelope(identity: Identity, run_key: str, ttl: float, **fields: Any) -> Envelope:
    """A heartbeat signed by ``identity``, in its own name: ``peer_id`` defaults to the identity's
    libp2p id and must equal it. Raises InvalidRecord for a field the schema refuses."""
    fields.setdefault("peer_id", identity.peer_id)
    if fields["peer_id"] != identity.peer_id:
        raise InvalidRecord("a heartbeat may only name the peer that signs it")
    payload = encode_payload("hb", fields)
    return Envelope.sign(identity, "hb", heartbeat_key(run_key), payload, clock.wall() + ttl)


def publish_heartbeat(dht: DHTFacade, identity: Identity, run_key: str, ttl: float, **fields: Any) -> None:
    dht.store(heartbeat_envelope(identity, run_key, ttl, **fields))


class HeartbeatPublisher:
    """Publishes heartbeats on the DHT loop without making the caller wait.

    A heartbeat is best effort, but a DHT store can hang for its whole timeout (seen in CI); done in
    the training loop, that made a peer miss the next round's matchmaking and train alone. A newer
    heartbeat supersedes a pending older one; a failed store is reported through ``warn``.
    ``identity`` must be the DHT's own (the libp2p id), or readers refuse the heartbeats."""

    def __init__(self, dht: DHTFacade, identity: Identity, run_key: str, ttl: float, warn: Callable[[str], None]):
        self.dht, self.identity, self.run_key, self.ttl, self.warn = dht, identity, run_key, ttl, warn
        self._pending: FutureLike | None = None
        self.extra: dict[str, Any] = {}  # fields every heartbeat carries (``reach``: how others reach us)

    def __call__(self, **fields: Any) -> None:
        try:
            envelope = heartbeat_envelope(self.identity, self.run_key, self.ttl, **{**self.extra, **fields})
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


def read_heartbeats(dht: DHTFacade, run_key: str) -> list[dict[str, Any]]:
    """The run's heartbeats whose ``peer_id`` is their signer's (training thread; raises DHTError
    on a DHT timeout). Heartbeats that break the schema or speak for another peer are skipped."""
    return _bound(dht.get(heartbeat_key(run_key)))


async def aread_heartbeats(dht: DHTFacade, run_key: str) -> list[dict[str, Any]]:
    """``read_heartbeats`` on the DHT's loop; raises TimeoutError past the DHT's timeout."""
    async with asyncio.timeout(dht.timeout):
        return _bound(await dht.aget(heartbeat_key(run_key)))


def _bound(envelopes: list[Envelope]) -> list[dict[str, Any]]:
    out = []
    for envelope in envelopes:
        try:
            out.append(decode_bound("hb", envelope))
        except InvalidRecord:
            continue
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
