"""The cross-group stage's pure rules (peer/averaging/cross.py): who the designees are, and whose
groups a designee's means wait for."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import torch

from hivetrain.dht import clock
from hivetrain.peer.averaging.api import shard_bounds
from hivetrain.peer.averaging.cross import MAX_EARLY_WORDS, Desk, derive
from hivetrain.peer.averaging.ready import MemoryReadyBoard, Ready
from hivetrain.peer.config import RunSpec
from hivetrain.peer.net.wire import ZERO, Code

RUN, BASE, OTHER = "a" * 64, "b" * 64, "c" * 64


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
    ctx = SimpleNamespace(spec=spec, run=RUN, numel=1 << 16, me="p1", codec=spec.codec(), bans=set())
    d = Desk(ctx, MemoryReadyBoard(), 3, BASE, lambda h, b: None, lambda: None)  # type: ignore[arg-type]
    d.plan = derive([ready("p1", clock.wall())], 3, BASE, RUN, units_=8, numel=1 << 16)
    group, members = "g" * 64, ["r", "a", "m"]
    start, end = shard_bounds(1 << 16, 8)[0]
    a, b = d.plan.sub_bounds(start, end)[0]
    body = ctx.codec.for_results(3).encode(torch.randn(b - a))
    result = hashlib.sha256(body).hexdigest()

    def header(shard: int, attest: bool, names: list[str], group: str = group) -> dict[str, object]:
        return {"type": "cross", "shard": shard, "sub": 0, "members": names, "weight": 3, "result": result,
                "enc": 3, "attest": attest, "ok": True, "group": group}

    async def go() -> None:
        try:
            # a word from outside the group (it names itself a member) first, then the attester's
            assert (await d.accept("x", header(0, True, [*members, "x"]), b""))[0] == Code.OK
            assert (await d.accept("a", header(0, True, members), b""))[0] == Code.OK
            assert (await d.accept("a", header(0, True, members), b""))[0] == Code.DUPLICATE
            assert d.work[(0, 0)].entries == {}  # held, nothing counted yet
            assert (await d.accept("r", header(0, False, members), body))[0] == Code.OK
            entry = d.work[(0, 0)].entries[group]
            assert entry.attested is True and entry.attester == "a" and entry.counts()
            assert not d.work[(0, 0)].early  # the held words are gone with it
            # the words held for one sub-piece are bounded: past the bound the sender is asked to come again
            for i in range(MAX_EARLY_WORDS):
                assert (await d.accept("a", header(1, True, members, group=f"{i:064x}"), b""))[0] == Code.OK
            code, why = await d.accept("a", header(1, True, members, group="f" * 64), b"")
            assert code == Code.NOT_READY and "not arrived" in why
        finally:
            d.stop()

    asyncio.run(go())
