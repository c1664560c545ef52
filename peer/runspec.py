"""A run in the DHT: publishing and fetching the owner-signed spec, and peer heartbeats."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from hivetrain.dht.errors import DHTError, InvalidRecord, RunNotFound
from hivetrain.dht.identity import Identity, make_run_key, parse_run_key
from hivetrain.dht.node import DHT
from hivetrain.dht.records import (
    MAX_PAYLOAD_BYTES,
    Envelope,
    decode_payload,
    encode_payload,
    heartbeat_key,
    spec_key,
    strict_unpack,
)
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import ConfigError, PeerError

SPEC_TTL = 7 * 86400.0  # seconds a signed spec stays in the DHT after its owner last signed it


def new_run(dht: DHT, owner: Identity, spec: RunSpec) -> tuple[str, Envelope]:
    """Signs and publishes ``spec`` as the run owner; returns (run key, signed spec record)."""
    run_key = make_run_key(spec.name, owner.public_key)
    envelope = Envelope.sign(owner, "spec", spec_key(run_key), spec.encode(), time.time() + SPEC_TTL)
    if not dht.store(envelope):
        raise DHTError("could not store the run spec in the DHT")
    return run_key, envelope


def decode_spec(run_key: str, envelope: Envelope) -> RunSpec:
    """Checks that the owner named by the run key signed this spec; raises InvalidRecord."""
    name, owner_fp = parse_run_key(run_key)
    if envelope.kind != "spec" or envelope.subkey != owner_fp or envelope.key != spec_key(run_key):
        raise InvalidRecord("run spec is not signed by the owner named in the run key")
    try:
        spec = RunSpec.from_dict(strict_unpack(envelope.payload, MAX_PAYLOAD_BYTES))
    except ConfigError as e:
        raise InvalidRecord(f"run spec is malformed: {e}") from None
    if spec.name != name:
        raise InvalidRecord(f"run spec names run {spec.name!r}, the key names {name!r}")
    return spec


def fetch_spec(dht: DHT, run_key: str, timeout: float) -> tuple[RunSpec, Envelope]:
    """Finds the owner-signed spec of ``run_key``, retrying until ``timeout``; raises RunNotFound."""
    try:
        parse_run_key(run_key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    deadline = time.monotonic() + timeout
    rejected = ""
    while True:
        for envelope in dht.get(spec_key(run_key), timeout=max(1.0, deadline - time.monotonic())):
            try:
                return decode_spec(run_key, envelope), envelope
            except InvalidRecord as e:
                rejected = f" (a spec signed by someone else was refused: {e})"
        if time.monotonic() >= deadline:
            raise RunNotFound(f"no run spec found under run key {run_key!r} within {timeout:.0f} s{rejected}; "
                              "check the key and --initial-peers")
        time.sleep(0.5)  # the DHT has no watch: retry a bounded number of times until the deadline


def republish(dht: DHT, envelope: Envelope) -> None:
    """Re-stores the owner-signed spec so it outlives the owner's presence (signature unchanged)."""
    dht.store(envelope)


def heartbeat_envelope(identity: Identity, run_key: str, ttl: float, **fields: Any) -> Envelope:
    """A signed heartbeat record; raises InvalidRecord for a field the schema refuses."""
    payload = encode_payload("hb", fields)
    return Envelope.sign(identity, "hb", heartbeat_key(run_key), payload, time.time() + ttl)


def publish_heartbeat(dht: DHT, identity: Identity, run_key: str, ttl: float, **fields: Any) -> None:
    dht.store(heartbeat_envelope(identity, run_key, ttl, **fields))


class HeartbeatPublisher:
    """Publishes heartbeats on the DHT loop without making the caller wait.

    A heartbeat is best effort, but a DHT store can hang for its whole timeout (seen in CI); done in
    the training loop, that made a peer miss the next round's matchmaking and train alone. A newer
    heartbeat supersedes a pending older one; a failed store is reported through ``warn``."""

    def __init__(self, dht: DHT, identity: Identity, run_key: str, ttl: float, warn: Callable[[str], None]):
        self.dht, self.identity, self.run_key, self.ttl, self.warn = dht, identity, run_key, ttl, warn
        self._pending: concurrent.futures.Future[bool] | None = None

    def __call__(self, **fields: Any) -> None:
        try:
            envelope = heartbeat_envelope(self.identity, self.run_key, self.ttl, **fields)
        except (DHTError, PeerError) as e:  # a field our schema refuses: training goes on, the next round publishes again
            self.warn(f"warning: heartbeat not published ({e})")
            return
        if self._pending is not None:
            self._pending.cancel()
        self._pending = self.dht.submit(asyncio.wait_for(self.dht.astore(envelope), self.dht.options.timeout))
        self._pending.add_done_callback(self._report)

    def _report(self, future: concurrent.futures.Future[bool]) -> None:
        if not future.cancelled() and (e := future.exception()) is not None:
            self.warn(f"warning: heartbeat not published ({type(e).__name__})")


def read_heartbeats(dht: DHT, run_key: str) -> list[dict[str, Any]]:
    out = []
    for envelope in dht.get(heartbeat_key(run_key)):
        try:
            out.append(decode_payload("hb", envelope.payload))
        except InvalidRecord:
            continue
    return out
