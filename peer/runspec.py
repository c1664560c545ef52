"""A run in the DHT: publishing and fetching the owner-signed spec.

Peer heartbeats live in peer/state/heartbeats.py; their names are re-exported here for callers
that import them from this module.
"""

from __future__ import annotations

import time

from hivetrain.dht.errors import DHTError, InvalidRecord, RunNotFound
from hivetrain.dht.identity import Identity, make_run_key, parse_run_key
from hivetrain.dht.node import DHT
from hivetrain.dht.records import (
    MAX_PAYLOAD_BYTES,
    Envelope,
    spec_key,
    strict_unpack,
)
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.state.heartbeats import (  # noqa: F401 (re-exported)
    HeartbeatPublisher,
    heartbeat_envelope,
    publish_heartbeat,
    read_heartbeats,
)

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
