"""The fixed rule every peer applies to the run's attestations (peer/state_sync.py: choose)."""

from __future__ import annotations

from hivetrain.peer.state.sync import choose

A, B, C, D = (c * 64 for c in "abcd")


def hb(peer: str, round_: int, state: str) -> dict[str, object]:
    return {"peer_id": peer, "round": round_, "state_hash": state}


def test_joiner_takes_the_highest_attested_round() -> None:
    got = choose([hb("p1", 5, A), hb("p2", 5, A), hb("p3", 4, B)], "me", 0, C, quorum=2)
    assert got is not None and (got.round, got.hash, got.attesters) == (5, A, ("p1", "p2"))


def test_a_single_liar_ahead_is_not_enough_with_a_quorum_of_two() -> None:
    assert choose([hb("liar", 99, D), hb("p2", 5, A), hb("p3", 5, A)], "me", 5, A, quorum=2) is None


def test_in_step_with_the_group_nothing_moves() -> None:
    # the others have not announced round 6 yet; what they attest for 5 is what we held at 5
    assert choose([hb("p1", 5, A), hb("p2", 5, A)], "me", 6, B, quorum=2, history={5: A}) is None


def test_a_lone_peer_that_raced_ahead_goes_back_to_the_majority() -> None:
    # we went alone in round 5 (held C at 5, now B at 6); three others attest A for round 5
    got = choose([hb("p1", 5, A), hb("p2", 5, A), hb("p3", 5, A)], "me", 6, B, quorum=2, history={5: C})
    assert got is not None and (got.round, got.hash) == (5, A)


def test_equal_halves_break_the_tie_by_the_smaller_hash() -> None:
    beats = choose([hb("p1", 7, A), hb("p2", 7, A), hb("p3", 7, B)], "p4", 7, B, quorum=2)
    assert beats is not None and beats.hash == A  # our side (B, 2 attesters) loses to A's 2 on the hash
    assert choose([hb("p1", 7, A), hb("p2", 7, B), hb("p3", 7, B)], "p4", 7, A, quorum=2) is None
    assert choose([hb("p1", 7, A), hb("p2", 7, B)], "p3", 7, B, quorum=2) is None  # 2 of us against 1


def test_a_fragmented_run_still_converges() -> None:
    got = choose([hb("p1", 3, A), hb("p2", 3, B)], "me", 3, C, quorum=2)
    assert got is not None and got.hash == A


def test_a_dht_timeout_at_a_round_boundary_keeps_our_state_and_training() -> None:
    """A heartbeat read past its deadline used to escape catch_up and stop the peer."""
    from hivetrain.dht.errors import DHTTimeout
    from hivetrain.peer.state.sync import StateKeeper

    class SlowDHTSync:
        def check(self, *_: object) -> None:
            raise DHTTimeout("DHT operation timed out after 15.0 s")

    said: list[str] = []
    keeper = StateKeeper(SlowDHTSync(), None, timeout=1.0, log=said.append)  # type: ignore[arg-type]
    assert keeper.catch_up(3, "ab" * 32) is None
    assert len(said) == 1 and "timed out" in said[0] and "keeping our state" in said[0], said
