"""Ready buckets (peer/averaging/ready.py): how many a round has, and reading one, some or all of
them from either board."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hivetrain.dht.identity import Identity
from hivetrain.dht.records import MAX_READY_LEVEL, Envelope, bucket_of
from hivetrain.peer.averaging.ready import BUCKET_GROUPS, DHTReadyBoard, MemoryReadyBoard, Ready, grown, level

RUN, BASE = "a" * 64, "b" * 64


@pytest.mark.parametrize("population, target, expected", [
    (0, 4, 0), (31, 4, 0), (32, 4, 1), (72, 4, 2), (256, 4, 4), (1000, 4, 5), (1000, 8, 4), (72, 8, 1),
    (10**6, 2, MAX_READY_LEVEL),
])
def test_the_bucket_count_follows_the_base_states_population(population: int, target: int, expected: int) -> None:
    assert level(population, target) == expected
    if 0 < expected < MAX_READY_LEVEL:  # a bucket holds between 1x and 2x BUCKET_GROUPS target-size groups
        assert BUCKET_GROUPS * target <= population / 2**expected < 2 * BUCKET_GROUPS * target


class _DictDHT:
    """The two calls DHTReadyBoard makes, on a dict keyed like the DHT; ``broken`` keys fail to read."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, Envelope]] = {}
        self.broken: set[str] = set()
        self.reads: list[str] = []

    async def astore(self, envelope: Envelope) -> bool:
        self.keys.setdefault(envelope.key, {})[envelope.subkey] = envelope
        return True

    async def aget(self, key: str) -> list[Envelope]:
        self.reads.append(key)
        if key in self.broken:
            raise TimeoutError(key)
        return list(self.keys.get(key, {}).values())


@pytest.mark.parametrize("kind", ["memory", "dht"])
def test_a_round_is_read_from_one_some_or_all_of_its_buckets(kind: str) -> None:
    dht = _DictDHT()
    board: Any = MemoryReadyBoard() if kind == "memory" else DHTReadyBoard(dht, "r")
    peers = [Identity.generate() for _ in range(40)]

    async def go() -> None:
        for p in peers:
            assert await board.publish(p, Ready(p.peer_id, 9, BASE, RUN), 60.0, 2)
        where = {p.peer_id: bucket_of(9, p.peer_id, 2) for p in peers}
        everyone = await board.read(9, 2)
        assert sorted(r.peer_id for r in everyone) == sorted(where)
        for b in range(4):
            assert {r.peer_id for r in await board.read(9, 2, [b])} == {p for p, w in where.items() if w == b}
        assert await board.read(9, 0) == [] and await board.read(9, 3) == []  # another level: other keys
        if kind == "dht":  # a bucket that cannot be read is left out; the caller reads again
            dht.broken = {k for k in dht.keys if k.endswith("/ready/9/2/1")}
            assert {r.peer_id for r in await board.read(9, 2)} == {p for p, w in where.items() if w != 1}
            dht.broken = set(dht.keys)
            with pytest.raises(TimeoutError):  # ... unless none can
                await board.read(9, 2)

    asyncio.run(go())


def test_a_record_found_under_another_bucket_is_ignored() -> None:
    """A record a node accepted under the wrong bucket (an old or lenient node) still does not count there."""
    dht = _DictDHT()
    p = Identity.generate()
    mine = bucket_of(4, p.peer_id, 1)

    async def go() -> None:
        await DHTReadyBoard(dht, "r").publish(p, Ready(p.peer_id, 4, BASE, RUN), 60.0, 1)
        (key,) = dht.keys
        dht.keys[key.rsplit("/", 1)[0] + f"/{1 - mine}"] = dht.keys[key]  # copied under the other bucket
        assert [r.peer_id for r in await DHTReadyBoard(dht, "r").read(4, 1)] == [p.peer_id]

    asyncio.run(go())


def test_a_population_grows_at_most_fourfold_a_round_whatever_weight_is_claimed() -> None:
    assert grown(0, 72, 4) == 64 and grown(64, 72, 4) == 72  # the first round: up to 4 buckets' worth
    assert grown(100, 10**6, 8) == 400 and grown(400, 90, 8) == 90  # shrinking is never capped
    population, rounds = 0, 0
    while level(population, 8) < level(1000, 8):  # 1000 peers: one key in round 0, 4 in round 1, then 16
        population, rounds = grown(population, 1000, 8), rounds + 1
    assert rounds == 2
