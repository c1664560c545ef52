"""Heartbeat buckets (peer/state/heartbeats.py): how many keys a run's heartbeats use, where a peer's
goes, and what fork choice, the keeper and ``peer status`` read of them."""

from __future__ import annotations

import random
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import msgpack
import pytest
from hivemind.dht.routing import DHTID

from hivetrain.dht.errors import DHTTimeout, InvalidRecord
from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.records import MAX_HEARTBEAT_LEVEL, Envelope, heartbeat_bucket, heartbeat_key
from hivetrain.dht.validator import check_record
from hivetrain.peer.averaging.simulation import LoopThread
from hivetrain.peer.config import RunSpec
from hivetrain.peer.state.heartbeats import (
    PEERS_PER_BUCKET,
    HeartbeatPublisher,
    buckets_of,
    heartbeat_envelope,
    heartbeat_level,
    read_heartbeats,
    sample_buckets,
)
from hivetrain.peer.state.keeper import StateKeeper
from hivetrain.peer.status import read_peers
from hivetrain.peer.trust import Trust

OWNER = Identity.generate()
RUN = make_run_key("hb", OWNER.public_key)
HASH = "ab" * 32


def _fields(round_: int = 3) -> dict[str, Any]:
    return dict(round=round_, state_hash=HASH, parent="0" * 64, throughput=1.0, train_loss=None, eval_loss=None)


@pytest.mark.parametrize("expected, level", [(0, 0), (64, 0), (65, 1), (128, 1), (129, 2), (1000, 4),
                                             (10**6, MAX_HEARTBEAT_LEVEL)])
def test_the_heartbeat_level_comes_from_the_peers_the_spec_expects(expected: int, level: int) -> None:
    assert heartbeat_level(RunSpec(name="hb", expected_peers=expected)) == level
    if 0 < level < MAX_HEARTBEAT_LEVEL:  # at most PEERS_PER_BUCKET expected per bucket, more than half
        assert PEERS_PER_BUCKET // 2 < expected / 2**level <= PEERS_PER_BUCKET


def test_a_peers_bucket_is_fixed_nests_and_spreads_peers_evenly() -> None:
    peers = [Identity.generate().peer_id for _ in range(512)]
    for p in peers[:64]:
        assert heartbeat_bucket(p, 0) == 0
        for lvl in range(1, MAX_HEARTBEAT_LEVEL + 1):
            assert heartbeat_bucket(p, lvl) >> 1 == heartbeat_bucket(p, lvl - 1)
    sizes = [sum(heartbeat_bucket(p, 3) == b for p in peers) for b in range(8)]
    assert min(sizes) > 32 and max(sizes) < 100  # 64 each on average
    assert buckets_of(peers[:3], 3) == sorted({heartbeat_bucket(p, 3) for p in peers[:3]})


def test_a_heartbeat_is_accepted_only_in_its_peers_bucket() -> None:
    me = Identity.generate()
    mine = heartbeat_bucket(me.peer_id, 3)
    good = heartbeat_envelope(me, RUN, 60.0, level=3, **_fields())
    assert good.key == heartbeat_key(RUN, 3, mine) and good.key.endswith(f"/peers/3/{mine}")
    assert heartbeat_envelope(me, RUN, 60.0, **_fields()).key == f"hivetrain/{RUN}/peers"  # level 0: one key

    def stored_under(key: str) -> Envelope:
        env = Envelope.sign(me, "hb", key, good.payload, good.expiration)
        return check_record(*_dht_args(env))

    assert stored_under(good.key) is not None and stored_under(heartbeat_key(RUN)) is not None
    bad = [heartbeat_key(RUN, 3, (mine + 1) % 8),  # another bucket: a flood aimed at someone else's
           f"hivetrain/{RUN}/peers/0/0",  # level 0 has one key, without numbers
           heartbeat_key(RUN, MAX_HEARTBEAT_LEVEL + 1, heartbeat_bucket(me.peer_id, MAX_HEARTBEAT_LEVEL + 1)),
           f"hivetrain/{RUN}/peers/3"]
    for key in bad:
        with pytest.raises(InvalidRecord):
            stored_under(key)


def _dht_args(env: Envelope) -> tuple[bytes, bytes, bytes, float]:
    """The raw (key id, subkey, value, expiration) a hivemind DHT node hands to its validator."""
    return (DHTID.generate(source=env.key).to_bytes(), msgpack.packb(env.subkey),
            msgpack.packb(env.encode(), use_bin_type=True), env.expiration)


@pytest.mark.parametrize("level, count, expected", [(0, 2, [0]), (1, 2, [0, 1]), (3, 8, list(range(8)))])
def test_a_sample_of_few_buckets_is_all_of_them(level: int, count: int, expected: list[int]) -> None:
    assert sample_buckets(level, random.Random(0), count) == expected


def test_a_sample_draws_distinct_buckets_and_others_each_time() -> None:
    rng = random.Random(1)
    draws = [sample_buckets(4, rng) for _ in range(64)]
    assert all(len(set(d)) == 2 and all(0 <= b < 16 for b in d) for d in draws)
    assert len({b for d in draws for b in d}) == 16  # every bucket gets read by someone, some time


class KeyDHT:
    """The DHT facade over a dict of keys on a loop thread; counts the keys read."""

    def __init__(self, loop: LoopThread, me: Identity):
        self.loop, self.identity, self.peer_id = loop, me, me.peer_id
        self.keys: dict[str, dict[str, Envelope]] = {}
        self.reads: list[str] = []
        self.broken: set[str] = set()
        self.timeout = 2.0

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return self.loop.run(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.submit(coro)

    async def aget(self, key: str, latest: bool = True) -> list[Envelope]:
        self.reads.append(key)
        if key in self.broken:
            raise TimeoutError(key)
        return list(self.keys.get(key, {}).values())

    def get(self, key: str, latest: bool = True, timeout: float | None = None) -> list[Envelope]:
        return self.run(self.aget(key), timeout or self.timeout)  # type: ignore[no-any-return]

    async def astore(self, envelope: Envelope) -> bool:
        self.keys.setdefault(envelope.key, {})[envelope.subkey] = envelope
        return True

    def store(self, envelope: Envelope, timeout: float | None = None) -> bool:
        return self.run(self.astore(envelope), timeout or self.timeout)  # type: ignore[no-any-return]


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def test_published_heartbeats_are_read_from_their_buckets_all_or_a_sample(loop: LoopThread) -> None:
    peers = [Identity.generate() for _ in range(40)]
    dht = KeyDHT(loop, OWNER)
    for p in peers:
        dht.store(heartbeat_envelope(p, RUN, 60.0, level=2, **_fields()))
    assert {k.rsplit("/", 2)[1] for k in dht.keys} == {"2"} and len(dht.keys) == 4
    everyone = read_heartbeats(dht, RUN, 2)
    assert sorted(hb["peer_id"] for hb in everyone) == sorted(p.peer_id for p in peers)
    dht.reads.clear()
    some = read_heartbeats(dht, RUN, 2, [1, 3])
    assert sorted(dht.reads) == [heartbeat_key(RUN, 2, 1), heartbeat_key(RUN, 2, 3)]
    assert {hb["peer_id"] for hb in some} == {p.peer_id for p in peers if heartbeat_bucket(p.peer_id, 2) in (1, 3)}
    dht.broken.add(heartbeat_key(RUN, 2, 1))  # one key fails: the others' heartbeats still count
    assert {hb["peer_id"] for hb in read_heartbeats(dht, RUN, 2, [1, 3])} == \
        {p.peer_id for p in peers if heartbeat_bucket(p.peer_id, 2) == 3}
    dht.broken.add(heartbeat_key(RUN, 2, 3))  # every one fails: an error, never "nobody is there"
    with pytest.raises(DHTTimeout):
        read_heartbeats(dht, RUN, 2, [1, 3])


def test_a_heartbeat_found_under_another_bucket_is_ignored(loop: LoopThread) -> None:
    # a DHT node that answers one key with another key's records (the validator checks the key a
    # record was signed for, not that a reply holds only that key's records)
    me = Identity.generate()
    dht = KeyDHT(loop, OWNER)
    env = heartbeat_envelope(me, RUN, 60.0, level=2, **_fields())
    other = (heartbeat_bucket(me.peer_id, 2) + 1) % 4
    dht.keys[heartbeat_key(RUN, 2, other)] = {env.subkey: env}
    assert read_heartbeats(dht, RUN, 2, [other]) == []


def test_the_publisher_writes_to_its_bucket_and_status_reads_every_bucket(loop: LoopThread) -> None:
    spec = RunSpec(name="hb", expected_peers=200)
    lvl = heartbeat_level(spec)
    assert lvl == 2
    dht = KeyDHT(loop, OWNER)
    peers = [Identity.generate() for _ in range(12)]
    for p in peers:
        publisher = HeartbeatPublisher(dht, p, RUN, 60.0, lambda w: None, lvl)  # type: ignore[arg-type]
        publisher(**_fields(5))
        publisher._pending.result(5)  # type: ignore[union-attr]
    assert all(k.startswith(f"hivetrain/{RUN}/peers/2/") for k in dht.keys)
    rows = read_peers(dht, RUN, spec)  # type: ignore[arg-type]
    assert sorted(r.peer_id for r in rows) == sorted(p.peer_id for p in peers)
    assert {r.round for r in rows} == {5}


class _Sync:
    """What StateKeeper reads of a StateSync when it waits on heartbeats."""

    def __init__(self, dht: KeyDHT, level: int):
        self.dht, self.run_key, self.heartbeat_level = dht, RUN, level
        self.reach: dict[str, int] = {}
        self.sampled = 1.0


def test_the_keeper_waits_on_the_buckets_of_the_peers_it_waits_for_only(loop: LoopThread) -> None:
    dht = KeyDHT(loop, OWNER)
    peers = [Identity.generate() for _ in range(3)]
    for p in peers:
        dht.store(heartbeat_envelope(p, RUN, 60.0, level=4, **_fields(4)))
    keeper = StateKeeper(_Sync(dht, 4), Trust(), None, 1.0, 0.2, log=lambda _: None)  # type: ignore[arg-type]
    assert keeper.wait_for_end(3, tuple(p.peer_id for p in peers), time.monotonic() + 30) == []
    assert set(dht.reads) == {heartbeat_key(RUN, 4, b) for b in buckets_of([p.peer_id for p in peers], 4)}
    keeper.sync.sampled, keeper.sync.reach = 0.125, {"direct": 5, "unknown": 1}  # 2 of 16 buckets read
    assert keeper.peers_seen() == 48  # what the sample stands for
