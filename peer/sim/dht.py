"""The simulated DHT: the run's records held by the k peers nearest each key, with the real checks.

Every simulated peer is a DHT node. A record is stored at the ``replicas`` nodes nearest to its key
(XOR distance between SHA-1 ids, as Kademlia and hivemind order them) among the nodes the writer
can reach (a partition splits the DHT too), and read back from the nearest nodes the reader can
reach, their dictionaries merged with the latest expiration per subkey winning (hivemind's
``get(latest=True)``). What a node accepts is what a real node accepts: hivemind's validator call
with our ``EnvelopeValidator`` rules (dht/validator.py ``check_record``: signed, bound, sized,
expiring) and the store quotas of dht/quota.py (rate window, at most ``max_subkeys_per_key``
records per key, ``max_entries`` in all, the largest holder losing when full), applied to stores
from other peers as dht/store_guard.py applies them in front of hivemind.

Costs are counted, not spent: a node verifies a record's signature when it stores it and a reader
when it reads it; the simulator counts those verifies, the reads and writes per peer, the bytes
they move, and the bytes each node serves (the hot holders of a round's ready key). Each operation
takes ``op_rtts`` round trips of the reader's latency in virtual time.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack

from hivetrain.dht import clock
from hivetrain.dht.errors import DHTTimeout, InvalidRecord
from hivetrain.dht.identity import Identity
from hivetrain.dht.quota import Ledger, QuotaConfig, RateWindow, shrink
from hivetrain.dht.records import Envelope
from hivetrain.dht.validator import check_record
from hivetrain.peer.net.memory import MemoryNetwork
from hivetrain.peer.sim.green import GreenFuture, GreenRunner

MAX_KNOWN = 256  # as dht/node.py: bound ids remembered for routing refreshes


def node_id(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest(), "big")


def _ready_round(key: str) -> int | None:
    """The round of a ready key (dht/records.py ``ready_key``), None for any other key."""
    parts = key.split("/")
    return int(parts[3]) if len(parts) >= 4 and parts[2] == "ready" and parts[3].isdigit() else None


def key_id(key: str) -> bytes:
    """The DHT id of a record key, as hivemind computes it (SHA-1 of the msgpack'd key)."""
    return hashlib.sha1(msgpack.packb(key, use_bin_type=True)).digest()


@dataclass
class _Held:
    envelope: Envelope
    nbytes: int
    expiration: float


@dataclass
class Node:
    """One peer's DHT storage and the quotas it applies to other peers' stores."""

    peer: str
    id: int
    quota: QuotaConfig
    storage: dict[str, dict[str, _Held]] = field(default_factory=dict)  # key -> subkey -> record
    rates: RateWindow = field(default_factory=RateWindow)
    ledger: Ledger = field(default_factory=Ledger)
    served: int = 0  # bytes of records this node returned to readers
    refused: Counter[str] = field(default_factory=Counter)  # stores refused, by reason

    def store(self, source: str, envelope: Envelope, nbytes: int, now: float) -> bool:
        """Stores one validated record from ``source`` (ourselves: no quota); returns whether it is held."""
        self.ledger.prune(now)
        if source != self.peer and not self.rates.admit(source, 1, now, self.quota):
            self.refused["rate"] += 1
            return False
        held = self.storage.setdefault(envelope.key, {})
        old = held.get(envelope.subkey)
        if old is not None and old.expiration >= envelope.expiration:
            if not held:
                del self.storage[envelope.key]
            self.refused["stale"] += 1
            return False  # not newer: hivemind keeps what it holds
        held[envelope.subkey] = _Held(envelope, nbytes, envelope.expiration)
        if source == self.peer:
            self.ledger.forget(("storage", envelope.key, envelope.subkey))
            return True
        entry = ("storage", envelope.key, envelope.subkey)
        self.ledger.record(entry, source, envelope.expiration)
        evicted = self._trim(source, (entry[0], entry[1]))
        return entry not in evicted

    def _trim(self, source: str, group: tuple[str, str]) -> set[Any]:
        """As dht/store_guard.py trims: the largest holders lose entries until the key and the total fit."""
        evicted: set[Any] = set()

        def evict(victim: Any, reason: str) -> None:
            owner = self.ledger.get(victim)
            self.ledger.forget(victim)
            key, subkey = str(victim[1]), str(victim[2])
            held = self.storage.get(key, {})
            if owner is not None and subkey in held and held[subkey].expiration == owner[1]:
                del held[subkey]
                if not held:
                    del self.storage[key]
                evicted.add(victim)
                self.refused[reason if owner[0] == source else "evicted_others"] += 1

        shrink(lambda: self.ledger.in_group(group), lambda: len(self.storage.get(group[1], {})),
               self.quota.max_subkeys_per_key, source, lambda victim: evict(victim, "subkey_cap"))
        shrink(self.ledger.by_source, lambda: len(self.ledger), self.quota.max_entries, source,
               lambda victim: evict(victim, "storage_cap"))
        return evicted

    def get(self, key: str, now: float) -> list[_Held]:
        held = self.storage.get(key)
        if not held:
            return []
        live = [h for h in held.values() if h.expiration >= now]
        if len(live) < len(held):  # expired records go, as hivemind's TimedStorage drops them
            for subkey in [s for s, h in held.items() if h.expiration < now]:
                del held[subkey]
            if not held:
                del self.storage[key]
        self.served += sum(h.nbytes for h in live)
        return live

    def entries(self) -> int:
        return sum(len(h) for h in self.storage.values())


@dataclass
class Costs:
    """One peer's DHT work, as counted (reset by whoever reads them per round)."""

    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    verifies: int = 0  # signature checks this peer's operations cost, on it and on the nodes it wrote to


class DHTWorld:
    """All nodes of one simulated swarm's DHT."""

    def __init__(self, net: MemoryNetwork, replicas: int = 5, quota: QuotaConfig | None = None,
                 op_rtts: float = 2.0):
        self.net, self.replicas, self.quota, self.op_rtts = net, replicas, quota or QuotaConfig(), op_rtts
        self.nodes: dict[str, Node] = {}
        self.costs: dict[str, Costs] = {}
        self.served: Counter[str] = Counter()  # peer -> bytes its node returned to readers, over its restarts
        self.served_ready: dict[int, Counter[str]] = {}  # round -> peer -> bytes of that round's ready records
        self.served_heartbeats: Counter[str] = Counter()  # peer -> bytes of heartbeats its node returned
        self.heartbeat_read_bytes = 0  # bytes of heartbeats returned to all readers
        self._order: dict[str, list[Node]] = {}  # key -> nodes nearest first (recomputed when nodes change)

    def join(self, peer: str) -> None:
        self.nodes[peer] = Node(peer, node_id(peer), self.quota)
        self.costs.setdefault(peer, Costs())
        self._order.clear()

    def leave(self, peer: str) -> None:
        """A crashed node: what it stored is gone (records live on at the other replicas)."""
        self.nodes.pop(peer, None)
        self._order.clear()

    def nearest(self, key: str, reader: str) -> list[Node]:
        """The ``replicas`` nodes nearest ``key`` that ``reader`` can reach (itself always)."""
        order = self._order.get(key)
        if order is None:
            kid = int.from_bytes(key_id(key), "big")
            order = self._order[key] = sorted(self.nodes.values(), key=lambda n: n.id ^ kid)
        out: list[Node] = []
        for node in order:
            if node.peer == reader or not self.net.is_cut(reader, node.peer):
                out.append(node)
                if len(out) == self.replicas:
                    break
        return out

    def delay(self, peer: str) -> float:
        return self.op_rtts * 2 * self.net.latency_of(peer)

    async def store(self, writer: str, envelope: Envelope) -> bool:
        costs = self.costs[writer]
        raw = envelope.encode()
        wrapped = msgpack.packb(raw, use_bin_type=True)  # hivemind's serializer wraps our bytes
        await asyncio.sleep(self.delay(writer))
        now = clock.wall()
        try:  # every replica runs the same check; once is enough to know its outcome, all are counted
            check_record(key_id(envelope.key), msgpack.packb(envelope.subkey, use_bin_type=True), wrapped,
                         envelope.expiration)
            valid = True
        except InvalidRecord:
            valid = False
        nodes = self.nearest(envelope.key, writer)
        costs.writes += 1
        costs.write_bytes += len(raw) * len(nodes)
        costs.verifies += len(nodes)
        if not valid or not nodes:
            return False
        stored = [node.store(writer, envelope, len(raw), now) for node in nodes]
        return any(stored)

    async def get(self, reader: str, key: str) -> list[Envelope]:
        costs = self.costs[reader]
        await asyncio.sleep(self.delay(reader))
        now = clock.wall()
        merged: dict[str, _Held] = {}
        costs.reads += 1
        ready_round = _ready_round(key)
        heartbeats = key.split("/")[2:3] == ["peers"]  # dht/records.py ``heartbeat_key``, any bucket
        for node in self.nearest(key, reader):
            for held in node.get(key, now):
                self.served[node.peer] += held.nbytes
                if ready_round is not None:
                    self.served_ready.setdefault(ready_round, Counter())[node.peer] += held.nbytes
                if heartbeats:
                    self.served_heartbeats[node.peer] += held.nbytes
                    self.heartbeat_read_bytes += held.nbytes
                costs.read_bytes += held.nbytes
                costs.verifies += 1  # hivemind validates every record it receives
                best = merged.get(held.envelope.subkey)
                if best is None or best.expiration < held.expiration:
                    merged[held.envelope.subkey] = held
        return [h.envelope for h in list(merged.values())[:1024]]


class SimDHT:
    """One simulated peer's DHT facade: what peer code uses of dht/node.py's ``DHT``, over ``DHTWorld``."""

    def __init__(self, world: DHTWorld, identity: Identity, timeout: float = 15.0):
        self.world, self.identity = world, identity
        self.peer_id = identity.peer_id
        self.timeout = timeout
        self.runner = GreenRunner(DHTTimeout)
        self._known: dict[str, None] = {}

    # ---- the loop facade --------------------------------------------------------------------------

    def run(self, coro: Any, timeout: float) -> Any:
        return self.runner.run(coro, timeout)

    def submit(self, coro: Any) -> GreenFuture:
        return self.runner.submit(coro)

    # ---- records ----------------------------------------------------------------------------------

    async def astore(self, envelope: Envelope) -> bool:
        return await self.world.store(self.peer_id, envelope)

    async def aget(self, key: str, latest: bool = True) -> list[Envelope]:
        return await self.world.get(self.peer_id, key)

    def store(self, envelope: Envelope, timeout: float | None = None) -> bool:
        return bool(self.run(self.astore(envelope), timeout or self.timeout))

    def get(self, key: str, latest: bool = True, timeout: float | None = None) -> list[Envelope]:
        return list(self.run(self.aget(key, latest), timeout or self.timeout))

    def remember(self, peer_ids: Any) -> None:
        for peer in peer_ids:
            self._known.pop(peer, None)
            self._known[peer] = None
        while len(self._known) > MAX_KNOWN:
            self._known.pop(next(iter(self._known)))

    def remember_threadsafe(self, peer_ids: Any) -> None:
        self.remember(list(peer_ids))
