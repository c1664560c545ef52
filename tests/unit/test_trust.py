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
