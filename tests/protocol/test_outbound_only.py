"""Outbound-only members: peers behind a NAT (nobody can dial them; MemoryNetwork.behind_nat) that
know it. They join groups with the open peers, send their parts, receive results and verdicts on
connections they opened, and reduce and audit nothing; the group still ends bit-identical."""

from __future__ import annotations

from hivetrain.peer.averaging.session import RoundSession
from hivetrain.peer.averaging.simulation import LocalSwarm
from hivetrain.peer.errors import RoundFailed
from tests.protocol.harness import BASE, NUMEL, assert_identical, completed, deltas, spec, story


def _sessions(swarm: LocalSwarm, round_: int) -> list[RoundSession]:
    return [p.sessions[round_] for p in swarm.peers if round_ in p.sessions]


def test_two_peers_behind_nat_train_with_the_one_open_peer_every_round() -> None:
    swarm = LocalSwarm(spec(3), NUMEL, 3, behind_nat=[1, 2])
    ids = swarm.ids()
    try:
        assert not swarm.net.dial(ids[1], ids[2]) and not swarm.net.dial(ids[2], ids[1])  # the NATs hold
        for round_ in range(3):
            results = swarm.all_reduce(round_, BASE, deltas(3, seed=round_))
            done = assert_identical(results, members=3)
            assert all(len(r.group) == 3 for r in done), story(results)
            for s in _sessions(swarm, round_):
                assert s.closed == {ids[1], ids[2]} and s.reducers == (ids[0],)
                assert s.mine == ([] if s.me != ids[0] else list(range(s.units)))
    finally:
        swarm.close()


def test_open_peers_reduce_and_audit_for_three_outbound_only_members() -> None:
    swarm = LocalSwarm(spec(5), NUMEL, 5, behind_nat=[2, 3, 4])
    ids = swarm.ids()
    try:
        ds = deltas(5)
        results = swarm.all_reduce(0, BASE, ds)
        done = assert_identical(results, members=5)
        expected = sum(ds) / 5
        assert (done[0].averaged - expected).abs().max() < 1e-3, story(results)
        sessions = _sessions(swarm, 0)
        assert {s.group for s in sessions} == {sessions[0].group}
        for s in sessions:
            assert set(s.reducers) == {ids[0], ids[1]} and s.audit  # two open members: each audits the other
            if s.me in s.closed:
                assert not s.mine and not s.audited
                assert all(p not in s.closed for p in s.applied)  # closed members hear the open ones only
    finally:
        swarm.close()


def test_peers_that_are_all_behind_nat_train_alone_without_waiting_for_each_other() -> None:
    swarm = LocalSwarm(spec(2), NUMEL, 2, behind_nat=[0, 1])
    try:
        results = swarm.all_reduce(0, BASE, deltas(2))
        done = assert_identical([r for r in results[:1]], members=1) + assert_identical(results[1:], members=1)
        assert all(r.group == (swarm.ids()[i],) for i, r in enumerate(done)), story(results)
    finally:
        swarm.close()


def test_closed_peers_never_apply_a_lone_unaudited_reducer_they_never_completed_a_round_with() -> None:
    """Review N3: dial-back lies make honest public peers believe they are closed, and the one open
    member, the attacker, reduces every shard with nobody to audit it. Closed peers with a history
    void such a round when the lone reducer is a newcomer to them (in a fresh run, with no history,
    the first test's groups still train)."""
    swarm = LocalSwarm(spec(3, allreduce_timeout=2.0), NUMEL, 3, behind_nat=[1, 2])
    ids = swarm.ids()
    try:
        for i in (1, 2):  # they completed round 0 together, without peer 0
            swarm.peers[i].ctx.trust.record_completed(0, [ids[1], ids[2]], ids[i])
        results = swarm.all_reduce(1, BASE, deltas(3, seed=1))
        for i in (1, 2):
            assert isinstance(results[i], RoundFailed), story(results)
            assert "is the only member of our group that can be dialed" in str(results[i]), story(results)
        assert not completed(results[1:])
    finally:
        swarm.close()
