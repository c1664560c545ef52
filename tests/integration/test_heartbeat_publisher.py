"""HeartbeatPublisher (peer/state/heartbeats.py) against a real DHT node on 127.0.0.1: the training
loop never waits for a heartbeat store, a newer heartbeat supersedes a hung one, failures are
reported, and heartbeats are bound to the libp2p identity: a record naming another peer is neither
stored by the DHT nor read back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.dht.records import Envelope, encode_payload, heartbeat_bucket, heartbeat_key
from hivetrain.peer.state.heartbeats import HeartbeatPublisher, read_heartbeats

pytestmark = pytest.mark.timeout(60)
HASH = "ab" * 32


@pytest.fixture
def dht() -> Iterator[DHT]:
    node = DHT(DHTOptions(timeout=5.0)).start()
    yield node
    node.shutdown()


def _fields(dht: DHT, round_: int) -> dict[str, Any]:
    return dict(peer_id=dht.peer_id, round=round_, state_hash=HASH, parent=HASH, throughput=1.0, train_loss=None,
                eval_loss=None)


def _wait(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_hung_store_does_not_block_and_a_newer_heartbeat_supersedes_it(dht: DHT) -> None:
    run_key = make_run_key("hb", Identity.generate().public_key)
    warnings: list[str] = []
    publisher = HeartbeatPublisher(dht, dht.identity, run_key, 120.0, warnings.append)
    store, release = dht.astore, threading.Event()
    hung: list[bool] = []

    cancelled: list[bool] = []

    async def hanging_store(envelope: Any) -> bool:
        hung.append(True)
        try:
            while not release.is_set():
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return await store(envelope)

    dht.astore = hanging_store  # type: ignore[method-assign]
    t0 = time.monotonic()
    publisher(**_fields(dht, 1))
    assert time.monotonic() - t0 < 1.0  # returned at once, with the store still hanging
    _wait(lambda: hung)
    dht.astore = store  # type: ignore[method-assign]
    publisher(**_fields(dht, 2))  # cancels the hung one
    _wait(lambda: [h["round"] for h in read_heartbeats(dht, run_key)] == [2])
    _wait(lambda: cancelled)  # the hung store was cancelled, not left to finish some time later
    release.set()
    assert warnings == []  # a superseded heartbeat is not a failure


def test_a_failing_store_is_reported_and_a_bad_field_does_not_raise(dht: DHT) -> None:
    run_key = make_run_key("hb", Identity.generate().public_key)
    warnings: list[str] = []
    publisher = HeartbeatPublisher(dht, dht.identity, run_key, 120.0, warnings.append)

    async def broken_store(envelope: Any) -> bool:
        raise ConnectionError("p2pd went away")

    dht.astore = broken_store  # type: ignore[method-assign]
    publisher(**_fields(dht, 1))
    _wait(lambda: warnings)
    assert warnings == ["warning: heartbeat not published (ConnectionError)"]
    publisher(**{**_fields(dht, 1), "peer_id": Identity.generate().peer_id})  # another peer's name
    assert len(warnings) == 2 and "only name the peer that signs it" in warnings[1], warnings
    publisher(**{**_fields(dht, 1), "parent": None})
    assert len(warnings) == 3 and "heartbeat not published" in warnings[2], warnings


def test_a_heartbeat_naming_another_peer_is_not_stored_and_not_read(dht: DHT) -> None:
    run_key = make_run_key("hb", Identity.generate().public_key)
    liar = Identity.generate()
    fields = {**_fields(dht, 7), "peer_id": dht.peer_id}  # signed by the liar, in our name
    forged = Envelope.sign(liar, "hb", heartbeat_key(run_key), encode_payload("hb", fields), time.time() + 60)
    assert dht.store(forged) is False  # our validator refuses it: not stored
    HeartbeatPublisher(dht, dht.identity, run_key, 120.0, lambda w: None)(**_fields(dht, 3))
    _wait(lambda: [(h["peer_id"], h["round"]) for h in read_heartbeats(dht, run_key)] == [(dht.peer_id, 3)])


def test_a_bucketed_heartbeat_is_stored_under_its_bucket_only(dht: DHT) -> None:
    # a run whose spec expects many peers: heartbeats under 2^3 keys; the real DHT node's validator
    # stores ours under our bucket and refuses it under another
    run_key = make_run_key("hb", Identity.generate().public_key)
    publisher = HeartbeatPublisher(dht, dht.identity, run_key, 120.0, lambda w: None, level=3)
    publisher(**_fields(dht, 4))
    mine = heartbeat_bucket(dht.peer_id, 3)
    _wait(lambda: [h["round"] for h in read_heartbeats(dht, run_key, 3, [mine])] == [4])
    assert read_heartbeats(dht, run_key) == []  # not under the run's one key
    assert [h["peer_id"] for h in read_heartbeats(dht, run_key, 3)] == [dht.peer_id]  # every bucket read
    ours = dht.get(heartbeat_key(run_key, 3, mine))[0]
    elsewhere = Envelope.sign(dht.identity, "hb", heartbeat_key(run_key, 3, (mine + 1) % 8), ours.payload,
                              ours.expiration)
    assert dht.store(elsewhere) is False
    assert dht.get(heartbeat_key(run_key, 3, (mine + 1) % 8)) == []
