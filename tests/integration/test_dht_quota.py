"""Per-peer store quotas between real hivemind DHT nodes on 127.0.0.1 (dht/store_guard.py).

A victim node with small caps, an attacker node that floods it with properly signed records over
hivemind's own store RPC, and an honest node with its own libp2p id and signing identity."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.dht.quota import QuotaConfig
from hivetrain.dht.records import Envelope, encode_payload, heartbeat_key, ready_key

pytestmark = pytest.mark.timeout(60)
HASH = "cd" * 32
RUN_KEY = make_run_key("quota", Identity.generate().public_key)


@pytest.fixture
def start() -> Iterator[Callable[..., DHT]]:
    started: list[DHT] = []

    def _start(config: QuotaConfig | None = None, initial: tuple[str, ...] = ()) -> DHT:
        options = DHTOptions(initial_peers=initial, timeout=10.0, store_quota=config or QuotaConfig())
        dht = DHT(options)
        started.append(dht)
        return dht.start()

    yield _start
    for dht in reversed(started):
        dht.shutdown()


def heartbeat(identity: Identity, expiration: float) -> Envelope:
    fields = dict(peer_id=identity.peer_id, round=1, state_hash=HASH, parent=HASH, throughput=1.0, train_loss=None,
                  eval_loss=None)  # bound: in the signer's own name, or the validator refuses it
    return Envelope.sign(identity, "hb", heartbeat_key(RUN_KEY), encode_payload("hb", fields), expiration)


def ready(identity: Identity, round_: int, expiration: float) -> Envelope:
    fields = dict(peer_id=identity.peer_id, round=round_, base_hash=HASH, spec_hash=HASH, done=True, eta=0.0)
    return Envelope.sign(identity, "ready", ready_key(RUN_KEY, round_), encode_payload("ready", fields), expiration)


def send(sender: DHT, victim: DHT, envelopes: list[Envelope]) -> list[bool]:
    """One store request straight to ``victim``, as hivemind's DHTNode.store would send it."""
    async def call() -> Any:
        return await sender._node.protocol.call_store(
            PeerID.from_base58(victim.peer_id), keys=[DHTID.generate(source=e.key) for e in envelopes],
            values=[MSGPackSerializer.dumps(e.encode()) for e in envelopes],
            expiration_time=[e.expiration for e in envelopes], subkeys=[e.subkey for e in envelopes])

    result = sender.run(call(), timeout=15)
    assert result is not None, "the victim did not answer a store request"
    return list(result)


def served(asker: DHT, victim: DHT, key: str) -> set[str]:
    """The subkeys ``victim`` itself returns for ``key`` (one find RPC, no DHT traversal)."""
    key_id = DHTID.generate(source=key)

    async def call() -> Any:
        return await asker._node.protocol.call_find(PeerID.from_base58(victim.peer_id), [key_id])

    found = asker.run(call(), timeout=15)
    assert found is not None, "the victim did not answer a find request"
    value = found[key_id][0]
    if value is None or not isinstance(value.value, DictionaryDHTValue):
        return set()
    return {subkey for subkey, _ in value.value.items()}


def chunks(items: list[Envelope], size: int) -> list[list[Envelope]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def test_a_flood_of_subkeys_and_keys_is_capped_and_the_victim_keeps_serving(start: Callable[..., DHT]) -> None:
    victim = start(QuotaConfig(max_subkeys_per_key=8, max_entries=24, max_values_per_request=16))
    maddrs = tuple(victim.visible_maddrs())
    attacker, honest = start(initial=maddrs), start(initial=maddrs)
    now = time.time()
    first = Identity.generate()
    assert send(honest, victim, [heartbeat(first, now + 120)]) == [True]

    # 40 signing identities behind one libp2p id, with later expirations than the honest record
    subkey_flood = [heartbeat(Identity.generate(), now + 3000 + i) for i in range(40)]
    subkey_results = [ok for batch in chunks(subkey_flood, 8) for ok in send(attacker, victim, batch)]
    held = served(honest, victim, heartbeat_key(RUN_KEY))
    assert len(held) == 8 and first.fingerprint in held
    # each batch pushed out the attacker's own earlier entries, never the honest one
    assert subkey_results.count(False) == 5 and victim.quota_stats()["subkey_cap"] == 33

    flooder = Identity.generate()
    key_flood = [ready(flooder, r, now + 3000 + r) for r in range(1, 41)]
    for batch in chunks(key_flood, 8):
        send(attacker, victim, batch)
    stats = victim.quota_stats()  # 1 honest entry and 23 of the attacker's 47 are held
    assert (stats["entries"], stats["subkey_cap"], stats["storage_cap"]) == (24, 33, 24), stats
    assert first.fingerprint in served(honest, victim, heartbeat_key(RUN_KEY))

    # the victim keeps working: a fresh record from a third identity is stored, served and found
    second = Identity.generate()
    fresh = ready(second, 1000, now + 120)
    assert send(honest, victim, [fresh]) == [True]
    assert served(honest, victim, fresh.key) == {second.fingerprint}
    later = ready(second, 1001, now + 120)
    assert honest.store(later)
    assert [e.subkey for e in victim.get(later.key)] == [second.fingerprint]
    assert victim.quota_stats()["entries"] <= 24


def test_a_request_flood_is_rate_limited_per_source(start: Callable[..., DHT],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    victim = start(QuotaConfig(max_requests_per_window=20, max_values_per_request=16))
    maddrs = tuple(victim.visible_maddrs())
    attacker, honest = start(initial=maddrs), start(initial=maddrs)
    now, flooder = time.time(), Identity.generate()
    with caplog.at_level(logging.WARNING, logger="hivetrain.dht.store_guard"):
        assert send(attacker, victim, [ready(flooder, r, now + 600) for r in range(17)]) == [False] * 17
        results = [send(attacker, victim, [ready(flooder, r, now + 600)]) for r in range(100, 130)]
    assert results == [[True]] * 20 + [[False]] * 10
    stats = victim.quota_stats()
    assert (stats["too_many_values"], stats["rate"]) == (17, 10), stats
    lines = [r for r in caplog.records if attacker.peer_id in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # 27 refusals, one log line

    # another libp2p id is not affected, and the victim still answers reads
    other = Identity.generate()
    assert send(honest, victim, [ready(other, 7, now + 120)]) == [True]
    record = ready(other, 8, now + 120)
    assert honest.store(record)
    assert [e.subkey for e in victim.get(record.key)] == [other.fingerprint]
    assert served(honest, victim, ready_key(RUN_KEY, 100)) == {flooder.fingerprint}
