"""Signed, strict, size-bounded DHT records.

Every value this client puts into the DHT is an *envelope*::

    ["HT1", kind, key, subkey, payload, expiration, public_key, signature]

signed with Ed25519 over (kind, key, subkey, payload, expiration), so a record cannot be moved to
another key, another subkey, or kept alive longer than its signer wanted. ``subkey`` is always the
signer's fingerprint: a peer can only write under its own name. Payloads are flat msgpack maps with
a fixed schema per kind; decoding never uses ext hooks, object deserializers or recursion beyond one level.

Records that name a peer (``BOUND_KINDS``: heartbeats, ready records) are *bound* to the transport's
identity: their ``peer_id`` field must be the libp2p peer id of the signer's key (``peer_id_of``).
``decode_bound`` is the one way to read such a payload; the DHT validator applies the same check
before storing, so a record that speaks in another peer's name is not even kept.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from . import clock
from .errors import InvalidRecord
from .identity import PUBLIC_KEY_LEN, SIGNATURE_LEN, Identity, fingerprint, peer_id_of, verify

MAGIC = "HT1"
MAX_RECORD_BYTES = 16 * 1024  # a whole envelope
MAX_PAYLOAD_BYTES = 12 * 1024
MAX_STR = 512
MAX_TTL = 3600.0  # seconds: no peer record may claim to live longer than this from now
MAX_TTL_SPEC = 30 * 86400.0  # seconds: a run spec outlives its owner's session, re-served by every peer
CLOCK_SKEW = 120.0  # seconds of tolerated clock difference between peers
_DOMAIN = b"hivetrain-record-v1\0"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KINDS = ("spec", "hb", "ready")
MAX_MAP_LEN = 48  # entries of one msgpack map: the run spec has 34 fields (peer/config.py RunSpec)


def _reject_ext(code: int, data: bytes) -> Any:
    raise InvalidRecord("msgpack ext types are not allowed")


def strict_unpack(data: bytes, max_bytes: int) -> Any:
    """Decodes msgpack without ext types, with every container and string capped."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > max_bytes:
        raise InvalidRecord(f"record larger than {max_bytes} bytes or not bytes")
    try:
        value = msgpack.unpackb(
            bytes(data), raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True,
            max_str_len=MAX_PAYLOAD_BYTES, max_bin_len=MAX_PAYLOAD_BYTES,
            max_array_len=64, max_map_len=MAX_MAP_LEN, max_ext_len=0,
        )
    except InvalidRecord:
        raise
    except Exception as e:  # msgpack raises a zoo of types for malformed input
        raise InvalidRecord(f"malformed msgpack: {type(e).__name__}") from None
    _check_depth(value, MAX_DEPTH)
    return value


MAX_DEPTH = 2  # an envelope is a list of scalars; a payload is a map whose values may hold one list


def _check_depth(value: Any, max_depth: int) -> None:
    """Rejects containers nested deeper than ``max_depth`` (iterative: no recursion to exhaust)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= max_depth:
                raise InvalidRecord(f"record nested deeper than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


@dataclass(frozen=True)
class Envelope:
    kind: str
    key: str
    subkey: str
    payload: bytes
    expiration: float  # DHT time (unix seconds)
    public_key: bytes
    signature: bytes

    @staticmethod
    def signed_message(kind: str, key: str, subkey: str, payload: bytes, expiration: float) -> bytes:
        return _DOMAIN + msgpack.packb([kind, key, subkey, payload, float(expiration)], use_bin_type=True)

    @classmethod
    def sign(cls, identity: Identity, kind: str, key: str, payload: bytes, expiration: float) -> Envelope:
        subkey = identity.fingerprint
        sig = identity.sign(cls.signed_message(kind, key, subkey, payload, expiration))
        return cls(kind, key, subkey, payload, float(expiration), identity.public_key, sig)

    def encode(self) -> bytes:
        return msgpack.packb(
            [MAGIC, self.kind, self.key, self.subkey, self.payload, self.expiration, self.public_key, self.signature],
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes, now: float | None = None) -> Envelope:
        """Parses and verifies an envelope from an untrusted peer; raises InvalidRecord."""
        raw = strict_unpack(data, MAX_RECORD_BYTES)
        if not (isinstance(raw, list) and len(raw) == 8 and raw[0] == MAGIC):
            raise InvalidRecord("not a hivetrain record")
        _, kind, key, subkey, payload, expiration, public_key, signature = raw
        if kind not in KINDS:
            raise InvalidRecord(f"unknown record kind {kind!r}")
        if not (isinstance(key, str) and 0 < len(key) <= MAX_STR and isinstance(subkey, str)):
            raise InvalidRecord("bad record key")
        if not (isinstance(payload, bytes) and len(payload) <= MAX_PAYLOAD_BYTES):
            raise InvalidRecord("bad record payload")
        if not (isinstance(expiration, float) and math.isfinite(expiration)):
            raise InvalidRecord("bad record expiration")
        if not (isinstance(public_key, bytes) and len(public_key) == PUBLIC_KEY_LEN):
            raise InvalidRecord("bad public key")
        if not (isinstance(signature, bytes) and len(signature) == SIGNATURE_LEN):
            raise InvalidRecord("bad signature")
        if subkey != fingerprint(public_key):
            raise InvalidRecord("record subkey is not its signer's fingerprint")
        now = clock.wall() if now is None else now
        max_ttl = MAX_TTL_SPEC if kind == "spec" else MAX_TTL
        if expiration > now + max_ttl + CLOCK_SKEW:
            raise InvalidRecord(f"{kind} record expires more than {max_ttl:.0f} s ahead")
        verify(public_key, signature, cls.signed_message(kind, key, subkey, payload, expiration))
        return cls(kind, key, subkey, payload, expiration, public_key, signature)


# ---- keys -------------------------------------------------------------------------------------------


def spec_key(run_key: str) -> str:
    return f"hivetrain/{run_key}/spec"


MAX_HEARTBEAT_LEVEL = 8  # a run's heartbeats are spread over at most 2^8 keys (peer/state/heartbeats.py)


def heartbeat_key(run_key: str, level: int = 0, bucket: int = 0) -> str:
    """The key of bucket ``bucket`` of 2^level of the run's heartbeats (one key at level 0)."""
    if level == 0:
        return f"hivetrain/{run_key}/peers"
    return f"hivetrain/{run_key}/peers/{level}/{bucket}"


def heartbeat_bucket(peer_id: str, level: int) -> int:
    """The bucket of ``peer_id``'s heartbeats when the run has 2^level of them: the top ``level``
    bits of a hash of the peer id, the same in every round (a heartbeat outlives its round)."""
    return _top_bits(f"hivetrain-heartbeat/{peer_id}", level)


MAX_READY_LEVEL = 12  # a round's ready records are spread over at most 2^12 keys (peer/averaging/ready.py)


def ready_key(run_key: str, round_: int, level: int = 0, bucket: int = 0) -> str:
    """The key of bucket ``bucket`` of 2^level of round ``round_``'s ready records (one key at level 0)."""
    if level == 0:
        return f"hivetrain/{run_key}/ready/{round_}"
    return f"hivetrain/{run_key}/ready/{round_}/{level}/{bucket}"


def bucket_of(round_: int, peer_id: str, level: int) -> int:
    """The bucket of ``peer_id``'s ready record of ``round_`` when the round has 2^level buckets:
    the top ``level`` bits of a hash of the peer id, so buckets nest from one level to the next. The
    same in every round (``round_`` only names the key): a bucket's peers meet again in the next
    round, and the trust they earned together spares them every newcomer cap (cross.py reads two
    buckets a round, not all of them)."""
    del round_
    return _top_bits(f"hivetrain-bucket/{peer_id}", level)


def _top_bits(text: str, level: int) -> int:
    """The top ``level`` bits of sha256(text): a bucket of 2^level that nests into the level below."""
    if level == 0:
        return 0
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> (64 - level)


# ---- payload schemas --------------------------------------------------------------------------------

Check = Callable[[Any], bool]


def _is_int(lo: int, hi: int) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_float(lo: float, hi: float) -> Check:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # a base58 libp2p peer id


def _is_peer_id(v: Any) -> bool:
    return isinstance(v, str) and bool(_PEER_ID.fullmatch(v))


def _is_hex64(v: Any) -> bool:
    return isinstance(v, str) and bool(_HEX64.fullmatch(v))


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


MAX_ROUND = 10**9
MAX_ADDRS, MAX_ADDR_LEN = 4, 200  # a heartbeat's ``addrs``: how many, and the characters of each
_ADDR = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[0-9A-Za-z.:%_-]+/tcp/[0-9]{1,5}$")


def is_address(a: Any) -> bool:
    """A heartbeat address: /ip4|ip6|dns.../<host>/tcp/<port>, no /p2p part (the reader adds the signer's)."""
    return isinstance(a, str) and len(a) <= MAX_ADDR_LEN and _ADDR.fullmatch(a) is not None


def _is_addresses(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_ADDRS and all(map(is_address, v))


REACH_MODES = ("direct", "outbound_only", "unknown")  # a heartbeat's ``reach``
SCHEMAS: dict[str, dict[str, Check]] = {
    "hb": {
        "peer_id": _is_peer_id,
        "round": _is_int(0, MAX_ROUND),
        "state_hash": _is_hex64,
        "parent": _is_hex64,  # the state this one was computed from (lineage; peer/state/snapshot.py)
        "throughput": _is_float(0.0, 1e12),  # tokens per second
        "train_loss": _optional(_is_float(0.0, 1e6)),
        "eval_loss": _optional(_is_float(0.0, 1e6)),
        "reach": lambda v: v in REACH_MODES,  # how others reach the peer (peer/reach.py); may be absent
        "addrs": _is_addresses,  # where to dial it, without /p2p/<id> (peer/join.py); may be absent
        "tokens": _is_int(0, 10**18),  # tokens it trained since its process started (peer/totals.py); may be absent
        "rounds": _is_int(0, MAX_ROUND),  # ... and rounds it completed; may be absent
    },
    "ready": {
        "peer_id": _is_peer_id,
        "round": _is_int(0, MAX_ROUND),
        "base_hash": _is_hex64,  # all zeros in an announcement made before the base is known
        "spec_hash": _is_hex64,
        "done": lambda v: isinstance(v, bool),  # false: announced ahead, still computing
        "eta": _is_float(0.0, 1e11),  # unix time the peer expects to be ready (its claim; bounded by the reader)
        "closed": lambda v: isinstance(v, bool),  # true: nobody can dial it (an outbound-only member); may be absent
        "up": _is_int(0, 10**8),  # its uplink claim for the round, kB/s (0: unknown); may be absent
        "out": lambda v: isinstance(v, bool),  # true: its round failed (it voids); may be absent
        # ... and the group it failed in (itself included; at most 64): peers no designee waits for
        "group": lambda v: isinstance(v, list) and len(v) <= 64 and all(_is_peer_id(p) for p in v),
    },
}
OPTIONAL = {"hb": frozenset({"reach", "addrs", "tokens", "rounds"}), "ready": frozenset({"closed", "up", "out", "group"})}  # fields a record may leave out
BOUND_KINDS = ("hb", "ready")  # payloads whose ``peer_id`` must be their signer's libp2p id


def encode_payload(kind: str, fields: dict[str, Any]) -> bytes:
    check_payload(kind, fields)
    return msgpack.packb(fields, use_bin_type=True)


def check_payload(kind: str, fields: Any) -> dict[str, Any]:
    schema, optional = SCHEMAS[kind], OPTIONAL.get(kind, frozenset())
    if not isinstance(fields, dict) or not set(schema) - optional <= set(fields) <= set(schema):
        raise InvalidRecord(f"{kind} record must have exactly the fields {sorted(schema)} "
                            f"(of which {sorted(optional)} may be left out)")
    for name, check in schema.items():
        if name in fields and not check(fields[name]):
            raise InvalidRecord(f"{kind} record field {name!r} is invalid")
    return fields


def decode_payload(kind: str, payload: bytes) -> dict[str, Any]:
    return check_payload(kind, strict_unpack(payload, MAX_PAYLOAD_BYTES))


# decoded payloads, by a hash of what the outcome depends on: a board is re-read many times a round, its
# records unchanged. Keys are 32 bytes; at most MAX_BOUND_CACHED payloads of MAX_PAYLOAD_BYTES are held
_BOUND: OrderedDict[tuple[str, bytes], dict[str, Any]] = OrderedDict()
MAX_BOUND_CACHED = 2048


def decode_bound(kind: str, envelope: Envelope) -> dict[str, Any]:
    """The verified payload of ``envelope``, a record of ``kind`` (one of ``BOUND_KINDS``).

    ``envelope`` must come from ``Envelope.decode`` (signature checked) or ``Envelope.sign``. Raises
    InvalidRecord if it is of another kind, if its payload breaks the schema, or if its ``peer_id``
    is not the libp2p id of the key that signed it: one libp2p identity speaks only for itself."""
    if kind not in BOUND_KINDS or envelope.kind != kind:
        raise InvalidRecord(f"expected a {kind} record, got a {envelope.kind} record")
    key = (kind, hashlib.sha256(len(envelope.public_key).to_bytes(4, "big") + envelope.public_key + envelope.payload).digest())
    fields = _BOUND.get(key)
    if fields is None:
        fields = decode_payload(kind, envelope.payload)
        signer = peer_id_of(envelope.public_key)
        if fields["peer_id"] != signer:
            raise InvalidRecord(f"{kind} record names peer {fields['peer_id'][:60]} but is signed by {signer}")
        _BOUND[key] = fields
        while len(_BOUND) > MAX_BOUND_CACHED:
            _BOUND.popitem(last=False)
    return dict(fields)
