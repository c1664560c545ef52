"""Fork choice (peer/state/choose.py): strangers weigh nothing, lineages are compared by earned
weight, claimed rounds are bounded by time, and joiners count network prefixes, not identities."""

from __future__ import annotations

import hashlib
import random

import pytest

from hivetrain.peer.state.choose import (
    MAX_PER_STATE,
    Attestation,
    Clock,
    Own,
    State,
    choose,
    choose_joiner,
    plan_contacts,
    round_ceiling,
    vote_key,
)

ZERO = "0" * 64


def h(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def st(tag: str, round_: int, parent: str) -> State:
    """State ``tag`` of round ``round_`` computed from state ``parent`` (a tag, or a raw hash)."""
    return State(round_, h(tag), parent if len(parent) == 64 else h(parent))


def line(prefix: str, first: int, last: int) -> list[State]:
    """States prefix{first}..prefix{last}, each the child of the one before."""
    return [st(f"{prefix}{r}", r, f"{prefix}{r - 1}") for r in range(first, last + 1)]


def att(peer: str, state: State) -> Attestation:
    return Attestation(peer, state)


def own(states: list[State], me: str = "me", partners: tuple[str, ...] = ()) -> Own:
    return Own(me, states[-1], tuple(states), partners=frozenset(partners))


FULL = {"t1": 1.0, "t2": 1.0, "t3": 1.0}
A8, A9, A10 = line("A", 8, 10)
A11 = st("A11", 11, "A10")


def established(found: list[Attestation], mine: Own, weights: dict[str, float] | None = None,
                elapsed: float = 0.0, seen: dict[str, tuple[int, float]] | None = None,
                **kw: object) -> tuple[State | None, dict[str, str]]:
    clock = Clock(0.2, elapsed, seen or {})
    choice = choose(found, mine, FULL if weights is None else weights, clock, **kw)  # type: ignore[arg-type]
    t = choice.target
    return (None if t is None else State(t.round, t.hash, t.parent)), dict(choice.refused)


# ---- an established peer and strangers ------------------------------------------------------------


@pytest.mark.parametrize("liars", [2, 3])
@pytest.mark.parametrize("claimed", [11, 10**9])
@pytest.mark.parametrize("parent", ["A10", "Z"])  # a child of our state, or another history
def test_colluding_strangers_never_move_an_established_peer(liars: int, claimed: int, parent: str) -> None:
    honest = [att("t1", A10), att("t2", A10)]
    evil = [att(f"s{i}", st("EVIL", claimed, parent)) for i in range(liars)]
    target, refused = established(honest + evil, own([A8, A9, A10]), elapsed=5.0)
    assert target is None
    if claimed == 10**9:  # refused on sight, and attributed
        assert set(refused) == {f"s{i}" for i in range(liars)} and "beyond 37" in refused["s0"]
    else:
        assert refused == {}  # a plausible claim, but the claimants weigh nothing


def test_strangers_weigh_nothing_even_when_no_trusted_peer_speaks() -> None:
    evil = [att(f"s{i}", A11) for i in range(50)]  # 50 identities, one step ahead on our own lineage
    assert established(evil, own([A9, A10]))[0] is None


def test_an_established_peer_that_stalled_moves_forward_to_its_group() -> None:
    target, _ = established([att("t1", A10), att("t2", A10)], own([A8, A9]))
    assert target == A10
    choice = choose([att("t1", A10), att("t2", A10)], own([A8, A9]), FULL, Clock(0.2, 0.0))
    assert choice.target is not None and choice.target.attesters == ("t1", "t2")
    assert "ahead on our lineage" in choice.detail


def test_a_peer_two_rounds_behind_its_only_partner_catches_up() -> None:
    # A10 is attested by nobody any more, so A11 does not link to our A9: equal weight, the later state wins
    target, _ = established([att("t1", A11)], own([A8, A9]), weights={"t1": 1.0})
    assert target == A11


def test_a_peer_that_went_alone_goes_back_to_the_trusted_majority() -> None:
    c10 = st("C10", 10, "A9")  # our lone round from A9
    choice = choose([att("t1", A10), att("t2", A10)], own([A8, A9, c10]), FULL, Clock(0.2, 0.0))
    assert choice.target is not None and choice.target.hash == A10.hash
    assert choice.detail == "lineage weight 2.00 against ours 1.00"


def test_in_a_young_run_the_keepers_self_weight_lets_the_group_pull_a_loner_back() -> None:
    """After one round together a peer's weight is 1/3. Counting ourselves as 1 would keep a loner on
    its own lineage until trust decays; StateKeeper counts us like our most trusted peer instead."""
    c10 = st("C10", 10, "A9")
    young = {"t1": 1 / 3, "t2": 1 / 3}
    assert established([att("t1", A10), att("t2", A10)], own([A9, c10]), young)[0] is None  # self = 1
    target, _ = established([att("t1", A10), att("t2", A10)], own([A9, c10]), young, self_weight=1 / 3)
    assert target == A10


def test_a_trusted_peer_behind_us_on_our_lineage_is_not_a_competitor() -> None:
    assert established([att("t1", A9), att("t2", A9)], own([A8, A9, A10]))[0] is None
    assert established([att("t1", A8)], own([A8, A9, A10]))[0] is None


def test_a_void_sibling_does_not_pull_us_while_our_partner_has_not_published() -> None:
    """We and Q completed round 9 (A10); P voided it (V10). Q's heartbeat still says A9."""
    v10 = st("V10", 10, "A9")
    weights = {"P": 1.0, "Q": 1.0, "me": 1.0}
    heartbeats = [att("P", v10), att("Q", A9)]
    assert established(heartbeats, own([A8, A9, A10], partners=("me", "Q")), weights)[0] is None
    # Q is our partner: it counts for A10 before it publishes it. Were it not, a tie settled by hash
    assert established(heartbeats, own([A8, A9, A10]), weights)[0] == (None if A10.hash < v10.hash else v10)
    # P's view: Q did not make V10 with P, so Q counts for neither side ...
    for_p = own([A8, A9, v10], "P")
    assert established([att("me", A10), att("Q", A9)], for_p, weights)[0] == \
        established([att("me", A10)], for_p, weights)[0]
    # ... and P goes over as soon as Q publishes A10
    assert established([att("me", A10), att("Q", A10)], for_p, weights)[0] == A10


def test_a_dead_peers_last_heartbeat_does_not_hold_us_on_a_lineage_we_made_alone() -> None:
    """Round 9: the victim died after matchmaking; we decided without it first and trained alone
    (L10), P and Q decided a group with it and voided (V10). The victim's last heartbeat says A9,
    the parent of both, for as long as it lives in the DHT. It counts for neither side: we move to
    the lineage of P and Q at once, not after a tie settled by hash every round until it expires."""
    v10 = st("V10", 10, "A9")
    weights = {"P": 1.0, "Q": 1.0, "victim": 1.0, "me": 1.0}
    heartbeats = [att("victim", A9), att("P", v10), att("Q", v10)]
    for tag in ("L", "M", "N"):  # whichever hash is smaller
        assert established(heartbeats, own([A8, A9, st(f"{tag}10", 10, "A9")]), weights)[0] == v10
    assert established(heartbeats, own([A8, A9, v10], "P"), weights)[0] is None  # and P stays
    # a partner that died before publishing still counts for the state its round made
    l10 = st("L10", 10, "A9")
    tie = established([att("victim", A9), att("P", v10)], own([A8, A9, l10], partners=("me", "victim")), weights)[0]
    assert tie == (None if l10.hash < v10.hash else v10)


def test_a_partition_heals_towards_more_earned_weight_not_more_rounds() -> None:
    majority, minority = ["m1", "m2", "m3"], ["n1", "n2"]
    b10, b11, b12 = line("B", 10, 12)  # the minority's side: more rounds (some of them void)
    everyone = {p: 1.0 for p in majority + minority}
    heartbeats = [att(p, A10) for p in majority] + [att(p, b12) for p in minority]
    for p in majority:  # nobody on the heavier side moves ...
        assert established(heartbeats, own([A8, A9, A10], p), everyone)[0] is None
    for p in minority:  # ... and the other side switches, back to fewer rounds
        choice = choose(heartbeats, own([b10, b11, b12], p), everyone, Clock(0.2, 0.0))
        assert choice.target is not None and choice.target.hash == A10.hash and choice.target.round == 10
        assert choice.detail == "lineage weight 3.00 against ours 2.00"


def test_a_heavier_side_far_ahead_in_rounds_pulls_the_other_side_when_time_allows() -> None:
    a30 = st("A30", 30, "A29")
    b12 = line("B", 10, 12)
    found = [att(p, a30) for p in ("m1", "m2", "m3")] + [att("n2", b12[-1])]
    everyone = {p: 1.0 for p in ("m1", "m2", "m3", "n1", "n2")}
    seen = {p: (9, 120.0) for p in ("m1", "m2", "m3")}  # before the partition, two minutes ago
    target, _ = established(found, own(b12, "n1"), everyone, seen=seen)
    assert target == a30


def test_earned_weight_beats_a_larger_number_of_weakly_trusted_peers() -> None:
    b12 = st("B12", 12, "B11")
    weights = {"old": 1.0, "new1": 0.3, "new2": 0.3, "new3": 0.3}
    found = [att("old", A10)] + [att(p, b12) for p in ("new1", "new2", "new3")]
    assert established(found, own([A9, A10]), weights)[0] is None  # 1 + 1 against 0.9


def test_equal_weights_are_broken_the_same_way_by_both_sides() -> None:
    x, y = st("X", 10, "P"), st("Y", 10, "Q")
    low, high = sorted([x, y], key=lambda s: s.hash)
    assert established([att("b", high)], own([low], "a"), {"b": 1.0})[0] is None
    assert established([att("a", low)], own([high], "b"), {"a": 1.0})[0] == low


def test_the_claimed_round_is_bounded_by_wall_clock_time() -> None:
    x13 = st("X13", 13, "X12")  # two trusted peers on another lineage, 3 rounds ahead of our 10
    found = [att("t1", x13), att("t2", x13)]
    target, refused = established(found, own([A9, A10]), elapsed=0.0)  # ceiling 10 + 2 + 0
    assert target is None and set(refused) == {"t1", "t2"} and "beyond 12" in refused["t1"]
    target, refused = established(found, own([A9, A10]), elapsed=0.2)  # one more round fits in 0.2 s
    assert target == x13 and refused == {}
    assert round_ceiling(10, 3600.0, 0.2) == 18012
    assert round_ceiling(10, float("nan"), 0.2) == round_ceiling(10, -5.0, 0.2) == 12
    _, refused = established([att("t1", st("Y", 10**9, "Z"))], own([A10]), elapsed=3600.0)
    assert set(refused) == {"t1"}  # 10**9 after an hour: refused on sight


def test_a_peer_that_fell_far_behind_catches_up_with_peers_it_saw_before() -> None:
    """At a round boundary we just reached, our own term allows our round + 2; a peer that spent a
    minute downloading is 10 rounds behind its group. What we saw of them bounds them instead."""
    a20 = st("A20", 20, "A19")
    found = [att("t1", a20), att("t2", a20)]
    target, refused = established(found, own([A9, A10]), elapsed=0.0)
    assert target is None and set(refused) == {"t1", "t2"}  # never seen: only our own term
    seen = {"t1": (10, 60.0), "t2": (10, 60.0)}  # both attested round 10 a minute ago
    assert established(found, own([A9, A10]), elapsed=0.0, seen=seen) == (a20, {})
    liar = {"t1": (10, 0.5)}  # seen at round 10 half a second ago: round 20 is impossible
    assert set(established(found, own([A9, A10]), elapsed=0.0, seen=liar)[1]) == {"t1", "t2"}
    choice = choose(found, own([A9, A10]), FULL, Clock(0.2, 0.0, seen))
    assert set(choice.seen) == {("t1", 20), ("t2", 20)}  # what the caller remembers for next time
    with pytest.raises(ValueError, match="min_round_s"):
        Clock(0.0, 0.0)


def test_a_state_of_round_zero_can_be_chosen() -> None:
    other = State(0, h("other init"), ZERO)  # another initial state, attested by our whole group
    target, _ = established([att("t1", other), att("t2", other)], own([State(0, h("init"), ZERO)]))
    assert target == other


def test_a_poisoned_state_is_never_chosen_and_our_own_heartbeat_is_ignored() -> None:
    found = [att("t1", A10), att("t2", A10), att("me", st("OLD", 3, "x"))]
    assert established(found, own([A8, A9]), exclude={A10.hash})[0] is None
    assert established(found, own([A8, A9]))[0] == A10


def test_the_rule_does_not_depend_on_the_order_of_heartbeats() -> None:
    b12 = st("B12", 12, "B11")
    found = [att("t1", A10), att("t2", b12), att("t3", b12), att("s1", A11), att("s2", A11)]
    expected = established(found, own([A9, A10]))
    assert expected[0] == b12
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(found)
        assert established(found, own([A9, A10])) == expected


# ---- joiners: network prefixes, not identities ----------------------------------------------------

HONEST_ADDRS = ["/ip4/203.0.113.7/tcp/1", "/ip4/198.51.100.9/tcp/1", "/ip4/192.0.2.200/tcp/1"]
H5 = st("H5", 5, "H4")
FRESH = own([State(0, h("init"), ZERO)], "joiner")


def joiner(found: list[Attestation], addrs: dict[str, list[str]], mine: Own = FRESH) -> State | None:
    """Plans contacts, lets every planned attester 'serve', and counts them as their addresses vote."""
    plan = plan_contacts(found, mine, salt=b"secret")
    votes = {p: vote_key(addrs[p]) for peers in plan.values() for p in peers}
    t = choose_joiner(plan, mine, votes).target
    return None if t is None else State(t.round, t.hash, t.parent)


@pytest.mark.parametrize("liars", [2, 3])
@pytest.mark.parametrize("claimed", [6, 10**9])
@pytest.mark.parametrize("liar_prefixes", [1, 2])
def test_colluders_on_fewer_prefixes_lose_a_joiner(liars: int, claimed: int, liar_prefixes: int) -> None:
    honest = {f"h{i}": [a] for i, a in enumerate(HONEST_ADDRS)}
    evil = {f"s{i}": [f"/ip4/100.{10 + i % liar_prefixes}.0.{i + 1}/tcp/1"] for i in range(liars)}
    found = [att(p, H5) for p in honest] + [att(p, st("EVIL", claimed, "H5")) for p in evil]
    assert joiner(found, {**honest, **evil}) == H5


def test_more_identities_on_one_prefix_are_one_vote() -> None:
    evil = {f"s{i}": [f"/ip4/100.20.0.{i + 1}/tcp/1"] for i in range(30)}  # 30 identities, one /24
    honest = {"h0": [HONEST_ADDRS[0]], "h1": [HONEST_ADDRS[1]]}
    found = [att(p, H5) for p in honest] + [att(p, st("EVIL", 6, "H5")) for p in evil]
    assert joiner(found, {**honest, **evil}) == H5
    plan = plan_contacts(found, FRESH, b"s")
    choice = choose_joiner(plan, FRESH, {p: vote_key(a) for p, a in {**honest, **evil}.items()})
    assert choice.detail == "attested by 2 network prefixes/IPs (2 identities)"


def test_relayed_attesters_vote_once_per_relay_prefix() -> None:
    """Review N6: 32 identities reachable only through relays on 32 IPs of one /24 were 32 votes
    and took a joiner from 20 honest /24s; they are one vote now (a private relay: one per IP)."""
    relayed = {f"s{i}": [f"/ip4/100.20.0.{i + 1}/tcp/4001/p2p/{RELAY}/p2p-circuit"] for i in range(32)}
    assert {vote_key(a) for a in relayed.values()} == {"relay:100.20.0.0/24"}
    honest = {f"h{i}": [f"/ip4/198.{i}.100.9/tcp/1"] for i in range(20)}
    found = [att(p, H5) for p in honest] + [att(p, st("EVIL", 6, "H5")) for p in relayed]
    assert joiner(found, {**honest, **relayed}) == H5
    lan = ["/ip4/192.168.1.5/tcp/4001/p2p/" + RELAY + "/p2p-circuit", "/ip4/192.168.1.6/tcp/4001/p2p/" + RELAY
           + "/p2p-circuit"]
    assert [vote_key([a]) for a in lan] == ["ip:192.168.1.5", "ip:192.168.1.6"]


RELAY = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_on_one_host_identities_decide_then_rounds() -> None:
    """Loopback is exempt from prefixes: one vote per IP, so every state here has one vote."""
    loop = ["/ip4/127.0.0.1/tcp/1"]
    found = [att("h0", H5), att("h1", H5), att("s0", st("EVIL", 9, "x"))]
    assert joiner(found, {p: loop for p in ("h0", "h1", "s0")}) == H5  # 2 identities against 1
    found += [att("s1", st("EVIL", 9, "x")), att("s2", st("EVIL", 9, "x"))]
    assert joiner(found, {p: loop for p in ("h0", "h1", "s0", "s1", "s2")}).round == 9  # documented limit
    tie = [att("a", st("R5", 5, "x")), att("b", st("R7", 7, "y"))]
    assert joiner(tie, {"a": loop, "b": loop}).round == 7  # then the higher round


def test_a_joiner_keeps_its_state_when_nobody_verifiably_attests_another() -> None:
    found = [att("s0", st("EVIL", 6, "x"))]
    plan = plan_contacts(found, FRESH, b"s")
    assert choose_joiner(plan, FRESH, {}).target is None  # s0 served no manifest: no vote
    assert choose_joiner(plan, FRESH, {"s0": None}).target is None  # no IP connection: no vote
    assert choose_joiner({}, FRESH, {}).target is None


def test_a_resumed_peer_without_history_prefers_the_state_the_run_attests() -> None:
    mine = own([st("OLD", 50, "OLD49")], "joiner")
    assert joiner([att("h0", H5)], {"h0": [HONEST_ADDRS[0]]}, mine) is None  # 1 vote each, 1 id each: round 50
    found = [att("h0", H5), att("h1", H5)]
    assert joiner(found, {"h0": [HONEST_ADDRS[0]], "h1": [HONEST_ADDRS[1]]}, mine) == H5


def test_a_joiner_never_goes_back_along_its_own_lineage() -> None:
    """A peer without earned trust that just finished round 1 from the initial state: the others'
    heartbeats still attest the initial state (they have not published yet). They are behind, and
    their votes are ours."""
    init = State(0, h("init"), ZERO)
    mine = own([init, st("S1", 1, init.hash)], "p0")
    loop = ["/ip4/127.0.0.1/tcp/1"]
    assert joiner([att(p, init) for p in ("p1", "p2", "p3")], {p: loop for p in ("p1", "p2", "p3")}, mine) is None
    other = st("X1", 1, init.hash)  # a sibling of ours, attested from more prefixes than ours (self + p4)
    found = [att("p1", other), att("p2", other), att("p3", other), att("p4", init)]
    addrs = {f"p{i + 1}": [a] for i, a in enumerate([*HONEST_ADDRS, "/ip4/100.20.0.1/tcp/1"])}
    assert joiner(found, addrs, mine) == other


def test_a_joiner_is_not_held_on_a_round_it_trained_alone_by_a_heartbeat_behind_it() -> None:
    """A joiner synced H5 and trained round 5 alone (J6): the run's group made T6. The last
    heartbeat of a peer that died at H5 is behind the joiner; it is no vote for J6."""
    j6, t6 = st("J6", 6, "H5"), st("T6", 6, "H5")
    mine = own([H5, j6], "joiner")
    loop = ["/ip4/127.0.0.1/tcp/1"]
    found = [att("dead", H5), att("p1", t6), att("p2", t6)]
    assert joiner(found, {p: loop for p in ("dead", "p1", "p2")}, mine) == t6
    assert joiner([att("dead", H5)], {"dead": loop}, mine) is None  # and never back to H5


def test_a_peer_restarted_ahead_of_the_run_does_not_take_a_lone_attackers_sibling_of_its_state() -> None:
    """Search seed 6,200,418: a peer restarted with no trust held J1, its own child of H0, where the
    run was (its round 0 was void; so were everyone's). H0 was behind it, so its 9 attesters on 9
    prefixes counted for nothing, and one attacker's A1, another child of H0, tied with the joiner's
    own vote: the smaller hash (ground) won, then the attacker's A2, and the peer trained on the
    attacker's lineage (2e12 x the honest deviation). A state no more prefixes attest than a state
    behind us does not take us; past the run's own next state it does."""
    h0, j1 = st("H0", 0, ZERO), st("J1", 1, "H0")
    mine = own([h0, j1], "joiner")
    for tag in ("A1", "B1"):  # its hash below and above ours
        lone = st(tag, 1, "H0")
        found = [att(f"h{i}", h0) for i in range(9)] + [att("attacker", lone)]
        addrs = {f"h{i}": [f"/ip4/20.0.{i}.5/tcp/1"] for i in range(9)} | {"attacker": ["/ip4/200.0.0.7/tcp/1"]}
        assert joiner(found, addrs, mine) is None, tag
        assert (joiner([att("attacker", lone)], addrs, mine) is None) == (h("J1") < h(tag))  # (alone: as before)
    assert h("A1") < h("J1") < h("B1")
    run = st("R1", 1, "H0")  # the run's next state, attested by more prefixes than H0 still is: taken
    found = [att(f"h{i}", h0) for i in range(3)] + [att(f"h{i}", run) for i in range(3, 9)]
    assert joiner(found, {f"h{i}": [f"/ip4/20.0.{i}.5/tcp/1"] for i in range(9)}, mine) == run


def test_a_lone_state_loses_a_tie_to_a_group_state_whose_other_attester_is_behind_nat() -> None:
    """We trained round 5 alone (J6); an open peer and a peer behind NAT made T6 together. The NATed
    attester cannot be dialed (no vote), so T6 and J6 have one vote each: the state more peers
    attest wins, whichever hash is smaller."""
    for tag in ("M6", "Z6"):  # our lone state's hash below (M6) and above (Z6) theirs
        j6, t6 = st(tag, 6, "H5"), st("T6", 6, "H5")
        mine = own([H5, j6], "joiner")
        found = [att("open", t6), att("natted", t6)]
        plan = plan_contacts(found, mine, salt=b"secret")
        votes = {"open": vote_key([HONEST_ADDRS[0]])}  # the NATed attester served nothing
        target = choose_joiner(plan, mine, votes).target
        assert target is not None and target.hash == t6.hash, tag
    assert h("M6") < h("T6") < h("Z6")
    lone = st("L6", 6, "H5")  # another lone state: one vote, one claim each, the smaller hash decides as before
    plan = plan_contacts([att("open", lone)], own([H5, st("J6", 6, "H5")], "joiner"), salt=b"secret")
    target = choose_joiner(plan, own([H5, st("J6", 6, "H5")], "joiner"), {"open": vote_key([HONEST_ADDRS[0]])}).target
    assert (target is None) == (h("J6") < h("L6"))


def test_contacts_are_bounded_and_spread_over_states() -> None:
    found = [att(f"p{i}", H5) for i in range(50)] + [att("q0", st("Q", 5, "x"))]
    plan = plan_contacts(found, FRESH, b"s")
    assert len(plan[H5]) == MAX_PER_STATE and len(plan[st("Q", 5, "x")]) == 1
    three = [att(f"a{i}", st("A", 5, "x")) for i in range(3)] + [att(f"b{i}", st("B", 5, "x")) for i in range(3)]
    small = plan_contacts(three + [att("c0", st("C", 5, "x"))], FRESH, b"s", budget=5)
    assert sorted(len(p) for p in small.values()) == [1, 2, 2]  # every state before any second contact
    assert plan_contacts(found, FRESH, b"one")[H5] != plan_contacts(found, FRESH, b"two")[H5]  # salted sample
    assert plan_contacts(found, FRESH, b"s", exclude={H5.hash}).keys() == {st("Q", 5, "x")}


def test_vote_keys() -> None:
    assert vote_key(["/ip4/203.0.113.7/tcp/4001"]) == "203.0.113.0/24"
    assert vote_key(["/ip6/2001:db8:1:2::5/tcp/4001"]) == "2001:db8:1::/48"
    assert vote_key(["/ip4/127.0.0.1/tcp/4001"]) == "ip:127.0.0.1"
    assert vote_key(["/ip4/10.1.2.3/tcp/1", "/ip4/203.0.113.7/tcp/1"]) == "203.0.113.0/24"  # public first
    relayed = "/ip4/198.51.100.7/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit"
    assert vote_key([relayed]) == "relay:198.51.100.0/24"  # one vote per relay prefix
    assert vote_key([]) is None and vote_key(["/dns4/example.org/tcp/1"]) is None


# ---- the keeper at a round boundary ---------------------------------------------------------------


def test_a_dht_timeout_at_a_round_boundary_keeps_our_state_and_training() -> None:
    """A heartbeat read past its deadline used to escape catch_up and stop the peer."""
    from hivetrain.dht.errors import DHTTimeout
    from hivetrain.peer.state.keeper import StateKeeper
    from hivetrain.peer.trust import Trust

    class SlowDHTSync:
        class dht:
            peer_id = "me"

        def check(self, *_: object, **__: object) -> None:
            raise DHTTimeout("DHT operation timed out after 15.0 s")

    said: list[str] = []
    keeper = StateKeeper(SlowDHTSync(), Trust(), None, timeout=1.0, min_round_s=0.2,  # type: ignore[arg-type]
                         log=said.append)
    assert keeper.catch_up(3, "ab" * 32) is None
    assert len(said) == 1 and "timed out" in said[0] and "keeping our state" in said[0], said


def test_a_peer_without_the_runs_weights_never_votes_for_its_own_state() -> None:
    """A peer that built the architecture without the run's initial weights holds no state of the
    run: on one host (one IP, one vote per state) a tie would otherwise keep its random state at
    round 0 half of the time (by hash); unheld, it takes what the run attests, and nothing if nobody does."""
    start = State(0, h("start"), ZERO)
    for tag in ("a", "b", "c", "d"):  # whatever its random state hashes to
        bare = Own("joiner", State(0, h(tag), ZERO), (), held=False)
        assert joiner([att("owner", start)], {"owner": ["/ip4/127.0.0.1/tcp/1"]}, bare) == start
    bare = Own("joiner", State(0, h("zz"), ZERO), (), held=False)
    assert choose_joiner({}, bare, {}).target is None
    plan = plan_contacts([att("owner", start)], bare, b"s")
    assert choose_joiner(plan, bare, {}).target is None  # the owner did not serve: still nothing to take
    # the same tie, held: its own state keeps its vote and stays (the hazard ``held=False`` removes)
    outcomes = {joiner([att("owner", start)], {"owner": ["/ip4/127.0.0.1/tcp/1"]},
                       Own("joiner", State(0, h(t), ZERO), ())) for t in ("a", "b", "c", "d")}
    assert None in outcomes
