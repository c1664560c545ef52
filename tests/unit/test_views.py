"""Matchmaking's pure rules (peer/averaging/views.py), driven by a deterministic harness: every
peer holds a View, sweeps are delivered explicitly, and attackers are scripted views."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hivetrain.peer.averaging.views import (
    MAX_CANDIDATES,
    Caps,
    Report,
    View,
    answer,
    derive_group,
    fold,
    outgoing,
    partition,
    priority,
    settle,
)
from hivetrain.peer.trust import Trust

ROUND, BASE = 5, "ab" * 32


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def caps_for(me: str, trust: Trust | None = None, prefixes: dict[str, str | None] | None = None, cap: int = 0,
             banned: frozenset[str] = frozenset()) -> Caps:
    trust = trust or Trust()
    return Caps(me=me, priority=priority(ROUND, BASE, lambda p: trust.weight(p, ROUND)),
                newcomer=lambda p: trust.on_probation(p, ROUND), prefixes=prefixes or {}, max_per_prefix=cap,
                banned=banned.__contains__)


class Harness:
    """Peers with views; ``sweep`` = every undecided peer asks every member of its view once."""

    def __init__(self, peers: list[str], candidates: dict[str, set[str]],
                 caps: dict[str, Caps] | None = None, unreachable: set[tuple[str, str]] | None = None):
        self.views = {p: View(ROUND, BASE, p, set(candidates.get(p, set()))) for p in peers}
        self.caps = caps or {p: caps_for(p) for p in peers}
        self.unreachable = unreachable or set()
        self.liars: dict[str, Callable[[str], Report]] = {}  # scripted answers of attackers
        self.hints: dict[str, frozenset[str]] = {p: frozenset() for p in peers}
        self.now = 0.0  # seconds: one per sweep

    def ask(self, asker: str, peer: str) -> Report | None:
        if (asker, peer) in self.unreachable or (peer, asker) in self.unreachable:
            return None
        if peer in self.liars:
            return self.liars[peer](asker)
        if peer not in self.views:
            return None
        return answer(self.views[peer], asker, outgoing(self.views[asker], self.caps[asker]), self.caps[peer])

    def sweep(self) -> None:
        hints = self.hints
        for me, view in self.views.items():
            if view.decided is not None:
                continue
            caps = self.caps[me]
            asked = settle(view, caps) - {me}
            if not asked and not hints[me]:
                view.decided = (me,)
                continue
            replies = {p: self.ask(me, p) for p in sorted(view.askable(asked | hints[me]))}
            for p, r in replies.items():
                if p in hints[me] and r is not None and r.ready and not r.decided:
                    view.add(p)
            self.now += 1.0
            step = fold(view, asked, {p: r for p, r in replies.items() if p in asked or (r and r.decided)}, caps,
                        self.now)
            hints[me] = step.hints

    def run(self, sweeps: int = 20) -> dict[str, tuple[str, ...] | None]:
        for _ in range(sweeps):
            if all(v.decided is not None for v in self.views.values()):
                break
            self.sweep()
        return {p: v.decided for p, v in self.views.items()}


def test_full_views_decide_one_group() -> None:
    peers = ids("p", 4)
    got = Harness(peers, {p: set(peers) for p in peers}).run()
    assert set(got.values()) == {tuple(sorted(peers))}


def test_partial_views_converge_through_first_hand_hints() -> None:
    peers = ids("p", 4)
    got = Harness(peers, {"p0": {"p1"}, "p1": {"p2"}, "p2": {"p3"}, "p3": set()}).run()
    assert set(got.values()) == {tuple(sorted(peers))}


def test_alone_decides_alone() -> None:
    assert Harness(["p0"], {}).run() == {"p0": ("p0",)}


def test_an_unreachable_candidate_is_excluded_and_the_rest_agree() -> None:
    peers = ids("p", 3)
    h = Harness(peers, {p: {*peers, "ghost"} for p in peers})
    got = h.run()
    assert set(got.values()) == {tuple(sorted(peers))}
    assert all("did not answer" in v.excluded["ghost"] for v in h.views.values())


def test_members_named_by_others_are_never_taken_on_their_word() -> None:
    """An outsider's view naming 64 fake members: none of them becomes a candidate (they never answer)."""
    peers = ids("p", 3)
    fakes = ids("fake", 70)
    h = Harness([*peers], {p: set(peers) | {"x"} for p in peers})
    h.liars["x"] = lambda asker: Report(frozenset(fakes[:64]) | {"x", asker}, frozenset())
    got = h.run()
    assert set(got.values()) == {tuple(sorted(peers))}  # x names fakes that never answer; x itself never agrees
    for v in h.views.values():
        assert not set(fakes) & set(v.effective())
        assert len(outgoing(v, h.caps[v.me]).members) <= 64


def test_a_view_never_exceeds_max_group() -> None:
    me = "p0"
    view = View(ROUND, BASE, me)
    for p in ids("c", 300):
        view.add(p)
    report = outgoing(view, caps_for(me))
    assert len(report.members) == 64 and len(report.excluded) <= 64 and me in report.members


def test_full_candidates_keep_the_highest_priority_not_the_first_to_ask_review_n5() -> None:
    me = "p0"
    trust = Trust()
    trust.record_completed(ROUND - 1, [me, "partner"], me)
    caps = caps_for(me, trust)
    view = View(ROUND, BASE, me, order=caps.priority)
    flood = ids("sybil", MAX_CANDIDATES)
    for p in flood:  # silent identities that asked first: each one view request
        assert view.add(p)
    assert len(view.candidates) == MAX_CANDIDATES
    ranked = sorted(flood, key=caps.priority)
    # a stranger ranked below every one of them is refused; our partner of the last round (trust) and a
    # stranger ranked above the lowest each take the place of the lowest
    below = next(p for p in ids("late", 10_000) if caps.priority(p) > caps.priority(ranked[-1]))
    above = next(p for p in ids("late", 10_000) if caps.priority(p) < caps.priority(ranked[-1]))
    assert not view.add(below) and below not in view.candidates
    assert view.add("partner") and "partner" in view.candidates and ranked[-1] not in view.candidates
    assert view.add(above) and ranked[-2] not in view.candidates
    assert len(view.candidates) == MAX_CANDIDATES and view.evicted == 2
    # an excluded candidate gives its place first, whatever its rank
    view.exclude(ranked[0], "did not answer")
    assert view.add(below) and ranked[0] not in view.candidates and ranked[-3] in view.candidates
    assert "partner" in outgoing(view, caps).members
    # without an order (or once decided) the cap is first come, as a bound on memory
    plain = View(ROUND, BASE, me)
    for p in flood:
        plain.add(p)
    assert not plain.add("partner")


def test_a_stranger_excluding_an_established_member_only_removes_itself() -> None:
    peers = ids("p", 3)
    trust = {p: Trust() for p in peers}
    for p in peers:
        trust[p].record_completed(ROUND - 1, peers, p)  # the three completed a round together
    caps = {p: caps_for(p, trust[p]) for p in peers}
    h = Harness(peers, {p: {*peers, "x"} for p in peers}, caps=caps)
    h.liars["x"] = lambda asker: Report(frozenset({"x", asker}), frozenset(set(peers) - {asker}))
    got = h.run()
    assert set(got.values()) == {tuple(sorted(peers))}
    assert all("x" in v.excluded for v in h.views.values())


def test_newcomers_stay_fewer_than_half_of_a_group() -> None:
    me = "p0"
    trust = Trust()
    trust.record_completed(ROUND - 1, [me, "old1"], me)
    kept, dropped = caps_for(me, trust).apply([me, "old1", "new1", "new2", "new3"])
    assert set(kept) == {me, "old1", "new1"} or set(kept) == {me, "old1", kept[2]}
    assert sum(p.startswith("new") for p in kept) == 1 and len(dropped) == 2
    assert all("newcomer" in why for why in dropped.values())
    kept, dropped = caps_for(me, trust).apply([me, "new1"])  # a pair with one newcomer is allowed
    assert kept == [me, "new1"] and not dropped


def test_a_decision_is_adopted_only_inside_our_capped_view() -> None:
    trust = Trust()
    trust.record_completed(ROUND - 1, ["me", "old"], "me")
    caps = caps_for("me", trust)
    view = View(ROUND, BASE, "me", {"old", "a", "b"})
    # a decided group of us and three newcomers: outside our caps
    step = fold(view, frozenset({"old", "a", "b"}), {"a": Report(frozenset({"me", "a", "b", "c"}), frozenset(), True)},
                caps, 0.0)
    assert step.decided is None and "c" in step.hints
    view2 = View(ROUND, BASE, "me", {"old", "a"})
    step = fold(view2, frozenset({"old", "a"}), {"a": Report(frozenset({"me", "a", "old"}), frozenset(), True)}, caps, 0.0)
    assert step.decided == ("a", "me", "old")


def test_in_a_derived_group_only_a_decision_of_our_whole_view_is_adopted() -> None:
    """An attacker dealt into our derived group answers our view request "decided: {you, me}"
    (review N1): refused, and it leaves; an honest member's decision is our whole view."""
    members = {"me", "a", "b", "x"}
    view = View(ROUND, BASE, "me", members - {"me"})
    derive_group(view, members, target=4)
    assert view.allowed == frozenset(members)
    step = fold(view, frozenset({"a", "b", "x"}), {"x": Report(frozenset({"me", "x"}), frozenset(), True)},
                caps_for("me"), 0.0)
    assert step.decided is None and "cannot accept" in view.excluded["x"]
    step = fold(view, frozenset({"a", "b"}), {"a": Report(frozenset({"me", "a", "b"}), frozenset(), True)},
                caps_for("me"), 0.0)
    assert step.decided == ("a", "b", "me")


def test_an_answer_from_a_members_window_is_no_agreement_until_it_derived() -> None:
    """Search seed 5,000,206: a restarted peer, its window still open, answered our view request with
    what its window held (exactly our view), and we decided on it; it then derived a group with a
    record that reached it later, refused us, and it and an attacker forked off as a pair. Now a
    member's answer counts only once it derived its group from its board."""
    members = {"me", "a", "b"}
    board = (members - {"me"}).__contains__
    caps = Caps(me="me", priority=priority(ROUND, BASE, lambda p: 0.0), newcomer=lambda p: False, prefixes={},
                max_per_prefix=0, banned=lambda p: False, board=board)
    view = View(ROUND, BASE, "me", members - {"me"})
    derive_group(view, members, target=4)
    assert outgoing(view, caps).derived
    same = frozenset(members)
    step = fold(view, frozenset({"a", "b"}), {"a": Report(same, frozenset()),
                                             "b": Report(same, frozenset(), derived=False)}, caps, 0.0)
    assert step.decided is None
    # a member that stays in its window while we ask is left out after SILENCE, not PATIENCE
    for sweep in range(1, 12):
        fold(view, frozenset({"a", "b"}), {"a": Report(same, frozenset()),
                                           "b": Report(same, frozenset(), derived=False)}, caps, float(sweep))
        assert ("b" in view.excluded) == (sweep >= 6), (sweep, view.excluded)
    assert "derive" in view.excluded["b"]
    # and the window's own answer says it has not derived
    window = View(ROUND, BASE, "a", {"me", "b"})
    assert not answer(window, "me", outgoing(view, caps), caps).derived


def test_boards_that_differ_by_a_record_derive_groups_that_differ_by_a_few_members() -> None:
    """Dealt round robin, one record more on a peer's board moved most peers to another group, so
    honest peers that read the board a moment apart derived different partitions and voided or
    forked. Groups are runs of consecutive ranks: a group differs by the record and by one member at
    each of its two cuts at most."""
    for n in range(6, 60):
        for target in (4, 8):
            board = ids("p", n)
            before = partition(board, ROUND, BASE, target)
            assert max(map(len, before)) - min(map(len, before)) <= 1
            for late in ids("late", 8):  # (at ranks all over the order)
                after = partition([*board, late], ROUND, BASE, target)
                if len(before) == len(after):
                    for group in before:
                        assert min(len(group ^ other) for other in after) <= 3, (n, target, late, group)


def test_a_member_whose_view_holds_ours_and_more_gets_the_time_to_leave_out_the_rest() -> None:
    """Members that banned a peer and one that has not caught it yet derive the same group: the
    others must not leave out the honest one before it leaves out the peer they banned."""
    view = View(ROUND, BASE, "me", {"a", "b"})
    ours, wider = frozenset({"me", "a", "b"}), frozenset({"me", "a", "b", "x"})
    for sweep in range(5):
        fold(view, frozenset({"a", "b"}), {"a": Report(ours, frozenset()), "b": Report(wider, frozenset())},
             caps_for("me"), sweep * 0.6)
    assert "b" not in view.excluded  # 2.4 s: past PATIENCE, within twice it
    fold(view, frozenset({"a", "b"}), {"a": Report(ours, frozenset()), "b": Report(ours, frozenset())}, caps_for("me"), 3.0)
    assert view.decided == ("a", "b", "me")


def test_a_decision_with_a_member_that_stopped_answering_us_is_ours_too() -> None:
    """A member killed right after it decided with the others (and before our sweep reached it) left
    us alone: the others' decision named it, our view no longer did, and we completed a round of our
    own apart from them (a fork). Their decision is adopted when what it adds to our view are members
    of our derived group that did not answer us: we void with them at the all-reduce instead."""
    members = {"me", "a", "b", "dead"}
    view = View(ROUND, BASE, "me", members - {"me"})
    derive_group(view, members, target=4)
    fold(view, frozenset({"a", "b", "dead"}), {"a": Report(frozenset(members), frozenset()), "dead": None,
                                               "b": Report(frozenset(members), frozenset())}, caps_for("me"), 0.0)
    assert view.decided is None and "dead" in view.excluded
    step = fold(view, frozenset({"a", "b"}), {"a": Report(frozenset(members), frozenset(), decided=True)},
                caps_for("me"), 1.0)
    assert step.decided == tuple(sorted(members))
    # never a member we left out for another reason, nor one outside our derived group
    other = View(ROUND, BASE, "me", members - {"me"})
    derive_group(other, members, target=4)
    other.exclude("dead", "its view and ours did not converge")
    fold(other, frozenset({"a", "b"}), {"a": Report(frozenset(members), frozenset(), decided=True)}, caps_for("me"), 0.0)
    assert other.decided is None


def test_a_decision_without_us_excludes_its_reporter() -> None:
    view = View(ROUND, BASE, "me", {"a", "b"})
    fold(view, frozenset({"a", "b"}), {"a": Report(frozenset({"a", "b"}), frozenset(), True)}, caps_for("me"), 0.0)
    assert "a" in view.excluded


@pytest.mark.parametrize("cap", [1, 2])
def test_the_prefix_cap_keeps_the_same_members_for_everyone(cap: int) -> None:
    peers = ids("p", 4)
    prefixes: dict[str, str | None] = {p: "203.0.113.0/24" for p in peers}
    caps = {p: caps_for(p, prefixes=prefixes, cap=cap) for p in peers}
    got = Harness(peers, {p: set(peers) for p in peers}, caps=caps).run()
    groups = {g for g in got.values() if g is not None}
    assert all(len(g) <= max(cap, 1) for g in groups), groups


def test_banned_peers_are_never_members() -> None:
    peers = ids("p", 3)
    caps = {p: caps_for(p, banned=frozenset({"p2"})) for p in peers[:2]}
    caps["p2"] = caps_for("p2")
    got = Harness(peers, {p: set(peers) for p in peers}, caps=caps).run()
    assert got["p0"] == got["p1"] == ("p0", "p1")


def test_peers_that_cannot_reach_each_other_split_without_attackers_winning() -> None:
    peers = ids("p", 3)
    h = Harness(peers, {p: set(peers) for p in peers}, unreachable={("p0", "p2")})
    got = h.run()
    for p, g in got.items():
        assert g is not None and p in g
        assert not {"p0", "p2"} <= set(g)


def _closed_harness(peers: list[str], closed: set[str], candidates: dict[str, set[str]]) -> Harness:
    """Closed peers cannot be dialed (nobody asks them; Harness.ask never reaches them) and say so."""
    h = Harness(peers, candidates, unreachable={(a, b) for a in closed for b in closed if a != b})
    for v in h.views.values():
        v.me_closed = v.me in closed
        for c in closed:
            v.mark(c, True)  # from their signed ready records
    return h


def test_closed_peers_agree_with_each_other_through_the_open_ones() -> None:
    peers = ["o0", "o1", "c0", "c1", "c2"]
    h = _closed_harness(peers, {"c0", "c1", "c2"}, {p: set(peers) for p in peers})
    got = h.run()
    assert set(got.values()) == {tuple(sorted(peers))}, got


def test_a_closed_member_that_never_asks_is_left_out_and_the_rest_agree() -> None:
    peers = ["o0", "o1", "c0", "c1"]
    h = _closed_harness(peers, {"c0", "c1", "gone"}, {p: {*peers, "gone"} for p in peers})
    got = h.run(40)
    assert set(got.values()) == {tuple(sorted(peers))}, got
    assert "did not ask us" in h.views["o0"].excluded["gone"]


def test_closed_peers_without_an_open_one_go_alone() -> None:
    h = _closed_harness(["c0", "c1"], {"c0", "c1"}, {"c0": {"c1"}, "c1": {"c0"}})
    assert h.run() == {"c0": ("c0",), "c1": ("c1",)}


def test_a_closed_peers_decision_is_adopted_only_inside_the_open_peers_view() -> None:
    caps = caps_for("o0")
    asks = Report(frozenset({"o0", "o1", "c0"}), frozenset(), decided=False, closed=True)
    told = Report(frozenset({"o0", "o1", "c0"}), frozenset(), decided=True, closed=True)
    view = View(ROUND, BASE, "o0", {"o1", "c0"})
    answer(view, "c0", asks, caps)  # a closed member asks first (it agrees with us), then tells us
    answer(view, "c0", told, caps)
    assert view.decided == ("c0", "o0", "o1") and "c0" in view.closed
    other = View(ROUND, BASE, "o0", {"o1", "c0"})
    answer(other, "c0", asks, caps)
    answer(other, "c0", Report(frozenset({"o0", "c0", "stranger"}), frozenset(), decided=True, closed=True), caps)
    assert other.decided is None and "cannot accept" in other.excluded["c0"]


def test_a_decision_is_never_adopted_unsolicited_nor_when_it_drops_a_member_review_n1() -> None:
    """One identity's first message, "decided: {you, me}", made every honest peer average with it
    alone (review N1); a member that asked before cannot shrink our group to a pair either."""
    caps = caps_for("o0")
    pair = Report(frozenset({"o0", "x"}), frozenset(), decided=True, closed=True)
    unsolicited = View(ROUND, BASE, "o0", {"o1", "o2"})
    answer(unsolicited, "x", pair, caps)
    assert unsolicited.decided is None and "cannot accept" in unsolicited.excluded["x"]
    alone = View(ROUND, BASE, "o0", set())  # even when we know nobody else: x never asked us before
    answer(alone, "x", pair, caps)
    assert alone.decided is None and "x" in alone.excluded
    dropping = View(ROUND, BASE, "o0", {"o1", "x"})
    answer(dropping, "x", Report(frozenset({"o0", "o1", "x"}), frozenset(), decided=False, closed=True), caps)
    answer(dropping, "x", pair, caps)  # it asked before, but its decision leaves o1 out
    assert dropping.decided is None and "cannot accept" in dropping.excluded["x"]


def test_with_derived_groups_only_peers_on_our_board_are_members_and_nothing_is_decided_before_we_derive() -> None:
    """A stock-hivemind outsider that never published a ready record asked us for our view, then told
    us "decided: {you, me}" while our window was open (our view: us and it): adopted, it skipped the
    partition and averaged with us (CI, 2026-12-05). Nobody off our board is a member, before or after
    we derive, and no decision is adopted before we derived ours."""
    board = {"o1", "o2"}
    caps = Caps(me="o0", priority=priority(ROUND, BASE, lambda p: 0.0), newcomer=lambda p: False, prefixes={},
                max_per_prefix=0, banned=lambda p: False, board=board.__contains__)
    window = View(ROUND, BASE, "o0", set())
    asks = Report(frozenset({"o0", "x"}), frozenset(), decided=False, closed=True)
    answer(window, "x", asks, caps)
    reply = answer(window, "x", Report(frozenset({"o0", "x"}), frozenset(), decided=True, closed=True), caps)
    assert window.decided is None and not reply.decided and reply.members == {"o0"}
    assert "x" in window.candidates and "board" in window.capped["x"]  # heard, never a member
    # a board peer's decision in our window is not adopted either (it is a request like any other)
    window.candidates.add("o1")
    answer(window, "o1", Report(frozenset({"o0", "o1"}), frozenset(), decided=False, closed=True), caps)
    answer(window, "o1", Report(frozenset({"o0", "o1"}), frozenset(), decided=True, closed=True), caps)
    assert window.decided is None and "o1" not in window.excluded
    # derived, and then left alone (the derived group's members did not answer): reopened to the board only
    derive_group(window, board, target=4)
    window.exclude("o2", "did not answer our view request")
    window.allowed = None
    answer(window, "y", Report(frozenset({"o0", "y"}), frozenset(), decided=False), caps)
    assert settle(window, caps) == {"o0", "o1"} and "board" in window.capped["y"]
    # after we derived, a board member's decision of exactly our view is adopted as before
    answer(window, "o1", Report(frozenset({"o0", "o1"}), frozenset(), decided=True, closed=True), caps)
    assert window.decided == ("o0", "o1")
