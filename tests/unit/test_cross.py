"""The cross-group stage's pure rules (peer/averaging/cross.py): who the designees are, and whose
groups a designee's means wait for."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from hivetrain.dht import clock
from hivetrain.dht.identity import Identity
from hivetrain.dht.records import bucket_of
from hivetrain.peer.averaging.api import shard_bounds
from hivetrain.peer.averaging.behaviour import HONEST
from hivetrain.peer.averaging.cross import (
    MAX_EARLY_WORDS,
    POLL,
    Desk,
    anchor,
    anchor_rank,
    bucket_label,
    derive,
    proven,
    proves,
    read_plan,
    sub_message,
    top_bucket,
    vouch,
)
from hivetrain.peer.averaging.ready import MemoryReadyBoard, Ready
from hivetrain.peer.averaging.statements import Where, sign_part
from hivetrain.peer.config import RunSpec
from hivetrain.peer.net.wire import MAX_GROUP, ZERO, Code
from hivetrain.peer.trust import Trust

RUN, BASE, OTHER = "a" * 64, "b" * 64, "c" * 64


def signed(sender: Identity, header: dict[str, Any], run: str = RUN, round_: int = 3, base: str = BASE) -> dict[str, Any]:
    """A tier-0 ``cross`` request signed by its sender, as an honest reducer or attester signs it."""
    h = header
    sig = sender.sign(sub_message(run, round_, base, h["group"], h["shard"], h["sub"], h["members"], h["weight"],
                                  h["result"], h["enc"], h["vouch"], h["attest"], h["ok"]))
    return dict(header, sig=sig.hex())


def ready(peer: str, eta: float, *, done: bool = True, base: str = BASE, closed: bool = False, up: int = 0,
          out: bool = False, group: tuple[str, ...] = ()) -> Ready:
    return Ready(peer, 3, base, RUN, done=done, eta=eta, closed=closed, up=up, out=out, group=group)


def test_the_designees_are_the_open_peers_ready_in_the_first_window() -> None:
    t0 = 1000.0
    records = [ready("p1", t0), ready("p2", t0 + 0.5), ready("p3", t0 + 0.9, closed=True), ready("p4", t0 + 1.5),
               ready("p5", t0, base=OTHER), ready("p6", t0 - 5, done=False)]
    plan = derive(records, 3, BASE, RUN, units_=8, numel=1 << 16)
    assert plan.designees == ("p1", "p2") and plan.t0 == t0  # p3 closed, p4 late, p5 elsewhere, p6 not ready
    # every peer that reads the same board ranks the same designees for a sub-piece, in any record order
    again = derive(list(reversed(records)), 3, BASE, RUN, units_=8, numel=1 << 16)
    assert [plan.ranked(k, 0) for k in range(8)] == [again.ranked(k, 0) for k in range(8)]
    # if every early peer is closed, each is its own designee rather than none
    only_closed = derive([ready("p3", t0, closed=True)], 3, BASE, RUN, units_=8, numel=1 << 16)
    assert only_closed.designees == ("p3",)


def test_identities_ready_early_neither_set_the_rounds_clock_nor_are_its_designees() -> None:
    # the designee class of step 14: one identity that published its ready record as soon as the base
    # was known (it need not train) was the round's earliest record, so it set the cutoff and was the
    # only designee of every sub-piece. The anchor is now the k-th earliest record, k = a third of the
    # bucket's expected peers (the base state's population) + 1
    assert [anchor_rank(p) for p in (0, 2, 3, 8, 9)] == [1, 1, 2, 3, 4]
    assert anchor_rank(64, level=2) == 6  # 16 peers expected in each of 4 buckets
    t0 = 1000.0
    honest = [ready(f"h{i}", t0 + 0.3 * i) for i in range(6)]
    early = [ready("x1", t0 - 60), ready("x2", t0 - 59.5)]  # claimed times: any, and backdated ones too
    plan = derive(honest + early, 3, BASE, RUN, units_=8, numel=1 << 16, rank=anchor_rank(8))
    assert plan.t0 == t0 and set(plan.designees) == {"h0", "h1", "h2", "h3"}  # the window: 1 s either side
    assert anchor(honest, 3) == t0 + 0.6  # without them, the third honest record: two moved it 2 places, no more
    old = derive(honest + early, 3, BASE, RUN, units_=8, numel=1 << 16)  # the old rule (rank 1)
    assert old.t0 == t0 - 60 and set(old.designees) == {"x1", "x2"}
    # fewer ready than the rank (a run smaller than its state's population): the latest anchors
    assert derive(honest[:2], 3, BASE, RUN, units_=8, numel=1 << 16, rank=3).t0 == t0 + 0.3
    assert anchor([], 3) is None


def test_a_record_that_claims_to_be_ready_in_the_future_anchors_no_plan() -> None:
    """When the anchor rank exceeds the records read (a run smaller than its population, or a base
    whose rounds voided, whose rank doubles), the latest record anchors: one identity claiming to
    be ready an hour from now made the round wait for that hour and named only itself. A plan
    reads no ready record past the reader's clock by more than ETA_SKEW."""
    board, _ = board_of(0, 4, clock.wall() - 30.0)
    liar = Identity.generate()
    asyncio.run(board.publish(liar, Ready(liar.peer_id, 3, BASE, RUN, done=True, eta=clock.wall() + 3600.0), 60.0))
    assert len(asyncio.run(board.read(3))) == 5
    mine, up = asyncio.run(asyncio.wait_for(read_plan(board, 3, BASE, RUN, 8, 1 << 20, rank=8), 10.0))
    assert liar.peer_id not in up.ready and liar.peer_id not in up.designees and up.t0 < clock.wall()
    assert len(up.ready) == 4


def test_a_faster_designee_is_ranked_first_more_often() -> None:
    t0 = 1000.0
    records = [ready(f"p{i}", t0, up=4000 if i == 0 else 1000) for i in range(8)]
    plan = derive(records, 3, BASE, RUN, units_=64, numel=1 << 20)
    firsts = [plan.ranked(k, j)[0] for k in range(64) for j in range(plan.subs)]
    assert firsts.count("p0") > 2 * len(firsts) / 8  # weight 4 of 11 against 1 of 11 each


def desk(mm_timeout: float = 5.0) -> Desk:
    spec = RunSpec(name="t", matchmaking_timeout=mm_timeout, target_group_size=4)
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me="p1")
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    return d


def test_the_means_wait_for_the_peers_ready_by_the_cutoff_less_those_whose_round_failed() -> None:
    now = clock.wall()
    d = desk()
    t0 = now - 100.0  # the cutoff (t0 + 5 s) settled long ago
    d.plan = derive([ready("p1", t0)], 3, BASE, RUN, units_=8, numel=1 << 16)
    records = [ready("p1", t0), ready("p2", t0 + 4.9), ready("late", t0 + 5.1),  # ready after the cutoff
               ready("gone", t0 + 1, done=False),  # announced, never ready: not after the cutoff settled
               ready("else", t0 + 1, base=OTHER)]
    assert d.waited(records) == {"p1", "p2"}
    # a peer whose round failed says so (and names its group); a peer two of them name is out too
    failed = [ready("p2", t0 + 4.9, out=True, group=("p2", "p3", "dead")),
              ready("p3", t0 + 1, out=True, group=("p2", "p3", "dead")), ready("p4", t0 + 1),
              ready("named_once", t0 + 1), ready("p5", t0 + 1, out=True, group=("p5", "named_once"))]
    assert d.waited([ready("p1", t0), ready("dead", t0 + 1), *failed]) == {"p1", "p4", "named_once"}


def test_before_the_cutoff_settles_the_means_wait_for_announced_peers_too() -> None:
    now = clock.wall()
    d = desk()
    d.plan = derive([ready("p1", now - 1)], 3, BASE, RUN, units_=8, numel=1 << 16)
    records = [ready("p1", now - 1), ready("coming", now + 2, done=False), ready("unknown_base", now, done=False,
                                                                                base=ZERO),
               ready("p9", now, done=False, base=OTHER), ready("p9", now, base=OTHER)]
    assert d.waited(records) == {"p1", "coming", "unknown_base"}


def test_an_out_record_carries_its_group_signed_and_a_plain_one_stays_as_it_was() -> None:
    from hivetrain.peer.averaging.ready import sign, verified
    from hivetrain.peer.sim.swarm import seeded_identity

    me, mate = seeded_identity(0, "me"), seeded_identity(0, "mate")
    group = (me.peer_id, mate.peer_id)
    out = verified(sign(me, "run", Ready(me.peer_id, 3, BASE, RUN, eta=5.0, out=True, group=group), 60.0))
    assert out is not None and out.out and out.group == group
    plain = sign(me, "run", Ready(me.peer_id, 3, BASE, RUN, eta=5.0), 60.0)
    back = verified(plain)
    assert back is not None and not back.out and back.group == ()
    assert b"group" not in plain.payload  # (records of peers that never fail are as small as before)


def test_a_word_that_comes_before_its_groups_sub_piece_is_held_and_counted_when_it_comes() -> None:
    """An attester's word (no body) usually arrives before its reducer's upload: held, not refused
    (refused, the attester asked again after pauses of up to 0.3 s; bench.swarm --slow-member)."""
    spec = RunSpec(name="t", matchmaking_timeout=5.0, target_group_size=4)
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me="p1", codec=spec.codec(), bans=set(), trust=Trust())
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    d.plan = derive([ready("p1", clock.wall())], 3, BASE, RUN, units_=8, numel=1 << 16)
    r, a_, m, x = (Identity.generate() for _ in range(4))
    group, members = "g" * 64, [r.peer_id, a_.peer_id, m.peer_id]
    start, end = shard_bounds(1 << 16, 8)[0]
    a, b = d.plan.sub_bounds(start, end)[0]
    body = ctx.codec.for_results(3).encode(torch.randn(b - a))
    result = hashlib.sha256(body).hexdigest()

    def header(shard: int, attest: bool, names: list[str], group: str = group,
               sender: Identity = a_) -> dict[str, object]:
        return signed(sender, {"type": "cross", "shard": shard, "sub": 0, "members": names, "weight": 3,
                               "result": result, "enc": 3, "attest": attest, "ok": True, "group": group, "tier": 0,
                               "bucket": 0, "groups": 1, "vouch": b""})

    async def go() -> None:
        try:
            # a word from outside the group (it names itself a member) first, then the attester's
            outsider = header(0, True, [*members, x.peer_id], sender=x)
            assert (await d.accept(x.peer_id, outsider, b""))[0] == Code.OK
            assert (await d.accept(a_.peer_id, header(0, True, members), b""))[0] == Code.OK
            assert (await d.accept(a_.peer_id, header(0, True, members), b""))[0] == Code.DUPLICATE
            assert d.work[(0, 0, 0)].entries == {}  # held, nothing counted yet
            assert (await d.accept(r.peer_id, header(0, False, members, sender=r), body))[0] == Code.OK
            entry = d.work[(0, 0, 0)].entries[group]
            assert entry.attested is True and entry.attester == a_.peer_id and entry.counts()
            assert not d.work[(0, 0, 0)].early  # the held words are gone with it
            # the words held for one sub-piece are bounded: past the bound the sender is asked to come again
            for i in range(MAX_EARLY_WORDS):
                assert (await d.accept(a_.peer_id, header(1, True, members, group=f"{i:064x}"), b""))[0] == Code.OK
            code, why = await d.accept(a_.peer_id, header(1, True, members, group="f" * 64), b"")
            assert code == Code.NOT_READY and "not arrived" in why
        finally:
            d.stop()

    asyncio.run(go())


class CountingBoard(MemoryReadyBoard):
    """A board that remembers which buckets were read."""

    def __init__(self) -> None:
        super().__init__(run_key="memory")
        self.read_buckets: list[int] = []

    async def read(self, round_: int, level: int = 0, buckets: object = None) -> list[Ready]:
        chosen = list(range(1 << level) if buckets is None else buckets)  # type: ignore[call-overload]
        self.read_buckets += chosen
        return await super().read(round_, level, chosen)


def board_of(level: int, n: int, t0: float, board: MemoryReadyBoard | None = None) -> tuple[MemoryReadyBoard, list[Identity]]:
    board = board or MemoryReadyBoard()
    idents = [Identity.generate() for _ in range(n)]

    async def publish() -> None:
        for i, ident in enumerate(idents):
            await board.publish(ident, Ready(ident.peer_id, 3, BASE, RUN, done=True, eta=t0 + 0.01 * i), 60.0, level)

    asyncio.run(publish())
    return board, idents


def test_with_buckets_a_peer_reads_two_and_derives_its_buckets_designees_and_the_tops() -> None:
    level, t0 = 3, clock.wall() - 100.0
    board, idents = board_of(level, 96, t0, CountingBoard())
    assert isinstance(board, CountingBoard)
    top = top_bucket(3, BASE, level)
    me = next(i.peer_id for i in idents if bucket_of(3, i.peer_id, level) != top)
    mine, up = asyncio.run(read_plan(board, 3, BASE, RUN, 8, 1 << 20, level=level, me=me, grace=5.0))
    assert set(board.read_buckets) == {bucket_of(3, me, level), top}  # two of the 8 buckets, whatever the run's size
    assert mine.designees and all(bucket_of(3, p, level) == bucket_of(3, me, level) for p in mine.designees)
    assert up.designees and all(bucket_of(3, p, level) == top for p in up.designees)
    assert mine.subs == up.subs  # every bucket cuts the same sub-pieces: the top's
    assert up.ready == mine.ready and set(mine.designees) | set(up.designees) <= up.ready
    # another peer of our bucket derives the same plans from the same board; the top is every peer's
    other = next(i.peer_id for i in idents if bucket_of(3, i.peer_id, level) == bucket_of(3, me, level) and i.peer_id != me)
    again = asyncio.run(read_plan(board, 3, BASE, RUN, 8, 1 << 20, level=level, me=other, grace=5.0))
    assert again == (mine, up)
    # the top is drawn from the base: another base, (almost always) another top
    assert len({top_bucket(3, f"{i:064x}", level) for i in range(64)}) > 4


def test_an_empty_top_bucket_gives_way_to_the_next_once_the_stragglers_are_late() -> None:
    level, t0 = 2, clock.wall() - 100.0
    top = top_bucket(3, BASE, level)
    board = MemoryReadyBoard()
    idents = []
    while len(idents) < 24:  # nobody in the top bucket
        ident = Identity.generate()
        if bucket_of(3, ident.peer_id, level) != top:
            idents.append(ident)

    async def publish() -> None:
        for ident in idents:
            await board.publish(ident, Ready(ident.peer_id, 3, BASE, RUN, done=True, eta=t0), 60.0, level)

    asyncio.run(publish())
    me = idents[0].peer_id
    _, up = asyncio.run(read_plan(board, 3, BASE, RUN, 8, 1 << 20, level=level, me=me, grace=5.0))
    first = next(b % (1 << level) for b in range(top + 1, top + (1 << level) + 1)
                 if any(bucket_of(3, i.peer_id, level) == b % (1 << level) for i in idents))
    assert up.designees and {bucket_of(3, p, level) for p in up.designees} == {first}


def test_a_top_designee_takes_a_buckets_mean_only_from_that_buckets_designee_and_within_its_size() -> None:
    level, t0 = 2, clock.wall() - 100.0
    board, idents = board_of(level, 48, t0)
    top = top_bucket(3, BASE, level)
    spec = RunSpec(name="t", matchmaking_timeout=5.0, target_group_size=4)
    tops = [i.peer_id for i in idents if bucket_of(3, i.peer_id, level) == top]
    probe = Desk(SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me=tops[0], codec=spec.codec(), bans=set(), trust=Trust()),  # type: ignore[arg-type]
                 board, 3, BASE, lambda h, b: None, lambda: None, level)
    asyncio.run(probe.get_plan())
    assert probe.plan is not None
    k, j = 0, 0
    me = probe.plan.ranked(k, j)[0]  # the top designee of sub-piece (0, 0)
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me=me, codec=spec.codec(), bans=set(), trust=Trust())
    d = Desk(ctx, board, 3, BASE, lambda h, b: None, lambda: None, level)  # type: ignore[arg-type]
    other = next(b for b in range(1 << level) if b != top and any(bucket_of(3, i.peer_id, level) == b for i in idents))
    peers = [i.peer_id for i in idents if bucket_of(3, i.peer_id, level) == other]

    async def go() -> None:
        try:
            plan = await d.get_plan()
            bucket = (await d.bucket_plans())[other]
            start, end = shard_bounds(1 << 16, plan.units)[k]
            a, b = plan.sub_bounds(start, end)[j]
            body = ctx.codec.for_results(8).encode(torch.randn(b - a))

            def header(weight: int, bucket_: int = other) -> dict[str, object]:
                return {"type": "cross", "shard": k, "sub": j, "members": [], "weight": weight,
                        "result": hashlib.sha256(body).hexdigest(), "enc": 8, "attest": False, "ok": True,
                        "group": bucket_label(RUN, 3, BASE, bucket_), "tier": 1, "bucket": bucket_, "groups": 2,
                        "vouch": b""}

            designee = bucket.ranked(k, j)[0]
            outsider = next(p for p in peers if p not in bucket.ranked(k, j))
            code, why = await d.accept(outsider, header(4), body)  # our read is moments old: come again
            assert code == Code.NOT_READY and "behind" in why
            await asyncio.sleep(POLL)  # then the buckets are read again, and the outsider is refused
            code, why = await d.accept(outsider, header(4), body)
            assert code == Code.WRONG_ROLE and "not a designee" in why
            code, why = await d.accept(designee, dict(header(4), group="f" * 64), body)  # another bucket's label
            assert code == Code.MALFORMED
            await asyncio.sleep(POLL)  # more weight than the bucket has ready peers: read again, then counted as those
            assert (await d.accept(designee, header(len(peers) + 5), body))[0] == Code.OK
            entry = d.work[(1, k, j)].entries[bucket_label(RUN, 3, BASE, other)]
            assert entry.counts() and entry.bucket == other and entry.groups == 2 and entry.weight == len(peers)
        finally:
            d.stop()

    asyncio.run(go())


def test_a_designee_counts_in_a_groups_weight_only_members_that_vouched_and_are_on_its_board() -> None:
    """Two identities named 64 peers as their group and claimed its weight: the weighted robust mean
    followed them, outweighing every honest group of a small run. A member counts only on its own
    signature of its part (sent to that group), and only if the designee saw it ready; a member that
    vouched for two groups counts in neither; the designee's wait counts a group's named members as
    arrived only when most of them vouched."""
    from hivetrain.peer.averaging.statements import Where, sign_part

    honest = [Identity.generate() for _ in range(4)]
    sybils = [Identity.generate() for _ in range(2)]
    fresh = [Identity.generate() for _ in range(3)]  # keys nobody saw on the board
    spec = RunSpec(name="t", matchmaking_timeout=5.0, target_group_size=4, aggregation="robust")
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me=honest[0].peer_id, codec=spec.codec(), bans=set(), trust=Trust())
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    board = [i.peer_id for i in honest + sybils]
    d.plan = derive([ready(p, clock.wall()) for p in board], 3, BASE, RUN, units_=8, numel=1 << 16)
    d._seen(d.plan.ready)
    ctx.me = d.plan.ranked(0, 0)[0]  # (we are the sub-piece's designee)
    start, end = shard_bounds(1 << 16, 8)[0]
    a, b = d.plan.sub_bounds(start, end)[0]

    def entry(group: str, members: list[Identity], signers: list[Identity], values: torch.Tensor,
              names: list[str] | None = None) -> tuple[dict[str, object], bytes]:
        names = names or [m.peer_id for m in members]
        words = {s.peer_id: ("0" * 32, sign_part(s, Where(RUN, 3, group, 0), "0" * 32)) for s in signers}
        body = ctx.codec.for_results(MAX_GROUP).encode(values)
        return ({"type": "cross", "shard": 0, "sub": 0, "members": names, "weight": len(names),
                 "result": hashlib.sha256(body).hexdigest(), "enc": MAX_GROUP, "attest": False, "ok": True,
                 "group": group, "tier": 0, "bucket": 0, "groups": 1, "vouch": vouch(names, words)}, body)

    async def go() -> None:
        try:
            good, evil = torch.ones(b - a), torch.full((b - a,), -100.0)
            h, body = entry("1" * 64, honest, honest, good)
            assert (await d.accept(honest[1].peer_id, signed(honest[1], h), body))[0] == Code.OK
            # the sybils' group: themselves, three fresh keys (they vouch), the honest peers (they cannot)
            names = [i.peer_id for i in sybils + fresh + honest]
            h, body = entry("2" * 64, [], sybils + fresh, evil, names)
            assert (await d.accept(sybils[0].peer_id, signed(sybils[0], h), body))[0] == Code.OK
            # a forged word: a sybil's signature in an honest member's place
            forged = dict(h, group="3" * 64)
            assert (await d.accept(sybils[1].peer_id, signed(sybils[1], forged), body))[0] == Code.OK
            unit = d.work[(0, 0, 0)]
            assert unit.entries["2" * 64].vouched == {i.peer_id for i in sybils + fresh}
            assert unit.entries["3" * 64].vouched == frozenset()  # signed for another group: counts nowhere
            assert unit.entries["2" * 64].covers(d.on_board) == {i.peer_id for i in sybils}  # no honest peer arrived
            assert unit.entries["1" * 64].covers(d.on_board) == set(board[:4])
            weighed = {e.group: e.weight for e in d._weighed(0, 0, list(unit.entries.values()))}
            assert weighed == {"1" * 64: 4, "2" * 64: 2, "3" * 64: 0}  # fresh keys: not on the board
            for e in unit.entries.values():
                e.attested = True
            out, weight, _, enc = d._mean(0, 0, d._weighed(0, 0, list(unit.entries.values())))
            mean = ctx.codec.for_results(enc).decode(out, b - a)
            assert weight == 6 and float(mean.mean()) > 0  # the honest majority holds the round's mean
            # one honest member that also vouched for the sybils' group counts in neither
            h, body = entry("4" * 64, [], [honest[3], sybils[0]], evil, [honest[3].peer_id, sybils[0].peer_id])
            assert (await d.accept(sybils[0].peer_id, signed(sybils[0], h), body))[0] == Code.OK
            weighed = {e.group: e.weight for e in d._weighed(0, 0, list(unit.entries.values()))}
            assert weighed["1" * 64] == 3 and weighed["2" * 64] == 1 and weighed["4" * 64] == 0
            # once we completed a round (with the honest peers), a member we never completed one with
            # weighs nothing (the reducers' Sybil brake, one stage up): the sybil on the board is a newcomer
            ctx.trust.record_completed(2, [i.peer_id for i in honest], ctx.me)
            weighed = {e.group: e.weight for e in d._weighed(0, 0, list(unit.entries.values()))}
            mine = int(ctx.me == sybils[1].peer_id)  # (the designee is drawn from random keys: never our own newcomer)
            assert weighed["1" * 64] == 3 and weighed["2" * 64] == mine and weighed["4" * 64] == 0
        finally:
            d.stop()

    asyncio.run(go())


def test_off_measures_a_mean_against_our_own_values_in_their_norms() -> None:
    from hivetrain.peer.averaging.cross import MEAN_BOUND, off

    own = torch.tensor([3.0, 4.0])  # norm 5
    assert off(own.clone(), own) == 0.0
    assert abs(off(torch.zeros(2), own) - 1.0) < 1e-6
    assert abs(off(-own, own) - 2.0) < 1e-6  # the update reversed: 2 norms (what the bound lets through)
    assert off(-1000.0 * own, own) > MEAN_BOUND
    assert off(torch.tensor([float("nan"), 0.0]), own) == float("inf")
    # a zero pseudo-gradient of ours is measured in our group's norm, not refused for want of a scale
    assert abs(off(torch.tensor([3.0, 4.0]), torch.zeros(2), torch.tensor([0.0, 5.0])) - 1.0) < 1e-6
    assert off(torch.ones(2), torch.zeros(2)) == float("inf")


def _cross_session(me: Identity, other: Identity, designee: Identity) -> tuple[object, dict[str, int], int]:
    """A group of two (``me``, ``other``) in the cross stage, with one designee; our own
    pseudo-gradient is all ones. Returns (session, {reducer id: a shard it reduces}, values per shard)."""
    from hivetrain.peer.averaging.session import RoundSession

    spec = RunSpec(name="t")
    numel, units = 4096, 2
    order = tuple(sorted((me.peer_id, other.peer_id)))
    s = RoundSession(RUN, 3, BASE, order, me.peer_id, numel, spec.codec(), False, clock.now() + 60.0, units=units)
    s.plan = s.local = derive([ready(designee.peer_id, 0.0)], 3, BASE, RUN, units_=units, numel=numel)
    assert s.plan.subs == 1
    s.own = torch.ones(numel)
    shard_of = {s.reducer(k): k for k in range(units)}
    assert set(shard_of) == set(order)
    for k, (start, end) in enumerate(s.bounds):  # our group's result: ones too
        s.shards[k].result = s.result_codec.encode(torch.ones(end - start))
        s.shards[k].result_hash = hashlib.sha256(s.shards[k].result).hexdigest()
    return s, shard_of, numel // units


def _mean_out(signer: Identity, k: int, values: torch.Tensor, groups: int = 2, body: bytes | None = None) -> tuple[dict[str, object], bytes]:
    from hivetrain.peer.averaging.cross import message

    codec = RunSpec(name="t").codec().for_results(MAX_GROUP)
    body = bytes(codec.encode(values)) if body is None else body
    result = hashlib.sha256(body).hexdigest()
    sig = signer.sign(message(RUN, 3, BASE, k, 0, result, 2, groups, MAX_GROUP)).hex()
    return ({"type": "cross_out", "run": RUN, "round": 3, "base": BASE, "group": ZERO, "shard": k, "sub": 0,
             "result": result, "weight": 2, "groups": groups, "enc": MAX_GROUP, "signer": signer.peer_id, "sig": sig,
             "witness": "", "wsig": ""}, body)


def test_a_reducer_refuses_a_designees_mean_far_from_its_values_and_asks_the_next() -> None:
    """A designee's mean is not audited: one that signs the true mean times -1000 took every honest
    state (lying_designee, 763x-1.09e4x the largest honest deviation). The reducer measures it
    against its own pseudo-gradient and its group's values: past MEAN_BOUND it is refused, named,
    and the round goes on (the reducer asks the sub-piece's next designee); a near one is taken."""
    me, other, designee = Identity.generate(), Identity.generate(), Identity.generate()
    s, shard_of, n = _cross_session(me, other, designee)
    k = shard_of[me.peer_id]
    header, body = _mean_out(designee, k, torch.full((n,), -1000.0))
    code, why = s.deposit_cross(designee.peer_id, header, body)  # type: ignore[attr-defined]
    assert code == Code.MALFORMED and "lies" in why and designee.peer_id in why
    assert s.refused == {(k, 0): designee.peer_id} and (k, 0) not in s.cross and s.void == ""  # type: ignore[attr-defined]
    # (it holds that mean, and would hand it to us again as to a late group: not asked to average it again)
    assert s.spent == {(k, 0): {designee.peer_id}}  # type: ignore[attr-defined]
    header, body = _mean_out(designee, k, torch.full((n,), 1.5))  # 0.5 norms off: an honest mean can be
    assert s.deposit_cross(designee.peer_id, header, body) == (Code.OK, "")  # type: ignore[attr-defined]
    assert (k, 0) in s.cross  # type: ignore[attr-defined]


def test_a_member_refuses_a_far_mean_its_reducer_passed_on_and_voids_at_once() -> None:
    from hivetrain.peer.errors import RoundFailed

    me, other, designee = Identity.generate(), Identity.generate(), Identity.generate()
    s, shard_of, n = _cross_session(me, other, designee)
    k = shard_of[other.peer_id]
    header, body = _mean_out(designee, k, torch.full((n,), -1.5))  # the update reversed and more: 2.5 norms
    assert s.deposit_cross(other.peer_id, header, body)[0] == Code.MALFORMED  # type: ignore[attr-defined]
    assert "lies 2.5" in s.void and s.refused == {(k, 0): designee.peer_id}  # type: ignore[attr-defined]

    async def go() -> None:
        try:
            await s.wait_for(lambda: False, clock.now() + 60.0, "the means")  # type: ignore[attr-defined]
        except RoundFailed as e:
            assert "lies" in str(e)
            return
        raise AssertionError("the round was not void")

    asyncio.run(asyncio.wait_for(go(), 5.0))


def test_a_reducer_signing_its_own_values_must_sign_exactly_its_groups_result() -> None:
    """When no designee took a sub-piece, its reducer signs the group's own values (``fallen_back``):
    members took whatever bytes it signed, so an attacker reducer that its auditor approved could
    apply anything to its group. Now a member applies only the sub-piece of the checked result."""
    me, other, designee = Identity.generate(), Identity.generate(), Identity.generate()
    s, shard_of, n = _cross_session(me, other, designee)
    k = shard_of[other.peer_id]
    header, body = _mean_out(other, k, torch.full((n,), 1.01), groups=1)  # near, but not our result
    code, why = s.deposit_cross(other.peer_id, header, body)  # type: ignore[attr-defined]
    assert code == Code.MALFORMED and "not" in why and s.void  # type: ignore[attr-defined]
    s2, shard_of, n = _cross_session(me, other, designee)
    k = shard_of[other.peer_id]
    header, body = _mean_out(other, k, torch.ones(n), groups=1, body=s2.shards[k].result)  # type: ignore[attr-defined]
    assert s2.deposit_cross(other.peer_id, header, body) == (Code.OK, "")  # type: ignore[attr-defined]


@dataclass
class _Witnessing:
    """A witness's desk for sub-piece (0, 0) of round 3 among ``designees`` (the plan's first two
    ranked are the designee it checks and itself), and how to make that sub-piece's messages."""
    d: Desk
    ctx: SimpleNamespace
    plan: Any
    primary: str
    witness: str
    numel: int  # values in the sub-piece
    codec: Any
    signer: Identity  # the designee's identity: it signs the mean it asks the witness to countersign

    def sub_piece(self, reducer: Identity, group: str, values: torch.Tensor) -> tuple[dict[str, object], bytes]:
        """A group of one's sub-piece, as its reducer sends it to both designees, with its own word."""
        word = {reducer.peer_id: ("0" * 32, sign_part(reducer, Where(RUN, 3, group, 0), "0" * 32))}
        body = bytes(self.codec.encode(values))
        return (signed(reducer, {"type": "cross", "shard": 0, "sub": 0, "members": [reducer.peer_id], "weight": 1,
                                 "result": hashlib.sha256(body).hexdigest(), "enc": MAX_GROUP, "attest": False,
                                 "ok": True, "group": group, "tier": 0, "bucket": 0, "groups": 1,
                                 "vouch": vouch([reducer.peer_id], word), "witness": self.witness}), body)

    def asked(self, values: torch.Tensor | bytes, weights: dict[str, int]) -> tuple[dict[str, object], bytes]:
        """The designee's ``cross_check``: its mean (values, or their bytes) of groups with weights."""
        from hivetrain.peer.averaging.cross import message

        body = values if isinstance(values, bytes) else bytes(self.codec.encode(values))
        result = hashlib.sha256(body).hexdigest()
        sig = self.signer.sign(message(RUN, 3, BASE, 0, 0, result, sum(weights.values()), len(weights), MAX_GROUP))
        return ({"type": "cross_check", "run": RUN, "round": 3, "base": BASE, "group": ZERO, "shard": 0, "sub": 0,
                 "result": result, "weight": sum(weights.values()), "groups": len(weights), "enc": MAX_GROUP,
                 "sig": sig.hex(), "manifest": [[bytes.fromhex(g), w] for g, w in sorted(weights.items())]}, body)


def _witnessing(designees: list[Identity]) -> _Witnessing:
    spec = RunSpec(name="t", matchmaking_timeout=5.0, target_group_size=4)
    plan = dataclasses.replace(derive([ready(i.peer_id, clock.wall()) for i in designees], 3, BASE, RUN, units_=8,
                                      numel=1 << 16), witnessed=True)
    primary, witness = plan.ranked(0, 0)[:2]
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me=witness, codec=spec.codec(), bans=set(), trust=Trust(),
                          identity=next(i for i in designees if i.peer_id == witness), behaviour=HONEST,
                          header=lambda kind, round_, base, **fields: {"type": kind, "run": RUN, "round": round_,
                                                                      "base": base, **fields})
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    d.plan = d.mine = plan
    start, end = shard_bounds(1 << 16, 8)[0]
    a, b = plan.sub_bounds(start, end)[0]
    return _Witnessing(d, ctx, plan, primary, witness, b - a, ctx.codec.for_results(MAX_GROUP),
                       next(i for i in designees if i.peer_id == primary))


def test_a_witness_countersigns_only_the_mean_it_recomputes_from_the_same_groups() -> None:
    """drawn_designee: a designee on time (one of those near the anchor) signed the means it drew
    times -1, within MEAN_BOUND, and every honest peer applied them (I1 broken in 3 of 3 seeds).
    Now its mean counts only with its witness's signature: the witness holds the same groups'
    sub-pieces (their reducers sent them to both) and signs only a mean it recomputes from them with
    weights it could give; one mean per sub-piece. A mean without it is refused by every member."""
    from hivetrain.peer.averaging.cross import checked, message
    from hivetrain.peer.averaging.statements import valid

    designees = [Identity.generate() for _ in range(3)]
    reducers = [Identity.generate() for _ in range(2)]
    w = _witnessing(designees)
    d, plan, primary, witness, codec, n = w.d, w.plan, w.primary, w.witness, w.codec, w.numel
    groups = {f"{i + 1}" * 64: (r, torch.full((n,), 1.0 + 2 * i)) for i, r in enumerate(reducers)}

    def sub_piece(group: str) -> tuple[dict[str, object], bytes]:
        r, values = groups[group]
        return w.sub_piece(r, group, values)

    asked = w.asked

    async def go() -> None:
        try:
            # a mean of groups we do not hold yet: asked again later (the stream is not held meanwhile)
            code, _, sig = await d.check(primary, *asked(torch.full((n,), 2.0), dict.fromkeys(groups, 1)))
            assert code == Code.NOT_READY and not sig
            for group, (r, _) in groups.items():
                assert (await d.accept(r.peer_id, *sub_piece(group)))[0] == Code.OK
            assert d.work[(0, 0, 0)].task is None  # we are their witness: we compute no mean of our own
            true = dict.fromkeys(groups, 1)
            mean, _, _, _ = d._mean(0, 0, list(d.work[(0, 0, 0)].entries.values()))  # (what an honest designee sends)
            code, why, _ = await d.check(primary, *asked(-codec.decode(mean, n), true))  # reversed
            assert code == Code.MALFORMED and "another" in why and d.refused[(0, 0)][0] == primary
            inflated = {**true, "2" * 64: 5}  # a weight no member's word allows
            code, why, _ = await d.check(primary, *asked(torch.full((n,), 2.5), inflated))
            assert code == Code.MALFORMED and "weighs 5" in why
            outsider = next(i.peer_id for i in designees if i.peer_id not in (primary, witness))
            assert (await d.check(reducers[0].peer_id, *asked(torch.full((n,), 2.0), true)))[0] == Code.WRONG_ROLE
            assert outsider in plan.ranked(0, 0)  # (a designee, but never the witness of its own mean)
            header, body = asked(mean, true)
            code, why, sig = await d.check(primary, header, body)
            signed = message(RUN, 3, BASE, 0, 0, str(header["result"]), 2, 2, MAX_GROUP)
            assert code == Code.OK and valid(witness, bytes.fromhex(sig), signed), why
            # one mean per sub-piece: another one (here the same groups, weighed otherwise) is refused
            code, why, _ = await d.check(primary, *asked(torch.full((n,), 7.0), {**true, "2" * 64: 0}))
            assert code == Code.EQUIVOCATION
            # members and reducers apply the designee's mean only with the witness's signature
            signer = next(i for i in designees if i.peer_id == primary)
            out = {"type": "cross_out", "run": RUN, "round": 3, "base": BASE, "group": ZERO, "shard": 0, "sub": 0,
                   "result": header["result"], "weight": 2, "groups": 2, "enc": MAX_GROUP, "signer": primary,
                   "sig": signer.sign(signed).hex(), "witness": "", "wsig": ""}
            assert "no witness" in checked(out, body, plan)
            assert "witness's signature" in checked(dict(out, witness=witness, wsig=signer.sign(signed).hex()), body, plan)
            assert checked(dict(out, witness=witness, wsig=sig), body, plan) == ""
        finally:
            d.stop()

    asyncio.run(go())


def test_a_witness_refuses_a_mean_of_groups_chosen_to_leave_the_rounds_groups_out() -> None:
    """partisan_designee: a designee named one group alone, a group of one it made up of itself (no
    other member's word is needed) with an honest group's values reversed, and sent it to its
    witness too: the mean was right for the groups it named, and the witness signed it (I1 broke in
    4 of 6 seeds). Now the witness also measures the mean against its own mean of the groups it
    holds: within the groups' spread (each group's distance to its nearest other) an honest
    designee's view may differ from ours (a mean of one real group chosen among several is still
    within it: an honest group's values); a mean further off is refused."""
    designees = [Identity.generate() for _ in range(3)]
    reducers = [Identity.generate() for _ in range(4)]
    w = _witnessing(designees)
    d, primary, n = w.d, w.primary, w.numel
    d._seen([r.peer_id for r in reducers] + [primary])
    torch.manual_seed(0)
    common = torch.randn(n)
    made_up = "9" * 64
    groups = {f"{i + 1}" * 64: (r, common + 0.5 * torch.randn(n)) for i, r in enumerate(reducers)}
    signer = next(i for i in designees if i.peer_id == primary)
    groups[made_up] = (signer, -common)  # the designee itself, the update reversed

    def sub_piece(group: str) -> tuple[dict[str, object], bytes]:
        r, values = groups[group]
        return w.sub_piece(r, group, values)

    asked = w.asked

    async def go() -> None:
        try:
            for group, (r, _) in groups.items():
                assert (await d.accept(r.peer_id, *sub_piece(group)))[0] == Code.OK
            entries = d.work[(0, 0, 0)].entries
            code, why, _ = await d.check(primary, *asked(entries[made_up].body, {made_up: 1}))  # the made-up group alone
            assert code == Code.MALFORMED and "lies" in why and d.refused[(0, 0)] == (primary, why)
            # an honest designee's mean: every group it holds (the made-up one too, one row of five)
            everyone = dict.fromkeys(groups, 1)
            mean, _, _, _ = d._mean(0, 0, list(entries.values()))
            code, why, sig = await d.check(primary, *asked(mean, everyone))
            assert code == Code.OK and sig, why
        finally:
            d.stop()

    asyncio.run(go())


def test_a_witness_signs_no_mean_of_values_that_only_a_peer_it_caught_vouches_for() -> None:
    """Search seed 5,000,467: an honest peer restarted and found itself alone at its state with the
    equivocator it had convicted; each was a group of one, the equivocator was the designee and
    averaged both, and the honest witness countersigned (it checks whatever its own bans): I1 broke.
    Now a group whose every vouched member we caught is refused; the same mean of a peer we did not
    catch is signed."""
    designees = [Identity.generate() for _ in range(2)]
    w = _witnessing(designees)
    d, ctx, primary, witness, n = w.d, w.ctx, w.primary, w.witness, w.numel
    ctx.bans = {primary}
    d._seen([primary, witness])
    ids = {i.peer_id: i for i in designees}
    torch.manual_seed(0)
    groups = {"1" * 64: (ids[witness], torch.randn(n)), "2" * 64: (ids[primary], 1e3 * torch.randn(n))}

    def sub_piece(group: str) -> tuple[dict[str, object], bytes]:
        r, values = groups[group]
        return w.sub_piece(r, group, values)

    async def go() -> None:
        try:
            for group, (r, _) in groups.items():
                assert (await d.accept(r.peer_id, *sub_piece(group)))[0] == Code.OK
            entries = d.work[(0, 0, 0)].entries
            mean, _, _, _ = d._mean(0, 0, [dataclasses.replace(e, banned=False) for e in entries.values()])
            header, _ = w.asked(mean, dict.fromkeys(groups, 1))
            code, why, sig = await d.check(primary, header, mean)
            assert code == Code.MALFORMED and "a peer we caught" in why and not sig, why
            assert d.refused[(0, 0)] == (primary, why)
            ctx.bans = set()  # the same mean, from a designee we caught nothing of: signed
            code, why, sig = await d.check(primary, header, mean)
            assert code == Code.OK and sig, why
        finally:
            d.stop()

    asyncio.run(go())


def test_the_groups_spread_is_robust_to_a_group_far_off_and_to_copies() -> None:
    """What a witness allows between a designee's mean and its own (``groups_spread``): far off
    groups with less than half the weight do not widen it, copies of an honest group keep it on the
    honest groups' scale, and a group alone or with most of the weight has none."""
    from hivetrain.peer.averaging.cross import groups_spread

    torch.manual_seed(1)
    common = torch.randn(256)
    honest = [common + 0.3 * torch.randn(256) for _ in range(4)]
    base = groups_spread(honest, [1.0] * 4)
    assert 0 < base < float(common.norm())
    far = groups_spread(honest + [-50 * common], [1.0] * 5)
    assert far <= 1.2 * base  # (the far group is one row of five)
    assert groups_spread(honest + [honest[0].clone()], [1.0] * 5) <= 1.5 * base
    assert groups_spread(honest[:1], [3.0]) == 0.0
    assert groups_spread([honest[0], -50 * common], [4.0, 1.0]) == 0.0  # one group with most of the weight


def test_a_reducer_refuses_a_mean_its_designees_proof_does_not_bear_out() -> None:
    """drawn_designee with two attackers as a sub-piece's designee and witness (search seeds
    5,000,339, 5,000,350, 5,000,479, 6,000,028): the witness countersigned the mean times -1 and
    every reducer passed it on, within MEAN_BOUND. In a small round every reducer now asks the
    designee for its proof (every group it held: its reducer's signed values, the members' vouches,
    another member's signed word, the weight it counted with) and recomputes the mean: the reversed
    mean, values the designee wrote in a group's place, weight beyond the members' words, a group
    counted without another member's word, and a proof without our own group are each refused."""
    spec = RunSpec(name="t", matchmaking_timeout=5.0, target_group_size=4, aggregation="robust")
    designees = [Identity.generate() for _ in range(3)]
    plan = dataclasses.replace(derive([ready(i.peer_id, clock.wall()) for i in designees], 3, BASE, RUN, units_=8,
                                      numel=1 << 16), witnessed=True)
    assert proves(plan, spec.target_group_size)
    me = next(i for i in designees if i.peer_id == plan.ranked(0, 0)[0])
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me=me.peer_id, codec=spec.codec(), bans=set(),
                          trust=Trust(), identity=me, behaviour=HONEST)
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    d.plan = d.mine = plan
    d._seen(plan.ready)
    start, end = shard_bounds(1 << 16, 8)[0]
    a, b = plan.sub_bounds(start, end)[0]
    n, codec = b - a, ctx.codec.for_results(MAX_GROUP)
    solo, reducer, mate = Identity.generate(), Identity.generate(), Identity.generate()
    d._seen([solo.peer_id, reducer.peer_id, mate.peer_id])
    witness = plan.ranked(0, 0)[1]

    def sub_piece(group: str, members: list[Identity], values: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        names = [m.peer_id for m in members]
        words = {m.peer_id: ("0" * 32, sign_part(m, Where(RUN, 3, group, 0), "0" * 32)) for m in members}
        body = bytes(codec.encode(values))
        return ({"type": "cross", "shard": 0, "sub": 0, "members": names, "weight": len(names),
                 "result": hashlib.sha256(body).hexdigest(), "enc": MAX_GROUP, "attest": False, "ok": True,
                 "group": group, "tier": 0, "bucket": 0, "groups": 1, "vouch": vouch(names, words),
                 "witness": witness}, body)

    one, two = "1" * 64, "2" * 64

    async def go() -> None:
        try:
            h1, b1 = sub_piece(one, [solo], torch.full((n,), 1.0))
            h2, b2 = sub_piece(two, [reducer, mate], torch.full((n,), 3.0))
            assert (await d.accept(solo.peer_id, signed(solo, h1), b1))[0] == Code.OK
            assert (await d.accept(reducer.peer_id, signed(reducer, h2), b2))[0] == Code.OK
            word = signed(mate, dict(h2, attest=True, vouch=b"", witness=""))
            assert (await d.accept(mate.peer_id, word, b""))[0] == Code.OK
            unit = d.work[(0, 0, 0)]
            entries = d._weighed(0, 0, list(unit.entries.values()))
            body, weight, groups, enc = d._mean(0, 0, entries)
            header = {"shard": 0, "sub": 0, "result": hashlib.sha256(body).hexdigest(), "weight": weight,
                      "groups": groups, "enc": enc}  # (what ``proven`` reads of the signed mean)
            held = {e.group: e for e in unit.entries.values()}
            unit.out, unit.used = (header, body), [(held[e.group], e.weight) for e in entries]

            def check(mean_header: dict[str, Any], mean: bytes, own: tuple[str, str] = (two, h2["result"])) -> str:
                unit.proof = None
                unit.served.clear()
                code, why, proof = d.prove(reducer.peer_id, {"shard": 0, "sub": 0, "result": mean_header["result"]})
                assert code == Code.OK, why
                return proven(RUN, 3, BASE, 0, 0, mean_header, mean, proof, ctx.codec, "robust", n, own)

            assert check(header, body) == ""  # an honest mean: its groups' own values give it
            assert check(header, body, (one, h1["result"])) == ""  # (as the other reducer sees it)
            assert check(header, body, (two, "")) == ""  # (as a member sees it: our verdicts may differ from our reducer's)
            asked = {"shard": 0, "sub": 0, "result": header["result"]}
            assert d.prove(reducer.peer_id, asked)[0] == Code.OK  # (twice; a third time: each costs an upload)
            assert d.prove(reducer.peer_id, asked)[0] == Code.DUPLICATE
            assert d.prove(Identity.generate().peer_id, {"shard": 0, "sub": 0, "result": header["result"]})[0] == \
                Code.NOT_MEMBER  # a proof is for the members of the groups in the mean
            # the drawn_designee pair: the mean times -1, signed (its witness countersigns anything)
            flipped = bytes(codec.encode(codec.decode(body, n) * -1.0))
            flipped_header = dict(header, result=hashlib.sha256(flipped).hexdigest())
            unit.out = (flipped_header, flipped)
            assert "is another" in check(flipped_header, flipped)
            unit.out = (header, body)
            # values the designee wrote in a group's place: its reducer never signed them
            forged = dataclasses.replace(held[one], body=bytes(codec.encode(torch.full((n,), -5.0))))
            unit.used = [(forged, 1), (held[two], 2)]
            assert "not signed" in check(header, body)
            # more weight than the members' words allow, and a group counted without another member's word
            unit.used = [(held[one], 1), (held[two], 3)]
            assert "weight" in check(header, body)
            unit.used = [(held[one], 1), (dataclasses.replace(held[two], word=None), 2)]
            assert "word" in check(header, body)
            # a proof without our group (it left us out, or it is another mean)
            unit.used = [(held[two], 2)]
            assert "our group" in check(header, body, (one, h1["result"]))
        finally:
            d.stop()

    asyncio.run(go())


def test_a_designee_hands_its_signed_mean_only_to_members_of_the_groups_it_averaged() -> None:
    """A member whose reducer died after its group's sub-piece went up asks the designee for the
    mean (search seed 5,000,110: the other group applied it, ours waited for its deadline and
    re-synced). The designee hands the mean it signed, as it sent it to that group's reducer, to a
    member its reducer named, at most PROOF_SERVED times; nothing before the mean is signed, nothing
    to a stranger or for a group it never held, nothing for a group whose reducer named it witness
    (another designee averaged that one)."""
    spec = RunSpec(name="t", matchmaking_timeout=5.0, target_group_size=4, aggregation="robust")
    designees = [Identity.generate() for _ in range(3)]
    plan = dataclasses.replace(derive([ready(i.peer_id, clock.wall()) for i in designees], 3, BASE, RUN, units_=8,
                                      numel=1 << 16), witnessed=True)
    me = next(i for i in designees if i.peer_id == plan.ranked(0, 0)[0])
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me=me.peer_id, codec=spec.codec(), bans=set(),
                          trust=Trust(), identity=me, behaviour=HONEST)
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    d.plan = d.mine = plan
    reducer, mate, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    d._seen([reducer.peer_id, mate.peer_id])
    start, end = shard_bounds(1 << 16, 8)[0]
    a, b = plan.sub_bounds(start, end)[0]
    codec = ctx.codec.for_results(MAX_GROUP)
    group, other = "2" * 64, "3" * 64
    names = [reducer.peer_id, mate.peer_id]
    words = {m.peer_id: ("0" * 32, sign_part(m, Where(RUN, 3, group, 0), "0" * 32)) for m in (reducer, mate)}
    body = bytes(codec.encode(torch.full((b - a,), 3.0)))
    h = {"type": "cross", "shard": 0, "sub": 0, "members": names, "weight": 2,
         "result": hashlib.sha256(body).hexdigest(), "enc": MAX_GROUP, "attest": False, "ok": True, "group": group,
         "tier": 0, "bucket": 0, "groups": 1, "vouch": vouch(names, words), "witness": plan.ranked(0, 0)[1]}
    asked = {"shard": 0, "sub": 0, "group": group}

    async def go() -> None:
        try:
            assert (await d.accept(reducer.peer_id, signed(reducer, h), body))[0] == Code.OK
            assert d.hand(mate.peer_id, asked)[0] == Code.NOT_READY  # (no mean signed yet)
            unit = d.work[(0, 0, 0)]
            out = {"type": "cross_out", "shard": 0, "sub": 0, "result": h["result"], "group": ZERO, "signer": me.peer_id}
            unit.out = (out, body)
            code, _, header, mean = d.hand(mate.peer_id, asked)
            assert code == Code.OK and mean == body and header == dict(out, group=group)  # (as its reducer got it)
            assert d.hand(mate.peer_id, asked)[0] == Code.OK
            assert d.hand(mate.peer_id, asked)[0] == Code.DUPLICATE  # (each is the mean's bytes: twice at most)
            assert d.hand(stranger.peer_id, asked)[0] == Code.NOT_MEMBER
            assert d.hand(reducer.peer_id, dict(asked, group=other))[0] == Code.NOT_MEMBER
            unit.entries[group].witness = me.peer_id  # its reducer named us witness: another designee's mean is its
            assert d.hand(reducer.peer_id, asked)[0] == Code.NOT_MEMBER
        finally:
            d.stop()

    asyncio.run(go())


def test_a_reducer_hands_a_member_only_a_mean_it_passed_on_and_says_busy_until_then() -> None:
    """A member that lost a forward asks its reducer first: the reducer hands only a mean it passed
    on (never one it holds while it checks it or asks the next pair: BUSY, and the member waits),
    only to its group's members, and says NOT_READY once its round failed without it (then the
    member asks the designees)."""
    me, other, designee = Identity.generate(), Identity.generate(), Identity.generate()
    s, shard_of, n = _cross_session(me, other, designee)
    k = shard_of[me.peer_id]
    asked = {"shard": k, "sub": 0}
    assert s.hand(other.peer_id, asked)[0] == Code.BUSY  # type: ignore[attr-defined]
    header, body = _mean_out(designee, k, torch.full((n,), 1.5))
    assert s.deposit_cross(designee.peer_id, header, body) == (Code.OK, "")  # type: ignore[attr-defined]
    assert s.hand(other.peer_id, asked)[0] == Code.BUSY  # (held, not yet passed on)  # type: ignore[attr-defined]
    s.passed.add(k)  # type: ignore[attr-defined]
    code, _, out, mean = s.hand(other.peer_id, asked)  # type: ignore[attr-defined]
    assert code == Code.OK and mean == body and out == dict(header, group=s.group)  # type: ignore[attr-defined]
    assert s.hand(designee.peer_id, asked)[0] == Code.NOT_MEMBER  # type: ignore[attr-defined]
    s.passed.clear()  # type: ignore[attr-defined]
    s.ended = "deadline passed"  # type: ignore[attr-defined]
    assert s.hand(other.peer_id, asked)[0] == Code.NOT_READY  # type: ignore[attr-defined]


def test_a_group_that_comes_after_the_mean_is_written_gets_it_without_its_values(monkeypatch: Any) -> None:
    """Search seed 6,100,708: an honest joiner, late for its round, was grouped with the two
    attackers that came as late. The designee of each sub-piece refused their group as too late,
    but its witness (a designee asked only as witness holds no mean of its own) took it, and with
    the next pair averaged it alone: 2 of 3 parts biased, 1.2e3 x the honest deviation. Now a group
    that comes after the mean is written, to the designee or to the witness that countersigned it,
    gets that mean with both signatures, without its values (one state; as a late bucket does), and
    its sub-piece joins the proof with weight 0 so that its reducer's check finds its group there."""
    from hivetrain.peer.averaging import cross
    from hivetrain.peer.averaging.cross import checked

    sent: list[tuple[str, dict[str, Any], bytes]] = []

    async def capture(ctx: Any, round_: int, deadline: float, sends: list[Any], strict: bool) -> None:
        sent.extend(sends)

    monkeypatch.setattr(cross, "send_all", capture)
    designees = [Identity.generate() for _ in range(3)]
    reducers = [Identity.generate() for _ in range(3)]
    w = _witnessing(designees)
    d, plan, primary, n = w.d, w.plan, w.primary, w.numel
    groups = {f"{i + 1}" * 64: (r, torch.full((n,), 1.0 + 2 * i)) for i, r in enumerate(reducers)}
    late = "3" * 64

    async def go() -> None:
        try:
            for group, (r, values) in groups.items():
                if group != late:
                    assert (await d.accept(r.peer_id, *w.sub_piece(r, group, values)))[0] == Code.OK
            true = {g: 1 for g in groups if g != late}
            mean, _, _, _ = d._mean(0, 0, list(d.work[(0, 0, 0)].entries.values()))
            header, body = w.asked(mean, true)
            code, why, wsig = await d.check(primary, header, body)
            assert code == Code.OK, why
            r, values = groups[late]
            sub, own = w.sub_piece(r, late, values)
            assert await d.accept(r.peer_id, sub, own) == (Code.OK, "")  # (before: refused, or averaged alone)
            await asyncio.sleep(0)
            assert d.work[(0, 0, 0)].task is None  # no mean of our own: the late group is in none
            assert len(sent) == 1
            to, out, mean_ = sent[0]
            assert to == r.peer_id and out["group"] == late and mean_ == body  # the round's mean, not its values
            assert (out["signer"], out["witness"], out["wsig"]) == (primary, w.witness, wsig)
            assert checked(out, mean_, plan) == ""  # both signatures: what every member applies
            assert (await d.accept(r.peer_id, sub, own))[0] == Code.DUPLICATE and len(sent) == 1  # (sent once)
            other, _ = w.sub_piece(r, "4" * 64, values)  # (one late group per reducer: a header costs it nothing)
            assert (await d.accept(r.peer_id, other, own))[0] == Code.EQUIVOCATION and len(sent) == 1
            word = signed(r, dict(sub, attest=True, members=[r.peer_id]))
            assert (await d.accept(r.peer_id, word, b""))[0] == Code.NOT_MEMBER  # (a word is moot now)
            code, why, proof = d.prove(r.peer_id, {"shard": 0, "sub": 0, "result": header["result"]})
            assert code == Code.OK, why
            assert proven(RUN, 3, BASE, 0, 0, out, mean_, proof, w.ctx.codec, w.ctx.spec.aggregation, n,
                          (late, sub["result"])) == ""  # its group is in the proof, with weight 0
        finally:
            d.stop()

    asyncio.run(go())
