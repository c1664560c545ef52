"""A whole swarm in one process: every peer is the real peer (peer/assembly.py) over the one seam.

Each simulated peer is built from the same classes as a real one: the averager and its matchmaking,
heartbeats, the dial-back check, state serving and sync, fork choice and the training loop, around
its own trust ledger and bans. What differs is the world they run in: in-memory links with the
peer's uplink and downlink caps, latency, loss, NAT and address (peer/net/memory.py), a simulated
DHT with the real record checks and quotas (peer/sim/dht.py), a quadratic objective whose inner
steps take virtual time (peer/sim/objective.py), and a checkpoint kept in memory. Everything runs on
one ``VirtualLoop`` (peer/sim/loop.py), the training loops in greenlets (peer/sim/green.py), so a run
is deterministic for its seed: the same ``Scenario`` gives the same trace and the same ``trace_hash``.

Faults are scheduled from outside the protocol: crashes and restarts (with the peer's checkpoint),
partitions and their heals, peers that join mid-run, and attackers (peer/sim/attacks.py).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from hivetrain.dht import clock
from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.peer.assembly import Peer, Seams, serve_dialback
from hivetrain.peer.averaging.behaviour import HONEST, Behaviour
from hivetrain.peer.config import RunSpec
from hivetrain.peer.net.memory import MemoryNetwork
from hivetrain.peer.sim import loop as vloop
from hivetrain.peer.sim.dht import DHTWorld, SimDHT
from hivetrain.peer.sim.green import Crashed, spawn, wait
from hivetrain.peer.sim.objective import QuadraticLearner
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.train.loop import MetricsWriter
from hivetrain.peer.trust import Bans, Trust

MBIT = 125_000.0  # bytes/s in one Mbit/s
LOG_LINES = 64  # lines of its own log each simulated peer keeps (for a failure's story)
PROBE_VALUES = 4096  # values of each honest pseudo-gradient and applied mean the swarm keeps (``Probe``)
# a swarm allocates millions of short-lived objects (frames, handles, futures): collecting them
# every 700 allocations cost a third of the run's time (32 peers: 16 s against 11 s)
GC_THRESHOLDS = (100_000, 50, 100)


@dataclass(frozen=True)
class Event:
    """A fault scheduled at virtual time ``at``: ``crash`` (the peers restart ``until`` seconds
    later, with their checkpoints; never if ``until`` is 0), ``partition`` (the peers are cut off
    from the others until ``until``)."""

    at: float
    kind: str  # "crash" or "partition"
    peers: tuple[int, ...]
    until: float = 0.0


@dataclass(frozen=True)
class Scenario:
    """One simulated run: its peers, their links and speeds, its faults. Times in virtual seconds."""

    peers: int = 8
    rounds: int = 4  # the run's round every honest peer trains to
    target: int = 4  # the run spec's target group size
    jitter_s: float = 0.0  # > 0: each round's inner steps take an extra U(jitter/3, jitter) seconds
    slow_fraction: float = 0.0  # peers whose links run at ``slow_mbit``
    seed: int = 0
    numel: int = 4096
    sync_every: int = 4  # H
    step_s: float = 1.0  # seconds per inner step (each peer's speed varies +-10% around it)
    mbit: float = 100.0  # up and down, Mbit/s
    slow_mbit: float = 20.0
    down_mbit: float = 0.0  # downlinks, Mbit/s (0: as the uplink)
    latency_s: float = 0.02  # one-way, per access link
    loss: float = 0.0  # probability that a stream a peer opens or takes fails at once
    nat_fraction: float = 0.0  # peers behind a NAT (outbound-only)
    join_at: tuple[float, ...] = ()  # per peer (index order), when it starts; missing: at 0
    events: tuple[Event, ...] = ()
    behaviours: tuple[tuple[int, Behaviour], ...] = ()  # peers that act otherwise (attackers in a Behaviour)
    dishonest: tuple[int, ...] = ()  # peers that are attackers (left out of the honest measurements)
    attacks: tuple[str, ...] = ()  # names from peer/sim/attacks.py LIBRARY, carried out by the dishonest peers
    attacker_prefixes: int = 0  # the /24s the dishonest peers' addresses are in (0: one each)
    spec: tuple[tuple[str, Any], ...] = ()  # run spec fields that differ from ``spec_of``'s
    limit_s: float = 0.0  # virtual seconds the run may take (0: from the rounds and the deadlines)
    equal_shares: bool = False  # roles ignore uplink claims (the protocol before peer/averaging/rates.py)
    cpu_scale: float = 0.0  # > 0: encoding, reducing and auditing cost their wall time x this (not deterministic)

    def run_spec(self) -> RunSpec:
        fields: dict[str, Any] = dict(name="sim", sync_every=self.sync_every, target_group_size=self.target,
                                      matchmaking_timeout=5.0, allreduce_timeout=30.0, inner_lr=0.05,
                                      outer_lr=0.7, outer_momentum=0.5, eval_every=1)
        fields.update(dict(self.spec))
        return RunSpec(**fields)


def seeded_identity(seed: int, *tag: object) -> Identity:
    """An identity drawn from ``seed`` and ``tag``: the same run gives its peers the same ids."""
    raw = hashlib.sha256(json.dumps([seed, *map(str, tag)]).encode()).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(raw))


def public_addr(index: int, host: int = 1, base: int = 20) -> str:
    """A public IPv4 address in the index-th /24 of the simulated internet."""
    return f"/ip4/{base + index // 65536}.{index // 256 % 256}.{index % 256}.{host}/tcp/4001"


class SimMetrics(MetricsWriter):
    """The trainer's metrics sink: every record goes to the swarm, stamped with virtual time."""

    def __init__(self, sink: Callable[[dict[str, Any]], None]):
        super().__init__(None, keep=8)
        self.sink = sink

    def write(self, record: dict[str, Any]) -> None:
        self.sink(dict(record, t=clock.now()))


class SimPeer:
    """One simulated peer: its world (link, DHT node, checkpoint) and, while it runs, its ``Peer``."""

    def __init__(self, swarm: Swarm, index: int, identity: Identity, addr: str, behaviour: Behaviour):
        self.swarm, self.index, self.identity, self.addr, self.behaviour = swarm, index, identity, addr, behaviour
        self.id = identity.peer_id
        self.honest = index not in swarm.scenario.dishonest
        self.disk: Snapshot | None = None  # the checkpoint in its state folder
        self.peer: Peer | None = None
        self.incarnations: list[Peer] = []  # one per start (a restart builds the peer anew)
        self.dht: SimDHT | None = None
        self.task: asyncio.Task[Any] | None = None
        self.alive = False
        self.done = False  # trained to the run's last round
        self.ledger: tuple[dict[str, Any], list[list[str]]] | None = None  # its trust file (survives restarts)
        self.began: list[tuple[int, str]] = []  # its note of the rounds it began averaging (survives restarts)
        self.gone = False  # crashed for good (no restart planned): the run does not wait for it
        self.failed: BaseException | None = None
        self.log: deque[str] = deque(maxlen=LOG_LINES)
        self.rng = random.Random(f"{swarm.scenario.seed}/{index}/compute")
        self.speed = swarm.scenario.step_s * (0.9 + 0.2 * self.rng.random())
        self.starts = 0
        self.runs = True  # False: an attacker identity that runs no peer, only an attack's actor

    def start(self) -> None:
        """Boots the peer (again, after a crash): a new link and DHT node, the same identity and disk."""
        link = self.swarm.net.link(self.id, self.addr)
        self.swarm.dht.join(self.id)
        self.dht = SimDHT(self.swarm.dht, self.identity)
        self.alive, self.starts = True, self.starts + 1
        self.task = asyncio.get_running_loop().create_task(spawn(self._main, link))
        self.task.add_done_callback(self._ended)
        self.swarm.note(self, "start", -1, {"restart": self.starts > 1})

    def crash(self) -> None:
        """Kills the peer at once: its tasks, its link and its DHT node are gone; its disk stays."""
        if not self.alive:
            return
        self.alive = False
        if self.task is not None:
            self.task.cancel()
        if self.dht is not None:
            self.dht.runner.cancel_all()
        link = self.swarm.net.links.get(self.id)
        if link is not None:
            link.shut()
        self.swarm.net.drop(self.id)
        self.swarm.dht.leave(self.id)
        self.swarm.note(self, "crash", -1, {})

    def kill(self) -> None:
        """Crashes the peer for good (a SIGKILL without a restart)."""
        self.gone = True
        self.crash()

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            self.done = True
            self.swarm.note(self, "done", -1, {})
        elif not isinstance(error, Crashed):
            self.failed = error
            self.swarm.note(self, "failed", -1, {"error": f"{type(error).__name__}: {error}"})
        if self.dht is not None:  # a finished peer stops its background work, as a real one exits
            self.dht.runner.cancel_all()
        self.alive = False

    # ---- inside the peer's greenlet ---------------------------------------------------------------

    def _main(self, link: Any) -> dict[str, Any]:
        sc = self.swarm.scenario
        assert self.dht is not None
        learner = QuadraticLearner(self.swarm.spec, sc.numel, sc.seed * 1_000_003 + self.index, self._compute,
                                   self._pause)
        wait(serve_dialback(link, self.behaviour))
        me = self.starts  # after a crash, what this incarnation's code still does on its way down is lost
        seams = Seams(self.dht, link, learner, self.behaviour,
                      save=lambda snapshot: self._save(snapshot) if self._live(me) else None, pause=self._pause,
                      rng=random.Random(f"{sc.seed}/{self.index}/{self.starts}"),
                      ledger=_DiskLedger(self, lambda: self._live(me)), began=_DiskBegan(self, lambda: self._live(me)))
        self.peer = Peer(seams, self.swarm.run_key, self.swarm.spec,
                         SimMetrics(lambda record: self._record(record) if self._live(me) else None),
                         lambda line: self._say(line) if self._live(me) else None)
        self.peer.averager.ctx.rates.enabled = not sc.equal_shares
        _probe(self, self.peer.averager, lambda: self._live(me))
        self.incarnations.append(self.peer)
        return self.peer.run(self.disk, 0, until_round=sc.rounds)

    def _live(self, incarnation: int) -> bool:
        """Whether the code calling is the peer's current incarnation (a crashed one writes nothing)."""
        return self.alive and incarnation == self.starts

    def _compute(self) -> float:
        jitter = self.swarm.scenario.jitter_s
        extra = self.rng.uniform(jitter / 3, jitter) if jitter > 0 else 0.0
        return self.swarm.scenario.sync_every * self.speed + extra

    def _pause(self, seconds: float) -> None:
        wait(asyncio.sleep(seconds))

    def _save(self, snapshot: Snapshot) -> None:
        self.disk = snapshot

    def _say(self, line: str) -> None:
        self.log.append(f"{clock.now():9.3f} {line}")

    def _record(self, record: dict[str, Any]) -> None:
        if record.get("event") == "round" and not record.get("void") and self.peer is not None:
            session = self.peer.averager.sessions.get(int(record["round"]))
            if session is not None:  # for the invariants: whose reduce of which shard was audited by whom
                record = dict(record, reducers=[session.reducer(k) for k in range(session.units)],
                              auditors=[session.auditor(k) if session.audit else None for k in range(session.units)])
        self.swarm.record(self, record)


@dataclass
class Probe:
    """What one peer averaged in one round, on a fixed sample of PROBE_VALUES coordinates: its own
    pseudo-gradient and, when the round completed, the mean it applied. The measure of what attackers
    did to the model: search.py's I1. An attacker's probe holds the pseudo-gradient its learner
    computed, before its attack made parts of it: what it would have sent had it been honest."""

    peer: int
    round: int
    base: str
    delta: torch.Tensor  # (PROBE_VALUES,) fp32
    applied: torch.Tensor | None = None  # (PROBE_VALUES,) fp32, once the round completed
    void: torch.Tensor | None = None  # (PROBE_VALUES,) bool: in a shard the round voided (not applied)
    honest: bool = True  # False: an attacker's own pseudo-gradient, as its learner computed it (before any attack)


def _sample(vector: torch.Tensor) -> torch.Tensor:
    step = max(1, vector.numel() // PROBE_VALUES)
    return vector.detach().reshape(-1)[::step][:PROBE_VALUES].clone()


def _probe(peer: SimPeer, averager: Any, live: Callable[[], bool]) -> None:
    """Wraps the averager's entry (from outside it, on this instance) to keep a ``Probe`` of each round
    (nothing the peer sees changes: a run's trace is the same with or without it)."""
    inner = averager.average_async

    async def average_async(round_: int, base: str, delta: torch.Tensor, population: int = 0) -> Any:
        probe = Probe(peer.index, round_, base, _sample(delta), honest=peer.honest)
        if live():
            (peer.swarm.probes if peer.honest else peer.swarm.attacker_probes).append(probe)
        result = await inner(round_, base, delta, population)
        void = torch.zeros(result.averaged.numel(), dtype=torch.bool)
        for start, end in result.void_ranges:
            void[start:end] = True
        probe.applied, probe.void = _sample(result.averaged), _sample(void).bool()
        return result

    averager.average_async = average_async


class _DiskLedger:
    """A simulated peer's trust ledger file: it survives the peer's restarts, as a real one's does."""

    def __init__(self, peer: SimPeer, live: Callable[[], bool]):
        self.peer, self.live = peer, live

    def load(self, trust: Trust, bans: Bans) -> None:
        if self.peer.ledger is not None:
            trust.restore(self.peer.ledger[0])
            bans.restore(self.peer.ledger[1])

    def save(self, trust: Trust, bans: Bans) -> None:
        if self.live():  # (a crashed incarnation writes nothing)
            self.peer.ledger = (trust.state(), bans.state())


class _DiskBegan:
    """A simulated peer's note of the rounds it began averaging (peer/state/checkpoint.py ``BeganFile``)."""

    def __init__(self, peer: SimPeer, live: Callable[[], bool]):
        self.peer, self.live = peer, live

    def marked(self) -> set[tuple[int, str]]:
        return set(self.peer.began)

    def mark(self, round_: int, base: str) -> None:
        if self.live():
            self.peer.began = [p for p in self.peer.began if p != (round_, base)][-3:] + [(round_, base)]


@dataclass
class Result:
    """What one simulated run produced."""

    scenario: Scenario
    records: list[tuple[int, dict[str, Any]]]  # (peer index, trainer record), in the order written
    trace: list[str]
    trace_hash: str
    virtual_s: float
    wall_s: float
    peers: list[SimPeer]
    net: MemoryNetwork
    dht: DHTWorld
    stalled: bool = False  # the virtual time limit passed before every honest peer finished
    probes: list[Probe] = field(default_factory=list)  # what honest peers averaged (``Probe``)
    attacker_probes: list[Probe] = field(default_factory=list)  # what attackers' learners computed (``Probe``)

    def honest(self) -> list[SimPeer]:
        return [p for p in self.peers if p.honest]


class Swarm:
    """Runs one ``Scenario`` (``run``), then hands over its ``Result``."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.spec = scenario.run_spec()
        self.owner = seeded_identity(scenario.seed, "owner")
        self.run_key = make_run_key(self.spec.name, self.owner.public_key)
        self.net = MemoryNetwork(rng=random.Random(f"{scenario.seed}/net"))
        self.dht = DHTWorld(self.net)
        self.peers: list[SimPeer] = []
        self.records: list[tuple[int, dict[str, Any]]] = []
        self.probes: list[Probe] = []  # one per honest peer-round that began averaging
        self.attacker_probes: list[Probe] = []  # one per attacker peer-round that began averaging
        self.trace: list[str] = []
        self.actors: list[Callable[[Swarm], Any]] = []  # outside attackers: coroutines started with the run
        self.progress: Callable[[Swarm], None] | None = None  # called every 5 virtual seconds (long runs say how far)
        behaviours = dict(scenario.behaviours)
        self.attacks = attack_plan(scenario)
        rng = random.Random(f"{scenario.seed}/world")
        slow = set(rng.sample(range(scenario.peers), round(scenario.slow_fraction * scenario.peers)))
        nat = set(rng.sample(range(scenario.peers), round(scenario.nat_fraction * scenario.peers)))
        dishonest = sorted(scenario.dishonest)
        for i in range(scenario.peers):
            addr = public_addr(i)
            if i in scenario.dishonest:  # attackers share ``attacker_prefixes`` /24s of their own
                j = dishonest.index(i)
                addr = public_addr(j % (scenario.attacker_prefixes or len(dishonest)), host=1 + j, base=200)
            peer = SimPeer(self, i, seeded_identity(scenario.seed, "peer", i), addr, behaviours.get(i, HONEST))
            rate = (scenario.slow_mbit if i in slow else scenario.mbit) * MBIT
            self.net.rates[peer.id] = rate
            self.net.down[peer.id] = scenario.down_mbit * MBIT if scenario.down_mbit else rate
            self.net.latency[peer.id] = scenario.latency_s
            if scenario.loss:
                self.net.loss[peer.id] = scenario.loss
            if i in nat:
                self.net.behind_nat.add(peer.id)
            self.peers.append(peer)
        attackers = [self.peers[i] for i in dishonest]
        for attack in self.attacks:
            for peer in attackers:
                peer.behaviour = attack.behaviour(self, peer) or peer.behaviour
                peer.runs = peer.runs and attack.runs_peer
            self.actors.append(functools.partial(attack.actor, attackers=attackers))

    # ---- what the peers report --------------------------------------------------------------------

    def index_of(self, peer_id: str) -> int:
        return self._index.get(peer_id, -1)

    def note(self, peer: SimPeer, event: str, round_: int, detail: dict[str, Any]) -> None:
        self.trace.append(json.dumps([round(clock.now(), 6), peer.index, event, round_, detail], sort_keys=True))

    def record(self, peer: SimPeer, record: dict[str, Any]) -> None:
        self.records.append((peer.index, record))
        event = record.get("event")
        detail: dict[str, Any] = {"state": record.get("state_hash", "")[:16]}
        if event == "round":
            detail.update(void=bool(record.get("void")),
                          group=sorted(self.index_of(p) for p in record.get("group", ())))
        elif event == "sync":
            detail.update(origin=record.get("from_round"))
        self.note(peer, str(event), int(record.get("round", -1)), detail)

    # ---- the run ----------------------------------------------------------------------------------

    def limit(self) -> float:
        sc = self.scenario
        if sc.limit_s:
            return sc.limit_s
        spec = self.spec
        per_round = sc.sync_every * sc.step_s * 1.1 + sc.jitter_s + 2 * spec.matchmaking_timeout \
            + spec.allreduce_timeout + 20
        return 3 * sc.rounds * per_round + max((e.until for e in sc.events), default=0.0) + max(sc.join_at, default=0.0) \
            + 120

    async def _run(self) -> float:
        sc = self.scenario
        self._index = {p.id: p.index for p in self.peers}
        loop = asyncio.get_running_loop()
        for i, peer in enumerate(self.peers):
            at = sc.join_at[i] if i < len(sc.join_at) else 0.0
            if not peer.runs:
                continue
            if at > 0:
                loop.call_at(at, peer.start)
            else:
                peer.start()
        for event in sc.events:
            loop.call_at(event.at, self._fire, event)
        actors = [loop.create_task(actor(self)) for actor in self.actors]
        deadline = self.limit()
        while clock.now() < deadline:
            honest = [p for p in self.peers if p.honest]
            if all(p.done or p.gone or p.failed is not None for p in honest) and not self._pending_restarts():
                break
            if self.progress is not None:
                self.progress(self)
            await asyncio.sleep(min(5.0, deadline - clock.now()))
        for actor_task in actors:
            actor_task.cancel()
        for peer in self.peers:
            peer.crash()
        await asyncio.sleep(0)
        return clock.now()

    def _pending_restarts(self) -> bool:
        return any(e.kind == "crash" and e.until and e.at + e.until > clock.now() for e in self.scenario.events)

    def _fire(self, event: Event) -> None:
        loop = asyncio.get_running_loop()
        targets = [self.peers[i] for i in event.peers]
        if event.kind == "crash":
            for peer in targets:
                if event.until:
                    peer.crash()
                    loop.call_at(event.at + event.until, self._restart, peer)
                else:
                    peer.kill()
        elif event.kind == "partition":
            for peer in targets:
                self.net.partition[peer.id] = 1
            self.trace.append(json.dumps([round(clock.now(), 6), -1, "partition", -1, sorted(event.peers)]))
            if event.until:
                loop.call_at(event.until, self._heal, event)
        else:
            raise ValueError(f"unknown event kind {event.kind!r}")

    def crash(self, index: int, restart_after: float = 0.0) -> None:
        """Crashes peer ``index`` now (from a Behaviour's point, say); restarts it ``restart_after``
        seconds later with its checkpoint (never if 0)."""
        self._fire(Event(clock.now(), "crash", (index,), restart_after))

    def _restart(self, peer: SimPeer) -> None:
        if not peer.alive and not peer.done:
            peer.start()

    def _heal(self, event: Event) -> None:
        for i in event.peers:
            self.net.partition.pop(self.peers[i].id, None)
        self.trace.append(json.dumps([round(clock.now(), 6), -1, "heal", -1, sorted(event.peers)]))

    def run(self) -> Result:
        """Runs the scenario on a fresh virtual loop (blocks; a few seconds for a few peers)."""
        t0 = time.perf_counter()
        thresholds = gc.get_threshold()
        gc.freeze()  # what exists now (modules, the peers' plans) is never garbage: not scanned again
        gc.set_threshold(*GC_THRESHOLDS)
        try:
            virtual = vloop.run(self._run(), cpu_scale=self.scenario.cpu_scale)
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        wall = time.perf_counter() - t0
        trace_hash = hashlib.sha256("\n".join(self.trace).encode()).hexdigest()
        stalled = not all(p.done or p.gone or p.failed is not None for p in self.peers if p.honest)
        return Result(self.scenario, self.records, self.trace, trace_hash, virtual, wall, self.peers, self.net,
                      self.dht, stalled, self.probes, self.attacker_probes)


def attack_plan(scenario: Scenario) -> list[Any]:
    """The ``Attack`` objects of the scenario's attack names (peer/sim/attacks.py)."""
    if not scenario.attacks:
        return []
    from hivetrain.peer.sim.attacks import LIBRARY  # (attacks build on this module)
    unknown = [name for name in scenario.attacks if name not in LIBRARY]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; the library has {sorted(LIBRARY)}")
    if not scenario.dishonest:
        raise ValueError("an attack needs attackers: list them in Scenario.dishonest")
    return [LIBRARY[name] for name in scenario.attacks]


def simulate(scenario: Scenario, progress: Callable[[Swarm], None] | None = None, **changes: Any) -> Result:
    """Runs ``scenario`` (with ``changes`` applied) and returns its result; ``progress(swarm)`` is
    called every 5 virtual seconds."""
    swarm = Swarm(replace(scenario, **changes) if changes else scenario)
    swarm.progress = progress
    return swarm.run()
