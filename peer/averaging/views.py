"""Who is in round r's group: the pure rules each peer applies to what it learned first-hand.

A peer's view holds only first-hand knowledge:

- *candidates*: peers known to be ready for (round, base): a ready record signed by the peer's own
  libp2p key (peer/averaging/ready.py), or the peer itself asking us or answering us for that
  round and base over an authenticated stream. A peer named only in someone else's view is a
  *hint*: we ask it ourselves before it can become a candidate. Nobody is a member on another's word.
- *excluded*: peers we will not group with, for good, and why: no answer, another base, a decision
  without us, or a disagreement we resolved (below).
- *capped*: peers our caps leave out of the current member list (bans, the per-prefix cap,
  newcomers kept fewer than half, at most MAX_GROUP); recomputed whenever the list changes.
- *reports*: what each candidate last told us, first-hand.

The group is decided when every member of our effective view (candidates minus excluded and capped,
us included) answered with exactly that view. Members whose answers keep differing from a view of
ours that stands still (STRIKES sweeps and PATIENCE seconds) are reconciled without taking anyone's
word: the one member whose departure reconciles the most of them leaves, ties going to a member that
disagrees itself, then to the lower priority (earned trust first, then a hash rank nobody chooses).
So a stranger that excludes an established member only removes itself, and so does a peer that
answers with a view it never converges on. A decision another peer reports is adopted only if it
contains us, lies inside our own effective view and passes our caps. With derived groups (one model
per round) only peers ready at our base on our board are members, nothing is decided before we
derived our group from the board, an answer counts only from a member that derived its own
(``Report.derived``), and a decision is exactly our view, or our view and members of our derived
group that stopped answering us (they decided with the others; we void with them).

*Closed* peers (nobody can dial them: behind a NAT, peer/reach.py) are outbound-only members.
Nobody asks a closed peer for its view; it asks the others. So an open peer takes a closed
member's own last request as its report, and needs it to match, like an answer. A closed peer
cannot hear the other closed members: when its view holds any, it adopts the decision of an open
member, which heard them all first-hand; otherwise it decides like anyone, on the answers of all
the others, and then tells them (a request marked decided), since nobody will ask it. Whether a
peer is closed is its own claim, first-hand (its signed ready record, its requests and answers);
the claim decides only what the group derives from it: closed members reduce and audit nothing
(session.py).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from hivetrain.peer.net.prefixes import cap_by_prefix
from hivetrain.peer.net.wire import MAX_GROUP

Priority = Callable[[str], tuple[float, bytes]]  # smaller sorts first = kept first
MAX_CANDIDATES = 4 * MAX_GROUP  # peers a view keeps as candidates (the highest priority)
MAX_MARKS = 4096  # peers whose reachability and uplink claims a view keeps (a derived partition reads the board)
MAX_HINTS = 2 * MAX_GROUP  # peers named by others that we ask per round; names beyond are ignored
STRIKES = 3  # sweeps a member may disagree with a view of ours that stands still, before we act ...
PATIENCE = 1.5  # ... and seconds: a member slowed by a busy machine must not look like a liar
NO_ANSWER = "did not answer our view request"
SILENCE = 6.0  # seconds a closed member may take to ask us at all (it may still be waiting for others)


@dataclass(frozen=True)
class Report:
    """One peer's answer to our view request (or its own request), as it stated it."""

    members: frozenset[str]
    excluded: frozenset[str]
    decided: bool = False
    ready: bool = True  # False: it is not forming this round's group from this base
    closed: bool = False  # nobody can dial the reporter
    up: int = 0  # the reporter's uplink claim for the round, kB/s (0: unknown)
    # the reporter derived its group from its board (one model per round): only then are its members
    # a view it stands by; before, they are what its window holds so far (a decision implies it)
    derived: bool = True

    def effective(self) -> frozenset[str]:
        return self.members - self.excluded


@dataclass
class View:
    """One peer's evolving view of round r's group. Mutated only on the link's loop."""

    round: int
    base: str
    me: str
    candidates: set[str] = field(default_factory=set)
    excluded: dict[str, str] = field(default_factory=dict)  # peer -> why
    reports: dict[str, Report] = field(default_factory=dict)
    capped: dict[str, str] = field(default_factory=dict)  # left out by our caps now (recomputed, not sticky)
    tried: set[str] = field(default_factory=set)  # hints we asked (bounded: named peers cost one ask each)
    strikes: dict[str, tuple[int, float]] = field(default_factory=dict)  # member -> (sweeps, since) of disagreement
    decided: tuple[str, ...] | None = None
    abandoned: bool = False  # the round failed for us: we answer "decided without you" from now on
    closed: set[str] = field(default_factory=set)  # peers that say nobody can dial them (bounded like candidates)
    me_closed: bool = False  # nobody can dial us (fixed for the round)
    claims: dict[str, int] = field(default_factory=dict)  # uplink claims, first-hand (bounded like candidates)
    me_up: int = 0  # our uplink claim (fixed for the round)
    allowed: frozenset[str] | None = None  # our part of the round's derived partition (None: not derived)
    derived: bool = False  # we derived our group (``allowed`` may be None again: it left us alone)
    left_out: frozenset[str] = frozenset()  # candidates the partition put elsewhere, or nowhere (not on our board)
    order: Priority | None = None  # who keeps a place among the candidates when they are full (None: first come)
    evicted: int = 0  # candidates that gave their place to one of higher priority

    def effective(self) -> frozenset[str]:
        return frozenset((self.candidates | {self.me}) - set(self.excluded) - set(self.capped))

    def add(self, peer: str) -> bool:
        """A peer known first-hand to be ready; returns True if the view grew. When the candidates
        are full (the cap bounds memory), a newcomer of higher priority (``order``) takes the place
        of the lowest: 256 silent identities that asked first no longer keep out the peers we
        averaged with (review N5); which candidates count is then decided by the caps on effective()."""
        if peer == self.me or peer in self.candidates:
            return False
        if self.allowed is not None and peer not in self.allowed:
            return False  # another group of the round's partition
        if len(self.candidates) >= MAX_CANDIDATES:
            if self.order is None or self.decided is not None:
                return False
            order = self.order
            lowest = max(self.candidates, key=lambda p: (p in self.excluded, order(p)))  # the excluded go first
            if lowest not in self.excluded and order(peer) >= order(lowest):
                return False
            self._forget(lowest)
        self.candidates.add(peer)
        return True

    def _forget(self, peer: str) -> None:
        """Drops a candidate and what we kept of it (it may come back as a newcomer)."""
        self.candidates.discard(peer)
        for kept in (self.reports, self.capped, self.strikes, self.claims):
            kept.pop(peer, None)
        self.closed.discard(peer)
        self.evicted += 1

    def mark(self, peer: str, closed: bool, up: int = 0) -> None:
        """A peer's own, first-hand claims of whether it can be dialed and of its uplink (its
        latest ones count)."""
        if peer != self.me and (peer in self.claims or len(self.claims) < MAX_MARKS):
            self.claims[peer] = up
        if not closed:
            self.closed.discard(peer)
        elif peer != self.me and len(self.closed) < MAX_MARKS:
            self.closed.add(peer)

    def askable(self, peers: Iterable[str]) -> frozenset[str]:
        """The peers we ask for their view: nobody dials a closed peer."""
        return frozenset(peers) - self.closed - {self.me}

    def exclude(self, peer: str, why: str) -> bool:
        """Leaves ``peer`` out for good (first-hand: it failed us, or a disagreement we resolved)."""
        if peer == self.me or peer in self.excluded:
            return False
        self.excluded[peer] = why
        self.capped.pop(peer, None)
        return True


@functools.lru_cache(maxsize=16384)  # asked for every candidate at every board read and settle
def rank(round_: int, base: str, peer: str) -> bytes:
    """A per-round hash rank: shared by all members, chosen by nobody (not even by joining late)."""
    return hashlib.sha256(f"rank/{round_}/{base}/{peer}".encode()).digest()


def priority(round_: int, base: str, weight: Callable[[str], float]) -> Priority:
    """Earned trust first (higher is kept), then the hash rank."""
    return lambda peer: (-weight(peer), rank(round_, base, peer))


def partition(peers: Collection[str], round_: int, base: str, target: int) -> list[frozenset[str]]:
    """The round's groups, derived by every peer from the same board: the ready peers sorted by
    their hash rank (nobody chooses it), cut into round(n / target) runs of consecutive ranks (at
    least one), so the groups' sizes differ by one at most. One record more or less on a peer's
    board moves at most one member across each cut while the number of groups stays: a group differs
    by that record and one member at each of its two cuts at most, where dealing round robin moved
    most peers to another group (honest peers that read the board a moment apart voided or forked)."""
    ordered = sorted(set(peers), key=lambda p: rank(round_, base, p))
    count = max(1, round(len(ordered) / max(1, target)))
    cuts = [len(ordered) * i // count for i in range(count + 1)]
    return [frozenset(ordered[cuts[i]:cuts[i + 1]]) for i in range(count)]


def derive_group(view: View, ready: Collection[str], target: int) -> frozenset[str]:
    """Restricts ``view`` to our group of the partition of ``ready`` (the peers ready at our base on
    our board, first-hand: signed records) and us; returns it. Called again while the group is not
    decided, when our board grew (matchmaking.py): boards read at different moments converge."""
    ours = next(g for g in partition({*ready, view.me}, view.round, view.base, target) if view.me in g)
    view.allowed = ours
    view.derived = True
    view.left_out = frozenset(sorted((view.candidates | view.left_out) - ours - {view.me})[: 4 * MAX_GROUP])
    view.candidates = (view.candidates | ours) & ours - {view.me}
    return ours


@dataclass(frozen=True)
class Caps:
    """Our own limits on a group's members (see the module doc)."""

    me: str
    priority: Priority
    newcomer: Callable[[str], bool]  # on probation: never completed a round with us (and we have a history)
    prefixes: Mapping[str, str | None]  # as our own connections see them; None: exempt
    max_per_prefix: int
    banned: Callable[[str], bool]
    max_size: int = MAX_GROUP
    # Derived groups (one model per round): whether a peer is ready at our base on our board, a record
    # signed by its own key and read first-hand; nobody else is ever a member, not even after the
    # derived group left us alone. None: any peer ready first-hand may be (asking us is enough).
    board: Callable[[str], bool] | None = None

    def apply(self, members: Iterable[str]) -> tuple[list[str], dict[str, str]]:
        """(kept: us first, then the others in priority order; {dropped: why})."""
        ordered = sorted(set(members) - {self.me}, key=self.priority)
        dropped = {p: "banned: we caught it misbehaving" for p in ordered if self.banned(p)}
        if self.board is not None:
            dropped.update({p: "not ready at our base on our board" for p in ordered
                            if p not in dropped and not self.board(p)})
        ordered = [p for p in ordered if p not in dropped]
        if self.max_per_prefix > 0:
            position = {p: i + 1 for i, p in enumerate(ordered)}  # within a prefix, the higher priority stays
            _, capped = cap_by_prefix([self.me, *ordered], self.prefixes, self.max_per_prefix,
                                      lambda p: position.get(p, 0).to_bytes(4, "big"))
            dropped.update({p: f"not grouped: {why}" for p, why in capped.items() if p != self.me})
            ordered = [p for p in ordered if p not in dropped]
        established = 1 + sum(not self.newcomer(p) for p in ordered)
        allowed = max(established - 1, 1)  # newcomers stay fewer than half (a pair of two is the exception)
        for p in [p for p in ordered if self.newcomer(p)][allowed:]:
            dropped[p] = "newcomer: newcomers are kept fewer than half of a group"
        ordered = [p for p in ordered if p not in dropped]
        for p in ordered[self.max_size - 1:]:
            dropped[p] = f"more than {self.max_size} members"
        return [self.me, *ordered[: self.max_size - 1]], dropped

    def accepts(self, group: Iterable[str]) -> bool:
        return not self.apply(group)[1]


def resolve_disagreement(view: View, disagree: Collection[str], order: Priority) -> tuple[str, str]:
    """Members whose reports kept differing from our standing view: leaves out the one member whose
    departure reconciles the most of them (the rest must then match our view without it); ties go
    to a member that disagrees itself, then to the lower priority. A stranger that excludes an
    honest member thus only removes itself, and so does a peer answering with a view it never
    converges on. Returns (who left, why); mutates ``view``."""
    members = view.effective()

    def remaining(gone: str) -> int:
        rest = members - {gone}
        return sum(1 for m in disagree if m != gone and (r := view.reports.get(m)) is not None and r.effective() != rest)

    suspects = set(disagree)
    for m in disagree:
        report = view.reports.get(m)
        if report is not None:
            suspects |= members - report.effective()
    suspects.discard(view.me)
    rank_of = {p: i for i, p in enumerate(sorted(suspects, key=order))}  # 0: the highest priority
    loser = min(suspects, key=lambda p: (remaining(p), p not in disagree, -rank_of[p]))
    why = f"its view and ours did not converge in {STRIKES} sweeps and {PATIENCE:g} s"
    view.exclude(loser, why)
    return loser, why


@dataclass(frozen=True)
class Step:
    """The outcome of folding one sweep of replies into a view."""

    decided: tuple[str, ...] | None = None
    hints: frozenset[str] = frozenset()  # peers others named that we have not asked yet


def settle(view: View, caps: Caps) -> frozenset[str]:
    """Applies our caps to the view (exclusions are deterministic and only grow); returns the
    effective view, which then has at most ``caps.max_size`` members."""
    kept, dropped = caps.apply((view.candidates | {view.me}) - set(view.excluded))
    view.capped = dropped
    if view.me_closed and not view.askable(kept):  # a group needs a member that others can dial: ours alone
        return frozenset({view.me})
    return frozenset(kept)


def outgoing(view: View, caps: Caps) -> Report:
    """What we tell others of our view: our effective members, and the peers of interest we exclude
    (candidates and reporters), each list at most ``MAX_GROUP`` long, highest priority first."""
    effective = settle(view, caps)
    interest = (view.candidates | set(view.reports)) & (set(view.excluded) | set(view.capped))
    return Report(effective, frozenset(sorted(interest, key=caps.priority)[:MAX_GROUP]), closed=view.me_closed,
                  up=view.me_up, derived=view.derived or caps.board is None)


def fold(view: View, asked: frozenset[str], replies: Mapping[str, Report | None], caps: Caps, now: float) -> Step:
    """Folds the replies to one sweep of view requests (about ``asked``: our effective view minus
    us, at the time; its closed members are not asked, their own requests count) into ``view``;
    returns the decision, if any, and the peers to ask next.

    Hints (peers others name) are asked once each, at most MAX_HINTS per round. A member whose
    answer differs from a view of ours that stood still for STRIKES sweeps and PATIENCE seconds
    (``now`` is monotonic seconds) is dealt with (``resolve_disagreement``): nothing honest
    disagrees that long, and a peer that answers with a view it never converges on must not stall
    the others until their deadline."""
    if view.decided is not None:  # adopted meanwhile (a closed member told us its decision)
        return Step(view.decided)
    excluded_before = len(view.excluded)
    named: set[str] = set()
    known = view.candidates | set(view.excluded) | view.tried | {view.me}
    for peer, reply in replies.items():
        if reply is None:
            view.exclude(peer, NO_ANSWER)
            continue
        view.reports[peer] = reply
        view.mark(peer, reply.closed, reply.up)
        if not reply.ready:
            view.exclude(peer, "not forming this round's group from our base")
        elif reply.decided and view.me not in reply.members:
            view.exclude(peer, "decided without us")
        elif reply.decided:
            # With derived groups a decision must be exactly our view: every honest member decided
            # when all of us answered with that view, and ours only shrinks after (an attacker
            # dealt into our group would otherwise answer "decided: {you, me}": review N1)
            group = reply.members
            ours = view.effective()
            # ... or our view and members of our derived group that stopped answering us after the others
            # decided with them: we void with the others at the all-reduce, not complete a round alone
            silent = {p for p, why in view.excluded.items() if why == NO_ANSWER}
            late = view.allowed is not None and ours < group <= ours | (silent & view.allowed)
            fits = group == ours or (view.allowed is None and group <= ours) or late
            if fits and caps.accepts(group):
                view.decided = tuple(sorted(group))
                return Step(view.decided)
            if view.me_closed and not group & set(view.excluded) and view.me in group:
                continue  # members we cannot ask and have not seen on the board yet: it will show them
            if not group - known or len(view.tried) >= MAX_HINTS:
                view.exclude(peer, "decided a group we cannot accept")
            named.update(group - known)
        else:
            named.update(reply.members - known)
        if view.me_closed:  # closed peers we cannot ask: an open member that heard them (or not) decides
            for gone in sorted(reply.excluded & view.closed):
                view.exclude(gone, f"a closed peer that {peer} left out (we cannot ask it ourselves)")
    hints = frozenset(sorted(named, key=caps.priority)[: max(0, MAX_HINTS - len(view.tried))])
    view.tried.update(hints)
    members = settle(view, caps)
    everyone = asked | {view.me}
    disagree = [p for p, r in replies.items()
                if p in members and (r is None or r.decided or r.effective() != everyone or not r.derived)]
    # members still in their window (they have not derived their group: what they answer is not yet a
    # view they stand by; a member that answered with our view and derived another one after had
    # us decide a group it then refused, and a pair of it and an attacker forked off: search seed 5,000,206)
    underived = {p for p, r in replies.items() if p in members and r is not None and not r.decided and not r.derived}
    quiet: set[str] = set()  # closed members that never asked us
    if not view.me_closed:  # closed members are not asked: their last request must match, like an answer
        for p in sorted((asked & members) - view.askable(asked)):
            if (r := view.reports.get(p)) is None or r.effective() != everyone or not r.derived:
                disagree.append(p)
                if r is None:
                    quiet.add(p)
                elif not r.derived:
                    underived.add(p)
    # A closed peer cannot hear the other closed members: if there are any, it adopts the decision
    # of an open member, which heard them all first-hand (above); it never decides on its own.
    vouched = not view.me_closed or members <= view.askable(members) | {view.me}
    if not disagree and not hints and members == everyone and vouched:
        view.decided = tuple(sorted(members))
        return Step(view.decided)
    if hints or members != everyone:  # our view moved: everyone gets time to catch up with it
        view.strikes.clear()
        return Step(None, hints)
    for peer in disagree:
        sweeps, since = view.strikes.get(peer, (0, now))
        view.strikes[peer] = (sweeps + 1, since)
    # A member whose view holds ours and more (peers our caps or bans leave out, that it has not caught)
    # resolves it on its side by leaving those out: it gets the time to, before we leave it out instead
    wider = {p for p in disagree if (r := view.reports.get(p)) is not None and not r.decided and r.effective() > everyone}

    def patience(p: str) -> float:
        return SILENCE if p in quiet or p in underived else 2 * PATIENCE if p in wider else PATIENCE

    ripe = [p for p in disagree if view.strikes[p][0] >= STRIKES and now - view.strikes[p][1] >= patience(p)]
    for p in ripe:
        if p in quiet:  # crashed, or cannot reach us: like a peer that does not answer
            view.exclude(p, f"a closed member that did not ask us for our view in {SILENCE:g} s")
        elif p in underived:  # an honest window lasts matchmaking_timeout at most (5 s by default)
            view.exclude(p, f"did not derive its group in {SILENCE:g} s")
    ripe = [p for p in ripe if p not in quiet and p not in underived]
    if ripe:
        resolve_disagreement(view, ripe, caps.priority)
    if ripe or len(view.excluded) > excluded_before:
        view.strikes.clear()
    return Step(None, hints)


def answer(view: View | None, sender: str, request: Report, caps: Caps | None) -> Report:
    """Our reply to ``sender``'s view request for ``view``'s round (None: we have no view for it).
    A sender asking with our round and base is ready first-hand: it becomes a candidate (it still
    has to pass our caps)."""
    if view is None or caps is None:
        return Report(frozenset(), frozenset(), decided=False, ready=False)
    if view.abandoned:
        return Report(frozenset(), frozenset(), decided=True, closed=view.me_closed, up=view.me_up)
    if view.decided is not None:
        return Report(frozenset(view.decided), frozenset(), decided=True, closed=view.me_closed, up=view.me_up)
    if caps.board is not None and not view.derived and request.decided:
        # With derived groups nothing is decided before we derive our group from the board: a closed
        # member that derived before us tells us again by asking (its last request is its report),
        # and an identity's "decided: {you, me}" in our window no longer skips the partition
        # (it made a stock-hivemind outsider a member of an honest group: review N1, again)
        request = Report(request.members, request.excluded, decided=False, closed=request.closed, up=request.up,
                         derived=request.derived)
    if caps.banned(sender):
        view.exclude(sender, "banned: we caught it misbehaving")
    elif view.add(sender) or sender in view.candidates:  # the candidate cap bounds the reports we keep too
        view.mark(sender, request.closed, request.up)
        asked_before = sender in view.reports
        view.reports[sender] = request
        if request.decided:  # a closed member's decision: nobody asks it, so it tells us
            # Adopted only from a member that asked us before (a closed member agrees with us first)
            # and only when it is exactly our own view: a decision never drops a member we still
            # count on. (An identity's one unsolicited "decided: {you, me}" made every honest peer
            # average with it alone: review N1.)
            group = request.members
            if view.me in group and asked_before and group == view.effective() and caps.accepts(group):
                view.decided = tuple(sorted(group))
                return Report(group, frozenset(), decided=True, closed=view.me_closed, up=view.me_up)
            view.exclude(sender, "decided a group we cannot accept")
    return outgoing(view, caps)
