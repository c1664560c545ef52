"""One whole peer composed from its parts, the same way for a real peer and a simulated one.

A real peer (peer/app.py) runs over hivemind's DHT and libp2p, trains a language model and keeps
its checkpoints on disk; a simulated one (peer/sim/) runs over a simulated DHT and in-memory links,
in virtual time, trains a quadratic and keeps its checkpoint in memory. What differs is gathered in
``Seams``; everything built here is the same code: the averager, heartbeats, reachability, state
serving and sync, fork choice and the training loop, around one trust ledger.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hivetrain.dht.facade import DHTFacade
from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.peer import join
from hivetrain.peer.averaging.averager import P2PAverager
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.ready import DHTReadyBoard
from hivetrain.peer.config import RunSpec
from hivetrain.peer.net import dialback
from hivetrain.peer.net.link import Link
from hivetrain.peer.reach import Reachability
from hivetrain.peer.state.heartbeats import (
    HeartbeatPublisher,
    attestation_fields,
    heartbeat_level,
    heartbeat_ttl,
)
from hivetrain.peer.state.keeper import StateKeeper
from hivetrain.peer.state.serve import StateService
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.state.sync import StateSync
from hivetrain.peer.train.learner import Learner
from hivetrain.peer.train.loop import Began, MetricsWriter, Trainer, TrainerParts
from hivetrain.peer.trust import Bans, Trust

Say = Callable[[str], None]


class Ledger(Protocol):
    """Where a peer keeps its trust ledger and bans between runs of the process (peer/trust.py)."""

    def load(self, trust: Trust, bans: Bans) -> None: ...

    def save(self, trust: Trust, bans: Bans) -> None: ...


@dataclass(frozen=True)
class Seams:
    """What a real peer and a simulated one do differently."""

    dht: DHTFacade  # records, and the loop the network runs on
    link: Link  # streams to other peers (its peer id is ``dht.identity``'s)
    learner: Learner  # the objective
    behaviour: Behaviour  # how this peer acts (honest, a fault, an attack)
    save: Callable[[Snapshot], None] | None = None  # writes a checkpoint (None: none kept)
    pause: Callable[[float], None] | None = None  # how the training thread waits (None: time.sleep)
    rng: random.Random | None = None  # this peer's randomness (None: the OS's)
    ledger: Ledger | None = None  # keeps trust and bans across restarts (None: each start is a newcomer's)
    began: Began | None = None  # notes the rounds whose averaging we begin (None: a restart is not guarded)


class Peer:
    """The parts of one peer of run ``run_key`` (construct on the training thread: it serves the
    peer's protocols on the link before it returns; the dial-back check is served earlier, by the
    caller, with ``serve_dialback``)."""

    def __init__(self, seams: Seams, run_key: str, spec: RunSpec, metrics: MetricsWriter, say: Say):
        dht, link, identity = seams.dht, seams.link, seams.dht.identity
        self.spec, self.say = spec, say
        numel = sum(p.numel() for p in seams.learner.model.parameters())
        bans = Bans()
        self.trust = Trust(banned=bans.__contains__)  # one ledger: the trainer records completed rounds; averaging
        # and fork choice read it
        if seams.ledger is not None:
            seams.ledger.load(self.trust, bans)
        ef = ErrorFeedback(numel) if spec.carries_residual else None
        ctx = PeerContext(spec, numel, spec.codec(), link, identity, self.trust, bans, seams.behaviour, ef)
        self.averager = P2PAverager(ctx, DHTReadyBoard(dht, run_key), dht).start()
        self.heartbeat = HeartbeatPublisher(dht, identity, run_key, heartbeat_ttl(spec), say, heartbeat_level(spec))
        self.reachability = Reachability(link, dht, say, self.reached, seams.rng)
        self.service = StateService(spec.spec_hash().hex(), seams.behaviour)
        dht.run(link.serve(self.service.protocol, self.service.server), timeout=10)
        self.sync = StateSync(dht, link, self.service, run_key, numel, seams.rng, heartbeat_level(spec))
        self.keeper = StateKeeper(self.sync, self.trust, self._saver(seams, bans), timeout=spec.allreduce_timeout * 5,
                                  min_round_s=spec.min_round_s, log=say)
        self.keeper.announce = lambda round_, base: self.averager.announce(round_, base, None)
        parts = TrainerParts(spec, identity.peer_id, None, self.averager, metrics, seams.behaviour, self.keeper,
                             self.trust, learner=seams.learner, pause=seams.pause or time.sleep, began=seams.began)
        self.trainer = Trainer(parts, log=say, heartbeat=self.heartbeat)

    def _saver(self, seams: Seams, bans: Bans) -> Callable[[Snapshot], None] | None:
        """What keeps a round boundary: the checkpoint, and the trust it was reached with."""
        save, ledger = seams.save, seams.ledger
        if ledger is None:
            return save

        def keep(snapshot: Snapshot) -> None:
            if save is not None:
                save(snapshot)
            ledger.save(self.trust, bans)

        return keep

    def reached(self, verdict: dialback.Verdict) -> None:
        """How others reach us changed: it takes effect at the next round's matchmaking."""
        self.averager.ctx.closed = verdict.mode == dialback.OUTBOUND_ONLY
        self.heartbeat.extra["reach"] = verdict.mode
        public = join.learnt(verdict, self.heartbeat.extra.get("addrs", []))
        if public is not None:  # the address the peers that dialed us see: the one to give out
            self.heartbeat.extra["addrs"] = join.own([public, *self.heartbeat.extra.get("addrs", [])])
            hb = self.heartbeat
            self.say(f"public address {public}, as the peers that dialed us see it; join with: peer start --join "
                     f"{join.line(hb.run_key, [f'{public}/p2p/{hb.identity.peer_id}'])}")

    def run(self, saved: Snapshot | None, max_rounds: int, until_round: int = 0, wait_for_peers: int = 0,
            wait_timeout: float = 120.0) -> dict[str, Any]:
        """Trains (training thread) from ``saved`` (a verified local checkpoint) or the run's state,
        ``max_rounds`` rounds or until the run's round ``until_round`` (0: no limit); first waits, at
        most ``wait_timeout`` seconds, for ``wait_for_peers`` peers to show up. Returns the totals."""
        self.reachability.first_check()
        self.reachability.start()
        trainer = self.trainer
        if saved is not None:
            trainer.resume(saved)
        if not trainer.held:  # no weights of the run's start: its state from its peers, before anything else
            trainer.take_run_state()
        if wait_for_peers > 1:
            snapshot = trainer.outer.snapshot()
            self.keeper.committed(snapshot)  # served while we wait: a peer without the weights syncs it
            self.heartbeat(**attestation_fields(snapshot), throughput=0.0, train_loss=None, eval_loss=None)
            self.say(f"waiting for {wait_for_peers} peers (at most {wait_timeout:.0f} s)")
            seen = self.keeper.wait_for_peers(wait_for_peers, wait_timeout)
            self.averager.first_expected = set(sorted(self.keeper.present)[:64])  # start together: round 0
            if seen < wait_for_peers:
                self.say(f"warning: only {seen} of {wait_for_peers} peers showed up; starting anyway")
        return trainer.run(max_rounds, until_round)

    def stop(self) -> None:
        self.reachability.stop()


async def serve_dialback(link: Link, behaviour: dialback.Answering) -> dialback.DialBackService:
    """Answers other peers' reachability checks on ``link`` (before anyone learns our address:
    a joiner may check with us at once)."""
    service = dialback.DialBackService(link, behaviour)
    await link.serve(dialback.PROTOCOL, service.server)
    return service

