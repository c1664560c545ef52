"""DHT store quotas: the pure rules (dht/quota.py) and the guard in front of hivemind's rpc_store
(dht/store_guard.py), driven here in-process against hivemind's real storage, with no network."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import timed_storage
from hivemind.utils.serializer import MSGPackSerializer

from hivetrain.dht.errors import InvalidRecord
from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.quota import Ledger, QuotaConfig, RateWindow, RejectionLog, victims
from hivetrain.dht.records import Envelope, encode_payload, heartbeat_key, ready_key
from hivetrain.dht.store_guard import StoreGuard
from hivetrain.dht.validator import EnvelopeValidator, check_record

HASH = "ab" * 32
RUN_KEY = make_run_key("quota", Identity.generate().public_key)

# ---- pure rules -----------------------------------------------------------------------------------


def test_config_names_the_field_and_range() -> None:
    with pytest.raises(ValueError, match="window"):
        QuotaConfig(window=0)
    with pytest.raises(ValueError, match=r"max_subkeys_per_key must be an integer in \[1, 1000000\]"):
        QuotaConfig(max_subkeys_per_key=0)
    assert QuotaConfig().max_subkeys_per_key == 256


def test_rate_window_counts_requests_and_values_and_slides() -> None:
    config = QuotaConfig(window=12.0, max_requests_per_window=3, max_values_per_window=5)  # 1 s slices
    rates = RateWindow()
    assert [rates.admit("a", 1, t, config) for t in (0.0, 1.0, 2.0)] == [True, True, True]
    assert rates.admit("a", 1, 3.0, config) is False  # a 4th request within 12 s
    assert rates.admit("b", 5, 3.0, config) is True  # another source has its own window
    assert rates.admit("b", 1, 4.0, config) is False  # 6 values > 5
    assert rates.admit("a", 1, 11.9, config) is False  # refused requests are not counted, none expired yet
    assert rates.admit("a", 3, 12.0, config) is True  # the request at t=0 left the window: 2 + 3 values
    assert rates.admit("a", 1, 12.5, config) is False  # 3 requests in the window again
    assert rates.admit("a", 4, 14.0, config) is False  # t=1, t=2 gone: 3 values + 4 > 5
    assert rates.admit("a", 2, 14.0, config) is True
    assert len(rates._windows["a"]) == 2  # slices 12 and 14: bounded, whatever the request rate


def test_rate_window_remembers_a_bounded_number_of_sources() -> None:
    config = QuotaConfig(window=60.0, max_requests_per_window=1)
    rates = RateWindow(max_sources=2)
    assert rates.admit("a", 1, 0.0, config) and rates.admit("b", 1, 0.0, config)
    assert not rates.admit("a", 1, 1.0, config)  # "a" is now the most recent
    assert rates.admit("c", 1, 1.0, config)  # forgets "b", the least recent
    assert rates.admit("b", 1, 2.0, config)  # a forgotten source starts afresh
    assert not rates.admit("b", 1, 3.0, config)


def test_largest_holder_loses_its_earliest_expiring_entry() -> None:
    holdings = {
        "honest": {("s", 1, "h1"): 50.0},
        "flood": {("s", 1, "f1"): 300.0, ("s", 1, "f2"): 200.0, ("s", 1, "f3"): 400.0},
    }
    # not the earliest-expiring entry overall (honest's, at 50), but the flood's earliest
    assert victims(holdings, "honest", 1) == [("s", 1, "f2")]
    assert victims(holdings, "flood", 1) == [("s", 1, "f2")]
    # flood 1 vs honest 1: the flood claims the later expiration (400 > 50), so it loses the tie
    assert victims(holdings, "x", 3) == [("s", 1, "f2"), ("s", 1, "f1"), ("s", 1, "f3")]
    assert victims(holdings, "honest", 3) == [("s", 1, "f2"), ("s", 1, "f1"), ("s", 1, "h1")]  # tie: incoming
    assert victims(holdings, "x", 9) == [("s", 1, e) for e in ("f2", "f1", "f3", "h1")]
    assert victims({}, "x", 1) == [] and victims({"a": {}}, "x", 1) == []


def test_on_equal_holdings_the_incoming_source_loses_then_the_longest_claim() -> None:
    holdings = {"old": {("s", 1, "o"): 10.0}, "new": {("s", 1, "n"): 999.0}, "other": {("s", 1, "x"): 20.0}}
    assert victims(holdings, "old", 1) == [("s", 1, "o")]  # first come, first kept
    assert victims(holdings, "nobody", 2) == [("s", 1, "n"), ("s", 1, "x")]


def test_evictions_follow_the_holdings_as_they_shrink() -> None:
    holdings = {"a": {("s", 1, f"a{i}"): 10.0 + i for i in range(5)},
                "b": {("s", 1, f"b{i}"): 1.0 + i for i in range(3)},
                "c": {("s", 1, "c0"): 0.5}}
    # a: 5 -> 4 -> 3; then a and b hold 3 each and a claims the later expiration (14 > 3); then b (3 > 2)
    assert victims(holdings, "c", 4) == [("s", 1, e) for e in ("a0", "a1", "a2", "b0")]
    assert len(holdings["a"]) == 5  # it only chooses


def test_ledger_attributes_indexes_and_prunes() -> None:
    ledger = Ledger()
    ledger.record(("storage", 1, "a"), "p", 10.0)
    ledger.record(("storage", 1, "b"), "p", 20.0)
    ledger.record(("storage", 2, "a"), "q", 30.0)
    assert len(ledger) == 3
    assert {s: dict(e) for s, e in ledger.in_group(("storage", 1)).items()} == {
        "p": {("storage", 1, "a"): 10.0, ("storage", 1, "b"): 20.0}}
    ledger.record(("storage", 1, "a"), "q", 40.0)  # overwritten by a newer copy from q
    assert ledger.get(("storage", 1, "a")) == ("q", 40.0)
    assert set(ledger.by_source()["p"]) == {("storage", 1, "b")}
    ledger.prune(now=25.0)  # b (20) expired; a's old copy (10) must not take the new one with it
    assert ("storage", 1, "b") not in ledger and ledger.get(("storage", 1, "a")) == ("q", 40.0)
    assert "p" not in ledger.by_source()
    ledger.forget(("storage", 2, "a"))
    ledger.forget(("storage", 2, "a"))  # twice is fine
    assert ledger.in_group(("storage", 2)) == {}
    for i in range(500):  # many overwrites of one entry: the heap stays bounded, the entry stays
        ledger.record(("storage", 1, "a"), "q", 100.0 + i)
    assert len(ledger._heap) <= 2 * len(ledger) + 65
    ledger.prune(now=598.0)
    assert ledger.get(("storage", 1, "a")) == ("q", 599.0)
    ledger.prune(now=600.0)
    assert len(ledger) == 0


def test_rejections_are_logged_once_per_source_per_interval() -> None:
    log = RejectionLog(interval=60.0, max_lines=1)
    assert log.note("a", "rate", 3, now=0.0) == {"rate": 3}
    assert log.note("a", "rate", 1, now=1.0) is None
    assert log.note("a", "subkey_cap", 2, now=59.0) is None
    assert log.note("a", "rate", 1, now=60.0) == {"rate": 2, "subkey_cap": 2}  # what was held back
    assert log.note("b", "rate", 1, now=61.0) is None  # one line (a's) in the last 60 s, over all sources
    assert log.note("b", "rate", 1, now=121.0) == {"rate": 2}
    assert log.totals["rate"] == 7 and log.totals["subkey_cap"] == 2


def test_validator_refuses_a_nan_dht_expiration() -> None:
    envelope = heartbeat(Identity.generate(), time.time() + 60)
    key, subkey, value = raw(envelope)
    check_record(key, subkey, value, envelope.expiration)
    with pytest.raises(InvalidRecord, match="not finite"):
        check_record(key, subkey, value, math.nan)


# ---- the guard on hivemind's storage --------------------------------------------------------------


def heartbeat(identity: Identity, expiration: float) -> Envelope:
    fields = dict(peer_id=identity.peer_id, round=1, state_hash=HASH, parent=HASH, throughput=1.0, train_loss=None,
                  eval_loss=None)  # bound: in the signer's own name, or the validator refuses it
    return Envelope.sign(identity, "hb", heartbeat_key(RUN_KEY), encode_payload("hb", fields), expiration)


def ready(identity: Identity, round_: int, expiration: float) -> Envelope:
    fields = dict(peer_id=identity.peer_id, round=round_, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0)
    return Envelope.sign(identity, "ready", ready_key(RUN_KEY, round_), encode_payload("ready", fields), expiration)


def raw(envelope: Envelope) -> tuple[bytes, bytes, bytes]:
    """(key, subkey, value) bytes as hivemind's DHTNode.store puts them on the wire."""
    return (DHTID.generate(source=envelope.key).to_bytes(), MSGPackSerializer.dumps(envelope.subkey),
            MSGPackSerializer.dumps(envelope.encode()))


def request(envelopes: list[Envelope], expirations: list[float] | None = None) -> dht_pb2.StoreRequest:
    rows = [raw(e) for e in envelopes]
    return dht_pb2.StoreRequest(keys=[r[0] for r in rows], subkeys=[r[1] for r in rows], values=[r[2] for r in rows],
                                expiration_time=expirations or [e.expiration for e in envelopes],
                                in_cache=[False] * len(rows))


ORIGINAL: Any = getattr(DHTProtocol.rpc_store, "__wrapped__", DHTProtocol.rpc_store)  # unpatched


class Node:
    """A DHTProtocol with hivemind's real storage and our validator, and a guard in front of it."""

    def __init__(self, config: QuotaConfig):
        self.protocol = DHTProtocol(_initialized_with_create=True)
        self.protocol.storage, self.protocol.cache = DHTLocalStorage(), DHTLocalStorage()
        self.protocol.record_validator = EnvelopeValidator()
        self.protocol.node_info = dht_pb2.NodeInfo()
        self.guard = StoreGuard(config)

    def store(self, source: str, req: dht_pb2.StoreRequest, guarded: bool = True) -> list[bool]:
        context = P2PContext("DHTProtocol.rpc_store", PeerID(b"victim"), PeerID(source.encode()))

        async def call() -> Any:
            if guarded:
                return await self.guard.handle(self.protocol, req, context, ORIGINAL)
            return await ORIGINAL(self.protocol, req, context)

        return list(asyncio.run(call()).store_ok)

    def subkeys(self, key: str) -> set[str]:
        found = self.protocol.storage.get(DHTID.generate(source=key))
        return set() if found is None else {k for k, _ in found.value.items()}


def test_subkey_flood_evicts_the_flooder_not_the_honest_record() -> None:
    node = Node(QuotaConfig(max_subkeys_per_key=4))
    honest = Identity.generate()
    now = time.time()
    assert node.store("honest", request([heartbeat(honest, now + 30)])) == [True]
    # one libp2p source, six signing identities, later expirations than the honest record
    flood = [heartbeat(Identity.generate(), now + 3000 + i) for i in range(6)]
    results = node.store("flood", request(flood))
    assert results == [False, False, False, True, True, True]  # it evicts its own earliest-expiring ones
    held = node.subkeys(heartbeat_key(RUN_KEY))
    assert len(held) == 4 and honest.fingerprint in held
    # a second honest source still gets in: the flooder (3 entries) loses its earliest-expiring one
    newcomer = Identity.generate()
    assert node.store("newcomer", request([heartbeat(newcomer, now + 30)])) == [True]
    held = node.subkeys(heartbeat_key(RUN_KEY))
    assert {honest.fingerprint, newcomer.fingerprint} <= held and flood[3].subkey not in held
    stats = node.guard.stats()
    assert stats["subkey_cap"] == 3 and stats["evicted_others"] == 1 and stats["entries"] == 4


def test_a_whole_dictionary_counts_every_subkey() -> None:
    node = Node(QuotaConfig(max_subkeys_per_key=4, max_values_per_request=8))
    now = time.time()
    envelopes = [heartbeat(Identity.generate(), now + 60 + i) for i in range(6)]
    dictionary = DictionaryDHTValue()
    for e in envelopes:
        dictionary.store(e.subkey, MSGPackSerializer.dumps(e.encode()), e.expiration)
    key = DHTID.generate(source=heartbeat_key(RUN_KEY)).to_bytes()
    req = dht_pb2.StoreRequest(keys=[key], subkeys=[b""], values=[MSGPackSerializer.dumps(dictionary)],
                               expiration_time=[now + 70], in_cache=[False])
    assert node.store("forwarder", req) == [False]  # not all of it was kept
    assert len(node.subkeys(heartbeat_key(RUN_KEY))) == 4
    too_many = DictionaryDHTValue()
    for i in range(9):
        too_many.store(f"s{i}", b"x", now + 60)
    req.values[0] = MSGPackSerializer.dumps(too_many)
    assert node.store("forwarder", req) == [False]
    assert node.guard.stats()["too_many_values"] == 9


def test_distinct_key_flood_is_capped_and_new_honest_keys_still_fit() -> None:
    node = Node(QuotaConfig(max_entries=6))
    honest, attacker = Identity.generate(), Identity.generate()
    now = time.time()
    assert node.store("honest", request([ready(honest, 1, now + 20)])) == [True]
    for round_ in range(2, 22):
        node.store("flood", request([ready(attacker, round_, now + 3000 + round_)]))
    assert len(node.protocol.storage) == 6 and node.guard.stats()["entries"] == 6
    assert node.subkeys(ready_key(RUN_KEY, 1)) == {honest.fingerprint}
    assert node.store("other", request([ready(Identity.generate(), 99, now + 20)])) == [True]
    assert node.subkeys(ready_key(RUN_KEY, 1)) == {honest.fingerprint}
    assert node.guard.stats()["storage_cap"] == 15 and node.guard.stats()["evicted_others"] == 1


def test_requests_over_the_rate_or_size_are_refused_whole() -> None:
    node = Node(QuotaConfig(max_requests_per_window=3, max_values_per_request=4))
    now = time.time()
    too_big = request([ready(Identity.generate(), r, now + 60) for r in range(5)])
    assert node.store("flood", too_big) == [False] * 5
    results = [node.store("flood", request([ready(Identity.generate(), r, now + 60)])) for r in range(5)]
    assert results == [[True]] * 3 + [[False]] * 2
    assert node.store("honest", request([ready(Identity.generate(), 9, now + 60)])) == [True]
    stats = node.guard.stats()
    assert (stats["too_many_values"], stats["rate"], stats["stored"]) == (5, 2, 4)


def test_nan_expirations_and_misaligned_requests_are_malformed() -> None:
    node = Node(QuotaConfig())
    envelope = heartbeat(Identity.generate(), time.time() + 60)
    assert node.store("x", request([envelope], expirations=[math.nan])) == [False]
    misaligned = request([envelope])
    misaligned.in_cache.append(False)
    assert node.store("x", misaligned) == [False]
    assert node.guard.stats()["malformed"] == 2 and len(node.protocol.storage) == 0


def test_a_replayed_older_copy_no_longer_cuts_the_newer_record_short(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [time.time()]
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: clock[0])
    signer = Identity.generate()
    old, new = heartbeat(signer, clock[0] + 10), heartbeat(signer, clock[0] + 100)
    for guarded, survives in ((False, False), (True, True)):
        node = Node(QuotaConfig())
        assert node.store("signer", request([new]), guarded) == [True]
        assert node.store("replayer", request([old]), guarded) == [False]
        clock[0] += 11  # past the old copy's expiration, well before the new one's
        assert (signer.fingerprint in node.subkeys(heartbeat_key(RUN_KEY))) is survives  # unguarded: hivemind's bug
        clock[0] -= 11
    assert node.guard.stats()["stale"] == 1
    node = Node(QuotaConfig())  # the same two copies in one request, newer first
    assert node.store("replayer", request([new, old])) == [True, False]
    clock[0] += 11
    assert signer.fingerprint in node.subkeys(heartbeat_key(RUN_KEY))
