"""``Averager`` over a ``Link``: matchmaking (peer/averaging/matchmaking.py), then one
``RoundSession`` and its audited all-reduce (peer/averaging/allreduce.py) per round.

``average`` is the one synchronous entry, called by the training thread; everything else runs on
the link's loop. The averager is also the ``Service`` the link serves: it routes each inbound
message by type to the round's matchmaking or to the session of the group we derived, and refuses
everything else on its header, before reading any body. The sender is always the peer id the link
authenticated, never a field of the message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
from typing import Any, TypeVar

import torch

from hivetrain.dht import clock
from hivetrain.dht.facade import FutureLike, LoopRunner
from hivetrain.peer.averaging.agreement import held_statements
from hivetrain.peer.averaging.allreduce import AllReduceRunner
from hivetrain.peer.averaging.api import MAX_PIECES, AverageResult
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.cross import Desk, anchor_rank, top_bucket, units
from hivetrain.peer.averaging.matchmaking import AGREE_MIN, Matchmaking
from hivetrain.peer.averaging.ready import READ_TIMEOUT, Ready, ReadyBoard, grown
from hivetrain.peer.averaging.ready import level as ready_level
from hivetrain.peer.averaging.reduce import digest
from hivetrain.peer.averaging.session import Intake, RoundSession
from hivetrain.peer.averaging.statements import STATEMENT_LEN, pack_all
from hivetrain.peer.averaging.views import Report
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import Done, Reply, Server, Ticket
from hivetrain.peer.net.wire import MAX_GROUP, ZERO, Code, reason

logger = logging.getLogger(__name__)
T = TypeVar("T")
SESSION_KINDS = ("part", "pledge", "relay", "result", "audit", "applied", "evidence_req", "statements_req", "cross_out")
MAX_COMPANIONS = 4096  # peers recorded as sharing a round's means with us (trust), at most
MAX_AWAITED = 16  # peers whose end of a round we wait to see before fork choice (RoundFailed.awaiting)
MAX_RANK_DOUBLINGS = 8  # rounds without a population after which the anchor rank of round 0 stops doubling
SETTLE_MARGIN = 3.0  # s past our all-reduce deadline for a member that decided later to publish its end


class _InFlight:
    """The ``Pending`` of an averaging running on the link's loop."""

    def __init__(self, future: FutureLike, budget: float):
        self.future, self.budget = future, budget

    def result(self) -> AverageResult:
        try:
            return self.future.result(self.budget)  # type: ignore[no-any-return]
        except RoundFailed:
            raise
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            raise RoundFailed(f"the averaging did not end within {self.budget:.0f} s") from None
        except (KeyboardInterrupt, SystemExit):  # Ctrl+C or SIGTERM while we wait: the user stops the peer
            self.future.cancel()
            raise
        except BaseException as e:  # the round is void whatever went wrong; say what it was
            raise RoundFailed(reason(f"{type(e).__name__}: {e}")) from None


class _Deposit:
    """The link's ``Ticket`` for a session message whose body is being read."""

    def __init__(self, averager: P2PAverager, intake: Intake):
        self.averager, self.intake = averager, intake

    @property
    def deadline(self) -> float:
        return self.intake.deadline

    async def complete(self, body: bytes) -> Reply:
        code, why = self.intake.deposit(body)
        return self.averager.refusal(self.intake.header, code, why)

    def abort(self) -> None:
        self.intake.abort()


class _CrossTicket:
    """The link's ``Ticket`` for a sub-piece sent to us as its designee."""

    def __init__(self, averager: P2PAverager, desk: Desk, sender: str, header: dict[str, Any]):
        self.averager, self.desk, self.sender, self.header = averager, desk, sender, header
        self.deadline = clock.now() + averager.ctx.spec.allreduce_timeout

    async def complete(self, body: bytes) -> Reply:
        code, why = await self.desk.accept(self.sender, self.header, body)
        return self.averager.refusal(self.header, code, why)

    def abort(self) -> None:
        pass


class _CheckTicket(_CrossTicket):
    """The link's ``Ticket`` for another designee's mean sent to us as its witness (cross.py ``check``)."""

    async def complete(self, body: bytes) -> Reply:
        code, why, sig = await self.desk.check(self.sender, self.header, body)
        h = self.header
        return self.averager.ctx.header("cross_sig", h["round"], h["base"], shard=h["shard"], sub=h["sub"],
                                        code=int(code), reason=reason(why), sig=sig), b""


class _ReturnTicket(_CrossTicket):
    """The link's ``Ticket`` for a top designee's mean of a sub-piece our bucket sent up."""

    async def complete(self, body: bytes) -> Reply:
        code, why = self.desk.returned(self.sender, self.header, body)
        return self.averager.refusal(self.header, code, why)


class P2PAverager:
    """Averages pseudo-gradients with the peers of one run. Construct, then ``start()``."""

    def __init__(self, ctx: PeerContext, board: ReadyBoard, runner: LoopRunner):
        self.ctx, self.board, self.runner = ctx, board, runner
        self.server = Server(self)
        self.current_round = -1
        self.matchmaking: dict[int, Matchmaking] = {}  # this round's and the previous one's
        self.sessions: dict[int, RoundSession] = {}  # round -> the session of the group we derived (two rounds)
        self.desks: dict[int, Desk] = {}  # round -> our designee's desk (cross.py; this round's and the previous)
        self.replayed: dict[str, str] = {}  # members that sent old parts during this round -> why
        self.announced: dict[int, float] = {}  # round -> when our announcement of it expires (unix time)
        # peers to wait for in our first round, like a previous group (the ones --wait-for-peers saw)
        self.first_expected: set[str] = set()

    def start(self) -> P2PAverager:
        self.runner.run(self.ctx.link.serve(self.ctx.protocol, self.server), timeout=10)
        return self

    # ---- the training thread's entry ------------------------------------------------------------

    @property
    def budget(self) -> float:
        """Seconds one averaging may take at most, matchmaking and agreement included."""
        spec = self.ctx.spec
        return spec.matchmaking_timeout * 2 + max(AGREE_MIN, spec.matchmaking_timeout / 2) + spec.allreduce_timeout + 15

    def average(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> AverageResult:
        return self.begin(round_, base_hash, delta, population).result()

    def begin(self, round_: int, base_hash: str, delta: torch.Tensor, population: int = 0) -> _InFlight:
        return _InFlight(self.runner.submit(self.average_async(round_, base_hash, delta, population)), self.budget)

    def base_population(self, population: int) -> int:
        """A base state's population, or, for one without (round 0's), the run's ``expected_peers``."""
        return population or self.ctx.spec.expected_peers

    def anchor_rank(self, round_: int, population: int, level: int) -> int:
        """Which ready record anchors the round's cross stage (cross.anchor_rank): from the base state's
        population. A base without one (round 0's, and the void rounds on top of it: a void keeps its
        parent's population) takes a target group's, as the least a run starts with, doubled for each
        round since the start. Else two identities whose ready records come first in a run of 8 with
        a target of 4 were every designee of round 0, refused the role, voided it for everyone, and so
        kept the population unknown and the role theirs, round after round (search seeds 5,000,092
        and 5,000,161: 0.17 and 0.13 of honest peer-rounds completed)."""
        known = self.base_population(population)
        if known:
            return anchor_rank(known, level)
        return anchor_rank(self.ctx.spec.target_group_size, level) << min(round_, MAX_RANK_DOUBLINGS)

    def level(self, population: int) -> int:
        """The round's ready buckets (2^level) at a base state of ``population`` (ready.level); one
        without the cross-group stage, whose groups need not agree across buckets."""
        spec = self.ctx.spec
        return ready_level(self.base_population(population), spec.target_group_size) if spec.cross_groups else 0

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None, population: int = 0) -> None:
        """Publishes our announcement for ``round_`` in the background (best effort: a peer that is
        not announced is still found when it is ready; it only cannot be waited for). It lives
        until we must have started that round's averaging (the ETA, then at most the averaging in
        flight: ``budget``); our ready record for the round expires later, so that it replaces
        this one (the DHT keeps the later expiration under one subkey)."""
        eta = clock.wall() + eta_s if eta_s else 0.0
        ready = Ready(self.ctx.me, round_, base_hash or ZERO, self.ctx.run, done=False, eta=eta, closed=self.ctx.closed,
                      up=self.ctx.rates.claim())
        ttl = (eta_s or 0.0) + self.budget
        self.announced[round_] = clock.wall() + ttl
        for old in sorted(self.announced)[:-4]:  # bounded: recent rounds only
            del self.announced[old]

        async def publish() -> None:
            try:
                await asyncio.wait_for(self.board.publish(self.ctx.identity, ready, ttl, self.level(population)),
                                       READ_TIMEOUT)
            except Exception as e:  # a background task: say what went wrong, never raise unseen
                logger.info("round %d: announcing ahead failed: %r", round_, e)

        self.runner.submit(publish())

    async def average_async(self, round_: int, base: str, delta: torch.Tensor, population: int = 0) -> AverageResult:
        ctx = self.ctx
        t0 = clock.now()
        sent0, received0 = ctx.traffic.sent + self.server.traffic.sent, ctx.traffic.received + self.server.traffic.received
        self._enter(round_)
        level_ = self.level(population)
        mm = self.matchmaking[round_] = Matchmaking(ctx, self.board, round_, base, level_)
        mm.anchor_rank = self.anchor_rank(round_, population, level_)
        desk = self._desk(round_, base, level_, mm.anchor_rank) if ctx.spec.cross_groups else None
        mm.outlive = self.announced.get(round_, 0.0)
        previous = self.sessions.get(round_ - 1)
        if previous is not None:  # the peers we just completed (or tried) a round with: likely ready soon
            mm.expected = set(previous.order)
        elif self.first_expected:  # our first round: the peers we waited for at start (their announcement
            mm.expected, self.first_expected = self.first_expected, set()  # may still be on its way)
        mm.expected = {p for p in mm.expected if mm.in_bucket(p)}  # (the others are grouped in their own buckets)
        try:
            order = await mm.run()
            t1 = clock.now()
            ctx.behaviour.at("after_matchmaking", round_)
            layout = units(ctx.numel, ctx.spec.target_group_size, ctx.spec.piece_values) if desk else None
            session = RoundSession(ctx.run, round_, base, order, ctx.me, ctx.numel, ctx.codec,
                                   ctx.spec.audit, clock.now() + ctx.spec.allreduce_timeout,
                                   ctx.spec.piece_values, mm.closed_members(order), mm.claims(order), layout)
            lone = session.reducers[0] if len(session.reducers) == 1 and session.n > 1 else ctx.me
            if ctx.spec.audit and lone != ctx.me and ctx.trust.on_probation(lone, round_):
                # nobody would audit it: a newcomer that made the others believe they are closed
                # (dial-back lies) took every shard of their groups unaudited (review N3)
                raise RoundFailed(f"{lone}, a peer we never completed a round with, is the only member of our group "
                                  "that can be dialed: it would reduce every shard unaudited")
            self.sessions[round_] = session
            self._mark_replays(session)
            runner = AllReduceRunner(ctx, session, desk)
            outcome = await runner.run(delta)
        except RoundFailed as e:
            mm.view.abandoned = True  # tell peers that still ask: we are out of this round
            excluded = {**mm.view.capped, **e.excluded}
            ours = self.sessions.get(round_)
            if desk is not None:
                self._out(mm, ours.order if ours is not None else (ctx.me,))
            # the members we did not find at fault may still complete the round in a group without us
            # (they decided later, without a member that died): fork choice should see how it ended
            awaiting = tuple(p for p in ours.order if p != ctx.me and p not in excluded)[:MAX_AWAITED] \
                if ours is not None else ()
            until = ours.deadline + SETTLE_MARGIN if ours is not None else 0.0
            raise RoundFailed(str(e), excluded, awaiting, until) from None
        except BaseException:
            mm.view.abandoned = True
            raise
        sent = ctx.traffic.sent + self.server.traffic.sent - sent0
        received = ctx.traffic.received + self.server.traffic.received - received0
        # with the cross-group stage: how many groups and members the round's means came from (at most)
        groups = max((h["groups"] for h, _ in session.cross.values()), default=1)
        members = max((h["weight"] for h, _ in session.cross.values()), default=len(order))
        others = len(mm.seen - set(order)) - max(0, members - len(order))
        stats = {"matchmaking_s": t1 - t0, "window_s": mm.waited, "allreduce_s": clock.now() - t1,
                 "others_seen": float(max(0, others)), "up_claim_kBps": float(mm.view.me_up),
                 "shards_reduced": float(len(session.mine)), "shards": float(session.units),
                 "groups": float(groups), "round_members": float(max(members, len(order))),
                 # sub-pieces of ours whose mean no designee sent back by the deadline: our group applied
                 # its own values there (the run may fork there; cross.py)
                 "cross_fallbacks": float(runner.fallbacks),
                 # means of our sub-pieces that their designees' proofs refuted (another pair's came instead)
                 "cross_disproven": float(len(session.disproven)),
                 # means we asked for because our reducer's forward had not come (from it, or from their
                 # designees when it died: allreduce ``_fetch``)
                 "cross_fetched": float(runner.fetched)}
        # alone while others of the run were here: they may be averaging without us right now
        alone = tuple(sorted(mm.seen - {ctx.me}))[:MAX_AWAITED] if len(order) == 1 and groups <= 1 else ()
        population_ = grown(self.base_population(population), members, ctx.spec.target_group_size) if desk else 0
        companions = await self._companions(mm, desk, order, population_) if groups > 1 else ()
        return AverageResult(outcome.averaged, order, outcome.applied, sent, received, stats,
                             {**{p: w for p, w in mm.view.capped.items() if p not in order}, **outcome.excluded},
                             tuple(outcome.void_ranges), alone,
                             clock.now() + self._settle_s if alone else 0.0,
                             companions, population_)

    async def _companions(self, mm: Matchmaking, desk: Desk | None, order: tuple[str, ...],
                          population: int) -> tuple[str, ...]:
        """The peers beyond our group whose groups' results went into our round's means, as far as
        we know: those ready at our base in the buckets the plan read (ours and the top). Trust is
        recorded for them, so that the peers we meet in the next round's bucket are no newcomers to
        each other and every member's caps keep the same group: a bucket is the same every round,
        but when the next round has fewer buckets (the state's population shrank) ours takes in
        others, and those are read too (once, in that round only)."""
        everyone = set(mm.ready_here | (desk.plan.ready if desk is not None and desk.plan is not None else frozenset()))
        if desk is not None and desk.plan is not None and self.level(population) < desk.level:
            shift = desk.level - self.level(population)
            merged = [b for b in range(1 << desk.level) if b >> shift == desk.bucket >> shift]
            read = {desk.bucket, top_bucket(desk.round, desk.base, desk.level)}
            try:
                records = await asyncio.wait_for(self.board.read(desk.round, desk.level, [b for b in merged if b not in read]),
                                                 READ_TIMEOUT)
                everyone |= {r.peer_id for r in records if r.done and r.base == desk.base and r.spec == self.ctx.run}
            except Exception as e:  # (fewer companions: some of the next round's mates are newcomers to us)
                logger.info("round %d: reading the buckets that merge into ours failed: %r", desk.round, e)
        # (a record whose peer did not answer our ping was in no group: it earns nothing; before, an
        # identity whose ready record sat on the board through one round was established for everyone)
        return tuple(sorted(everyone - set(order) - mm.silent))[:MAX_COMPANIONS]

    def _out(self, mm: Matchmaking, group: tuple[str, ...]) -> None:
        """Our round failed: we say so on the board (our ready record again, ``out``, with the group
        we were in), so that the round's designees stop waiting for our group (cross.py)."""
        record = dataclasses.replace(mm.own_record(), out=True, group=tuple(group[:MAX_GROUP]))
        spec = self.ctx.spec  # (it must outlive our ready record: the DHT keeps the later expiration)
        ttl = max(spec.matchmaking_timeout + spec.allreduce_timeout + 10.0, mm.outlive - clock.wall() + 2.0)

        async def publish() -> None:
            try:
                await asyncio.wait_for(self.board.publish(self.ctx.identity, record, ttl, mm.level), READ_TIMEOUT)
            except Exception as e:  # a background task: say what went wrong, never raise unseen
                logger.info("round %d: saying we are out failed: %r", record.round, e)

        self.runner.submit(publish())

    @property
    def _settle_s(self) -> float:
        """Seconds within which peers still matching when we went alone must have ended the round."""
        return self.ctx.spec.matchmaking_timeout + self.ctx.spec.allreduce_timeout + SETTLE_MARGIN

    def _desk(self, round_: int, base: str, level_: int, rank: int) -> Desk:
        desk = self.desks.get(round_)
        if desk is None or desk.base != base or desk.level != level_ or desk.rank != rank:
            if desk is not None:
                desk.stop()
            desk = self.desks[round_] = Desk(self.ctx, self.board, round_, base,
                                             lambda header, body: self._local_mean(round_, header, body),
                                             lambda: self._own_record(round_, base), level_,
                                             lambda peer: self._silent(round_, base, peer), rank)
        return desk

    def _silent(self, round_: int, base: str, peer: str) -> bool:
        """Whether ``peer`` showed us no sign of life in the round (it did not answer our ping before
        the partition, or its record came after it and was never pinged), unless it says it cannot be
        dialed (outbound-only: never pinged, it stays in the partition)."""
        mm = self.matchmaking.get(round_)
        return (mm is not None and mm.view.base == base and peer != self.ctx.me and peer not in mm.alive
                and peer not in mm.view.closed)

    def _own_record(self, round_: int, base: str) -> Ready | None:
        mm = self.matchmaking.get(round_)
        return mm.own_record() if mm is not None and mm.view.base == base else None

    def _local_mean(self, round_: int, header: dict[str, Any], body: bytes) -> None:
        """A mean our desk computed for a shard we reduce in our own group."""
        session = self.sessions.get(round_)
        if session is not None and session.plan is not None:
            session.deposit_cross(self.ctx.me, dict(header, group=session.group), body)

    def _enter(self, round_: int) -> None:
        self.current_round = round_
        self.replayed = {}
        for old in [r for r in self.desks if r != round_ - 1]:
            self.desks.pop(old).stop()
        for rounds in (self.matchmaking, self.sessions):
            # the previous round's are kept (late askers, evidence requests); any others are gone, rounds
            # ahead of us too: after a sync to another lineage, the round counter can go back
            for old in [r for r in rounds if r != round_ - 1]:
                del rounds[old]

    def _mark_replays(self, session: RoundSession) -> None:
        """Leaves out at once, in the shards we reduce or audit, members that sent old parts this round."""
        for peer, why in self.replayed.items():
            if peer in session.order and peer != self.ctx.me:
                for k in (*session.mine, *session.audited):
                    if peer not in session.shards[k].parts:
                        session.shards[k].invalid.setdefault(peer, why)
        session.arrived.set()

    # ---- the Service the link serves (on the loop) ----------------------------------------------

    @functools.cached_property
    def max_body(self) -> int:
        """The largest body any message can have: one whole encoded vector (a part, or a result for
        any group size: sparse results grow with the group), or the statements of a round's MAX_PIECES
        shards."""
        codec, numel = self.ctx.codec, self.ctx.numel
        results = max(codec.for_results(n).encoded_nbytes(numel) for n in range(1, MAX_GROUP + 1))
        return max(codec.encoded_nbytes(numel), results, MAX_PIECES * STATEMENT_LEN)

    def is_member(self, peer: str) -> bool:
        session = self.sessions.get(self.current_round)
        if session is not None:
            return peer in session.order
        mm = self.matchmaking.get(self.current_round)
        return mm is not None and peer in mm.view.candidates

    def refusal(self, header: dict[str, Any], code: Code, why: str) -> Reply:
        return self.ctx.header("ack", header.get("round", 0), header.get("base", "0" * 64), code=int(code),
                               reason=reason(why)), b""

    def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Reply | Ticket:
        kind = header["type"]
        if kind not in ("view", "cross", "cross_check", "cross_proof_req", "cross_mean_req", "ping") and \
                kind not in SESSION_KINDS:  # (a message of another protocol)
            return self.refusal(header, Code.MALFORMED, f"{kind} is not an averaging request")
        round_ = header["round"]
        if header["run"] != self.ctx.run:
            return self.refusal(header, Code.FOREIGN, "message for another run spec")
        if kind == "ping":  # we are here (Matchmaking._ping_board); nothing else changes
            return Done(self.refusal(header, Code.OK, "")) if not body_len else self.refusal(
                header, Code.WRONG_SIZE, "a ping has no body")
        if kind == "view":
            return Done(self._on_view(sender, header)) if not body_len else self.refusal(
                header, Code.WRONG_SIZE, "a view request has no body")
        if not self.current_round - 1 <= round_ <= self.current_round + 1:
            return self.refusal(header, Code.FOREIGN, f"round {round_} is not near ours ({self.current_round})")
        if kind in ("cross", "cross_check"):
            return self._admit_cross(sender, header, body_len)
        if kind == "cross_proof_req":  # a reducer checks a mean we signed (cross.py ``prove``)
            desk = self.desks.get(round_)
            if body_len or desk is None or desk.base != header["base"]:
                return self.refusal(header, Code.WRONG_SIZE if body_len else Code.NOT_READY,
                                    "a proof request has no body" if body_len else "we averaged nothing there")
            code, why, proof = desk.prove(sender, header)
            return Done((self.ctx.header("cross_proof", round_, header["base"], shard=header["shard"],
                                         sub=header["sub"], code=int(code), reason=reason(why)), proof))
        if kind == "cross_mean_req":  # a member asks its reducer (session ``hand``), then the designees (cross.py ``hand``)
            ours, desk = self.sessions.get(round_), self.desks.get(round_)
            if body_len:
                return self.refusal(header, Code.WRONG_SIZE, "a mean request has no body")
            if ours is not None and ours.base == header["base"] and ours.group == header["group"] and \
                    header["shard"] in ours.mine:
                code, why, out, mean = ours.hand(sender, header)
            elif desk is not None and desk.base == header["base"]:
                code, why, out, mean = desk.hand(sender, header)
            else:
                code, why, out, mean = Code.NOT_READY, "we averaged nothing there", {}, b""
            return Done((out, mean)) if code == Code.OK else self.refusal(header, code, why)
        session = self.sessions.get(round_)
        desk = self.desks.get(round_)
        if kind == "cross_out" and desk is not None and desk.level > 0 and header["group"] == desk.label:
            # a top designee's mean of our bucket's sub-piece, to us as the bucket's designee: checked by the desk
            if body_len > self.max_body:
                return self.refusal(header, Code.WRONG_SIZE, "too large")
            return _ReturnTicket(self, desk, sender, header)
        if kind == "cross_out":  # from a designee (not a member) or our reducer: checked by the session
            if session is None or session.group != header["group"]:
                return self.refusal(header, Code.NOT_READY if session is None else Code.WRONG_GROUP,
                                    "no such group of ours in that round")
            crossed = session.admit_cross(sender, header, body_len)
            return _Deposit(self, crossed) if isinstance(crossed, Intake) else self.refusal(header, *crossed)
        if sender in self.ctx.bans and (session is None or sender not in session.order):
            # (a member we caught during this round still delivers its part of the round: the others
            # wait for it, and what it sends is checked like anybody's)
            return self.refusal(header, Code.BANNED, "we caught you misbehaving")
        if kind == "evidence_req" and session is not None and session.group == header["group"]:
            code, body = session.evidence(sender, header)
            if code != Code.OK:
                return self.refusal(header, code, "no such evidence")
            return self.ctx.header("evidence", round_, header["base"], group=session.group, shard=header["shard"],
                                   index=header["index"], ok=True), body
        if kind == "statements_req" and session is not None and session.group == header["group"]:
            if sender not in session.order:
                return self.refusal(header, Code.NOT_MEMBER, "statements are for the group's members")
            return self.ctx.header("statements", round_, header["base"], group=session.group, ok=True), \
                pack_all(held_statements(session))
        if round_ < self.current_round:
            return self._late(sender, header)
        if session is None or session.group != header["group"]:
            if session is None and round_ >= self.current_round:
                mm = self.matchmaking.get(round_)
                if mm is not None and kind == "part":
                    mm.on_early_part(sender)
                return self.refusal(header, Code.NOT_READY, "no group decided here yet")
            return self.refusal(header, Code.WRONG_GROUP, "we decided another group for that round")
        outcome = session.admit(sender, header, body_len)
        if isinstance(outcome, Intake):
            return _Deposit(self, outcome)
        code, why = outcome
        if code == Code.NOT_MEMBER:  # it named a group it is not in: nobody honest does that
            self.ctx.bans.ban(sender, f"round {round_}: sent a {kind} for a group it is not in")
        return self.refusal(header, code, why)

    def _admit_cross(self, sender: str, header: dict[str, Any], body_len: int) -> Reply | Ticket:
        """A group's sub-piece for us as its designee: only for a round and base we are ready for."""
        round_ = header["round"]
        if not self.ctx.spec.cross_groups:
            return self.refusal(header, Code.MALFORMED, "this run has no cross-group stage")
        # (a member we banned is heard: its group still needs the means; the desk leaves its values out)
        mm = self.matchmaking.get(round_)
        if mm is None or mm.view.base != header["base"]:
            return self.refusal(header, Code.NOT_READY, "we are not forming that round's group from that base")
        if body_len > self.max_body:
            return self.refusal(header, Code.WRONG_SIZE, "too large")
        desk = self._desk(round_, header["base"], mm.level, mm.anchor_rank)
        return (_CheckTicket if header["type"] == "cross_check" else _CrossTicket)(self, desk, sender, header)

    def _on_view(self, sender: str, header: dict[str, Any]) -> Reply:
        round_, base = header["round"], header["base"]
        mm = self.matchmaking.get(round_)
        members, excluded = header["members"], header["excluded"]
        request = Report(frozenset(members), frozenset(excluded), decided=header["decided"], closed=header["closed"],
                         up=header["up"], derived=header["derived"])
        if mm is None or mm.view.base != base:
            reply = Report(frozenset(), frozenset(), decided=round_ < self.current_round, ready=False,
                           closed=self.ctx.closed)
        else:
            reply = mm.on_view(sender, request)
        assert len(reply.members) <= MAX_GROUP and len(reply.excluded) <= MAX_GROUP
        return self.ctx.header("view_reply", round_, base, members=sorted(reply.members),
                               excluded=sorted(reply.excluded), decided=reply.decided, ready=reply.ready,
                               closed=reply.closed, up=reply.up, derived=reply.derived), b""

    def _late(self, sender: str, header: dict[str, Any]) -> Reply:
        """A message of an earlier round. The same part again is a retry; another from a member of our
        current group is a replay: its part is left out of our shards at once (no waiting for it)."""
        if header["type"] == "part":
            old = self.sessions.get(header["round"])
            if old is not None and old.group == header["group"] and header["shard"] < old.units:
                held = old.shards[header["shard"]].parts.get(sender)
                if held is not None and digest(held) == header["digest"]:
                    return self.refusal(header, Code.DUPLICATE, "")
            if self.is_member(sender) and len(self.replayed) < MAX_GROUP and sender not in self.replayed:
                self.replayed[sender] = f"replayed its part of round {header['round']} in round {self.current_round}"
                current = self.sessions.get(self.current_round)
                if current is not None:
                    self._mark_replays(current)
        return self.refusal(header, Code.STALE, f"round {header['round']} is over")
