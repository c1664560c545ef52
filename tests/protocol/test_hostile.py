"""Attacks on the averaging protocol, in process, one per finding of the 2026-12 review and per rule
of step 6. Every attack is injected from outside the protocol code (a Behaviour, a wrapped link,
or an outsider speaking the wire protocol); every test asserts that the attack happened, that it
was refused and attributed, and that the honest members stayed bit-identical (or voided together)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hivetrain.dht.identity import Identity
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.agreement import equivocators, held_statements
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.ready import Ready
from hivetrain.peer.averaging.reduce import digest
from hivetrain.peer.averaging.simulation import LocalSwarm
from hivetrain.peer.averaging.statements import REJECTED, commitment, sign_result, sign_verdict
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.faults import FaultPlan
from hivetrain.peer.net.link import Server
from hivetrain.peer.net.wire import Code

from .harness import BASE, NUMEL, Outsider, assert_identical, completed, deltas, filter_outbound, spec, story


class OnPoint(Behaviour):
    """Honest, except that ``action`` runs (on the loop) when ``point`` of ``round_`` is reached."""

    def __init__(self, point: str, round_: int, action: Callable[[], Any]):
        self.point, self.round, self.action, self.tasks = point, round_, action, []

    def at(self, point: str, round_: int) -> None:
        if (point, round_) == (self.point, self.round):
            out = self.action()
            if asyncio.iscoroutine(out):
                self.tasks.append(asyncio.ensure_future(out))


def finish(swarm: LocalSwarm, trigger: OnPoint) -> list[Any]:
    """Waits for the attack's own coroutines (they run on the swarm's loop)."""
    async def wait() -> list[Any]:
        return list(await asyncio.gather(*trigger.tasks, return_exceptions=True))

    return swarm.loop.run(wait(), 10)


def session_of(swarm: LocalSwarm, i: int, round_: int) -> Any:
    return swarm.peers[i].sessions[round_]


# ---- findings 2-3: frames from outside the group, claims in another member's name -------------------


def test_an_outsider_frames_for_our_group_are_refused_attributed_and_unused() -> None:
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    outsider = Outsider(swarm)
    sent: dict[str, Any] = {}

    def attack() -> Any:
        s = session_of(swarm, 0, 0)
        me = swarm.ids()[0]
        shard = s.mine[0]
        junk = os.urandom(s.shard_nbytes(shard))
        sig = sign_result(outsider.identity, s.where(shard), hashlib.sha256(junk).digest(), commitment([""] * n, [], []))
        frames = {
            "part": (outsider.header("part", 0, group=s.group, shard=shard, digest=digest(junk), sig=""), junk),
            "result": (outsider.header("result", 0, group=s.group, shard=(shard + 1) % n,
                                       result=hashlib.sha256(junk).hexdigest(), parts=[""] * n, probation=[],
                                       excluded=[], sig=sig.hex(), sigs=[b""] * n), junk),
            "audit": (outsider.header("audit", 0, group=s.group, shard=0, ok=False, result="0" * 64, finding=1,
                                      reason="lies", sig="00" * 64, twins=[]), b""),
            "evidence_req": (outsider.header("evidence_req", 0, group=s.group, shard=0, index=0), b""),
        }

        async def go() -> None:
            for kind, (h, b) in frames.items():
                sent[kind] = (await outsider.send_async(me, h, b))[0]
        return go()

    swarm.peers[0].ctx.behaviour = trigger = OnPoint("before_parts", 0, attack)
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert not [e for e in finish(swarm, trigger) if e is not None]
        assert_identical(results, members=n)
        assert outsider.identity.peer_id not in results[0].group
        assert sent["part"]["code"] == Code.NOT_MEMBER, sent  # refused on its header ...
        assert all(sent[k]["code"] == Code.BANNED for k in ("result", "audit", "evidence_req")), sent  # ... and banned
        assert outsider.identity.peer_id in swarm.peers[0].ctx.bans  # attributed
        session = swarm.peers[0].sessions[0]
        # parts of the shards it reduces and audits, results, statements, and the cross-group means: < 5 vectors
        assert session.held_bytes() <= session.bound() < 5 * swarm.peers[0].ctx.codec.encoded_nbytes(NUMEL)
    finally:
        swarm.close()


def test_a_member_claiming_another_members_role_is_convicted_and_banned() -> None:
    n = 4
    swarm = LocalSwarm(spec(n), NUMEL, n)
    replies: dict[str, Any] = {}

    def attack() -> Any:
        s = session_of(swarm, 3, 0)
        liar = swarm.peers[3].ctx
        victim_shard = (s.mine[0] + 1) % n  # a shard it does not reduce
        body = os.urandom(s.shard_nbytes(victim_shard))
        rh = hashlib.sha256(body).digest()
        sig = sign_result(liar.identity, s.where(victim_shard), rh, commitment([""] * n, [], []))
        header = liar.header("result", 0, BASE, group=s.group, shard=victim_shard, result=rh.hex(), parts=[""] * n,
                             probation=[], excluded=[], sig=sig.hex(), sigs=[b""] * n)
        targets = [p for i, p in enumerate(s.order) if p != liar.me and i != victim_shard]

        async def go() -> None:
            from hivetrain.peer.net.link import request

            for t in targets:
                replies[t] = (await request(liar.link, t, liar.protocol, header, body, 3.0))[0]
        return go()

    swarm.peers[3].ctx.behaviour = trigger = OnPoint("after_parts", 0, attack)
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert not [e for e in finish(swarm, trigger) if e is not None]
        liar = swarm.ids()[3]
        assert replies and all(r["code"] in (Code.WRONG_ROLE, Code.NOT_READY) for r in replies.values()), replies
        refused = [p for p, r in replies.items() if r["code"] == Code.WRONG_ROLE]
        assert refused, replies
        honest = [r for i, r in enumerate(results) if i != 3]
        assert_identical(honest)
        for i, p in enumerate(swarm.ids()):
            if p in refused:
                assert liar in swarm.peers[i].ctx.bans, story(results)  # attributed to the liar
    finally:
        swarm.close()


def test_a_forged_reducer_signature_is_refused() -> None:
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    forger = Identity.generate()

    class Forge(Behaviour):
        def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int,
                       codec: Codec) -> bytes:
            return result  # the result is right; the signature below is not its own

    try:
        import hivetrain.peer.averaging.allreduce as ar

        real = ar.sign_result

        def forged(identity: Identity, *a: Any) -> bytes:
            return real(forger if identity.peer_id == swarm.ids()[2] else identity, *a)

        ar.sign_result = forged  # type: ignore[assignment]
        try:
            results = swarm.all_reduce(0, BASE, deltas(n))
        finally:
            ar.sign_result = real  # type: ignore[assignment]
        assert all(isinstance(r, RoundFailed) for r in results[:2]), story(results)  # no valid result of shard 2
        for i in (0, 1):
            assert swarm.ids()[2] in swarm.peers[i].ctx.bans
            assert "not signed by it" in (swarm.peers[i].ctx.bans.why(swarm.ids()[2]) or "")
    finally:
        swarm.close()


# ---- finding 4: view overflow; 64+ fake members -----------------------------------------------------


def test_three_hundred_fake_ready_records_and_a_fake_member_list_do_not_stop_the_honest_group() -> None:
    # (300: more than the 256 candidates a view keeps, so a first-come cap would show: review §3, N5)
    n = 3
    swarm = LocalSwarm(spec(n, matchmaking_timeout=1.0), NUMEL, n)
    liar = Outsider(swarm)
    fakes = [Identity.generate() for _ in range(300)]

    async def publish() -> None:
        for f in fakes:
            await swarm.board.publish(f, Ready(f.peer_id, 0, BASE, swarm.peers[0].ctx.run), 60)
        await swarm.board.publish(liar.identity, Ready(liar.identity.peer_id, 0, BASE, swarm.peers[0].ctx.run), 60)

    class Liar:
        """Answers every view request (and ping) with 64 members it made up, itself and the asker."""

        max_body = 0

        def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Any:
            members = sorted({f.peer_id for f in fakes[:61]} | {liar.identity.peer_id, sender})
            return liar.header("view_reply", header["round"], header["base"], members=members, excluded=[],
                               decided=False, ready=True, closed=False, up=0, derived=True), b""

        def refusal(self, header: dict[str, Any], code: Code, why: str) -> Any:
            return liar.header("ack", 0, code=int(code), reason=why), b""

        def is_member(self, peer: str) -> bool:
            return False

    try:
        swarm.loop.run(publish(), 10)
        swarm.loop.run(liar.link.serve(swarm.peers[0].ctx.protocol, Server(Liar())), 5)  # type: ignore[arg-type]
        results = swarm.all_reduce(0, BASE, deltas(n), timeout=60)
        done = assert_identical(results, members=n)
        assert set(done[0].group) == set(swarm.ids())
        for p in swarm.peers:
            mm = p.matchmaking[0]
            assert {f.peer_id for f in fakes} <= mm.silent  # all 300 records were on its board, and silent
            assert liar.identity.peer_id in mm.alive  # the liar answered (and was left out for its views)
            assert liar.identity.peer_id in mm.view.excluded or liar.identity.peer_id not in (mm.view.allowed or ())
            assert not {f.peer_id for f in fakes} & set(mm.view.effective())
    finally:
        swarm.close()


# ---- finding 5: junk group hashes; finding 6: sizes and floods ----------------------------------------


def test_junk_group_hashes_for_the_next_round_hold_nothing_and_block_nothing() -> None:
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    outsider = Outsider(swarm)
    try:
        assert_identical(swarm.all_reduce(0, BASE, deltas(n)), members=n)
        codes = []
        for _ in range(8):
            junk = os.urandom(1000)
            h = outsider.header("part", 1, group=os.urandom(32).hex(), shard=0, digest=digest(junk), sig="")
            codes.append(outsider.send(0, h, junk)[0]["code"])
        assert set(codes) == {Code.NOT_READY}
        assert 1 not in swarm.peers[0].sessions
        assert_identical(swarm.all_reduce(1, BASE, deltas(n, seed=1)), members=n)
    finally:
        swarm.close()


def test_a_wrong_size_part_is_refused_unread_attributed_and_the_next_round_goes_on_without_it() -> None:
    n = 4
    plan = FaultPlan.parse("shortlen@parts:0")
    swarm = LocalSwarm(spec(n, allreduce_timeout=2.0), NUMEL, n, behaviours={3: plan})
    try:
        cheat = swarm.ids()[3]
        moved_before = swarm.net.bytes_moved[cheat]
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert plan.fired
        # its parts were refused on their headers, so it never reduces: the honest members void together
        assert all(isinstance(r, RoundFailed) for r in results), story(results)
        size = swarm.peers[0].sessions[0].shard_nbytes(0)
        assert all(f"not {size}" in r.excluded.get(cheat, "") for r in results[:3]), story(results)  # type: ignore[union-attr]
        assert swarm.net.bytes_moved[cheat] - moved_before < 20_000  # headers only: its bodies stayed unread
        assert all(cheat in p.ctx.bans for p in swarm.peers[:3])
        nxt = assert_identical(swarm.all_reduce(1, BASE, deltas(n, seed=1))[:3], members=3)
        assert set(nxt[0].group) == set(swarm.ids()[:3])
    finally:
        swarm.close()


def test_a_flood_of_stalled_streams_is_capped_and_the_group_completes() -> None:
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    flooders = [Outsider(swarm) for _ in range(8)]
    target = swarm.ids()[0]

    async def flood() -> list[Any]:
        writers = []
        for f in flooders:
            for _ in range(25):
                try:
                    reader, writer = await f.link.open(target, f.ctx.protocol, 1.0)
                    writers.append(writer)  # opened, never written: the server waits for a header
                except ConnectionError:
                    pass
        await asyncio.sleep(0.1)
        return writers

    try:
        writers = swarm.loop.run(flood(), 10)
        server = swarm.peers[0].server
        # 12 streams per peer at most, the rest refused at once; a silent stream waits for its header
        # apart from the 64 shared slots, which stay free for streams whose header is here
        assert server.pending == 8 * server.max_per_peer == 96 and server.refused_busy == 200 - 96
        assert server.others == 0
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert_identical(results, members=n)
        assert len(writers) == 200
    finally:
        swarm.close()


# ---- finding 7: a reducer biased by a fraction of a quantization step ----------------------------------


class Biased(Behaviour):
    def __init__(self, steps: float):
        self.steps, self.fired = steps, False

    def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int, codec: Codec) -> bytes:
        self.fired = True
        x = codec.decode(result, numel)  # (numel,) fp32
        chunk = codec.chunk_size  # type: ignore[attr-defined]
        out = x.clone()
        for a in range(0, numel, chunk):
            seg = x[a:a + chunk]
            step = float(seg.max() - seg.min()) / 255
            out[a:a + chunk] = seg - self.steps * step
        return bytes(codec.encode(out))


def test_a_reducer_biased_by_a_fraction_of_a_step_is_caught_and_its_shard_void() -> None:
    for steps in (0.25, 0.5):
        n = 4
        cheat = Biased(steps)
        swarm = LocalSwarm(spec(n), NUMEL, n, behaviours={3: cheat})
        try:
            results = swarm.all_reduce(0, BASE, deltas(n))
            assert cheat.fired
            done = assert_identical([r for i, r in enumerate(results) if i != 3], members=3)
            order = done[0].group
            k = order.index(swarm.ids()[3])
            s = session_of(swarm, 0, 0)
            theirs = tuple(s.bounds[j] for j in range(s.units) if s.reducer(j) == swarm.ids()[3])
            assert s.pieces == 2 and done[0].void_ranges == theirs, story(results)  # exactly its pieces are void
            why = done[0].excluded[swarm.ids()[3]]
            assert "wrong aggregate" in why or "checked ourselves" in why, why
            auditor = order[(k + 1) % n]
            assert swarm.ids()[3] in swarm.peers[swarm.ids().index(auditor)].ctx.bans
        finally:
            swarm.close()


# ---- group agreement after the round: equivocation ----------------------------------------------------


def test_an_equivocating_reducer_is_proven_and_banned_by_every_member() -> None:
    n = 4
    # the group's own statements prove it (with the cross-group stage a member that got another result
    # than the designee cannot use the mean forwarded without bytes, and voids: peer/averaging/cross.py)
    swarm = LocalSwarm(spec(n, cross_groups=False), NUMEL, n)
    cheat_id = swarm.ids()[3]

    class TwoFaced(Behaviour):
        fired = False

        def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int,
                       codec: Codec) -> bytes:
            s = session_of(swarm, 3, round_)
            if recipient == s.auditor(shard):
                return result  # the auditor checks the honest result ...
            TwoFaced.fired = True
            x = codec.decode(result, numel)
            return bytes(codec.encode(x * 3.0))  # ... the others get another one, signed all the same

    swarm.peers[3].ctx.behaviour = TwoFaced()
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert TwoFaced.fired
        applied = {r.applied for i, r in enumerate(results) if i != 3 and not isinstance(r, RoundFailed)}
        assert len(applied) <= 1, story(results)
        for i in range(3):
            why = swarm.peers[i].ctx.bans.why(cheat_id) or ""
            assert "equivocation" in why or "not the one its auditor checked" in str(results[i]), (i, why, story(results))
        assert sum("equivocation" in (swarm.peers[i].ctx.bans.why(cheat_id) or "") for i in range(3)) >= 2
        # (the proof: statements that members whose digests differed asked each other for)
        assert any(swarm.peers[i].sessions[0].statements for i in range(3))
        nxt = swarm.all_reduce(1, BASE, deltas(n, seed=1))
        assert len(completed(nxt[:3])) == 3, story(nxt)  # the honest three go on together (not vacuous)
        for r in completed(nxt[:3]):
            assert cheat_id not in r.group  # never grouped with again
    finally:
        swarm.close()


def test_a_reducer_that_sends_its_auditor_another_result_is_convicted_and_the_auditor_kept() -> None:
    """The mirror of the test above: the auditor gets a wrong result (and rejects it), the other members
    the honest one. Their recomputation on their own copy finds nothing wrong; they must not ban the
    auditor for it (the search found honest auditors banned this way, I3), and the reducer's two
    signed results convict it."""
    n = 4
    swarm = LocalSwarm(spec(n, cross_groups=False), NUMEL, n)
    cheat_id = swarm.ids()[3]

    class Misleads(Behaviour):
        fired = False

        def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int,
                       codec: Codec) -> bytes:
            if recipient != session_of(swarm, 3, round_).auditor(shard):
                return result
            Misleads.fired = True
            return bytes(codec.encode(codec.decode(result, numel) * 3.0))  # signed all the same

    swarm.peers[3].ctx.behaviour = Misleads()
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert Misleads.fired
        s = session_of(swarm, 0, 0)
        auditor = s.auditor(s.order.index(cheat_id))
        assert auditor is not None and auditor != cheat_id
        for i in range(3):
            assert swarm.peers[i].ctx.bans.why(auditor) is None, (i, swarm.peers[i].ctx.bans.why(auditor), story(results))
            assert swarm.peers[i].ctx.bans.why(cheat_id), (i, story(results))
        assert sum("equivocation" in (swarm.peers[i].ctx.bans.why(cheat_id) or "") for i in range(3)) >= 2
        applied = {r.applied for r in results[:3] if not isinstance(r, RoundFailed)}
        assert len(applied) <= 1, story(results)
        nxt = swarm.all_reduce(1, BASE, deltas(n, seed=1))
        assert len(completed(nxt[:3])) == 3, story(nxt)  # the honest three, the auditor among them, go on
        assert all(cheat_id not in r.group for r in completed(nxt[:3]))
    finally:
        swarm.close()


def test_an_auditor_whose_verdict_names_a_result_it_does_not_hold_is_convicted_by_its_own_statements() -> None:
    """The other half of the rule: an auditor judges the result it holds. Its own statements, signed
    by it, showing a verdict on another result convict it (agreement.equivocators)."""
    n = 4
    swarm = LocalSwarm(spec(n, cross_groups=False), NUMEL, n)
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert len(completed(results)) == n, story(results)
        s = session_of(swarm, 0, 0)
        k = s.mine[0]
        auditor = s.auditor(k)
        assert auditor is not None
        theirs = held_statements(session_of(swarm, swarm.ids().index(auditor), 0))
        ours = held_statements(s)
        assert list(equivocators(s, auditor, ours, theirs)) == []  # honest: nothing to say
        other = hashlib.sha256(b"a result nobody sent").digest()
        liar = swarm.peers[swarm.ids().index(auditor)].ctx.identity
        theirs[k] = dataclasses.replace(theirs[k], verdict=REJECTED, verdict_hash=other,
                                        verdict_sig=sign_verdict(liar, s.where(k), False, other))
        found = list(equivocators(s, auditor, ours, theirs))
        assert (auditor, f"signed two different verdicts on shard {k} (equivocation)") in found, found
        ours[k] = theirs[k]  # even where we hold that same verdict: its own result is not the one it judged
        assert list(equivocators(s, auditor, ours, theirs)) == [
            (auditor, f"signed a verdict on shard {k} about a result it does not hold")]
    finally:
        swarm.close()


def test_an_equivocating_auditor_is_proven_and_the_majority_decides() -> None:
    n = 5
    # the group's own agreement on what it applies (with the cross-group stage the means come from
    # designees, which take the auditor's word as it gave it to them: peer/averaging/cross.py)
    swarm = LocalSwarm(spec(n, cross_groups=False), NUMEL, n)
    liar_id = swarm.ids()[4]

    class TwoVerdicts(Behaviour):
        told: dict[str, bool] = {}

        def verdict_for(self, round_: int, shard: int, recipient: str, ok: bool) -> bool:
            s = session_of(swarm, 4, round_)
            said = ok if recipient == s.reducer(shard) else not ok  # the reducer hears "ok", the others "void"
            TwoVerdicts.told[recipient] = said
            return said

    swarm.peers[4].ctx.behaviour = TwoVerdicts()
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert set(TwoVerdicts.told.values()) == {True, False}
        s = session_of(swarm, 0, 0)
        reducer = s.reducer((s.order.index(liar_id) - 1) % n)
        majority = [r for p, r in zip(swarm.ids()[:4], results[:4], strict=True) if p != reducer]
        done = assert_identical(majority, members=3)  # the three told "void" apply the shard void, alike
        assert len(done[0].void_ranges) == s.pieces  # the pieces it audits
        minority = results[swarm.ids().index(reducer)]
        assert isinstance(minority, RoundFailed) and "only 2 of 5" in str(minority), story(results)
        assert all("equivocation" in (swarm.peers[i].ctx.bans.why(liar_id) or "") for i in range(4)), story(results)
    finally:
        swarm.close()


# ---- finding 8: stalls -----------------------------------------------------------------------------


def test_a_ready_peer_that_never_answers_views_costs_one_view_timeout() -> None:
    n = 3
    swarm = LocalSwarm(spec(n, matchmaking_timeout=1.0), NUMEL, n)
    staller = Outsider(swarm)

    class Silent:
        def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Any:
            class Never:
                deadline = 0.0

                async def complete(self, body: bytes) -> Any:
                    await asyncio.sleep(3600)

                def abort(self) -> None:
                    pass
            return Never()

        def refusal(self, header: dict[str, Any], code: Code, why: str) -> Any:
            return staller.header("ack", 0, code=int(code), reason=why), b""

        def is_member(self, peer: str) -> bool:
            return True

    async def setup() -> None:
        await staller.link.serve(swarm.peers[0].ctx.protocol, Server(Silent()))  # type: ignore[arg-type]
        await swarm.board.publish(staller.identity, Ready(staller.identity.peer_id, 0, BASE, swarm.peers[0].ctx.run), 60)

    try:
        swarm.loop.run(setup(), 5)
        results = swarm.all_reduce(0, BASE, deltas(n), timeout=40)
        done = assert_identical(results, members=n)
        assert staller.identity.peer_id not in done[0].group
        assert all("did not answer" in p.matchmaking[0].view.excluded[staller.identity.peer_id] for p in swarm.peers)
    finally:
        swarm.close()


# ---- byzantine members inside the group (ported from the subprocess tests) -------------------------------


@pytest.mark.parametrize("compression", ["int8", "sparse"])
def test_one_of_four_sending_garbage_is_left_out_named_and_banned(compression: str) -> None:
    for attack in ("nan", "flip", "scale", "huge"):
        n = 4
        plan = FaultPlan.parse(f"{attack}@parts:0")
        swarm = LocalSwarm(spec(n, compression=compression), NUMEL, n, behaviours={3: plan})
        try:
            results = swarm.all_reduce(0, BASE, deltas(n))
            assert plan.fired
            bad = swarm.ids()[3]
            done = assert_identical(results[:3], members=3)
            assert bad in done[0].excluded, (attack, story(results))
            assert torch.isfinite(done[0].averaged).all()
            nxt = assert_identical(swarm.all_reduce(1, BASE, deltas(n, seed=1))[:3])
            assert all(bad not in r.group for r in nxt), attack
        finally:
            swarm.close()


@pytest.mark.parametrize("compression", ["int8", "sparse"])
def test_a_reducer_returning_a_wrong_aggregate_is_caught_by_its_auditor_and_every_member(compression: str) -> None:
    n = 4
    plan = FaultPlan.parse("wrongsum@results:0")
    swarm = LocalSwarm(spec(n, compression=compression), NUMEL, n, behaviours={3: plan})
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        cheat = swarm.ids()[3]
        done = assert_identical(results[:3], members=3)
        assert len(done[0].void_ranges) == session_of(swarm, 0, 0).pieces and cheat in done[0].excluded
        for i in range(3):
            assert cheat in swarm.peers[i].ctx.bans, i  # the auditor, and the others after checking its evidence
        nxt = assert_identical(swarm.all_reduce(1, BASE, deltas(n, seed=1))[:3], members=3)
        assert set(nxt[0].group) == set(swarm.ids()[:3])
    finally:
        swarm.close()


def test_an_auditor_accusing_falsely_is_found_out_and_the_reducer_kept() -> None:
    n = 4
    plan = FaultPlan.parse("accuse@results:0")
    swarm = LocalSwarm(spec(n), NUMEL, n, behaviours={3: plan})
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        liar = swarm.ids()[3]
        done = assert_identical(results[:3], members=3)
        assert len(done[0].void_ranges) == session_of(swarm, 0, 0).pieces  # what a lie costs: one share for one round
        for i in range(3):
            assert liar in swarm.peers[i].ctx.bans and "accused" in (swarm.peers[i].ctx.bans.why(liar) or "")
        nxt = assert_identical(swarm.all_reduce(1, BASE, deltas(n, seed=1))[:3], members=3)
        assert set(nxt[0].group) == set(swarm.ids()[:3])  # the accused reducer stays
    finally:
        swarm.close()


def test_replayed_parts_of_an_earlier_round_are_refused_and_attributed_at_once() -> None:
    n = 4
    swarm = LocalSwarm(spec(n), NUMEL, n)
    try:
        assert_identical(swarm.all_reduce(0, BASE, deltas(n)), members=n)
        replayer = swarm.peers[3].ctx
        old = swarm.peers[3].sessions[0]
        # from round 1 on, its fresh parts never leave (dropped on its own link) and the parts it
        # sent in round 0 go out again instead
        link = filter_outbound(swarm, 3, lambda peer, h: h.get("type") == "part" and h["round"] == 1,
                               blackhole=True)
        old_frames = []
        for k in range(n):
            for target in {old.order[k], old.order[(k + 1) % n]} - {replayer.me}:
                body = os.urandom(old.shard_nbytes(k))
                old_frames.append((target, replayer.header("part", 0, BASE, group=old.group, shard=k, sig="",
                                                           digest=digest(body)), body))

        async def replay() -> None:
            from hivetrain.peer.net.link import request

            for target, h, b in old_frames:
                await request(link.inner, target, replayer.protocol, h, b, 2.0)

        replayer.behaviour = trigger = OnPoint("after_matchmaking", 1, replay)
        results = swarm.all_reduce(1, BASE, deltas(n, seed=1))
        finish(swarm, trigger)
        assert link.dropped
        done = assert_identical(results[:3], members=3)
        assert "replayed its part of round 0" in done[0].excluded.get(replayer.me, ""), story(results)
    finally:
        swarm.close()


def test_identities_from_one_prefix_are_capped_per_group() -> None:
    n = 3
    addrs = [f"/ip4/203.0.113.{i + 5}/tcp/4000" for i in range(n)]
    swarm = LocalSwarm(spec(n, max_per_prefix=2, matchmaking_timeout=1.0), NUMEL, n, addrs=addrs)
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        groups = {r.group for r in completed(results)}
        assert groups and all(len(g) <= 2 for g in groups), story(results)
        left_out = [r for r in completed(results) if len(r.group) == 2]
        assert any("at most 2 per prefix" in why for r in left_out for why in r.excluded.values()), story(results)
    finally:
        swarm.close()


class TwoParts(Behaviour):
    """A member whose auditors get another well-formed part (signed) than its reducers (review N7)."""

    def __init__(self) -> None:
        self.other: dict[int, bytes] = {}

    def parts(self, round_: int, parts: list[bytes], delta: torch.Tensor, bounds: list[tuple[int, int]],
              codec: Codec) -> list[bytes]:
        self.other = {k: bytes(codec.encode(delta[a:b] * 0.5)) for k, (a, b) in enumerate(bounds)}
        return parts

    def part_for(self, round_: int, shard: int, recipient: str, auditor: bool, part: bytes) -> bytes:
        return self.other[shard] if auditor else part


def test_a_member_that_signs_its_auditor_another_part_is_proven_to_every_member_and_banned() -> None:
    """Review N7: the shard was unverifiable and nobody was blamed, every round. The result carries the
    members' signatures of the parts it used, the verdict the auditor's copy's: each member checks both
    signatures of the cheat on two parts of one shard itself and bans it; the next round goes on without it."""
    n = 4
    swarm = LocalSwarm(spec(n), NUMEL, n)
    cheat_id = swarm.ids()[3]
    swarm.peers[3].ctx.behaviour = TwoParts()
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        for i in range(3):
            why = swarm.peers[i].ctx.bans.why(cheat_id) or ""
            assert "signed two different parts of shard" in why, (i, why, story(results))
        assert not [i for i in range(3) for j in range(3) if swarm.ids()[j] in swarm.peers[i].ctx.bans]
        nxt = swarm.all_reduce(1, BASE, deltas(n, seed=1))
        assert len(completed(nxt[:3])) == 3, story(nxt)
        for r in completed(nxt[:3]):
            assert cheat_id not in r.group
    finally:
        swarm.close()


def test_an_auditor_that_names_a_member_with_a_made_up_second_part_is_the_one_banned(monkeypatch: Any) -> None:
    """A proof that does not check is the auditor's: a member named with a part it never signed is not
    banned; the auditor that named it is, by every member that checked."""
    from hivetrain.peer.averaging.session import RoundSession

    n = 4
    swarm = LocalSwarm(spec(n), NUMEL, n)
    liar, victim = swarm.ids()[3], swarm.ids()[0]
    real = RoundSession.twins

    def framing(self: RoundSession, k: int) -> list[tuple[int, str, str]]:
        if self.me != liar:
            return real(self, k)
        return [(self.order.index(victim), "0" * 32, "ab" * 64)]  # a digest and a signature the victim never made

    monkeypatch.setattr(RoundSession, "twins", framing)

    class Unverifying(Behaviour):  # the liar finds every shard it audits unverifiable, so that it sends a proof
        def finding(self, round_: int, shard: int, finding: Any) -> Any:
            from hivetrain.peer.averaging.reduce import Finding, FindingKind
            return Finding(FindingKind.UNVERIFIABLE, "parts differ")

    swarm.peers[3].ctx.behaviour = Unverifying()
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        blamed = [swarm.peers[i].ctx.bans.why(liar) or "" for i in range(3) if i != swarm.ids().index(victim)]
        assert any("with a part it did not sign" in why for why in blamed), (blamed, story(results))
        assert not any(victim in swarm.peers[i].ctx.bans for i in range(1, 4) if swarm.ids()[i] != liar)
    finally:
        swarm.close()


def test_an_accuser_that_shows_no_evidence_is_struck_once_then_banned(monkeypatch: Any) -> None:
    """An auditor that accuses and then cannot show its evidence may have crashed after its verdict
    (search seed 3,000,501: the members banned such an honest auditor). The members that check it
    note a strike, not a ban; the reducer it accused knows the accusation is false and bans it. A
    second unanswered accusation bans it everywhere (``Bans.strike``)."""
    from hivetrain.peer.averaging.session import RoundSession

    n = 4
    plan = FaultPlan.parse("accuse@results:0")
    swarm = LocalSwarm(spec(n), NUMEL, n, behaviours={3: plan})
    liar = swarm.ids()[3]
    real = RoundSession.evidence
    monkeypatch.setattr(RoundSession, "evidence",
                        lambda self, sender, header: (Code.NO_EVIDENCE, b"") if self.me == liar else real(self, sender, header))
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert_identical(results[:3], members=3)
        s = session_of(swarm, 0, 0)
        accused = {s.reducer(k) for k in range(s.units) if s.auditor(k) == liar}
        checkers = [i for i in range(3) if swarm.ids()[i] not in accused]
        assert checkers, "every honest member was accused: nobody checked"
        for i in range(3):
            why = swarm.peers[i].ctx.bans.why(liar) or ""
            if i in checkers:
                assert liar not in swarm.peers[i].ctx.bans, (i, why)  # one silence is not proof
                assert swarm.peers[i].ctx.bans.strike(liar, "holds no evidence", 1)  # one in a later round is
            else:
                assert "accused us falsely" in why, (i, why)
    finally:
        swarm.close()
