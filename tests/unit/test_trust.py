"""Earned trust (peer/trust.py): who completed rounds with us, what their word weighs, probation;
and the bounded ban list."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivetrain.peer.trust import RAMP, WINDOW, Bans, Trust


def test_a_node_without_history_trusts_everyone_and_weighs_nobody() -> None:
    t = Trust()
    assert not t.on_probation("X", 0) and not t.on_probation("X", 7)
    assert t.weight("X", 7) == 0.0 and not t.has_history(7)


def test_newcomers_are_on_probation_until_they_complete_a_round_with_us() -> None:
    t = Trust()
    t.record_completed(3, ["me", "A", "B"], "me")
    assert not t.on_probation("A", 4) and t.on_probation("N", 4)
    t.record_completed(4, ["me", "A", "N"], "me")  # N sat through round 4
    assert not t.on_probation("N", 5)
    assert t.on_probation("N", 4)  # history counts only before the round


def test_weight_ramps_with_rounds_together_and_decays_after_the_window() -> None:
    t = Trust()
    for r in range(RAMP + 2):
        t.record_completed(r, ["me", "A"], "me")
        assert t.weight("A", r + 1) == min(r + 1, RAMP) / RAMP
    last = RAMP + 1
    assert t.weight("A", last + WINDOW) == 1.0 and t.weight("A", last + WINDOW + 1) == 0.0
    assert t.trusted(last + 1) == {"A": 1.0}


def test_a_round_alone_vets_nobody_and_we_never_trust_ourselves() -> None:
    t = Trust()
    t.record_completed(1, ["me"], "me")
    assert not t.has_history(2) and len(t) == 0
    t.record_completed(2, ["me", "A"], "me")
    assert t.weight("me", 3) == 0.0 and len(t) == 1


def test_least_recently_seen_peers_are_forgotten() -> None:
    t = Trust(max_known=2)
    t.record_completed(1, ["me", "A", "B"], "me")
    t.record_completed(2, ["me", "C"], "me")  # A was the least recently seen
    assert len(t) == 2 and t.weight("A", 3) == 0.0 and t.on_probation("A", 3)
    with pytest.raises(ValueError, match="max_known"):
        Trust(max_known=0)


@given(st.lists(st.tuples(st.integers(0, 20), st.lists(st.sampled_from("ABCDEFG"), max_size=4, unique=True)),
                max_size=20), st.integers(0, 25), st.sampled_from("ABCDEFGXYZ"))
@settings(max_examples=200, deadline=None)
def test_trust_properties(history: list[tuple[int, list[str]]], round_: int, peer: str) -> None:
    t = Trust(max_known=5)
    for r, group in history:
        t.record_completed(r, ["me", *group], "me")
    assert len(t) <= 5
    assert 0.0 <= t.weight(peer, round_) <= 1.0
    if not any(r < round_ and group for r, group in history):
        assert not t.on_probation(peer, round_)  # no history before this round: everyone trusted


def test_bans_are_bounded_and_the_oldest_is_forgotten() -> None:
    bans = Bans(max_bans=3)
    for p in "ABCD":
        bans.ban(p, f"caught {p}")
    assert "A" not in bans and len(bans) == 3 and bans.why("D") == "caught D"
    bans.ban("B", "again")  # refreshed: now the newest
    bans.ban("E", "new")
    assert "B" in bans and "C" not in bans


def _id(n: int) -> str:
    return f"12D3KooW{n:0>4}".replace("0", "z") + "A" * 40


def test_the_ledger_and_bans_survive_a_restart_through_their_file(tmp_path) -> None:
    from hivetrain.peer.trust import LedgerFile

    said: list[str] = []
    t, b = Trust(), Bans()
    t.record_completed(3, [_id(0), _id(1), _id(2)], _id(0))
    t.record_completed(5, [_id(0), _id(1)], _id(0))
    b.ban(_id(9), "sent two different parts")
    path = str(tmp_path / "run.trust.json")
    first = LedgerFile(path, "run.key", said.append)
    first.save(t, b)
    first.flush()
    t2, b2 = Trust(), Bans()
    LedgerFile(path, "run.key", said.append).load(t2, b2)
    assert t2.state() == t.state() and b2.state() == b.state()
    assert t2.has_history(6) and t2.on_probation(_id(7), 6) and not t2.on_probation(_id(2), 6)  # not a newcomer
    assert t2.weight(_id(1), 6) == 1.0 and _id(9) in b2 and b2.why(_id(9)) == "sent two different parts"
    assert said == ["trust ledger: 2 peers we completed rounds with, 1 banned"]


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"version": 1, "run": "other.key", "trust": {}, "bans": []}',
                                     b'{"version": 1, "run": "run.key", "trust": {"peers": [["x", 1, 2, 1]]}, "bans": []}',
                                     b'{"version": 1, "run": "run.key", "trust": {"peers": [], "our_first": -1}, "bans": []}',
                                     b'{"version": 1, "run": "run.key", "trust": {"peers": []}, "bans": [[1, 2]]}',
                                     b" " * (8 * 1024 * 1024 + 1)])
def test_a_damaged_ledger_is_said_and_left_alone(tmp_path, content: bytes) -> None:
    from hivetrain.peer.trust import LedgerFile

    path = tmp_path / "run.trust.json"
    path.write_bytes(content)
    said: list[str] = []
    t, b = Trust(), Bans()
    t.record_completed(1, [_id(0), _id(1)], _id(0))
    LedgerFile(str(path), "run.key", said.append).load(t, b)
    assert len(said) == 1 and said[0].startswith("warning: ignoring the trust ledger"), said
    assert len(t) == 1 and len(b) == 0  # nothing half-loaded
    assert path.read_bytes() == content


def test_a_banned_peer_weighs_nothing_and_earns_nothing() -> None:
    """Review N9: a member banned during a round kept fork-choice weight 1 from that very round."""
    bans = Bans()
    t = Trust(banned=bans.__contains__)
    t.record_completed(3, ["me", "A", "B"], "me")
    bans.ban("B", "equivocation: signed two different results")
    assert t.weight("A", 4) == 1.0 and t.weight("B", 4) == 0.0 and t.trusted(4) == {"A": 1.0}
    t.record_completed(4, ["me", "A", "B", "C"], "me")
    bans.ban("C", "caught after the round")
    assert t.trusted(5) == {"A": 1.0}


def test_the_rounds_a_peer_began_averaging_outlive_it(tmp_path) -> None:
    from hivetrain.peer.state.checkpoint import BeganFile

    said: list[str] = []
    path = str(tmp_path / "run.began.json")
    assert BeganFile(path, said.append).marked() == set()
    first = BeganFile(path, said.append)
    for r in range(6):
        first.mark(r, f"{r:064x}")
    assert BeganFile(path, said.append).marked() == {(r, f"{r:064x}") for r in range(2, 6)}  # the last four
    (tmp_path / "run.began.json").write_text("{oops")
    assert BeganFile(path, said.append).marked() == set() and said and said[0].startswith("warning: ignoring")


def test_a_first_unattributable_failure_is_a_strike_and_one_in_a_later_round_bans() -> None:
    """An auditor that accused and then could not show its evidence may have crashed (search seed
    3,000,501 banned such an honest peer): every shard of that round fails at once, one strike; a
    failure in a later round bans, with both reasons."""
    bans = Bans(max_bans=2)
    assert not bans.strike("a", "no evidence", 1) and "a" not in bans
    assert not bans.strike("a", "no evidence of shard 2", 1)  # the same round: the same crash
    assert not bans.strike("b", "no evidence", 1)
    assert bans.strike("a", "no evidence", 2) and "a" in bans
    assert bans.why("a") == "round 2: no evidence (and in round 1: no evidence)"
    assert bans.strike("a", "again", 3)
    for p in "cde":  # strikes are bounded like bans: the oldest makes room
        bans.strike(p, "x", 1)
    assert not bans.strike("b", "again", 2) and "b" not in bans  # (its first strike was forgotten)
