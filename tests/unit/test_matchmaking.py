"""Leaderless group formation (peer/matchmaking.py): View merging, reconcile_step, and an in-memory
simulation of several peers reconciling their views the way P2PAverager does."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest

from hivetrain.peer.averaging.views import Reply, View, reconcile_step

BASE = "ab" * 32


def _view(me: str, members: Iterable[str], excluded: Iterable[str] = ()) -> View:
    return View(round=1, base=BASE, me=me, members=set(members), excluded=set(excluded))


def _reply(members: Iterable[str], excluded: Iterable[str] = (), decided: bool = False) -> Reply:
    return Reply(frozenset(members), frozenset(excluded), decided)


# ---- View -----------------------------------------------------------------------------------------


def test_view_always_contains_me() -> None:
    v = View(round=0, base=BASE, me="A")
    assert v.members == {"A"} and v.effective() == frozenset({"A"})


def test_view_merge_is_a_monotone_union() -> None:
    v = _view("A", {"A", "B"})
    assert v.merge(["B", "C"], ["D"]) is True
    assert v.changed.is_set()
    assert v.members == {"A", "B", "C"} and v.excluded == {"D"}
    assert v.effective() == frozenset({"A", "B", "C"})
    v.changed.clear()
    assert v.merge(["A"], []) is False
    assert not v.changed.is_set()
    assert v.merge(["C"], ["A"]) is False  # nobody can exclude me from my own view
    assert "A" not in v.excluded


def test_view_exclude() -> None:
    v = _view("A", {"A", "B"})
    v.exclude("A")
    assert v.excluded == set() and not v.changed.is_set()
    v.exclude("B")
    assert v.excluded == {"B"} and v.changed.is_set()
    assert v.effective() == frozenset({"A"})


# ---- reconcile_step -------------------------------------------------------------------------------


def test_all_replies_equal_to_my_view_decides() -> None:
    v = _view("A", "ABC")
    group = reconcile_step(v, {"B": _reply("ABC"), "C": _reply("ABC")})
    assert group == ("A", "B", "C")
    assert v.decided == group


def test_equal_effective_views_with_exclusions_decide() -> None:
    v = _view("A", "ABCD", excluded="D")
    assert reconcile_step(v, {"B": _reply("ABCD", "D"), "C": _reply("ABC")}) == ("A", "B", "C")


def test_alone_decides_alone() -> None:
    v = _view("A", "A")
    assert reconcile_step(v, {}) == ("A",)


def test_non_answering_peer_is_excluded_without_decision() -> None:
    v = _view("A", "ABC")
    assert reconcile_step(v, {"B": _reply("ABC"), "C": None}) is None
    assert v.excluded == {"C"} and v.decided is None
    assert v.effective() == frozenset("AB")
    # next round of asking: B now agrees on {A, B}
    assert reconcile_step(v, {"B": _reply("ABC", "C")}) == ("A", "B")


def test_bigger_view_is_merged_without_decision() -> None:
    v = _view("A", "AB")
    assert reconcile_step(v, {"B": _reply("ABCD")}) is None
    assert v.members == set("ABCD") and v.decided is None
    assert reconcile_step(v, {"B": _reply("ABCD"), "C": _reply("ABCD"), "D": _reply("ABCD")}) == tuple("ABCD")


def test_reply_with_more_exclusions_is_merged_without_decision() -> None:
    v = _view("A", "ABC")
    assert reconcile_step(v, {"B": _reply("ABC", "C"), "C": _reply("ABC")}) is None
    assert v.excluded == {"C"}


def test_smaller_reply_prevents_decision() -> None:
    v = _view("A", "ABC")
    assert reconcile_step(v, {"B": _reply("AB"), "C": _reply("ABC")}) is None
    assert v.members == set("ABC") and v.excluded == set()


def test_decided_reply_containing_me_is_adopted() -> None:
    v = _view("A", "ABC")
    assert reconcile_step(v, {"B": _reply("AB", decided=True), "C": _reply("ABC")}) == ("A", "B")
    assert v.decided == ("A", "B")


def test_decided_reply_without_me_excludes_that_peer() -> None:
    v = _view("A", "ABC")
    assert reconcile_step(v, {"B": _reply("BC", decided=True), "C": _reply("ABC")}) is None
    assert v.excluded == {"B"} and v.decided is None
    assert reconcile_step(v, {"C": _reply("ABC", "B")}) == ("A", "C")


def test_no_decision_on_members_that_were_not_asked() -> None:
    """The view grows while the replies are in flight (a handler merged another peer's view): the
    peer must not decide a group containing C, which it never asked (docstring: ``replies`` maps each
    other member of the view *as it was when asked*; a peer decides when every member answered)."""
    v = _view("A", "AB")
    asked = {"B"}  # A asks B only
    v.merge(["B", "C"], [])  # meanwhile C's view reaches A through _on_view
    assert set(v.effective()) - {"A"} != asked
    group = reconcile_step(v, {"B": _reply("ABC")})
    assert group is None, f"decided {group} without ever asking C"


# ---- in-memory simulation of P2PAverager._matchmake / _on_view ------------------------------------


def _answer(asker: View, answerer: View) -> Reply:
    """What P2PAverager._on_view replies (and does to the answerer's view) for a ``view`` request."""
    if answerer.decided is not None:
        return Reply(frozenset(answerer.decided), frozenset(), True)
    answerer.merge(sorted(asker.members) + [asker.me], sorted(asker.excluded))
    return Reply(frozenset(answerer.members), frozenset(answerer.excluded), False)


def _ask_all(views: dict[str, View], me: str) -> None:
    """One iteration of the agreement loop of P2PAverager._matchmake for peer ``me``."""
    view = views[me]
    if view.decided is not None:
        return
    asked = sorted(view.effective() - {me})
    if not asked:
        view.decided = (me,)
        return
    replies: dict[str, Reply | None] = {peer: _answer(view, views[peer]) for peer in asked}
    reconcile_step(view, replies)


def _simulate(initial: dict[str, set[str]], order: Iterable[str], sweeps: int = 20) -> dict[str, tuple[str, ...] | None]:
    views = {p: _view(p, members) for p, members in initial.items()}
    order = list(order)
    for _ in range(sweeps):
        if all(v.decided is not None for v in views.values()):
            break
        for peer in order:
            _ask_all(views, peer)
    return {p: v.decided for p, v in views.items()}


INITIAL = {"A": {"A", "B"}, "B": {"A", "B", "C"}, "C": {"C", "D"}, "D": {"D"}}


def test_four_peers_from_partial_views_decide_the_same_group() -> None:
    decided = _simulate(INITIAL, "ABCD")
    groups = {g for g in decided.values() if g is not None}
    assert len(groups) == 1, decided
    assert groups == {("A", "B", "C", "D")}
    assert all(g is not None for g in decided.values())


@pytest.mark.parametrize("order", ["".join(p) for p in itertools.permutations("ABCD")])
def test_four_peers_any_order_decide_consistently(order: str) -> None:
    """Whatever the order, every peer decides, and members of one decided group all decided it
    (different orders may split the peers into disjoint groups, never into overlapping ones)."""
    decided = _simulate(INITIAL, order)
    assert all(g is not None for g in decided.values()), decided
    for peer, group in decided.items():
        assert group is not None and peer in group
        for member in group:
            assert decided[member] == group, decided
    assert set(itertools.chain.from_iterable(g for g in decided.values() if g)) == set("ABCD")


def test_four_peers_with_full_views_decide_in_one_sweep() -> None:
    full = {p: set("ABCD") for p in "ABCD"}
    views = {p: _view(p, m) for p, m in full.items()}
    _ask_all(views, "A")
    assert views["A"].decided == tuple("ABCD")
    for p in "BCD":
        _ask_all(views, p)  # each adopts A's decision from A's reply
    assert {v.decided for v in views.values()} == {tuple("ABCD")}


def test_ring_of_views_converges() -> None:
    ring = {"A": {"A", "B"}, "B": {"B", "C"}, "C": {"C", "D"}, "D": {"D", "A"}}
    decided = _simulate(ring, "ABCD")
    assert set(decided.values()) == {tuple("ABCD")}
