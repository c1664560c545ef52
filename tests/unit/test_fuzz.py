"""Bounded fuzzing of every decoder that sees peer bytes: only the documented rejections, no crash."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivetrain.dht.errors import InvalidRecord
from hivetrain.dht.hardening import ExtNestingError, install
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import Envelope, decode_bound, decode_payload, strict_unpack
from hivetrain.dht.validator import check_record
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import decode, encoded_nbytes
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import ConfigError, StateMismatch
from hivetrain.peer.net.wire import MAGIC, PREFIX, ProtocolError, read_frame
from hivetrain.peer.state.choose import (
    Attestation,
    Clock,
    Own,
    State,
    choose,
    choose_joiner,
    plan_contacts,
    round_ceiling,
)
from hivetrain.peer.state.snapshot import parse_manifest

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# msgpack-shaped inputs reach deeper than random bytes
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=40),
                    st.binary(max_size=80))
trees = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=6), st.dictionaries(st.text(max_size=8), c,
                                                                                           max_size=6)),
                     max_leaves=30)
packed = st.one_of(st.binary(max_size=400), trees.map(lambda t: msgpack.packb(t, use_bin_type=True)))


@FUZZ
@given(packed)
def test_envelope_decode(data: bytes) -> None:
    try:
        Envelope.decode(data)
    except InvalidRecord:
        pass


@FUZZ
@given(packed, st.sampled_from(["hb", "ready"]))
def test_payload_decode(data: bytes, kind: str) -> None:
    try:
        decode_payload(kind, data)
    except InvalidRecord:
        pass


SIGNER = Identity.generate()


@FUZZ
@given(packed, st.sampled_from(["hb", "ready", "spec"]), st.sampled_from(["hb", "ready"]))
def test_bound_decode(payload: bytes, kind: str, asked: str) -> None:
    envelope = Envelope.sign(SIGNER, kind, "hivetrain/x/peers", payload[:8000], 1e9)
    try:
        fields = decode_bound(asked, envelope)
    except InvalidRecord:
        return
    assert fields["peer_id"] == SIGNER.peer_id  # anything that decodes speaks for its signer


@FUZZ
@given(packed, st.binary(max_size=40), st.binary(max_size=40))
def test_dht_validator(value: bytes, key: bytes, subkey: bytes) -> None:
    try:
        check_record(key, subkey, msgpack.packb(value, use_bin_type=True), 1e9)
    except InvalidRecord:
        pass


@FUZZ
@given(trees)
def test_run_spec_from_untrusted(tree: object) -> None:
    try:
        raw = strict_unpack(msgpack.packb(tree, use_bin_type=True), 16 * 1024)
        RunSpec.from_dict(raw)
    except (InvalidRecord, ConfigError):
        pass


async def _frame(data: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    try:
        await read_frame(reader, timeout=1.0, max_body=4096)
    except (ProtocolError, asyncio.IncompleteReadError):
        pass


@FUZZ
@given(packed, st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.binary(max_size=64))
def test_wire_frames(header: bytes, header_len: int, body_len: int, tail: bytes) -> None:
    asyncio.run(_frame(PREFIX.pack(MAGIC, header_len, body_len) + header + tail))
    asyncio.run(_frame(PREFIX.pack(MAGIC, len(header), len(tail)) + header + tail))


@FUZZ
@given(st.integers(1, 3000), st.binary(max_size=64), st.data())
def test_int8_decode(numel: int, prefix: bytes, data: st.DataObject) -> None:
    n = encoded_nbytes(numel, 1024)
    body = data.draw(st.binary(min_size=max(0, n - 2), max_size=n + 2))
    for payload in (body, prefix + body[len(prefix):]):
        try:
            decode(payload, numel, 1024)
        except CodecError:
            pass


@FUZZ
@given(st.binary(max_size=200), st.integers(1, 10**6), st.integers(0, 5))
def test_state_manifest(manifest: bytes, numel: int, round_: int) -> None:
    with pytest.raises(StateMismatch):
        parse_manifest(round_, numel, manifest, "0" * 64)


@FUZZ
@given(st.integers(1, 300), st.binary(max_size=20))
def test_hivemind_serializer_is_guarded(depth: int, junk: bytes) -> None:
    from hivemind.utils.serializer import MSGPackSerializer

    install()
    packed_value = msgpack.packb(0)
    for _ in range(depth):
        packed_value = msgpack.packb(msgpack.ExtType(0x40, b"\x91" + packed_value))
    try:
        MSGPackSerializer.loads(packed_value + junk)
    except (ExtNestingError, ValueError, msgpack.ExtraData, struct.error):
        pass


hashes = st.sampled_from([c * 64 for c in "0123456789"])
states = st.builds(State, st.integers(0, 10**9), hashes, hashes)
peers = st.sampled_from(["me", "t1", "t2", "t3", "s1", "s2"])


@FUZZ
@given(st.lists(st.builds(Attestation, peers, states), max_size=12), states, st.lists(states, max_size=6),
       st.dictionaries(peers, st.floats(0.0, 1.0), max_size=4), st.floats(0.0, 1e6), st.sets(hashes, max_size=2))
def test_fork_choice_on_arbitrary_attestations(found: list[Attestation], mine: State, history: list[State],
                                               weights: dict[str, float], elapsed: float, exclude: set[str]) -> None:
    """Whatever the heartbeats claim: no crash, and a target only ever comes from trusted peers
    within the clock bound, never a refused or excluded state."""
    own = Own("me", mine, tuple(history))
    choice = choose(found, own, weights, Clock(0.2, elapsed), exclude=exclude)
    if choice.target is not None:
        t = choice.target
        assert t.attesters and all(weights.get(p, 0.0) > 0 and p != "me" for p in t.attesters)
        assert t.round <= round_ceiling(mine.round, elapsed, 0.2) and t.hash not in exclude
        assert any(a.peer in t.attesters and (a.state.round, a.state.hash) == (t.round, t.hash) for a in found)
    plan = plan_contacts(found, own, b"salt", exclude)
    joined = choose_joiner(plan, own, {p: p[:1] for ps in plan.values() for p in ps})
    assert joined.target is None or joined.target.hash not in exclude
