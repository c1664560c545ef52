"""A hivemind record validator that admits only signed hivetrain envelopes.

Every DHT node of the swarm runs it on every record it is asked to store and on every record it
reads, so a peer cannot write under another peer's subkey, publish a spec for a run it does not
own, keep a record alive past the expiration its signer chose, or store a heartbeat or ready
record that names a peer other than its signer (``records.decode_bound``).
"""

from __future__ import annotations

import math

import msgpack
from hivemind.dht.crypto import DHTRecord, RecordValidatorBase
from hivemind.dht.routing import DHTID

from .errors import InvalidRecord
from .identity import RUN_KEY_RE
from .records import (
    BOUND_KINDS,
    MAX_HEARTBEAT_LEVEL,
    MAX_READY_LEVEL,
    MAX_RECORD_BYTES,
    Envelope,
    bucket_of,
    decode_bound,
    heartbeat_bucket,
    strict_unpack,
)


class EnvelopeValidator(RecordValidatorBase):
    def validate(self, record: DHTRecord) -> bool:
        try:
            check_record(record.key, record.subkey, record.value, record.expiration_time)
        except InvalidRecord:
            return False
        return True


def check_record(key_id: bytes, subkey_bytes: bytes, value_bytes: bytes, expiration_time: float) -> Envelope:
    """Checks one raw DHT record as hivemind hands it over; raises InvalidRecord."""
    value = strict_unpack(value_bytes, MAX_RECORD_BYTES + 16)  # the DHT wraps our bytes in a msgpack bin
    if not isinstance(value, bytes):
        raise InvalidRecord("DHT value is not a hivetrain envelope")
    envelope = Envelope.decode(value)
    if DHTID.generate(source=envelope.key).to_bytes() != key_id:
        raise InvalidRecord("envelope was signed for another key")
    if subkey_bytes != msgpack.packb(envelope.subkey, use_bin_type=True):
        raise InvalidRecord("envelope stored under a subkey that is not its signer's")
    if not math.isfinite(expiration_time) or expiration_time > envelope.expiration:
        # NaN passes every comparison in hivemind's TimedStorage: such a record would never expire
        raise InvalidRecord("DHT expiration is not finite or later than the signed expiration")
    parts = envelope.key.split("/")
    if len(parts) < 3 or parts[0] != "hivetrain" or not RUN_KEY_RE.fullmatch(parts[1]):
        raise InvalidRecord("record key is not a hivetrain run key")
    expected = {"spec": ("spec",), "hb": ("peers",), "ready": ("ready", "<round>")}[envelope.kind]
    numbers = parts[3:]
    if parts[2] != expected[0] or not all(n.isdigit() and len(n) <= 10 for n in numbers) or \
            len(numbers) not in {"ready": (1, 3), "hb": (0, 2)}.get(envelope.kind, (0,)):
        raise InvalidRecord(f"a {envelope.kind} record may not be stored under {envelope.key!r}")
    if envelope.kind == "spec" and parts[1].rsplit(".", 1)[1] != envelope.subkey:
        raise InvalidRecord("run spec not signed by the run owner")
    if envelope.kind in BOUND_KINDS:
        fields = decode_bound(envelope.kind, envelope)  # schema, and the named peer is the signer
        if envelope.kind == "ready":
            _check_bucket(fields, [int(n) for n in numbers])
        elif numbers:
            _check_heartbeat_bucket(fields, [int(n) for n in numbers])
    return envelope


def _check_heartbeat_bucket(fields: dict[str, object], numbers: list[int]) -> None:
    """A heartbeat under a bucket key sits in its peer's bucket (peer/state/heartbeats.py)."""
    level, bucket = numbers
    if not 1 <= level <= MAX_HEARTBEAT_LEVEL or heartbeat_bucket(str(fields["peer_id"]), level) != bucket:
        raise InvalidRecord("a heartbeat stored outside its peer's bucket")


def _check_bucket(fields: dict[str, object], numbers: list[int]) -> None:
    """A ready record sits under its own round, in its peer's bucket (peer/averaging/ready.py)."""
    round_, level, bucket = (*numbers, 0, 0) if len(numbers) == 1 else numbers
    if fields["round"] != round_:
        raise InvalidRecord("a ready record stored under another round")
    if level == 0 and len(numbers) == 3 or level > MAX_READY_LEVEL or \
            bucket_of(round_, str(fields["peer_id"]), level) != bucket:
        raise InvalidRecord("a ready record stored outside its peer's bucket")
