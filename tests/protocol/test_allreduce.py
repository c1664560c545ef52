"""The averaging protocol end to end, in process: real averagers (matchmaking, audited all-reduce,
agreement after the round) over in-process links. Honest peers and crash faults."""

from __future__ import annotations

import time

import pytest
import torch

from hivetrain.kernels.int8 import get_codec
from hivetrain.peer.averaging.api import AverageResult, shard_bounds
from hivetrain.peer.averaging.simulation import LocalSwarm
from hivetrain.peer.errors import RoundFailed

from .harness import BASE, NUMEL, assert_identical, deltas, spec, story


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_every_member_applies_the_same_bytes(n: int) -> None:
    swarm = LocalSwarm(spec(n), NUMEL, n)
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        done = assert_identical(results, members=n)
        assert set(done[0].group) == set(swarm.ids())
        # every member applied the same: nobody asked anybody for its statements (they cost O(n x pieces))
        assert all(len(p.sessions[0].applied) == n - 1 and not p.sessions[0].statements for p in swarm.peers)
        mean = torch.stack(deltas(n)).mean(0)
        err = (done[0].averaged - mean).abs().max()
        assert err < 0.05 * mean.abs().max(), err  # int8 parts, robust aggregation of honest parts: near the mean
    finally:
        swarm.close()


def test_fp32_mean_is_exact() -> None:
    n = 3
    swarm = LocalSwarm(spec(n, compression="fp32", aggregation="mean"), NUMEL, n)
    try:
        d = deltas(n)
        results = swarm.all_reduce(0, BASE, d)
        done = assert_identical(results, members=n)
        order = done[0].group
        by_peer = dict(zip(swarm.ids(), d, strict=True))
        expected = torch.empty(NUMEL)
        codec = get_codec("fp32")
        for (a, b) in shard_bounds(NUMEL, n):
            acc = torch.zeros(b - a)
            for p in order:  # the reducer's order: the group's fixed order
                acc.add_(codec.decode(codec.encode(by_peer[p][a:b].contiguous()), b - a))
            expected[a:b] = acc.mul_(1.0 / n)
        assert torch.equal(done[0].averaged, expected)
    finally:
        swarm.close()


@pytest.mark.parametrize("how", ["mean", "robust"])
def test_sparse_rounds_are_bit_identical_and_the_mean_is_the_reducers_exact_one(how: str) -> None:
    """compression sparse: top-k parts with error feedback, results with room for every part; the
    robust audit passes honest reducers (no void shard), and with mean every member applies exactly
    the result codec's encoding of the fp32 mean of the decoded parts, shard by shard."""
    n, numel = 3, 20_000
    swarm = LocalSwarm(spec(n, compression="sparse", aggregation=how), numel, n)
    try:
        assert all(p.ctx.ef is not None for p in swarm.peers)  # sparse always carries its residual
        for r in range(2):
            d = deltas(n, numel, seed=r)
            residuals = [p.ctx.ef.residual.clone() for p in swarm.peers]  # type: ignore[union-attr]
            done = assert_identical(swarm.all_reduce(r, BASE, d), members=n)
            assert not done[0].void_ranges and not done[0].excluded
            by_peer = {p.ctx.me: d[i] + residuals[i] for i, p in enumerate(swarm.peers)}
            codec = get_codec("sparse")
            result_codec = codec.for_results(n)
            expected = torch.empty(numel)
            for (a, b) in shard_bounds(numel, swarm.peers[0].sessions[r].units):  # shards in the group's order
                acc = torch.zeros(b - a)
                for p in done[0].group:
                    acc.add_(codec.decode(codec.encode(by_peer[p][a:b].contiguous()), b - a))
                expected[a:b] = result_codec.decode(result_codec.encode(acc.mul_(1.0 / n)), b - a)
            if how == "mean":
                assert torch.equal(done[0].averaged, expected)
            else:  # robust: near the mean of the same sparse parts
                assert float((done[0].averaged - expected).norm() / expected.norm()) < 0.5
            bounds = shard_bounds(numel, swarm.peers[0].sessions[r].units)
            room = sum(min(b - a, n * codec.k) * -(-(b - a) // codec.chunk_size) for a, b in bounds)
            assert 0 < int((done[0].averaged != 0).sum()) <= room
            assert all(bool(p.ctx.ef.residual.any()) for p in swarm.peers)  # type: ignore[union-attr]
    finally:
        swarm.close()


def test_consecutive_rounds_and_trust_is_earned() -> None:
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    try:
        for r in range(3):
            assert_identical(swarm.all_reduce(r, BASE, deltas(n, seed=r)), members=n)
        trust = swarm.peers[0].ctx.trust
        assert all(trust.weight(p, 3) == 1.0 for p in swarm.ids()[1:])
    finally:
        swarm.close()


def test_members_with_another_base_never_mix() -> None:
    n = 4
    swarm = LocalSwarm(spec(n, matchmaking_timeout=1.0), NUMEL, n)
    try:
        other = "cd" * 32
        results = swarm.all_reduce(0, [BASE, BASE, other, other], deltas(n))
        for r in results:
            assert isinstance(r, AverageResult), story(results)
        assert results[0].group == results[1].group and set(results[0].group) == set(swarm.ids()[:2])
        assert set(results[2].group) == set(swarm.ids()[2:])
    finally:
        swarm.close()


def test_a_member_cut_off_after_matchmaking_voids_the_round_for_all_at_the_deadline() -> None:
    n = 3
    swarm = LocalSwarm(spec(n, allreduce_timeout=2.0), NUMEL, n)

    class CutAfterMatchmaking:
        def __init__(self) -> None:
            self.fired = False

        def at(self, point: str, round_: int) -> None:
            if point == "after_matchmaking" and not self.fired:
                self.fired = True
                swarm.net.cut.add(swarm.ids()[2])

    ended: dict[int, float] = {}
    for i, peer in enumerate(swarm.peers):  # when each one's round ended (void), on the loop's clock
        def timed(real, i=i):  # type: ignore[no-untyped-def]
            async def run(round_: int, base: str, delta: torch.Tensor) -> AverageResult:
                try:
                    return await real(round_, base, delta)  # type: ignore[no-any-return]
                finally:
                    ended[i] = time.monotonic()
            return run
        peer.average_async = timed(peer.average_async)  # type: ignore[method-assign]
    try:
        fault = CutAfterMatchmaking()
        swarm.peers[2].ctx.behaviour = type("B", (type(swarm.peers[2].ctx.behaviour),), {"at": lambda self, p, r: fault.at(p, r)})()
        t0 = time.monotonic()
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert fault.fired
        assert all(isinstance(r, RoundFailed) for r in results), story(results)
        # the two that still reach each other void together at the deadline; the one that reaches
        # nobody (every other member lost) has nobody to void with and leaves at once
        assert ended[2] - t0 < 1.5 <= min(ended[0], ended[1]) - t0, (ended, t0)
        swarm.net.cut.clear()
        assert_identical(swarm.all_reduce(1, BASE, deltas(n, seed=1)), members=n)  # the next round works again
    finally:
        swarm.close()


def test_a_member_that_decides_late_still_gets_every_part_and_the_group_completes() -> None:
    """Members decide at different times: parts sent to a member still matchmaking are answered
    NOT_READY and sent again until it has its session (nothing is held for it meanwhile)."""
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    late = swarm.peers[2]
    real = late.average_async

    async def slow_start(round_: int, base: str, delta: torch.Tensor) -> AverageResult:
        import asyncio

        await asyncio.sleep(0.8)
        return await real(round_, base, delta)

    late.average_async = slow_start  # type: ignore[method-assign]
    try:
        assert_identical(swarm.all_reduce(0, BASE, deltas(n)), members=n)
    finally:
        swarm.close()


def test_a_peer_arriving_after_the_group_decided_is_left_out_and_the_group_completes() -> None:
    n = 3
    swarm = LocalSwarm(spec(3, matchmaking_timeout=0.6), NUMEL, n)
    late = swarm.peers[2]
    real = late.average_async

    async def very_late(round_: int, base: str, delta: torch.Tensor) -> AverageResult:
        import asyncio

        await asyncio.sleep(2.5)  # after the others' window and agreement
        return await real(round_, base, delta)

    late.average_async = very_late  # type: ignore[method-assign]
    try:
        results = swarm.all_reduce(0, BASE, deltas(n))
        assert_identical(results[:2], members=2)
        assert len(results[0].group) == 2  # type: ignore[union-attr]
        assert isinstance(results[2], RoundFailed) or len(results[2].group) == 1, story(results)
    finally:
        swarm.close()


def test_the_audit_recompute_runs_ahead_next_to_the_reduce_and_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each auditor reduces its audited shard as soon as its copies are in, next to its own reduce;
    when the result arrives with the claims and digests it assumed, the audit compares against that
    instead of reducing again (``audit_shard`` never calls ``reduce_shard`` itself)."""
    from hivetrain.peer.averaging import allreduce, reduce

    calls = {"runner": 0, "audit": 0}
    real = reduce.reduce_shard

    def counted(key: str) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[key] += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]
        return wrapper

    monkeypatch.setattr(allreduce, "reduce_shard", counted("runner"))
    monkeypatch.setattr(reduce, "reduce_shard", counted("audit"))
    n = 3
    swarm = LocalSwarm(spec(n), NUMEL, n)
    try:
        assert_identical(swarm.all_reduce(0, BASE, deltas(n)), members=n)
        units = swarm.peers[0].sessions[0].units
    finally:
        swarm.close()
    assert units == 2 * n  # two pieces per member
    assert calls == {"runner": 2 * units, "audit": 0}, calls  # a reduce and a recompute ahead per shard, none inside audits


@pytest.mark.parametrize("piece_values", [1024, 1 << 21])
def test_pieces_or_whole_shards_every_member_applies_the_same_bytes(piece_values: int) -> None:
    n = 3
    swarm = LocalSwarm(spec(n, piece_values=piece_values), NUMEL, n)
    try:
        done = assert_identical(swarm.all_reduce(0, BASE, deltas(n)), members=n)
        s = swarm.peers[0].sessions[0]
        assert s.pieces == (2 if piece_values == 1024 else 1) and s.units == n * s.pieces
        assert sorted(s.mine + [k for i in range(1, n) for k in swarm.peers[i].sessions[0].mine]) == list(range(s.units))
        mean = torch.stack(deltas(n)).mean(0)
        assert (done[0].averaged - mean).abs().max() < 0.05 * mean.abs().max()
    finally:
        swarm.close()


def test_a_reducer_returns_its_first_piece_while_its_later_pieces_still_stream() -> None:
    """Pipelining, on capped uplinks (in-process, like tbf): each member reduces, signs and sends
    the result of its first piece as soon as that piece's parts are in, before the parts of its
    last piece have crossed the links; the round still ends bit-identical."""
    n = 3
    swarm = LocalSwarm(spec(n, allreduce_timeout=30.0), NUMEL, n)
    seen: dict[int, tuple[bool, bool]] = {}

    class Watch(type(swarm.peers[0].ctx.behaviour)):  # type: ignore[misc]
        def __init__(self, i: int):
            self.i = i

        def at(self, point: str, round_: int) -> None:
            if point == "before_results":
                s = swarm.peers[self.i].sessions[round_]
                seen[self.i] = (s.has_parts(s.mine[0]), s.has_parts(s.mine[-1]))

    try:
        for i, peer in enumerate(swarm.peers):
            peer.ctx.behaviour = Watch(i)
            swarm.net.rates[peer.ctx.me] = 8000.0  # bytes/s: ~9 KB of parts each, about a second
        assert_identical(swarm.all_reduce(0, BASE, deltas(n)), members=n)
        assert seen == {i: (True, False) for i in range(n)}, seen
    finally:
        swarm.close()


def test_more_pieces_than_a_group_has_members_cross_the_wire() -> None:
    """Shard indices go up to MAX_PIECES - 1 on the wire (not MAX_GROUP - 1): 2 members x 35 pieces."""
    n, numel = 2, 70_000
    # (70 sub-pieces, each to a designee and its witness: a designee's wait, a quarter of the deadline, holds
    # under a loaded machine with a deadline longer than the harness's 4 s)
    swarm = LocalSwarm(spec(n, allreduce_timeout=12.0), numel, n)
    try:
        done = assert_identical(swarm.all_reduce(0, BASE, deltas(n, numel=numel)), members=n)
        s = swarm.peers[0].sessions[0]
        assert s.units == 70 and not done[0].void_ranges, story(done)
        mean = torch.stack(deltas(n, numel=numel)).mean(0)
        assert (done[0].averaged - mean).abs().max() < 0.05 * mean.abs().max()
    finally:
        swarm.close()
