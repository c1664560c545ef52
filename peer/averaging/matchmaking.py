"""Forming round r's group: the I/O around the pure rules of peer/averaging/views.py.

1. Window: publish our signed ready record; collect the ready peers with our base state from the
   board. The window closes as soon as nobody is worth waiting for: every peer that announced this
   round ahead (peer/averaging/ready.py), and every member of our previous round's group, is ready
   or gone to another base; at once when we are the only peer of the round. Without derived
   groups it also closes when the group reaches the run's target size and when a candidate shows
   that it already decided (its part for the round reached us: it waits for us); and at the latest
   ``spec.matchmaking_timeout`` after we were ready: the grace a straggler gets, whatever it claims.
   With derived groups, every dialable peer ready at our base on our board is pinged first
   (``_ping_board``): a record whose peer gives no sign of life within VIEW_TIMEOUT (an identity
   that only published a record, or a peer that died since) is left out of the partition, so that
   free records cannot split the live peers into groups they never fill. Every honest peer pings
   the same records and finds the same ones silent. What we answer from the window counts as no
   agreement with derived groups (``View.derived``): a peer that derived its group waits for ours.
   (Nobody's request closes our window: one identity's early part closed every honest window at
   once, and each derived a partition of a different board, review N4.)
2. Agreement: ask every member of our effective view for its view, first-hand, and fold the
   answers in (views.fold) until every member answers with exactly our view, or one reports a
   decision we can accept. Peers others name are asked before they can count. With derived groups
   an answer counts only from a member that derived its group, and until we decide we derive ours
   again whenever our board grew: peers that read the board a moment apart converge on one board
   instead of deciding on what one of them held before a late record reached it.

Runs on the link's loop; one ``Matchmaking`` per round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from hivetrain.dht import clock
from hivetrain.dht.records import bucket_of
from hivetrain.peer.averaging.api import group_order
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.ready import Ready, ReadyBoard
from hivetrain.peer.averaging.views import (
    Caps,
    Report,
    View,
    answer,
    derive_group,
    fold,
    outgoing,
    priority,
    settle,
)
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import request
from hivetrain.peer.net.prefixes import cap_key, first_prefix
from hivetrain.peer.net.wire import MAX_GROUP, ZERO, Code

logger = logging.getLogger(__name__)
POLL = 0.1  # seconds between board reads while the window is open
MAX_PENDING = 256  # announced peers we keep track of (the board's most recent, highest priority first)
VIEW_TIMEOUT = 3.0  # seconds for one view request: a peer that accepts the stream and never answers is excluded
VIEW_ATTEMPTS = 3  # tries of one view request that fails fast (a dropped stream, a refused dial)
BUSY_PAUSE = 0.2  # seconds (x the attempt) before asking a peer that answered BUSY again
FAST_FAILURE = 1.0  # seconds: a view request that failed sooner than this is tried again
RECONCILE_PAUSE = 0.05  # seconds before asking again when a sweep changed nothing
AGREE_MIN = 2 * VIEW_TIMEOUT + 2.0  # seconds, at least, for the agreement after the window
MAX_MEMO = 4096  # peers whose priority a round remembers (any peer can make us look one up)
MAX_BOARD = 4096  # peers ready at our base that a round's partition is derived from


@dataclass
class _Ask:
    peer: str
    reply: Report | None


class Matchmaking:
    """Forms one round's group. ``run`` returns the group in its fixed order, or raises RoundFailed."""

    def __init__(self, ctx: PeerContext, board: ReadyBoard, round_: int, base: str, level: int = 0):
        self.ctx, self.board = ctx, board
        self.level = level  # the round has 2^level ready buckets; we read ours alone (peer/averaging/ready.py)
        self.anchor_rank = 1  # which ready record of a bucket anchors the round's cross stage (cross.anchor_rank)
        self.bucket = bucket_of(round_, ctx.me, level)
        # our reachability and uplink claim are fixed for the round
        self.view = View(round_, base, ctx.me, me_closed=ctx.closed, me_up=ctx.rates.claim(), order=self._priority)
        self.changed = asyncio.Event()
        self.urgent: set[str] = set()  # candidates whose part for this round reached us: they decided
        self.early: set[str] = set()  # peers whose part reached us before we decided (at most MAX_GROUP kept)
        self.pending: dict[str, float] = {}  # announced, still computing -> the unix time it expects to be ready
        self.expected: set[str] = set()  # our previous round's group: waited for like announced peers
        self.elsewhere: set[str] = set()  # ready at another base: nobody waits for them
        self.seen: set[str] = set()  # every peer with a record for this round, any base (for "alone" warnings)
        self.ready_here: set[str] = set()  # ready at our base on our board (signed records): the partition's input
        self.alive: set[str] = set()  # peers that showed us they are here this round (a view request, a ping's answer)
        self.silent: set[str] = set()  # ready records whose peers did not answer our ping: never in the partition
        self.derived_from: frozenset[str] = frozenset()  # the board our group was last derived from
        self.ready_at = clock.wall()  # unix time we were ready (our record's ``eta``)
        self.waited = 0.0  # seconds the window stayed open
        self.outlive = 0.0  # unix time our announcement of this round expires: our ready record must outlive it
        self._prefixes: dict[str, str | None] = {}
        self._order = priority(round_, base, self._weight)
        self._priorities: dict[str, tuple[float, bytes]] = {}  # memos of ``_order`` and probation, this round
        self._newcomers: dict[str, bool] = {}
        self._caps = Caps(me=ctx.me, priority=self._priority, newcomer=self._newcomer, prefixes=self._prefixes,
                          max_per_prefix=ctx.spec.max_per_prefix, banned=ctx.bans.__contains__,
                          board=self.ready_here.__contains__ if ctx.spec.cross_groups else None)

    # ---- handlers (called by the averager's dispatch, on the loop) --------------------------------

    def on_view(self, sender: str, request: Report) -> Report:
        if len(self.alive) < MAX_BOARD:
            self.alive.add(sender)
        reply = answer(self.view, sender, request, self.caps())
        self.changed.set()
        return reply

    def on_early_part(self, sender: str) -> None:
        """A candidate sent us a part for this round before we decided: it is waiting for us."""
        # With derived groups the window's own rules close it (its sender derived from the same
        # board; it waits for us a moment): a part, junk or not, from a peer we never grouped with
        # closed every honest window at once, and each derived a partition of a different board
        # (review N4)
        if len(self.early) < MAX_GROUP:
            self.early.add(sender)
        if self.ctx.spec.cross_groups:
            return
        if sender in self.view.candidates and len(self.urgent) < MAX_GROUP:
            self.urgent.add(sender)
            self.changed.set()

    # ---- the round ------------------------------------------------------------------------------

    async def run(self) -> tuple[str, ...]:
        spec = self.ctx.spec
        announce = asyncio.create_task(self._announce())
        try:
            opened = clock.now()
            await self._window(opened + spec.matchmaking_timeout)
            self.waited = clock.now() - opened
            if spec.cross_groups and not self.view.decided:  # one model per round: groups are derived
                await self._read_board()
                await self._derive()
            group = await self._agree(clock.now() + max(AGREE_MIN, spec.matchmaking_timeout / 2))
            if self.view.me_closed and len(group) > 1:
                await self._tell_decision(group)
        finally:
            if not spec.cross_groups:  # (with the cross stage others derive the round's designees from it)
                announce.cancel()  # decided or failed: no more store retries for this round
        if len(group) < spec.min_group_size:
            raise RoundFailed(f"group of {len(group)} is below the run's minimum of {spec.min_group_size}")
        return group_order(group, self.view.round, self.view.base)

    def in_bucket(self, peer: str) -> bool:
        """Whether ``peer``'s ready record of this round is in our bucket: the peers we can group with."""
        return bucket_of(self.view.round, peer, self.level) == self.bucket

    def closed_members(self, group: tuple[str, ...]) -> frozenset[str]:
        """The members of our decided group that nobody can dial (their own claims; us included)."""
        return frozenset(p for p in group if p in self.view.closed or (p == self.ctx.me and self.view.me_closed))

    def claims(self, group: tuple[str, ...]) -> dict[str, int]:
        """The uplink each member of our decided group claimed, first-hand (ours included)."""
        return {p: self.view.me_up if p == self.ctx.me else self.view.claims.get(p, 0) for p in group}

    async def _tell_decision(self, group: tuple[str, ...]) -> None:
        """We are closed: nobody asks us, so we tell the open members what we decided (once each, in
        parallel); a member that adopted it or decided it already answers so; any other outcome
        shows in the all-reduce (a member that decided otherwise refuses our part)."""
        caps = self.caps()
        header = self.ctx.header("view", self.view.round, self.view.base, members=sorted(group), excluded=[],
                                 closed=True, decided=True, up=self.view.me_up, derived=True)

        async def tell(peer: str) -> None:
            try:
                await request(self.ctx.link, peer, self.ctx.protocol, header, b"", VIEW_TIMEOUT, traffic=self.ctx.traffic)
            except Exception as e:
                logger.debug("telling %s our decision failed: %r", peer, e)

        told = {p for p, r in self.view.reports.items() if r.decided and tuple(sorted(r.members)) == group}
        await asyncio.gather(*(tell(p) for p in sorted(self.view.askable(group) - told, key=caps.priority)))

    def own_record(self) -> Ready:
        """Our ready record of this round, as we publish it."""
        return Ready(self.ctx.me, self.view.round, self.view.base, self.ctx.run, done=True, eta=self.ready_at,
                     closed=self.view.me_closed, up=self.view.me_up)

    async def _announce(self) -> None:
        ready = self.own_record()
        ttl = max(self.ctx.spec.matchmaking_timeout + self.ctx.spec.allreduce_timeout, self.outlive - clock.wall() + 1.0)
        end = clock.now() + self.ctx.spec.matchmaking_timeout
        while clock.now() < end:
            try:
                if await asyncio.wait_for(self.board.publish(self.ctx.identity, ready, ttl, self.level),
                                          end - clock.now()):
                    return
            except TimeoutError:
                break
            except Exception as e:  # a background task: say what went wrong, never raise unseen
                logger.warning("round %d: storing our ready record failed: %r", self.view.round, e)
                return
            await asyncio.sleep(min(1.0, max(0.0, end - clock.now())))  # refused: not a tight loop
        # not fatal: peers we find still learn of us when we ask them for their view
        logger.warning("round %d: could not publish our ready record", self.view.round)

    async def _read_board(self) -> None:
        try:
            records = await self.board.read(self.view.round, self.level, (self.bucket,))
        except Exception as e:  # a partitioned or slow DHT: the window goes on with what we know
            logger.debug("round %d: reading ready records failed: %r", self.view.round, e)
            return
        records = [r for r in records if r.spec == self.ctx.run and r.peer_id != self.ctx.me]
        records.sort(key=lambda r: self._priority(r.peer_id))  # the caps keep the highest priority
        self.seen.update(r.peer_id for r in records[:MAX_PENDING])
        pending: dict[str, float] = {}
        for r in records:
            if r.done and r.base == self.view.base:
                if r.peer_id in self.silent:
                    continue
                if len(self.ready_here) < MAX_BOARD:
                    self.ready_here.add(r.peer_id)
                self.view.mark(r.peer_id, r.closed, r.up)
                if self.view.add(r.peer_id):
                    self.changed.set()
            elif r.done:
                if len(self.elsewhere) < MAX_PENDING:
                    self.elsewhere.add(r.peer_id)
            elif r.base in (self.view.base, ZERO) and len(pending) < MAX_PENDING:
                pending[r.peer_id] = r.eta
        self.pending = pending

    def worth_waiting(self) -> list[str]:
        """Peers we wait for (at most until the window's hard end): those that announced this round
        and the members of our previous round's group (an announcement can still be on its way
        through the DHT), unless they are candidates already, ready at another base, or banned.
        ETAs are not trusted either way: an ETA is an estimate (the peer's last inner steps took
        that long; the first ones include warm-up and are seconds off), and an outsider can announce
        what it likes, so waiting is bounded by the grace alone."""
        waited = (set(self.pending) | self.expected) - self.view.candidates - self.elsewhere - {self.ctx.me}
        return sorted(p for p in waited if p not in self.ctx.bans)

    async def _window(self, end: float) -> None:
        target = self.ctx.spec.target_group_size
        while True:
            await self._read_board()
            remaining = end - clock.now()
            full = len(self.view.effective()) >= target and not self.ctx.spec.cross_groups  # (derived: a partition)
            if remaining <= 0 or full or self.urgent or self.view.decided or not self.worth_waiting():
                return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(POLL, remaining))
            except TimeoutError:
                pass

    async def _agree(self, end: float) -> tuple[str, ...]:
        poller = asyncio.create_task(self._poll_board())  # peers that announced late (or behind a flood of fakes)
        try:
            return await self._sweeps(end)
        finally:
            poller.cancel()

    async def _poll_board(self) -> None:
        """Reads the board every POLL seconds, in the background: a slow DHT read never holds up a sweep."""
        while True:
            await asyncio.sleep(POLL)
            await self._read_board()

    async def _sweeps(self, end: float) -> tuple[str, ...]:
        view = self.view
        hints: frozenset[str] = frozenset()
        while view.decided is None:
            if clock.now() > end:
                raise RoundFailed(f"no agreement on the group of round {view.round}")
            if view.allowed is not None and self.ready_here != self.derived_from:
                await self._derive()  # our board grew since: boards read at other moments converge
            await self._observe(view.effective() | hints)
            caps = self.caps()
            asked = settle(view, caps) - {view.me}
            if not asked and not hints:
                if self._reopen():
                    continue
                view.decided = (view.me,)
                break
            self.changed.clear()
            ordered = sorted(view.askable(asked | hints), key=caps.priority)  # closed members ask us instead
            answers = await asyncio.gather(*(self._ask(peer, caps) for peer in ordered))
            for a in answers:  # a hint that answers ready, from our base, is a candidate first-hand
                if a.peer in hints and a.reply is not None and a.reply.ready and not a.reply.decided:
                    view.add(a.peer)
            replies = {a.peer: a.reply for a in answers if a.peer in asked or (a.reply is not None and a.reply.decided)}
            step = fold(view, asked, replies, caps, clock.now())
            hints = step.hints
            if step.decided is None and not hints and not self.changed.is_set():
                try:  # the others have yet to catch up: give them a moment, not a busy loop
                    await asyncio.wait_for(self.changed.wait(), RECONCILE_PAUSE)
                except TimeoutError:
                    pass
        return view.decided

    def _reopen(self) -> bool:
        """Our derived group left us alone (its other members did not answer: gone, or ready
        records of peers that do not exist): once per round, we look for a group among every
        candidate on our board instead, as before groups were derived. Returns whether we did."""
        view = self.view
        if view.allowed is None or len(view.allowed) < 2:
            return False
        logger.info("round %d: our derived group of %d left us alone; looking among all %d ready peers",
                    view.round, len(view.allowed), len(self.ready_here))
        view.allowed = None
        for peer in sorted(self.ready_here - set(view.excluded), key=self._priority):
            view.add(peer)
        view.strikes.clear()
        return True

    async def _derive(self) -> None:
        """Derives our group from the board as we read it now (its silent records left out)."""
        await self._ping_board()
        self.derived_from = frozenset(self.ready_here)
        derive_group(self.view, self.ready_here, self.ctx.spec.target_group_size)

    async def _ping_board(self) -> None:
        """Pings every peer ready at our base on our board that we can dial and that has not shown
        itself this round; those that give no sign of life (any reply counts, BUSY included) are
        left out of the partition and of our view for the round."""
        view = self.view
        peers = sorted(self.ready_here - self.alive - view.closed - set(view.excluded) - {self.ctx.me})
        if not peers:
            return
        answered = await asyncio.gather(*(self._ping(p) for p in peers))
        silent = [p for p, ok in zip(peers, answered, strict=True) if not ok]
        self.alive.update(p for p, ok in zip(peers, answered, strict=True) if ok)
        for peer in silent:
            self.ready_here.discard(peer)
            self.silent.add(peer)
            view.exclude(peer, "did not answer our ping before the partition")
        if silent:
            logger.info("round %d: %d of %d ready peers on our board did not answer a ping: left out of the "
                        "partition", view.round, len(silent), len(peers))

    async def _ping(self, peer: str) -> bool:
        """Whether ``peer`` gives a sign of life: any reply counts, BUSY included."""
        return await self._request(peer, self.ctx.header("ping", self.view.round, self.view.base), busy=False) is not None

    async def _ask(self, peer: str, caps: Caps) -> _Ask:
        mine = outgoing(self.view, caps)
        header = self.ctx.header("view", self.view.round, self.view.base, members=sorted(mine.members),
                                 excluded=sorted(mine.excluded), closed=self.view.me_closed, decided=False,
                                 up=self.view.me_up, derived=mine.derived)
        reply = await self._request(peer, header, busy=True)
        if reply is None or reply["type"] != "view_reply" or reply["base"] != self.view.base:
            return _Ask(peer, None)
        return _Ask(peer, Report(frozenset(reply["members"]), frozenset(reply["excluded"]), reply["decided"],
                                 reply["ready"], reply["closed"], reply["up"], reply["derived"]))

    async def _request(self, peer: str, header: dict[str, Any], busy: bool) -> dict[str, Any] | None:
        """One of matchmaking's requests; its reply, or None if ``peer`` gave none. Asking again is
        harmless: a stream that p2pd dropped at once is worth a retry (VIEW_ATTEMPTS in all), a
        request that ran into its timeout is not (the peer is stalled); ``busy``: a BUSY answer is
        asked again too (the peer is there; its stream caps were full)."""
        for attempt in range(VIEW_ATTEMPTS):
            last = attempt + 1 == VIEW_ATTEMPTS
            started = clock.now()
            try:
                reply, _ = await request(self.ctx.link, peer, self.ctx.protocol, header, b"", VIEW_TIMEOUT,
                                         traffic=self.ctx.traffic)
            except Exception as e:  # unreachable, refused, timed out, malformed
                logger.debug("%s to %s failed (attempt %d): %r", header["type"], peer, attempt + 1, e)
                if last or clock.now() - started > FAST_FAILURE:
                    return None
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            if busy and not last and reply["type"] == "ack" and reply["code"] == Code.BUSY:
                await asyncio.sleep(BUSY_PAUSE * (attempt + 1))
                continue
            return reply
        return None

    # ---- caps -----------------------------------------------------------------------------------

    def _weight(self, peer: str) -> float:
        return self.ctx.trust.weight(peer, self.view.round)

    def _priority(self, peer: str) -> tuple[float, bytes]:
        """``views.priority`` of ``peer``, computed once per round (every view in and out sorts the
        candidates by it; the ledger it reads changes between rounds, not within one)."""
        known = self._priorities.get(peer)
        if known is None:
            if len(self._priorities) >= MAX_MEMO:
                self._priorities.clear()
            known = self._priorities[peer] = self._order(peer)
        return known

    def _newcomer(self, peer: str) -> bool:
        known = self._newcomers.get(peer)
        if known is None:
            if len(self._newcomers) >= MAX_MEMO:
                self._newcomers.clear()
            known = self._newcomers[peer] = self.ctx.trust.on_probation(peer, self.view.round)
        return known

    def caps(self) -> Caps:
        return self._caps

    async def _observe(self, peers: frozenset[str]) -> None:
        """The network prefix of each peer as our own connections see it (never what it claims)."""
        if self.ctx.spec.max_per_prefix <= 0:
            return
        new = sorted(p for p in peers if p not in self._prefixes and p != self.ctx.me)
        if new:
            addrs = await self.ctx.link.observed_addrs(new)
            for peer in new:
                self._prefixes[peer] = cap_key(addrs.get(peer, []))  # (relayed: the relay's prefix, review N6)
        if self.ctx.me not in self._prefixes:  # ourselves: what we listen on or announce (None behind a NAT)
            try:
                self._prefixes[self.ctx.me] = first_prefix(await self.ctx.link.own_addrs())
            except Exception:
                self._prefixes[self.ctx.me] = None
