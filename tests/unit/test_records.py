"""Signed DHT records: identities and run keys (dht/identity.py), envelopes and payload schemas
(dht/records.py), the DHT validator (dht/validator.py) and the owner check of a run spec (peer/runspec.py)."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from hivetrain.dht import records
from hivetrain.dht.errors import InvalidRecord
from hivetrain.dht.identity import (
    FINGERPRINT_LEN,
    Identity,
    fingerprint,
    make_run_key,
    parse_run_key,
    verify,
)
from hivetrain.dht.records import (
    CLOCK_SKEW,
    MAX_MAP_LEN,
    MAX_RECORD_BYTES,
    MAX_TTL,
    MAX_TTL_SPEC,
    Envelope,
    decode_bound,
    decode_payload,
    encode_payload,
    heartbeat_key,
    ready_key,
    spec_key,
    strict_unpack,
)
from hivetrain.dht.validator import check_record
from hivetrain.peer.config import RunSpec
from hivetrain.peer.runspec import decode_spec

NOW = 1_700_000_000.0
HASH = "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def owner() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def other() -> Identity:
    return Identity.generate()


PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # a well-formed libp2p peer id


def _hb_fields(**over: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(peer_id=PEER, round=3, state_hash=HASH, parent="0" * 64, throughput=1234.5,
                                  train_loss=2.5, eval_loss=None)
    fields.update(over)
    return fields


def _hb_envelope(identity: Identity, expiration: float = NOW + 60) -> Envelope:
    """A heartbeat in the signer's own name (bound: peer_id is the signer's libp2p id)."""
    run_key = make_run_key("r1", identity.public_key)
    payload = encode_payload("hb", _hb_fields(peer_id=identity.peer_id))
    return Envelope.sign(identity, "hb", heartbeat_key(run_key), payload, expiration)


def _dht_args(env: Envelope, expiration: float | None = None) -> tuple[bytes, bytes, bytes, float]:
    """The raw (key id, subkey, value, expiration) a hivemind DHT node hands to its validator."""
    return (
        DHTID.generate(source=env.key).to_bytes(),
        msgpack.packb(env.subkey),
        msgpack.packb(env.encode(), use_bin_type=True),
        env.expiration if expiration is None else expiration,
    )


def _nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # [[[...[0]...]]]


def _nested_ext(depth: int, code: int = 0x40) -> bytes:
    data = msgpack.packb(0)
    for _ in range(depth):
        data = msgpack.packb(msgpack.ExtType(code, data))
    return data


# ---- run keys -------------------------------------------------------------------------------------


def test_run_key_round_trip(owner: Identity) -> None:
    key = make_run_key("my-run_1", owner.public_key)
    name, fp = parse_run_key(key)
    assert name == "my-run_1"
    assert fp == fingerprint(owner.public_key) == owner.fingerprint
    assert len(fp) == FINGERPRINT_LEN and fp == fp.lower()


def test_fingerprint_differs_between_keys(owner: Identity, other: Identity) -> None:
    assert owner.fingerprint != other.fingerprint
    assert fingerprint(owner.public_key) == fingerprint(bytes(owner.public_key))


@pytest.mark.parametrize("bad", [
    "", "r1", "r1.", ".abcdefghijklmnopqrstuvwxyz234567", "R1.abcdefghijklmnopqrstuvwxyz234567",
    "r1.abcdefghijklmnopqrstuvwxyz23456",  # 31 characters
    "r1.abcdefghijklmnopqrstuvwxyz2345678",  # 33 characters
    "r1.abcdefghijklmnopqrstuvwxyz234561",  # '1' is not base32
    "r1.ABCDEFGHIJKLMNOPQRSTUVWXYZ234567",  # uppercase
    "-r1.abcdefghijklmnopqrstuvwxyz234567", "bad name.abcdefghijklmnopqrstuvwxyz234567",
    "a" * 49 + ".abcdefghijklmnopqrstuvwxyz234567",
    "r1.abcdefghijklmnopqrstuvwxyz234567\n", "r1.r2.abcdefghijklmnopqrstuvwxyz234567",
])
def test_malformed_run_keys_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="malformed"):
        parse_run_key(bad)


@pytest.mark.parametrize("bad", [None, 123, b"r1.abcdefghijklmnopqrstuvwxyz234567"])
def test_non_string_run_keys_rejected(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_run_key(bad)


def test_longest_valid_run_name() -> None:
    key = "a" * 48 + ".abcdefghijklmnopqrstuvwxyz234567"
    assert parse_run_key(key) == ("a" * 48, "abcdefghijklmnopqrstuvwxyz234567")


# ---- signatures -----------------------------------------------------------------------------------


def test_verify(owner: Identity, other: Identity) -> None:
    sig = owner.sign(b"message")
    verify(owner.public_key, sig, b"message")
    for pk, s, msg in [(owner.public_key, sig, b"messagf"), (other.public_key, sig, b"message"),
                       (owner.public_key, sig[:-1] + bytes([sig[-1] ^ 1]), b"message"),
                       (owner.public_key[:31], sig, b"message"), (owner.public_key, sig[:63], b"message"),
                       (b"\xff" * 32, sig, b"message")]:
        with pytest.raises(InvalidRecord):
            verify(pk, s, msg)


# ---- envelopes ------------------------------------------------------------------------------------


def test_envelope_round_trip(owner: Identity) -> None:
    env = _hb_envelope(owner)
    assert env.subkey == owner.fingerprint and env.public_key == owner.public_key
    data = env.encode()
    assert len(data) <= MAX_RECORD_BYTES
    assert Envelope.decode(data, now=NOW) == env
    assert decode_payload("hb", Envelope.decode(data, now=NOW).payload) == _hb_fields(peer_id=owner.peer_id)


@pytest.mark.parametrize("index, tamper", [
    (1, lambda v: "ready"),  # kind
    (2, lambda v: v + "x"),  # key
    (3, lambda v: v[:-1] + ("a" if v[-1] != "a" else "b")),  # subkey
    (4, lambda v: bytes([v[0] ^ 1]) + v[1:]),  # payload, first byte
    (4, lambda v: v[:-1] + bytes([v[-1] ^ 0x80])),  # payload, last byte
    (5, lambda v: v + 1.0),  # expiration
    (5, lambda v: v - 1.0),  # expiration, shortened
    (6, lambda v: Identity.generate().public_key),  # public key
    (7, lambda v: bytes([v[0] ^ 1]) + v[1:]),  # signature
    (7, lambda v: v[:-1] + bytes([v[-1] ^ 0x40])),  # signature
    (0, lambda v: "HT2"),  # magic
])
def test_tampered_envelope_rejected(owner: Identity, index: int, tamper: Any) -> None:
    raw = msgpack.unpackb(_hb_envelope(owner).encode(), raw=False)
    raw[index] = tamper(raw[index])
    with pytest.raises(InvalidRecord):
        Envelope.decode(msgpack.packb(raw, use_bin_type=True), now=NOW)


@pytest.mark.parametrize("raw", [
    [], ["HT1"], "HT1", {"HT1": 1}, 42, None,
    ["HT1", "hb", "k", "s", b"", 1.0, b"", b"", "extra"],
])
def test_non_envelopes_rejected(raw: Any) -> None:
    with pytest.raises(InvalidRecord):
        Envelope.decode(msgpack.packb(raw, use_bin_type=True), now=NOW)


def test_wrong_field_types_rejected(owner: Identity) -> None:
    good = msgpack.unpackb(_hb_envelope(owner).encode(), raw=False)
    for index, value in [(2, b"key"), (2, ""), (3, 5), (4, "text"), (5, 5), (5, float("inf")),
                         (5, float("nan")), (6, "pk"), (7, "sig")]:
        raw = list(good)
        raw[index] = value
        with pytest.raises(InvalidRecord):
            Envelope.decode(msgpack.packb(raw, use_bin_type=True), now=NOW)


def test_expiration_bounds(owner: Identity) -> None:
    ok = _hb_envelope(owner, NOW + MAX_TTL)
    assert Envelope.decode(ok.encode(), now=NOW) == ok
    edge = _hb_envelope(owner, NOW + MAX_TTL + CLOCK_SKEW)
    assert Envelope.decode(edge.encode(), now=NOW) == edge
    too_far = _hb_envelope(owner, NOW + MAX_TTL + CLOCK_SKEW + 1.0)
    with pytest.raises(InvalidRecord, match="expires"):
        Envelope.decode(too_far.encode(), now=NOW)


def test_spec_expiration_allowed_up_to_max_ttl_spec(owner: Identity) -> None:
    run_key = make_run_key("r1", owner.public_key)
    payload = RunSpec.from_preset("r1", "tiny").encode()
    ok = Envelope.sign(owner, "spec", spec_key(run_key), payload, NOW + MAX_TTL_SPEC)
    assert MAX_TTL_SPEC > MAX_TTL + CLOCK_SKEW
    assert Envelope.decode(ok.encode(), now=NOW) == ok
    too_far = Envelope.sign(owner, "spec", spec_key(run_key), payload, NOW + MAX_TTL_SPEC + CLOCK_SKEW + 1.0)
    with pytest.raises(InvalidRecord):
        Envelope.decode(too_far.encode(), now=NOW)
    # a heartbeat may not claim the spec's lifetime
    hb = Envelope.sign(owner, "hb", heartbeat_key(run_key), encode_payload("hb", _hb_fields()), NOW + MAX_TTL_SPEC)
    with pytest.raises(InvalidRecord):
        Envelope.decode(hb.encode(), now=NOW)


def test_subkey_must_be_signers_fingerprint(owner: Identity, other: Identity) -> None:
    """A validly signed record claiming another peer's subkey is refused."""
    key, payload, exp = heartbeat_key("r1.x"), encode_payload("hb", _hb_fields()), NOW + 60
    sig = owner.sign(Envelope.signed_message("hb", key, other.fingerprint, payload, exp))
    forged = Envelope("hb", key, other.fingerprint, payload, exp, owner.public_key, sig)
    with pytest.raises(InvalidRecord, match="fingerprint"):
        Envelope.decode(forged.encode(), now=NOW)


def test_oversized_record_rejected_before_parsing(owner: Identity, monkeypatch: pytest.MonkeyPatch) -> None:
    big = msgpack.packb(b"x" * MAX_RECORD_BYTES, use_bin_type=True)
    assert len(big) > MAX_RECORD_BYTES

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an oversized record was handed to the msgpack parser")

    monkeypatch.setattr(records.msgpack, "unpackb", no_parse)
    with pytest.raises(InvalidRecord, match="larger than"):
        Envelope.decode(big, now=NOW)
    with pytest.raises(InvalidRecord, match="larger than"):
        strict_unpack(b"\x00" * (MAX_RECORD_BYTES + 1), MAX_RECORD_BYTES)


def test_strict_unpack_rejects_non_bytes() -> None:
    for bad in ("text", None, 5, [b"x"]):
        with pytest.raises(InvalidRecord):
            strict_unpack(bad, 100)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [
    msgpack.packb(msgpack.ExtType(1, b"x")),
    msgpack.packb([1, msgpack.ExtType(0x40, msgpack.packb([1]))]),
    msgpack.packb(list(range(65))),  # container too long
    msgpack.packb({str(i): i for i in range(MAX_MAP_LEN + 1)}),
    msgpack.packb({1: 2}),  # non-string map key
    b"\x91",  # truncated
    b"\xc1",  # never-used byte
    msgpack.packb(1) + msgpack.packb(2),  # trailing data
])
def test_strict_unpack_rejects_malformed(data: bytes) -> None:
    with pytest.raises(InvalidRecord):
        strict_unpack(data, MAX_RECORD_BYTES)


# ---- the nested payload attack --------------------------------------------------------------------


def test_nested_arrays_rejected_by_envelope_decode() -> None:
    for depth in (200, 1000, 5000):
        with pytest.raises(InvalidRecord):
            Envelope.decode(_nested_arrays(depth), now=NOW)


def test_nested_arrays_rejected_by_strict_unpack() -> None:
    """records.py promises flat payloads and no recursion beyond one level: 200 nested arrays are refused."""
    with pytest.raises(InvalidRecord):
        strict_unpack(_nested_arrays(200), MAX_RECORD_BYTES)


def test_deeply_nested_payload_field_rejected_by_decode_payload() -> None:
    """A signed heartbeat whose field holds a ~1000-deep list must give InvalidRecord, not RecursionError."""
    payload = b"\x86"
    for name, value in _hb_fields().items():
        payload += msgpack.packb(name)
        payload += _nested_arrays(1000) if name == "peer_id" else msgpack.packb(value)
    assert len(payload) <= records.MAX_PAYLOAD_BYTES
    with pytest.raises(InvalidRecord):
        decode_payload("hb", payload)


@pytest.mark.parametrize("code", [0x40, 0x01, 0x7f])
def test_nested_ext_types_rejected(code: int) -> None:
    data = _nested_ext(200, code)
    with pytest.raises(InvalidRecord):
        strict_unpack(data, MAX_RECORD_BYTES)
    with pytest.raises(InvalidRecord):
        Envelope.decode(data, now=NOW)


def test_hivemind_nested_tuple_rejected() -> None:
    value: Any = 0
    for _ in range(200):
        value = (value,)
    data = MSGPackSerializer.dumps(value)  # hivemind's tuple ext (code 0x40), nested
    with pytest.raises(InvalidRecord):
        strict_unpack(data, MAX_RECORD_BYTES)
    with pytest.raises(InvalidRecord):
        Envelope.decode(data, now=NOW)


# ---- payload schemas ------------------------------------------------------------------------------


def test_heartbeat_payload_round_trip() -> None:
    fields = _hb_fields()
    assert decode_payload("hb", encode_payload("hb", fields)) == fields
    also_ok = _hb_fields(train_loss=None, eval_loss=1.0, throughput=0)
    assert decode_payload("hb", encode_payload("hb", also_ok)) == also_ok


@pytest.mark.parametrize("fields", [
    _hb_fields(round="3"),  # wrong type
    _hb_fields(round=True),
    _hb_fields(round=-1),
    _hb_fields(round=3.0),
    _hb_fields(throughput="fast"),
    _hb_fields(throughput=float("nan")),
    _hb_fields(throughput=-1.0),
    _hb_fields(state_hash="xyz"),
    _hb_fields(state_hash=HASH.upper()),
    _hb_fields(parent="xyz"),
    _hb_fields(parent=None),
    _hb_fields(peer_id=""),
    _hb_fields(peer_id="p" * 129),
    _hb_fields(peer_id="not a peer id!"),  # would break view messages and the DHT refresh
    _hb_fields(train_loss=[1.0]),
    _hb_fields(extra=1),  # extra field
    {k: v for k, v in _hb_fields().items() if k != "eval_loss"},  # missing field
])
def test_bad_heartbeat_payload_rejected(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRecord):
        decode_payload("hb", msgpack.packb(fields, use_bin_type=True))
    with pytest.raises(InvalidRecord):
        encode_payload("hb", fields)


def test_non_map_payload_rejected() -> None:
    for data in (msgpack.packb([1, 2]), msgpack.packb("hb"), b"\xc1"):
        with pytest.raises(InvalidRecord):
            decode_payload("hb", data)


def test_ready_payload_round_trip() -> None:
    fields = dict(peer_id=PEER, round=0, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0)
    assert decode_payload("ready", encode_payload("ready", fields)) == fields
    with pytest.raises(InvalidRecord):
        encode_payload("ready", {**fields, "round": 10**9 + 1})


# ---- the DHT validator and the run spec -----------------------------------------------------------


def _spec_envelope(signer: Identity, run_key: str, spec: RunSpec, key: str | None = None) -> Envelope:
    return Envelope.sign(signer, "spec", key or spec_key(run_key), spec.encode(), time.time() + 3600)


def test_valid_spec_round_trips_through_validator_and_decode_spec(owner: Identity) -> None:
    spec = RunSpec.from_preset("r1", "tiny")
    run_key = make_run_key("r1", owner.public_key)
    env = _spec_envelope(owner, run_key, spec)
    assert check_record(*_dht_args(env)) == env
    decoded = decode_spec(run_key, env)
    assert decoded == spec
    assert decoded.spec_hash() == spec.spec_hash()


def test_spec_signed_by_non_owner_refused(owner: Identity, other: Identity) -> None:
    spec = RunSpec.from_preset("r1", "tiny")
    run_key = make_run_key("r1", owner.public_key)
    forged = _spec_envelope(other, run_key, spec)
    assert Envelope.decode(forged.encode()) == forged  # well-formed and validly signed, by the wrong key
    with pytest.raises(InvalidRecord):
        decode_spec(run_key, forged)
    with pytest.raises(InvalidRecord, match="owner"):
        check_record(*_dht_args(forged))


def test_decode_spec_refuses_mismatches(owner: Identity) -> None:
    run_key = make_run_key("r1", owner.public_key)
    other_name = _spec_envelope(owner, run_key, RunSpec.from_preset("r2", "tiny"))
    with pytest.raises(InvalidRecord, match="names run"):
        decode_spec(run_key, other_name)
    wrong_key = _spec_envelope(owner, run_key, RunSpec.from_preset("r1", "tiny"),
                               key=spec_key(make_run_key("r2", owner.public_key)))
    with pytest.raises(InvalidRecord):
        decode_spec(run_key, wrong_key)
    hb = Envelope.sign(owner, "hb", spec_key(run_key), encode_payload("hb", _hb_fields()), time.time() + 60)
    with pytest.raises(InvalidRecord):
        decode_spec(run_key, hb)
    garbage = Envelope.sign(owner, "spec", spec_key(run_key), msgpack.packb({"name": "r1"}), time.time() + 60)
    with pytest.raises(InvalidRecord, match="malformed"):
        decode_spec(run_key, garbage)
    with pytest.raises(ValueError):
        decode_spec("not a run key", other_name)


def test_check_record_binds_key_subkey_and_expiration(owner: Identity, other: Identity) -> None:
    env = _hb_envelope(owner, time.time() + 60)
    key_id, subkey, value, exp = _dht_args(env)
    assert check_record(key_id, subkey, value, exp) == env
    assert check_record(key_id, subkey, value, exp - 10) == env  # the DHT may drop it earlier
    with pytest.raises(InvalidRecord, match="another key"):
        check_record(DHTID.generate(source="hivetrain/other/peers").to_bytes(), subkey, value, exp)
    with pytest.raises(InvalidRecord, match="subkey"):
        check_record(key_id, msgpack.packb(other.fingerprint), value, exp)
    with pytest.raises(InvalidRecord, match="expiration"):
        check_record(key_id, subkey, value, exp + 1)
    with pytest.raises(InvalidRecord):
        check_record(key_id, subkey, env.encode(), exp)  # not wrapped as the DHT wraps values
    with pytest.raises(InvalidRecord):
        check_record(key_id, subkey, msgpack.packb(b"\x00" * (MAX_RECORD_BYTES + 100)), exp)


@pytest.mark.parametrize("kind, key", [
    ("hb", "hivetrain/{rk}/spec"),
    ("hb", "hivetrain/{rk}/peers/1"),
    ("ready", "hivetrain/{rk}/ready/x"),
    ("ready", "hivetrain/{rk}/ready"),
    ("ready", "hivetrain/{rk}/peers"),
    ("hb", "other/{rk}/peers"),
    ("hb", "hivetrain/not-a-run-key/peers"),
    ("hb", "peers"),
])
def test_check_record_rejects_kind_key_mismatch(owner: Identity, kind: str, key: str) -> None:
    run_key = make_run_key("r1", owner.public_key)
    payload = encode_payload("hb", _hb_fields()) if kind == "hb" else encode_payload(
        "ready", dict(peer_id=PEER, round=1, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0))
    env = Envelope.sign(owner, kind, key.format(rk=run_key), payload, time.time() + 60)
    with pytest.raises(InvalidRecord):
        check_record(*_dht_args(env))


def test_check_record_accepts_ready_record(owner: Identity) -> None:
    run_key = make_run_key("r1", owner.public_key)
    payload = encode_payload("ready", dict(peer_id=owner.peer_id, round=12, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0))
    env = Envelope.sign(owner, "ready", ready_key(run_key, 12), payload, time.time() + 60)
    assert check_record(*_dht_args(env)) == env
    assert decode_bound("ready", env)["peer_id"] == owner.peer_id


def test_a_ready_record_is_accepted_only_in_its_peers_bucket_of_its_round(owner: Identity) -> None:
    run_key = make_run_key("r1", owner.public_key)
    payload = encode_payload("ready", dict(peer_id=owner.peer_id, round=12, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0))
    mine = records.bucket_of(12, owner.peer_id, 3)

    def stored_under(key: str) -> Envelope:
        return check_record(*_dht_args(Envelope.sign(owner, "ready", key, payload, time.time() + 60)))

    assert stored_under(ready_key(run_key, 12, 3, mine)).key.endswith(f"/ready/12/3/{mine}")
    bad = [ready_key(run_key, 12, 3, (mine + 1) % 8),  # another peer's bucket: a flood aimed at one bucket
           ready_key(run_key, 13, 3, records.bucket_of(13, owner.peer_id, 3)),  # another round's key
           f"hivetrain/{run_key}/ready/12/0/0",  # level 0 has one key, without numbers
           ready_key(run_key, 12, records.MAX_READY_LEVEL + 1, records.bucket_of(12, owner.peer_id, 13)),
           f"hivetrain/{run_key}/ready/12/3"]
    for key in bad:
        with pytest.raises(InvalidRecord):
            stored_under(key)


def test_buckets_nest_from_one_level_to_the_next_and_spread_peers_evenly() -> None:
    peers = [Identity.generate().peer_id for _ in range(512)]
    for p in peers[:64]:
        assert records.bucket_of(5, p, 0) == 0
        for level in range(1, 8):
            assert records.bucket_of(5, p, level) >> 1 == records.bucket_of(5, p, level - 1)
    sizes = [sum(records.bucket_of(5, p, 3) == b for p in peers) for b in range(8)]
    assert min(sizes) > 32 and max(sizes) < 100  # 64 each on average
    # the same in every round: a bucket's peers meet again (the trust they earned spares them newcomer caps)
    assert [records.bucket_of(5, p, 3) for p in peers] == [records.bucket_of(6, p, 3) for p in peers]


# ---- records bound to the transport's identity ----------------------------------------------------


def _ready_envelope(signer: Identity, named: str) -> Envelope:
    run_key = make_run_key("r1", signer.public_key)
    payload = encode_payload("ready", dict(peer_id=named, round=12, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0))
    return Envelope.sign(signer, "ready", ready_key(run_key, 12), payload, time.time() + 60)


def test_a_record_bound_to_its_signer_decodes(owner: Identity) -> None:
    env = _hb_envelope(owner, time.time() + 60)
    assert decode_bound("hb", Envelope.decode(env.encode())) == _hb_fields(peer_id=owner.peer_id)
    assert check_record(*_dht_args(env)) == env


@pytest.mark.parametrize("kind", ["hb", "ready"])
def test_a_record_naming_another_peer_is_refused_by_decode_and_by_the_validator(
        owner: Identity, other: Identity, kind: str) -> None:
    """A signer that names another libp2p id (a real peer's, or a made-up one) speaks for nobody."""
    for named in (other.peer_id, PEER):
        if kind == "hb":
            payload = encode_payload("hb", _hb_fields(peer_id=named))
            env = Envelope.sign(owner, "hb", heartbeat_key(make_run_key("r1", owner.public_key)), payload,
                                time.time() + 60)
        else:
            env = _ready_envelope(owner, named)
        assert Envelope.decode(env.encode()) == env  # well-formed and validly signed
        with pytest.raises(InvalidRecord, match="signed by"):
            decode_bound(kind, env)
        with pytest.raises(InvalidRecord, match="signed by"):
            check_record(*_dht_args(env))


def test_decode_bound_refuses_another_kind_and_a_bad_payload(owner: Identity) -> None:
    env = _hb_envelope(owner, time.time() + 60)
    with pytest.raises(InvalidRecord, match="expected a ready record"):
        decode_bound("ready", env)
    with pytest.raises(InvalidRecord):
        decode_bound("spec", env)
    bad = Envelope.sign(owner, "hb", env.key, msgpack.packb({"peer_id": owner.peer_id}), time.time() + 60)
    with pytest.raises(InvalidRecord, match="exactly the fields"):
        decode_bound("hb", bad)
    with pytest.raises(InvalidRecord, match="exactly the fields"):
        check_record(*_dht_args(bad))  # the validator checks the schema too: such a record is not stored


# ---- identity files -------------------------------------------------------------------------------


def test_identity_load_or_create(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "identity.pem"
    created = Identity.load_or_create(str(path))
    assert path.exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left behind
    loaded = Identity.load_or_create(str(path))
    assert loaded.public_key == created.public_key
    assert loaded.fingerprint == created.fingerprint
    verify(created.public_key, loaded.sign(b"m"), b"m")


def test_identity_file_not_a_key(tmp_path: Path) -> None:
    path = tmp_path / "identity.pem"
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="PEM"):
        Identity.load_or_create(str(path))


def test_every_run_spec_field_fits_the_decoders_map_cap(owner: Identity) -> None:
    # a spec with more fields than the cap cannot be fetched by any joiner ("malformed msgpack"): grow the cap
    # with the spec (peer/config.py); a spec with every schedule field set still round-trips
    assert len(dataclasses.fields(RunSpec)) <= MAX_MAP_LEN
    spec = RunSpec.from_preset("r2", "tiny", inner_warmup=40, inner_schedule="cosine", inner_total_steps=4000)
    run_key = make_run_key("r2", owner.public_key)
    assert decode_spec(run_key, _spec_envelope(owner, run_key, spec)) == spec
