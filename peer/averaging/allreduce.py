"""One round's audited all-reduce for one group: reduce-scatter, all-gather, audit, agreement.

For a decided group ``order`` (n members) of round r, the vector is cut into n x P shards (pieces
of about the run's ``piece_values``; peer/averaging/session.py). Every member:

1. encodes its slice of every shard k and sends it to member k mod n (the reducer) and to member
   k + 1 mod n (the auditor of shard k, when the run audits), in shard order; a slow member sends
   its signed slice to the reducer only and its digest to the auditor, and the reducer relays the
   slice to the auditor (peer/averaging/session.py): a slow uplink carries the vector once;
2. as reducer, as soon as all parts of one of its shards are in, validates and combines them
   (peer/averaging/reduce.py) and sends the re-encoded result, with the digests of the parts it
   used, signed, to every member, while the later shards still stream;
3. as auditor, recomputes each shard it audits from its own copies of the parts as soon as they
   are in, and sends its signed verdict, with the hash of the result it checked, to every member;
4. checks any "wrong aggregate" accusation itself on the auditor's evidence (peer/averaging/disputes.py);
5. applies each shard whose verdict is positive and whose result is the one the auditor checked; a
   shard its auditor rejects is void (those parameters and their momentum keep their values);
6. tells every member the digest of what it applied and the hash of the signed statements it holds
   (results and verdicts, per shard): a member whose digest disagrees with the majority of its group
   voids the round (and re-syncs at the next boundary). Members whose hashes differ ask each other
   for those statements: a reducer or auditor that signed two different statements is caught and
   banned. An honest round costs each member two hashes per member, not the statements of every
   shard (O(n x pieces)).

A member that fails anywhere raises RoundFailed at the deadline at the latest, like the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from hivetrain.dht import clock
from hivetrain.kernels.errors import CodecError
from hivetrain.peer.averaging.agreement import equivocators, held_statements
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.cross import (
    DESIGNEE_MARGIN,
    LONG_WAIT,
    VOID,
    Desk,
    fallen_back,
    proof_nbytes,
    proven,
    proves,
    round_id,
    sub_message,
    vouch,
)
from hivetrain.peer.averaging.delivery import RETRY_PAUSE, Outbox, deliver, send_all
from hivetrain.peer.averaging.disputes import settle_accusations
from hivetrain.peer.averaging.reduce import (
    Finding,
    FindingKind,
    Shard,
    ShardInputs,
    audit_shard,
    digest,
    part_digests,
    probation_claims,
    reduce_shard,
)
from hivetrain.peer.averaging.session import RoundSession, Verdict
from hivetrain.peer.averaging.statements import (
    STATEMENT_LEN,
    Statement,
    applied_digest,
    commitment,
    pack_all,
    sign_part,
    sign_result,
    sign_verdict,
    unpack_all,
)
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.link import request
from hivetrain.peer.net.wire import MAX_GROUP, Code, reason

logger = logging.getLogger(__name__)
LOST_SETTLE = 3.0  # seconds our other deliveries get, once the round failed, to show who is still with us
STATEMENTS_SHARE = 0.25  # of the deadline, for fetching the statements of a member that applied something else
AUDIT_GRACE = 0.25  # share of the deadline an auditor keeps to send its verdict when parts are missing
FINDING_CODES = {FindingKind.WRONG_AGGREGATE: 1, FindingKind.UNVERIFIABLE: 2}  # verdict.finding on the wire


@dataclass
class Outcome:
    averaged: torch.Tensor  # (numel,) fp32
    applied: str  # applied_digest of what we apply
    excluded: dict[str, str] = field(default_factory=dict)  # member -> why it was left out or caught
    void_ranges: list[tuple[int, int]] = field(default_factory=list)


class AllReduceRunner:
    """Runs the all-reduce of one ``RoundSession`` (on the link's loop)."""

    def __init__(self, ctx: PeerContext, session: RoundSession, desk: Desk | None = None):
        self.ctx, self.session = ctx, session
        self.desk = desk  # our designee's desk of this round: the plan, and the means we compute (cross.py)
        self.fallbacks = 0  # sub-pieces of ours no designee took: our group applies its own values there
        self.fetched = 0  # means we asked for (our reducer's forward had not come: ``_fetch``)
        self.excluded: dict[str, str] = {}  # member -> why, as reported in the round's metrics
        self.claims: list[str] = []  # the members we put on probation this round
        self._vouches: dict[int, bytes] = {}  # shard -> our group's ``vouch`` of it (the same for every sub-piece)
        self._relayed: set[tuple[str, int]] = set()  # (slow member, shard) whose relay we put (bounded: group x shards)
        self.outbox = Outbox(ctx, session.round, session.deadline)  # our messages of the round, per member in order

    async def run(self, delta: torch.Tensor) -> Outcome:
        s, ctx = self.session, self.ctx
        try:
            outcome = await self._run(delta)
        except RoundFailed as e:
            s.ended = str(e) or "void"  # (a member asking us for a mean we never passed on asks its designees)
            self._note_refused()
            ctx.rates.observe(self.outbox.meter)
            if ctx.ef is not None:
                ctx.ef.discard()
            self._punish()
            # The others of the group void this round at the deadline at the latest; leaving earlier
            # would put us alone into the next round's matchmaking. Void together, start together;
            # unless no other member is with us: each refused our parts (it decided another group) or
            # could not be reached. Then they are on their way already, and we follow at once.
            others = set(s.order) - {ctx.me}
            if not others or not others <= set(self.outbox.lost):
                await asyncio.sleep(max(0.0, s.deadline - clock.now()))
            raise RoundFailed(str(e), {**self.excluded, **e.excluded}) from None
        if ctx.ef is not None:
            ctx.ef.commit()
        self._punish()
        ctx.rates.observe(self.outbox.meter)
        return outcome

    def _note_refused(self) -> None:
        """Names in the round's metrics the designees whose means we refused (session._far)."""
        for (k, j), signer in sorted(self.session.refused.items()):
            self.excluded.setdefault(signer, f"its mean of sub-piece ({k}, {j}) lay too far from our values: refused")

    def _punish(self) -> None:
        for peer, why in self.session.culprits.items():
            self._convict(peer, why)

    def _convict(self, peer: str, why: str, first: bool = True) -> None:
        """Bans ``peer`` and names it in the round's metrics (``first``: keep an earlier, more specific reason)."""
        self.ctx.bans.ban(peer, f"round {self.session.round}: {why}")
        if first:
            self.excluded.setdefault(peer, why)
        else:
            self.excluded[peer] = why

    async def _run(self, delta: torch.Tensor) -> Outcome:
        s, ctx = self.session, self.ctx
        r = s.round
        s.own = delta  # (what the designees' means are checked against: session.deposit_cross)
        parts = await asyncio.to_thread(self._encode, delta)
        parts = ctx.behaviour.parts(r, parts, delta, s.bounds, ctx.codec)
        for k in (*s.mine, *s.audited):
            s.shards[k].parts[ctx.me] = parts[k]
        self.claims = self._claims()
        ctx.behaviour.at("before_parts", r)
        relayed = ctx.me in s.relayed  # our audit copies go through the reducers: we send a pledge instead
        signed = relayed or s.cross_on  # (cross stage: our signature is our word that we are in the group)
        for k in range(s.units):  # in shard order: every member sends its part of shard 0 first, then 1, ...
            header = self._part_header(k, parts[k], signed)
            if signed and ctx.me in s.shards[k].parts:  # our own word in our group's vouch (_vouch_of)
                s.shards[k].sigs[ctx.me] = bytes.fromhex(header["sig"])
            for peer, auditor in ((s.reducer(k), False), (s.auditor(k), True)):
                if peer is not None and peer != ctx.me:
                    part = ctx.behaviour.part_for(r, k, peer, auditor, parts[k])
                    if auditor and relayed:
                        self.outbox.put(peer, self._header("pledge", k, digest=digest(part)), b"", strict=True)
                        continue
                    sent = header if part is parts[k] else self._part_header(k, part, signed)
                    self.outbox.put(peer, sent, part, strict=True)
        try:
            await self._pipeline()
        except RoundFailed:
            # a moment for our other deliveries to end too, so that ``run`` knows who is still with us
            # (a member lost once is not sent more: this is bounded by one answer or dial per member)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.outbox.flush(), max(0.0, min(LOST_SETTLE, s.deadline - clock.now())))
            self.outbox.stop()
            raise
        except BaseException:
            self.outbox.stop()
            raise
        for peer, why in s.proven_twins().items():
            if peer != ctx.me:
                self._convict(peer, why)
        averaged, applied, voids, conflict = self._gather_cross() if s.cross_on else self._gather()
        self._note_refused()
        if s.audit:
            for peer, why in (await settle_accusations(ctx, s)).items():
                self._convict(peer, why, first=False)  # the settled verdict replaces the accusation
        # with the cross-group stage every group of the round applies the same means: the same digest
        digest_hex = applied_digest(round_id(ctx.run, s.round, s.base) if s.cross_on else s.group, applied)
        await self._agree(digest_hex)
        if conflict:
            raise RoundFailed(conflict)
        return Outcome(averaged, digest_hex, self.excluded, voids)

    async def _pipeline(self) -> None:
        """Reduces our shards and audits our audited ones, each as soon as its parts are in, while
        the rest still streams; then waits for every result and verdict and for our sends."""
        s = self.session
        work = [self._parts_delivered(), self._reduce_all(), self._audit_all(), self._relay_all()]
        await first_failure(*work, *([self._cross()] if s.cross_on else []))
        await s.wait_for(lambda: all(sh.result is not None for sh in s.shards), s.deadline, "results of every shard")
        if s.audit:
            await s.wait_for(lambda: all(sh.verdict is not None for sh in s.shards), s.deadline,
                             "audit verdicts of every shard")
        if s.cross_on:
            await self._means_in()
            await self._forwarded_proven()
        await self.outbox.flush()

    # ---- the cross-group stage (peer/averaging/cross.py) -------------------------------------------

    async def _cross(self) -> None:
        """Derives the round's designees; sends our group's sub-pieces of each shard we reduce to
        their designees (and vouches for those we attest), and forwards the means they send back to
        our members."""
        s = self.session
        assert self.desk is not None
        try:
            s.plan = await asyncio.wait_for(self.desk.get_plan(), max(0.0, s.deadline - clock.now()))
            s.local = self.desk.mine
        except TimeoutError:
            raise RoundFailed("the round's designees could not be read from the board") from None
        s.arrived.set()
        self.ctx.behaviour.at("before_cross", s.round)
        vouched = [k for k in range(s.units) if s.attester(k) == self.ctx.me]
        await asyncio.gather(*(self._cross_shard(k) for k in s.mine), *(self._vouch(k) for k in vouched))

    def _cross_header(self, k: int, j: int, weight: int, enc: int, body: bytes, attest: bool, ok: bool) -> dict[str, Any]:
        result = hashlib.sha256(body).hexdigest() if body else VOID
        assert self.desk is not None
        s, blob = self.session, b"" if attest else self._vouch_of(k)
        sig = self.ctx.identity.sign(sub_message(self.ctx.run, s.round, s.base, s.group, k, j, s.order, weight, result,
                                                 enc, blob, attest, ok))
        return self._header("cross", k, sub=j, members=list(s.order), weight=weight, result=result,
                            enc=enc, attest=attest, ok=ok, tier=0, bucket=self.desk.bucket, groups=1,
                            vouch=blob, witness="", sig=sig.hex())

    def _vouch_of(self, k: int) -> bytes:
        """The members' words that they are in our group (their signed parts of shard ``k``, ours
        included), for the designees: they count nobody else (cross.vouched)."""
        s = self.session
        if k not in self._vouches:
            shard = s.shards[k]
            words = {m: (digest(shard.parts[m]), shard.sigs[m]) for m in s.order if m in shard.sigs and m in shard.parts}
            self._vouches[k] = vouch(s.order, words)
        return self._vouches[k]

    async def _cross_shard(self, k: int) -> None:
        s, ctx = self.session, self.ctx
        plan = s.plan
        assert plan is not None
        shard = s.shards[k]
        await s.wait_for(lambda: shard.result is not None and (not s.audit or shard.verdict is not None),
                         s.deadline, f"the audit of shard {k}")
        weight, enc, bodies = await asyncio.to_thread(s.sub_pieces, k)
        await asyncio.gather(*(self._sub_piece(k, j, weight, enc, body) for j, body in enumerate(bodies)))
        await s.wait_for(lambda: all((k, j) in s.cross for j in range(plan.subs)), s.deadline,
                         f"the cross-group means of shard {k}")
        for j in range(plan.subs):
            header, body = s.cross[(k, j)]
            # the mean of one group, ours, is our result's own bytes: the members have them already
            own = plan.subs == 1 and header["result"] == shard.result_hash and body == shard.result
            for peer in s.order:
                if peer != ctx.me:
                    self.outbox.put(peer, dict(header, group=s.group), b"" if own else body, strict=False)
        s.passed.add(k)  # (a member that lost our forward asks us for it: averager ``cross_mean_req``)

    async def _sub_piece(self, k: int, j: int, weight: int, enc: int, body: bytes) -> None:
        """Our group's sub-piece (k, j) to its first designee that takes it; if the mean does not
        come back in time (the designee died with it), to the next one; if none takes it, our
        group applies its own values there (loudly: the run may fork there)."""
        s, ctx = self.session, self.ctx
        assert s.plan is not None
        header = self._cross_header(k, j, weight, enc, body, False, True)
        skip: set[str] = set()  # designees that did not take it
        failed: set[tuple[str, str]] = set()  # pairs that took it and sent no mean we could apply
        # (as long as a designee may wait; with buckets, its bucket's mean waits again at the top)
        tiers = 2 if self.desk is not None and self.desk.level > 0 else 1
        patience = tiers * (LONG_WAIT * ctx.spec.allreduce_timeout + DESIGNEE_MARGIN)
        try:
            while True:
                taker, witness = await self._to_pair(k, j, header, body, skip, failed)
                s.refused.pop((k, j), None)
                try:
                    await s.wait_for(lambda: (k, j) in s.cross or (k, j) in s.refused,
                                     min(s.deadline, clock.now() + patience), f"the mean of sub-piece ({k}, {j})")
                except RoundFailed:
                    if clock.now() >= s.deadline or taker == ctx.me:
                        raise
                    logger.warning("round %d: designee %s took sub-piece (%d, %d) and sent no mean in %.0f s; "
                                   "asking the next", s.round, taker, k, j, patience)
                    self._failed(taker, witness, skip, failed)
                    continue
                if (k, j) in s.cross:
                    mean, _ = s.cross[(k, j)]
                    why = await self._unproven(k, j)
                    if not why:
                        return
                    # (a designee and its witness that collude sign any mean: the groups' own values refute it)
                    s.cross.pop((k, j), None)
                    s.disproven.add((k, j, mean["result"]))
                    s.spent.setdefault((k, j), set()).update({mean["signer"], mean["witness"]} - {""})
                    logger.warning("round %d: the mean of sub-piece (%d, %d) signed by %s and %s is not its groups' "
                                   "mean (%s); asking the next pair", s.round, k, j, mean["signer"],
                                   mean["witness"], why)
                    self._failed(mean["signer"], mean["witness"], skip, failed)
                    continue
                # its mean lies further from our values than honest groups' can (session._far): the next
                logger.warning("round %d: refused the mean of sub-piece (%d, %d) that %s took, or its witness did not "
                               "countersign it; asking the next", s.round, k, j, taker)
                self._failed(taker, witness, skip, failed)
        except RoundFailed as e:
            if (k, j) in s.cross:
                return
            if any(key[:2] == (k, j) for key in s.disproven):
                # a pair signed a mean its groups' values refute, and no other pair took ours: our group's own
                # values would be applied unchecked by any other group (a group without an honest majority's,
                # search seed 6,000,028), so the round is void for us instead
                raise RoundFailed(reason(f"a mean of sub-piece ({k}, {j}) was refuted by its proof and no other "
                                         f"pair averaged it: {e}")) from None
            logger.warning("round %d: %s; our group applies its own result for it (the run may fork there)", s.round, e)
            self.fallbacks += 1
            own_header, own = fallen_back(ctx, s.round, s.base, k, j, body, weight, enc)
            s.deposit_cross(ctx.me, dict(own_header, group=s.group), own)

    async def _means_in(self) -> None:
        """Waits for the means of every sub-piece. Those that our reducers of their shards have not
        passed on DESIGNEE_MARGIN after the last one came (or within a designee's whole wait, when none
        came) we ask for ourselves (``_fetch``), again after each such wait: a reducer that died once our
        group's values were up forwards nothing (search seed 5,000,110 waited 28 s for its deadline,
        then re-synced the state the other group had written with our values)."""
        s, ctx = self.session, self.ctx

        def every() -> bool:
            return s.plan is not None and len(s.cross) == s.units * s.plan.subs

        patience = LONG_WAIT * ctx.spec.allreduce_timeout + DESIGNEE_MARGIN
        begun, fetched = clock.now(), -math.inf
        while True:
            due = s.cross_at + DESIGNEE_MARGIN if s.cross_at else begun + patience
            try:
                await s.wait_for(every, min(s.deadline, max(due, fetched + patience)), "cross-group means of every shard")
                return
            except RoundFailed:
                if s.void or s.deadline - clock.now() <= clock.EPSILON or s.plan is None:
                    raise
            if s.cross_at and s.cross_at + DESIGNEE_MARGIN > clock.now() + clock.EPSILON:
                continue  # (a mean came meanwhile: the others may still come)
            plan, fetched = s.plan, clock.now()
            missing: dict[str, list[tuple[int, int]]] = {}  # per reducer: one request at a time to each
            for k in range(s.units):
                if k not in s.mine:
                    missing.setdefault(s.reducer(k) or "", []).extend((k, j) for j in range(plan.subs)
                                                                        if (k, j) not in s.cross)
            await asyncio.gather(*(self._fetch_all(subs) for subs in missing.values()))

    async def _fetch_all(self, subs: list[tuple[int, int]]) -> None:
        """``_fetch`` for the missing sub-pieces of one reducer's shards, one after the other; none
        more once the reducer says BUSY (it is in the round, still at work: its forwards will come).
        (All at once, a member with 60 missing sub-pieces opened 60 streams to each; with that, the
        round's countersignatures lost their connections in tests/integration/test_overlap.py twice in
        CI: the likely cause.)"""
        for k, j in subs:
            if await self._fetch(k, j) == Code.BUSY:
                return

    async def _fetch(self, k: int, j: int) -> Code | None:
        """Asks our reducer of shard ``k`` for the mean of sub-piece (k, j) it passed on (a forward
        lost on the way), and, if it no longer holds the round (it died, or its round failed) the
        sub-piece's designees, in rank order, for the mean they sent it (cross.py ``hand``). The first
        that comes is checked as if our reducer had forwarded it (``session.deposit_cross``; its proof
        too: ``_forwarded_proven``). A reducer still in the round that has not passed it on yet (it
        checks it, or asks the next pair) answers BUSY: we wait for it, and never take a mean it
        refused from its designee."""
        s, ctx = self.session, self.ctx
        assert self.desk is not None
        plan = self.desk.mine or s.plan
        assert plan is not None and s.plan is not None
        code = await self._take_mean(s.reducer(k), k, j)
        if code in (Code.OK, Code.BUSY):
            return code
        for designee in plan.ranked(k, j):
            if designee in (ctx.me, s.reducer(k)) or (k, j) in s.cross:
                continue
            if await self._take_mean(designee, k, j) == Code.OK:
                logger.info("round %d: took the mean of sub-piece (%d, %d) from its designee %s: our reducer %s "
                            "did not pass it on", s.round, k, j, designee, s.reducer(k))
                return Code.OK
        return code

    async def _take_mean(self, peer: str | None, k: int, j: int) -> Code | None:
        """One ``cross_mean_req`` to ``peer``: the code of its answer (OK: its mean is ours now), or
        None if it gave none we could use."""
        s, ctx = self.session, self.ctx
        if peer is None or peer == ctx.me:
            return None
        most = max(s.cross_nbytes(k, j, n) for n in range(1, MAX_GROUP + 1))
        try:
            wait = min((s.deadline - clock.now()) / 4, LONG_WAIT * ctx.spec.allreduce_timeout)
            reply, body = await request(ctx.link, peer, ctx.protocol, self._header("cross_mean_req", k, sub=j), b"",
                                        max(0.1, wait), max_reply_body=most, traffic=ctx.traffic)
        except Exception as e:  # (unreachable, too slow, or a malformed reply)
            logger.info("round %d: %s sent no mean of sub-piece (%d, %d): %r", s.round, peer, k, j, e)
            return None
        if reply.get("type") != "cross_out" or (reply["shard"], reply["sub"], reply["group"]) != (k, j, s.group):
            logger.info("round %d: %s sent no mean of sub-piece (%d, %d): %s %s", s.round, peer, k, j,
                        reply.get("code"), reply.get("reason", ""))
            with contextlib.suppress(ValueError):
                return Code(int(reply.get("code", -1))) if reply.get("type") == "ack" else None
            return None
        if len(body) != (0 if reply["result"] == VOID else s.cross_nbytes(k, j, reply["enc"])):  # (VOID: no values)
            logger.info("round %d: %s sent a mean of sub-piece (%d, %d) of %d bytes", s.round, peer, k, j, len(body))
            return None
        code, why = s.deposit_cross(peer, reply, body)
        if code != Code.OK:
            logger.info("round %d: refused the mean of sub-piece (%d, %d) from %s: %s", s.round, k, j, peer, why)
            return None
        self.fetched += 1
        return Code.OK

    async def _forwarded_proven(self) -> None:
        """Checks, as a member, the means that our reducer of their shard forwarded and also signed, as
        designee or witness: its own check of them (``_unproven``) is worth nothing to us. An attacker
        that reduces a shard of its group and is drawn as designee of one of its sub-pieces, with a
        second attacker as witness, sent its members the mean reversed (search seed 6,000,028, 1.75 x
        the honest deviation). A mean its proof refutes voids our round."""
        s = self.session
        for (k, j), (header, _) in sorted(s.cross.items()):
            forwarder = s.cross_from.get((k, j), "")
            if k in s.mine or forwarder == self.ctx.me or forwarder not in (header["signer"], header["witness"]):
                continue
            why = await self._unproven(k, j, member=True)
            if why:
                raise RoundFailed(reason(f"our reducer {forwarder} of shard {k} passed on a mean of sub-piece "
                                         f"({k}, {j}) that it signed and its proof refutes: {why}"))

    async def _unproven(self, k: int, j: int, member: bool = False) -> str:
        """Why the mean of our sub-piece (k, j) that came back is not the mean of the groups its
        designee held ("" if it is, or if the round is too large to check: cross.py ``proves``). We
        ask the designee that signed it for its proof and recompute the mean (``proven``): a check by
        every reducer of the sub-piece, not by one witness that could collude with it. ``member``: we
        check a mean our reducer forwarded, so what our group sent is our reducer's to know (our
        verdict on the shard may differ from its: an equivocating auditor), and the proof need only
        name our group."""
        s, ctx = self.session, self.ctx
        header, body = s.cross[(k, j)]
        plan = s.plan
        assert plan is not None
        signer = header["signer"]
        if ctx.me in (signer, header["witness"]) or header["result"] == VOID or signer not in plan.ranked(k, j) or \
                not plan.needs_witness(k, j) or not proves(plan, ctx.spec.target_group_size):
            return ""  # (a mean we signed we computed, or recomputed as its witness)
        _, _, bodies = s.sub_pieces(k)
        own = (s.group, hashlib.sha256(bodies[j]).hexdigest() if bodies[j] else VOID)
        if header["result"] == own[1]:  # our group's own values: nobody else's to check (one group in the round)
            return ""
        start, end = s.bounds[k]
        a, b = plan.sub_bounds(start, end)[j]
        ask = ctx.header("cross_proof_req", s.round, s.base, shard=k, sub=j, result=header["result"])
        whys = []
        for who in (signer, header["witness"]):  # (its witness holds the same groups: the designee may have died)
            try:
                # (half of what is left, so that the witness can still be asked when the designee died with the stream)
                wait = min((s.deadline - clock.now()) / 2, LONG_WAIT * ctx.spec.allreduce_timeout)
                reply, proof = await request(ctx.link, who, ctx.protocol, ask, b"", max(0.1, wait),
                                             max_reply_body=proof_nbytes(ctx.codec, b - a), traffic=ctx.traffic)
            except Exception as e:  # (unreachable, too slow, or a malformed reply)
                whys.append(f"{who}: {e!r}")
                continue
            if reply.get("type") == "cross_proof" and reply.get("code") == Code.OK and \
                    (reply.get("shard"), reply.get("sub")) == (k, j):
                break
            whys.append(f"{who}: {reply.get('code')} {reply.get('reason', '')}")
        else:
            return f"neither its designee nor its witness sent its proof ({'; '.join(whys)})"
        return await asyncio.to_thread(proven, ctx.run, s.round, s.base, k, j, header, body, proof, ctx.codec,
                                       ctx.spec.aggregation, b - a, (s.group, "") if member else own)

    async def _vouch(self, k: int) -> None:
        """Tells shard ``k``'s designees that its reducer's sub-pieces are what our group approved
        (or not): without another member's word a designee leaves a group's values out."""
        s = self.session
        shard = s.shards[k]
        await s.wait_for(lambda: shard.result is not None and (not s.audit or shard.verdict is not None),
                         s.deadline, f"the result of shard {k}")
        weight, enc, bodies = await asyncio.to_thread(s.sub_pieces, k)
        ok = weight > 0
        await asyncio.gather(*(self._vouch_one(k, j, self._cross_header(k, j, weight, enc, body, True, ok))
                               for j, body in enumerate(bodies)))

    async def _vouch_one(self, k: int, j: int, header: dict[str, Any]) -> None:
        """Our word on sub-piece (k, j), to every designee of it at once, until each took it or the
        mean is here. The reducer gives the sub-piece to the first designee that takes it, and we
        cannot know which: a word sent to the first designee that took *it* went astray whenever
        the two differ (a silent designee held our word until the deadline while the reducer's
        sub-piece, refused there at once, went on to the next; that designee then left our group
        out for want of a word, and a made-up group's values were its sub-piece's mean: search seed
        3,000,690). A designee that has not received the sub-piece yet holds our word for it
        (cross.py ``MAX_EARLY_WORDS``; past that bound it answers NOT_READY and is asked again).
        Once the mean is here the words are moot: the designee computed it."""
        s = self.session
        if (k, j) in s.cross:
            return
        assert self.desk is not None and self.desk.mine is not None
        words = [asyncio.ensure_future(self._offer(d, k, j, header, b"")) for d in self.desk.mine.ranked(k, j)]
        mean = asyncio.ensure_future(s.wait_for(lambda: (k, j) in s.cross, s.deadline,
                                                f"the mean of sub-piece ({k}, {j})"))
        try:
            pending: set[asyncio.Future[Any]] = {*words, mean}
            while mean in pending and pending - {mean}:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*words, mean):
                task.cancel()
            await asyncio.gather(*words, mean, return_exceptions=True)
        for word in words:
            error = word.exception() if word.done() and not word.cancelled() else None
            if isinstance(error, RoundFailed):  # its reducer's sub-piece may never have reached them: the means say
                logger.info("round %d: vouching for sub-piece (%d, %d): %s", s.round, k, j, error)
            elif error is not None:
                raise error

    @staticmethod
    def _failed(taker: str, witness: str, skip: set[str], failed: set[tuple[str, str]]) -> None:
        """A designee (and its witness) that took a sub-piece and sent no mean we could apply: which of
        the two failed us we cannot tell, so the pair is not asked again (a designee alone: it is not)."""
        if witness:
            failed.add((taker, witness))
        else:
            skip.add(taker)

    async def _to_pair(self, k: int, j: int, header: dict[str, Any], body: bytes, skip: set[str],
                       failed: set[tuple[str, str]]) -> tuple[str, str]:
        """Sends one sub-piece to a pair of its designees: the designee, which averages it, and its
        witness, which checks that mean (cross.py ``check``); both are told which is the witness.
        The pair is the first in ranked order, (1, 2), (1, 3), (2, 3), (1, 4) ..., of designees that
        did not refuse it (``skip``) and that did not fail us before (``failed``), whose designee
        holds no mean of it that we refused (``spent``: it signed or countersigned it, and would hand
        it to us again as to a late group). Returns (designee, witness). A designee that does not
        take it is added to ``skip``, and the next pair is asked. (One designee: to it alone, unchecked.)"""
        assert self.desk is not None and self.desk.mine is not None
        plan = self.desk.mine
        if not plan.needs_witness(k, j):
            return await self._to_designee(k, j, header, body, skip), ""
        why = "every designee was tried"
        ranked = plan.ranked(k, j)
        spent = self.session.spent.get((k, j), set())
        while True:
            pairs = [(a, b) for bi, b in enumerate(ranked) for a in ranked[:bi]
                     if a not in skip and b not in skip and (a, b) not in failed and a not in spent]
            if not pairs:
                raise RoundFailed(reason(f"no two designees took sub-piece ({k}, {j}): {why}"))
            pair = pairs[0]
            told = dict(header, witness=pair[1])
            got = await asyncio.gather(*(self._offer(d, k, j, told, body) for d in pair), return_exceptions=True)
            for d, outcome in zip(pair, got, strict=True):
                if isinstance(outcome, RoundFailed):
                    why = str(outcome)
                    logger.info("round %d: designee %s of sub-piece (%d, %d) did not take it: %s", self.session.round,
                                d, k, j, why)
                    skip.add(d)
                elif isinstance(outcome, BaseException):
                    raise outcome
            if not any(isinstance(outcome, BaseException) for outcome in got):
                return pair

    async def _to_designee(self, k: int, j: int, header: dict[str, Any], body: bytes,
                           skip: set[str] | frozenset[str] = frozenset()) -> str:
        """Sends one sub-piece to the first of its designees that takes it; returns which did."""
        why = "every designee was tried"
        assert self.desk is not None and self.desk.mine is not None
        for designee in self.desk.mine.ranked(k, j):  # (our bucket's designees: the top's sign the means)
            if designee in skip:
                continue
            try:
                await self._offer(designee, k, j, header, body)
                return designee
            except RoundFailed as e:
                why = str(e)
                logger.info("round %d: designee %s of sub-piece (%d, %d) did not take it: %s", self.session.round,
                            designee, k, j, why)
        raise RoundFailed(reason(f"no designee took sub-piece ({k}, {j}): {why}"))

    async def _offer(self, designee: str, k: int, j: int, header: dict[str, Any], body: bytes) -> None:
        """One sub-piece (or our word on it) to one designee; RoundFailed if it does not take it."""
        s, ctx = self.session, self.ctx
        assert self.desk is not None
        if designee != ctx.me:
            await deliver(ctx, s.deadline, designee, header, body)
            return
        pause = RETRY_PAUSE[0]
        while True:  # as ``deliver`` does: a designee not ready yet (its sub-piece to come) is asked again
            code, why = await self.desk.accept(ctx.me, header, body)
            if code in (Code.OK, Code.DUPLICATE):
                return
            if code not in (Code.NOT_READY, Code.BUSY) or clock.now() + pause >= s.deadline:
                raise RoundFailed(reason(f"we did not take sub-piece ({k}, {j}): {Code(code).name} {why}"))
            await asyncio.sleep(pause)
            pause = min(RETRY_PAUSE[1], 2 * pause)

    async def _parts_delivered(self) -> None:
        """Ends when our parts are delivered; fails the round as soon as one of them cannot be."""
        await self.outbox.strict_done.wait()
        if self.outbox.error is not None:
            raise self.outbox.error
        self.ctx.behaviour.at("after_parts", self.session.round)

    # ---- steps ----------------------------------------------------------------------------------

    def _encode(self, delta: torch.Tensor) -> list[bytes]:
        """Our slice for every shard (with error feedback if the run uses it); worker thread."""
        ef, codec, bounds = self.ctx.ef, self.ctx.codec, self.session.bounds
        source = ef.compensate(delta) if ef is not None else delta  # (numel,) fp32
        parts = [codec.encode(source[a:b].contiguous()) for a, b in bounds]
        if ef is not None:
            ef.sent(source, torch.cat([codec.decode(p, b - a) for p, (a, b) in zip(parts, bounds, strict=True)]))
        return parts

    def _inputs(self, k: int) -> ShardInputs:
        s = self.session
        shard = s.shards[k]
        start, end = s.bounds[k]
        return ShardInputs(dict(shard.parts), dict(shard.invalid), s.order, end - start, self.ctx.codec,
                           self.ctx.spec.aggregation)

    async def _reduce_all(self) -> None:
        s, ctx = self.session, self.ctx
        for i, k in enumerate(s.mine):
            await s.wait_for(lambda k=k: s.has_parts(k), s.deadline, f"parts of shard {k}")  # type: ignore[misc]
            out = await asyncio.to_thread(reduce_shard, self._inputs(k), self.claims)
            for peer, why in out.excluded.items():  # invalid parts and outliers, seen by us: never grouped again
                self._convict(peer, why, first=False)
            shard = s.shards[k]
            shard.result, shard.result_hash = out.result, hashlib.sha256(out.result).hexdigest()
            shard.commits, shard.claims, shard.excluded = out.digests, out.probation, sorted(out.excluded)
            shard.result_sigs = [shard.sigs[p].hex() if p in shard.sigs and shard.commits[i] else ""
                                 for i, p in enumerate(s.order)]
            commit = commitment(shard.commits, shard.claims, shard.excluded)
            shard.result_sig = sign_result(ctx.identity, s.where(k), bytes.fromhex(shard.result_hash), commit)
            s.arrived.set()
            if i == 0:
                ctx.behaviour.at("before_results", s.round)
            for m in s.order:  # a slow member's relay goes out before the result its auditor checks (not after
                if m in s.relayed and (m in shard.parts or m in shard.invalid):  # our other shards' relays)
                    self._relay_one(m, k)
            self._send_result(k)

    def _send_result(self, k: int) -> None:
        s, ctx = self.session, self.ctx
        shard = s.shards[k]
        assert shard.result is not None
        start, end = s.bounds[k]
        commit = commitment(shard.commits, shard.claims, shard.excluded)
        for peer in s.order:
            if peer == ctx.me:
                continue
            body = ctx.behaviour.result_for(s.round, k, peer, shard.result, end - start, s.result_codec)
            result_hash = hashlib.sha256(body).digest()
            sig = shard.result_sig if body == shard.result else sign_result(ctx.identity, s.where(k), result_hash,
                                                                            commit)
            self.outbox.put(peer, self._header("result", k, result=result_hash.hex(), parts=shard.commits,
                                               probation=shard.claims, excluded=shard.excluded, sig=sig.hex(),
                                               sigs=[bytes.fromhex(x) for x in shard.result_sigs]), body, strict=False)

    def _claims(self) -> list[str]:
        s, ctx = self.session, self.ctx
        newcomers = {p for p in s.order if p != ctx.me and ctx.trust.on_probation(p, s.round)}
        return probation_claims(s.order, newcomers)

    def _part_header(self, k: int, part: bytes, signed: bool) -> dict[str, Any]:
        d = digest(part)
        sig = sign_part(self.ctx.identity, self.session.where(k), d).hex() if signed else ""
        return self._header("part", k, digest=d, sig=sig)

    async def _relay_all(self) -> None:
        """As reducer: each slow member's part of our shards, as it arrives, to the shard's auditor
        with the member's signature (or our refusal of it)."""
        s = self.session
        await asyncio.gather(*(self._relay(m) for m in s.order if m in s.relayed))

    async def _relay(self, member: str) -> None:
        s = self.session
        for k in s.mine:
            shard = s.shards[k]
            await s.wait_for(lambda: member in shard.parts or member in shard.invalid,  # noqa: B023 (awaited here)
                             s.deadline, f"the part of {member} of shard {k}")
            self._relay_one(member, k)

    def _relay_one(self, member: str, k: int) -> None:
        """Puts ``member``'s part of our shard ``k`` (or our refusal of it) for the shard's auditor, once."""
        s, ctx = self.session, self.ctx
        shard, auditor = s.shards[k], s.auditor(k)
        if (member, k) in self._relayed or auditor is None or auditor == member:
            return
        self._relayed.add((member, k))
        held = shard.parts.get(member)
        part = None if held is None else ctx.behaviour.relay_for(s.round, k, member, held)
        if held is None or part is None:
            header = self._header("relay", k, member=member, digest="", sig="")
        else:
            header = self._header("relay", k, member=member, digest=digest(held), sig=shard.sigs[member].hex())
        self.outbox.put(auditor, header, part or b"", strict=False)

    async def _audit_all(self) -> None:
        for k in self.session.audited:
            await self._audit(k)

    async def _audit(self, k: int) -> None:
        """Checks shard ``k`` of ``reducer(k)`` and tells every member the verdict. Our recompute
        starts as soon as our copies of its parts are in, before its result arrives, with the
        probation we would claim ourselves (the reducer's claims are its own; they almost always agree)."""
        s, ctx = self.session, self.ctx
        shard = s.shards[k]
        grace = AUDIT_GRACE * ctx.spec.allreduce_timeout
        try:  # a member may withhold our copy: then the shard is unverifiable, not the round lost
            await s.wait_for(lambda: s.has_parts(k), s.deadline - grace, f"audit copies of shard {k}")
        except RoundFailed:
            pass
        missing = [p for p in s.order if p not in shard.parts and p not in shard.invalid]
        contested = s.contested(k)
        inputs = self._inputs(k)
        digests = part_digests(inputs.received, inputs.invalid, inputs.order)
        ahead: Shard | None = None
        if not missing:
            try:
                ahead = await asyncio.to_thread(reduce_shard, inputs, self.claims, digests)
            except RoundFailed:  # no majority: the audit decides without a head start
                ahead = None
        await s.wait_for(lambda: shard.result is not None, s.deadline, f"result of shard {k}")
        assert shard.result is not None
        finding: Finding | None
        if missing:
            relayed = [p for p in missing if p in s.relayed]
            finding = Finding(FindingKind.UNVERIFIABLE, reason(
                f"no part from {', '.join(missing)} reached us" + (" (its reducer relays it)" if relayed else "")))
        elif contested:
            finding = Finding(FindingKind.UNVERIFIABLE, reason(
                f"{', '.join(contested)} pledged a part its reducer says it refused"))
        else:
            # the head start counts only if it reduced exactly what the audit checks: the same parts, the same claims
            same = list(shard.claims) == self.claims and list(shard.commits) == digests
            finding = await asyncio.to_thread(audit_shard, shard.result, shard.commits, inputs, shard.claims,
                                              ahead if same else None)
        finding = ctx.behaviour.finding(s.round, k, finding)
        twins = s.twins(k) if finding is not None and finding.kind is FindingKind.UNVERIFIABLE else []
        for i, _, _ in twins:  # the shard stays unverifiable; who made it so is proven, and every member checks it
            self._convict(s.order[i], f"signed two different parts of shard {k}: one for its reducer, another for us")
        if finding is not None:
            logger.warning("round %d: audit of shard %d (reducer %s): %s: %s", s.round, k, s.reducer(k),
                           finding.kind.value, finding.reason)
            if finding.kind is FindingKind.WRONG_AGGREGATE:
                ctx.bans.ban(s.reducer(k), f"round {s.round}: {finding.kind.value}: {finding.reason}")
                shard.evidence = [shard.parts.get(p, b"") for p in s.order]
        ok = finding is None
        why = "" if finding is None else reason(f"{finding.kind.value}: {finding.reason}")
        code = 0 if finding is None else FINDING_CODES[finding.kind]
        result_hash = bytes.fromhex(shard.result_hash)
        shard.verdict = Verdict(ok, shard.result_hash, code, why,
                                sign_verdict(ctx.identity, s.where(k), ok, result_hash), tuple(twins))
        s.arrived.set()
        for peer in s.order:
            if peer == ctx.me:
                continue
            said = ctx.behaviour.verdict_for(s.round, k, peer, ok)
            sig = shard.verdict.sig if said == ok else sign_verdict(ctx.identity, s.where(k), said, result_hash)
            self.outbox.put(peer, self._header("audit", k, ok=said, result=shard.result_hash, finding=code,
                                               reason=why, sig=sig.hex(), twins=[list(t) for t in twins]),
                            b"", strict=False)

    def _gather(self) -> tuple[torch.Tensor, list[bytes | None], list[tuple[int, int]], str]:
        """Decodes every shard's result into one vector, applying the verdicts (see the module doc).
        Returns (averaged, per-shard applied result hash or None, void ranges, conflict or "")."""
        s, codec = self.session, self.session.result_codec
        averaged = torch.empty(s.numel, dtype=torch.float32)  # (numel,) fp32
        applied: list[bytes | None] = []
        voids: list[tuple[int, int]] = []
        conflict = ""
        for k, (start, end) in enumerate(s.bounds):
            shard = s.shards[k]
            assert shard.result is not None
            verdict = shard.verdict
            if verdict is not None and not verdict.ok:
                averaged[start:end] = 0.0
                voids.append((start, end))
                applied.append(None)
                self.excluded.setdefault(s.reducer(k), reason(f"shard {k} void: its auditor {s.auditor(k)} found it "
                                                            f"{verdict.reason}"))
                continue
            if verdict is not None and verdict.result_hash != shard.result_hash:
                conflict = conflict or f"our result of shard {k} from {s.reducer(k)} is not the one its auditor checked"
            try:
                averaged[start:end] = codec.decode(shard.result, end - start)
            except CodecError as err:
                raise RoundFailed(f"the result of shard {k} from {s.reducer(k)} is malformed: {err}") from None
            applied.append(bytes.fromhex(shard.result_hash))
        if len(voids) == s.units:
            raise RoundFailed("every shard of the round failed its audit", dict(self.excluded))
        for k, shard in enumerate(s.shards):
            for p in shard.claims:
                self.excluded.setdefault(p, f"on probation (weight 0) in shard {k}")
            for p in shard.excluded:
                self.excluded.setdefault(p, f"left out of shard {k} by {s.reducer(k)}")
        return averaged, applied, voids, conflict

    def _gather_cross(self) -> tuple[torch.Tensor, list[bytes | None], list[tuple[int, int]], str]:
        """``_gather`` with the cross-group stage: every shard is the designees' means of its
        sub-pieces (our group's result went into them only if its audit approved it); a sub-piece
        no group contributed to is void."""
        s = self.session
        plan = s.plan
        assert plan is not None
        averaged = torch.empty(s.numel, dtype=torch.float32)  # (numel,) fp32
        applied: list[bytes | None] = []
        voids: list[tuple[int, int]] = []
        for k, (start, end) in enumerate(s.bounds):
            h = hashlib.sha256()
            for j, (a, b) in enumerate(plan.sub_bounds(start, end)):
                header, body = s.cross[(k, j)]
                h.update(bytes.fromhex(header["result"]))
                if header["result"] == VOID:
                    averaged[a:b] = 0.0
                    voids.append((a, b))
                    continue
                try:
                    averaged[a:b] = self.ctx.codec.for_results(header["enc"]).decode(body, b - a)
                except CodecError as err:
                    raise RoundFailed(f"the mean of sub-piece ({k}, {j}) is malformed: {err}") from None
            applied.append(h.digest())
            shard = s.shards[k]
            if shard.verdict is not None and not shard.verdict.ok:
                self.excluded.setdefault(s.reducer(k), reason(f"shard {k}: its auditor {s.auditor(k)} found it "
                                                            f"{shard.verdict.reason}; our group's part left out"))
            for p in shard.claims:
                self.excluded.setdefault(p, f"on probation (weight 0) in shard {k}")
            for p in shard.excluded:
                self.excluded.setdefault(p, f"left out of shard {k} by {s.reducer(k)}")
        if voids and sum(b - a for a, b in voids) == s.numel:
            raise RoundFailed("no group of the round had values for any shard", dict(self.excluded))
        return averaged, applied, voids, ""

    # ---- agreement after the round ------------------------------------------------------------

    async def _agree(self, mine: str) -> None:
        """Sends what we applied to every member, waits for a majority (or everyone, or the deadline),
        convicts equivocating signers, and fails the round if a majority applied something else."""
        s, ctx = self.session, self.ctx
        ours = held_statements(s)
        held = hashlib.sha256(pack_all(ours)).hexdigest()
        header = ctx.header("applied", s.round, s.base, group=s.group, digest=mine, held=held)
        voters = [p for p in s.order if p != ctx.me and s.reaches_us(p)]  # closed members cannot reach each other
        sends = asyncio.ensure_future(self._send_all([(p, header, b"") for p in voters], strict=False))
        n = 1 + len(voters)

        def settled() -> bool:
            agree = 1 + sum(d == mine for d in s.applied.values())
            return 2 * agree > n or len(s.applied) == n - 1

        try:
            await s.wait_for(settled, s.deadline, "applied reports")
        except RoundFailed:
            pass  # the deadline: decide on what arrived
        await sends
        differ = sorted(m for m, d in s.applied.items() if d != mine or s.held.get(m) != held)
        if differ:  # who signed two different things? their statements against ours
            fetched = await asyncio.gather(*(self._statements_of(m) for m in differ))
            for member, theirs in zip(differ, fetched, strict=True):
                for culprit, why in equivocators(s, member, ours, theirs or []):
                    self._convict(culprit, why)
        agree = 1 + sum(d == mine for d in s.applied.values())
        if 2 * agree <= n:  # a member not backed by a majority of its group (those it hears) applies nothing
            others = Counter(d for d in s.applied.values() if d != mine)
            raise RoundFailed(f"only {agree} of {n} members applied what we did ({sum(others.values())} reported "
                              "something else): void, and re-sync")

    async def _statements_of(self, member: str) -> list[Statement] | None:
        """The statements ``member`` holds (it applied something else than we did); None if it does
        not show them in time (nobody is convicted without them)."""
        s, ctx = self.session, self.ctx
        header = ctx.header("statements_req", s.round, s.base, group=s.group)
        timeout = max(1.0, STATEMENTS_SHARE * ctx.spec.allreduce_timeout)
        try:
            reply, body = await request(ctx.link, member, ctx.protocol, header, b"", timeout,
                                        max_reply_body=s.units * STATEMENT_LEN, traffic=ctx.traffic)
        except Exception as e:
            logger.info("round %d: %s did not show its statements: %r", s.round, member, e)
            return None
        if reply.get("type") != "statements" or not reply.get("ok"):
            return None
        try:
            theirs = unpack_all(body, s.units)
        except ValueError as e:
            self._convict(member, f"malformed statements: {e}")
            return None
        if len(s.statements) < s.n:
            s.statements[member] = theirs
        return theirs

    # ---- sending --------------------------------------------------------------------------------

    def _header(self, kind: str, shard: int, **fields: Any) -> dict[str, Any]:
        s = self.session
        return self.ctx.header(kind, s.round, s.base, group=s.group, shard=shard, **fields)

    async def _send_all(self, sends: list[tuple[str, dict[str, Any], bytes]], strict: bool) -> None:
        await send_all(self.ctx, self.session.round, self.session.deadline, sends, strict)


async def first_failure(*work: Coroutine[Any, Any, None]) -> None:
    """Runs ``work`` concurrently; the first to raise cancels the others and its error is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        if errors:
            raise errors[0]  # type: ignore[misc]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
                # one that ends with its own error while being cancelled (its deadline passed): not a
                # second failure of the round, and not "Task exception was never retrieved" in the log
                t.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
