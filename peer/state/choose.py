"""Fork choice: the state a peer should hold, from the run's attestations. Pure: no sockets, no clock.

An attestation is one verified heartbeat (peer/state/heartbeats.py): a libp2p identity says it
holds (round, hash), computed from the state ``parent``. Identities are free, so no rule below
counts identities where it matters.

**Established peer** (``choose``: it has earned trust in some peers, peer/trust.py).

1. A claim beyond what time allows is refused and reported with the claimant's id (``Clock``: our
   round + 2 + seconds since our last round boundary / ``min_round_s``, or, if larger, the same
   counted from that peer's last heartbeat we saw). 10**9 is refused at once.
2. Only trusted peers' attestations are used; a stranger weighs 0, whatever it claims.
3. States are linked into a tree by parent (a parent is one round earlier, so no cycles), our own
   recent states included. Our state weighs ``self_weight``, a trusted peer ``Trust.weight``. A
   *partner* (a member of the group whose round made our state) whose state is an ancestor of ours
   has not yet published that round: it counts for our state. Any other attester of an ancestor
   counts where it is, above the fork: a peer that died before publishing, or a member of a round
   we voided or trained alone, never holds us on a lineage it did not make.
4. From the roots down, the subtree with more weight is taken at every fork (ties: the later
   latest weighted state, then its smaller hash), until no child carries weight. If that ends at
   our state we keep it; otherwise we move to where it ends: ahead on our own lineage (we stalled
   or voided), or onto another lineage with more earned weight (we went alone, or were on the
   lighter side of a partition: the heavier side wins whatever its round count).

**Joiner** (``choose_joiner``: no earned trust). Attestations are grouped by state; at most
``MAX_PER_STATE`` attesters per state (a sample salted with the joiner's secret) and
``MAX_CONTACTS`` in all are contacted (``plan_contacts``). The caller counts only those that served
a manifest matching the state they attest, each as what the connection our own daemon holds to it
says (``vote_key``): one vote per IPv4 /24 or IPv6 /48; addresses exempt from prefixes (loopback,
private, relayed) one vote per IP. The state with the most distinct votes wins; our own state has
one vote of its own. States our own history descends from (behind us) neither win nor vote for
ours: a joiner completed no round with anyone, so nobody behind it is a partner (a dead peer's
last heartbeat must not hold it on a lineage it trained alone); but a state no more prefixes attest
than the best-attested state behind us does not take us either (we keep ours: the run is behind us,
and will move past it). Ties: more such attesters, then the
higher round, then more attesters contacted for it whether or not they could serve (a peer behind
NAT cannot be dialed: the state a NATed peer's group made must not lose to our lone one on a
hash), then the smaller hash. On one host (one IP) every state has one vote, so identities decide
there.

What an attacker with N identities on M prefixes can do (H: distinct prefixes among the honest
attesters a joiner contacts; W: the weight of our lineage, ours plus the trusted peers on it):

- Established peer: nothing with identities alone, whatever N, M and the rounds claimed. To count
  at all an identity must first earn trust by completing audited rounds with this peer (real work
  per identity, ramping over ``trust.RAMP`` rounds (one), gone after ``trust.WINDOW`` rounds without);
  then it moves us only if the earned weight behind its lineage exceeds W (or equals it with a
  later state, within the clock bound).
- Joiner: it wins if M > H, or M == H and more of its identities served (or as many and a higher
  round, or more identities claiming it: a tie the smallest hash, which is as cheap to grind,
  would give it anyway). Beyond that tie-break N buys nothing: identities on one prefix are one vote. It can delay
  a join (each contact may stall sync.py's ``CONTACT_TIMEOUT``; at most ``MAX_CONTACTS`` contacts).
  It cannot make a joiner take bytes other than the hash chosen (every piece is verified), a state
  holding NaN or Inf (refused, and never chosen again), or speak in an honest peer's name
  (heartbeats are bound to their signer). Once the joiner completes a round with others it is
  established, and the rule above applies.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hivetrain.peer.net.prefixes import cap_key

ROUND_SLACK = 2  # rounds a peer may be ahead of us regardless of time (a round in flight, clock skew)
MAX_PER_STATE = 32  # attesters of one state a joiner contacts
MAX_CONTACTS = 1024  # in all (a DHT read returns at most 1024 heartbeats)
SELF_VOTE = "self"  # a joiner's vote for the state it already holds

Key = tuple[int, str]  # (round, hash): one node of the lineage tree


@dataclass(frozen=True)
class State:
    round: int
    hash: str
    parent: str


@dataclass(frozen=True)
class Attestation:
    peer: str  # a libp2p peer id, bound to the heartbeat's signer
    state: State


@dataclass(frozen=True)
class Own:
    """This peer's side: its id, its current state and the recent states it held (lineage)."""

    me: str
    state: State
    history: tuple[State, ...] = ()
    held: bool = True  # False: ``state`` is not a state of the run (no weights of its start): it gets no vote
    partners: frozenset[str] = frozenset()  # the group whose round made ``state`` (none: void, alone, synced)


@dataclass(frozen=True)
class Attested:
    """A state to move to, and the attesters to download it from (best first)."""

    round: int
    hash: str
    parent: str
    attesters: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    target: Attested | None  # None: keep our state
    refused: tuple[tuple[str, str], ...] = ()  # (peer, why): claims refused, attributed
    detail: str = ""  # why the target won, for the log
    seen: tuple[tuple[str, int], ...] = ()  # (trusted peer, round) accepted: for the caller's ``Clock.seen``


def round_ceiling(round_: int, elapsed: float, min_round_s: float) -> int:
    """The highest round a peer at ``round_`` ``elapsed`` seconds ago can have reached: no round is
    faster than ``min_round_s`` seconds."""
    if not (math.isfinite(elapsed) and elapsed > 0):
        elapsed = 0.0
    return round_ + ROUND_SLACK + int(elapsed / min_round_s + 1e-9)  # / not //: 5.0 // 0.2 is 24.0


@dataclass(frozen=True)
class Clock:
    """What wall-clock time allows a heartbeat to claim (seconds measured by the caller).

    A claim may reach ``round_ceiling`` from our round and the time since our last round boundary
    (the rule as specified), or from the round the same peer attested when we last saw its heartbeat
    and the time since then: at a round boundary the first term is about our round + 2, and without
    the second a peer that fell more rounds behind (a slow download, a partition whose sides ran at
    different speeds) could never catch up with its group."""

    min_round_s: float
    since_boundary: float  # seconds since our last round boundary
    seen: Mapping[str, tuple[int, float]] = field(default_factory=dict)  # peer -> (round, seconds ago)

    def __post_init__(self) -> None:
        if not self.min_round_s > 0:
            raise ValueError(f"min_round_s must be positive, got {self.min_round_s}")

    def ceiling(self, my_round: int, peer: str) -> int:
        bound = round_ceiling(my_round, self.since_boundary, self.min_round_s)
        if peer in self.seen:
            round_, ago = self.seen[peer]
            bound = max(bound, round_ceiling(round_, ago, self.min_round_s))
        return bound


def latest_per_peer(attestations: Iterable[Attestation], me: str) -> list[Attestation]:
    """One attestation per peer (its highest round), ours left out."""
    latest: dict[str, Attestation] = {}
    for a in attestations:
        if a.peer != me and (a.peer not in latest or a.state.round > latest[a.peer].state.round):
            latest[a.peer] = a
    return [latest[p] for p in sorted(latest)]


def _rank(weight: float, latest: Key) -> tuple[float, int, list[int]]:
    """Sort key: more weight, then the later latest state, then its smaller hash."""
    return round(weight, 9), latest[0], [-b for b in bytes.fromhex(latest[1])]


@dataclass(frozen=True)
class _Tree:
    """States linked by parent; ``total``: weight of each subtree, ``latest``: its latest weighted state."""

    parent_hash: dict[Key, str]  # node -> the hash it was computed from (ours, or the heaviest claim)
    parent: dict[Key, Key]  # node -> its parent node (absent for roots)
    children: dict[Key, list[Key]]
    total: dict[Key, float]
    latest: dict[Key, Key]
    ours: frozenset[Key]  # our state and its known ancestors


def _tree(own: Own, trusted: list[Attestation], weights: Mapping[str, float], self_weight: float) -> _Tree:
    mine: Key = (own.state.round, own.state.hash)
    parent_hash: dict[Key, str] = {(s.round, s.hash): s.parent for s in (*own.history, own.state)}
    claims: dict[Key, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for a in trusted:
        claims[(a.state.round, a.state.hash)][a.state.parent] += weights[a.peer]
    for key, by_parent in claims.items():  # our own history is authoritative; else the heaviest claim
        parent_hash.setdefault(key, min(by_parent, key=lambda p: (-by_parent[p], p)))
    # a parent is one round earlier: the links cannot form a cycle, whatever the claims
    parent = {k: (k[0] - 1, h) for k, h in parent_hash.items() if k[0] > 0}
    ours, k = {mine}, parent.get(mine)
    while k is not None and k not in ours:
        ours.add(k)
        k = parent.get(k)
    support: dict[Key, float] = defaultdict(float)
    support[mine] += self_weight
    for a in trusted:  # a partner behind us on our lineage has not published our round yet: ours
        key = (a.state.round, a.state.hash)
        support[mine if key in ours and a.peer in own.partners else key] += weights[a.peer]
    nodes = set(parent_hash) | set(parent.values())
    total: dict[Key, float] = dict.fromkeys(nodes, 0.0)
    latest: dict[Key, Key] = {}
    children: dict[Key, list[Key]] = defaultdict(list)
    for node in sorted(nodes, key=lambda n: -n[0]):  # children (round r) before parents (r - 1)
        total[node] += support.get(node, 0.0)
        if support.get(node, 0.0) > 0:
            latest[node] = max(latest.get(node, node), node, key=lambda n: _rank(0, n))
        if (up := parent.get(node)) is not None:
            children[up].append(node)
            total[up] += total[node]
            if node in latest:
                latest[up] = max(latest.get(up, latest[node]), latest[node], key=lambda n: _rank(0, n))
    return _Tree(parent_hash, parent, children, total, latest, frozenset(ours))


def _heaviest(tree: _Tree) -> tuple[Key | None, str]:
    """From the roots down, the heavier subtree at every fork; returns the state where that ends
    and, if our lineage lost a fork on the way, the weights of that fork."""

    def best(keys: Iterable[Key]) -> Key | None:
        weighted = [n for n in keys if tree.total[n] > 0]
        return max(weighted, key=lambda n: _rank(tree.total[n], tree.latest[n])) if weighted else None

    level = [n for n in tree.total if n not in tree.parent]
    tip, lost = best(level), ""
    while tip is not None:
        ours = next((n for n in level if n in tree.ours), None)
        if ours is not None and ours != tip and not lost:
            lost = f"lineage weight {tree.total[tip]:.2f} against ours {tree.total[ours]:.2f}"
        level = tree.children.get(tip, [])
        if (nxt := best(level)) is None:
            break
        tip = nxt
    return tip, lost


def choose(attestations: Iterable[Attestation], own: Own, weights: Mapping[str, float], clock: Clock, *,
           self_weight: float = 1.0, exclude: Collection[str] = ()) -> Choice:
    """The established peer's rule (module doc). ``weights``: earned trust per peer (0 if absent);
    ``clock``: what time allows; ``self_weight``: ours (> 0); ``exclude``: state hashes known bad.
    Raises ValueError for a non-positive ``self_weight``."""
    if not self_weight > 0:
        raise ValueError(f"self_weight must be positive, got {self_weight}")
    claims = latest_per_peer(attestations, own.me)
    ceilings = {a.peer: clock.ceiling(own.state.round, a.peer) for a in claims}
    refused = tuple((a.peer, f"claims round {a.state.round}, beyond {ceilings[a.peer]} that time allows")
                    for a in claims if a.state.round > ceilings[a.peer])
    trusted = [a for a in claims if a.state.round <= ceilings[a.peer] and weights.get(a.peer, 0.0) > 0
               and a.state.hash not in exclude]
    seen = tuple((a.peer, a.state.round) for a in trusted)
    tree = _tree(own, trusted, weights, self_weight)
    tip, lost = _heaviest(tree)
    if tip is None or tip in tree.ours:  # our state, or (never, with self_weight > 0) an ancestor of it
        return Choice(None, refused, "", seen)
    attesters = sorted((a.peer for a in trusted if (a.state.round, a.state.hash) == tip),
                       key=lambda p: (-weights[p], p))
    detail = lost or f"ahead on our lineage, weight {tree.total[tip]:.2f}"
    return Choice(Attested(tip[0], tip[1], tree.parent_hash[tip], tuple(attesters)), refused, detail, seen)


def _order(peers: Iterable[str], salt: bytes) -> list[str]:
    """A sample order no attester can predict or steer (``salt`` is the joiner's secret)."""
    return sorted(peers, key=lambda p: hashlib.sha256(salt + p.encode()).digest())


def plan_contacts(attestations: Iterable[Attestation], own: Own, salt: bytes, exclude: Collection[str] = (),
                  per_state: int = MAX_PER_STATE, budget: int = MAX_CONTACTS) -> dict[State, tuple[str, ...]]:
    """The attesters a joiner contacts, by state: at most ``per_state`` each, ``budget`` in all,
    handed out one per state per pass (states with more attesters first), so no state goes
    uncontacted while another gets a second contact."""
    groups: dict[State, list[str]] = defaultdict(list)
    for a in latest_per_peer(attestations, own.me):
        if a.state.hash not in exclude:
            groups[a.state].append(a.peer)
    order = sorted(groups, key=lambda s: (-len(groups[s]), -s.round, s.hash))
    queues = {s: _order(groups[s], salt)[:per_state] for s in order}
    plan: dict[State, list[str]] = {s: [] for s in order}
    left, depth = budget, 0
    while left > 0 and any(len(q) > depth for q in queues.values()):
        for s in order:
            if left > 0 and len(queues[s]) > depth:
                plan[s].append(queues[s][depth])
                left -= 1
        depth += 1
    return {s: tuple(p) for s, p in plan.items() if p}


def vote_key(addrs: Sequence[str]) -> str | None:
    """What one attester's vote counts as: the public prefix of the connection we hold to it; if we
    reach it through a relay with a public address, the relay's prefix (every identity relayed
    through one /24 is one vote, wherever it really is: review N6 counted one per relay IP, 32 votes
    from 32 relays in one /24); otherwise (loopback, private) its first IP: one vote per IP. None if
    we hold no IP connection to it."""
    key = cap_key(addrs)
    if key is not None:
        return key
    for addr in addrs:
        parts = addr.split("/") if isinstance(addr, str) and len(addr) <= 1024 else []
        if len(parts) >= 3 and parts[0] == "" and parts[1] in ("ip4", "ip6") and parts[2]:
            return f"ip:{parts[2]}"
    return None


def _ancestors(own: Own) -> set[Key]:
    """The states our own history says ours descends from."""
    parent = {(s.round, s.hash): s.parent for s in (*own.history, own.state)}
    out: set[Key] = set()
    key = (own.state.round, own.state.hash)
    while key in parent and key[0] > 0 and (up := (key[0] - 1, parent[key])) not in out:
        out.add(up)
        key = up
    return out


def choose_joiner(plan: Mapping[State, Sequence[str]], own: Own, votes: Mapping[str, str | None]) -> Choice:
    """The joiner's rule (module doc). ``plan``: attesters contacted per state; ``votes``: the
    ``vote_key`` of each attester that served a manifest matching its state (others: absent).
    A state our own history descends from is behind us: neither a competitor nor a vote for us."""
    behind = _ancestors(own) if own.held else set()
    tally: dict[State, tuple[set[str], list[str]]] = {own.state: ({SELF_VOTE}, [own.me])} if own.held else {}
    bar = (0, 0)  # the most (votes, voters) a state behind us has: the run may be there, not where we went
    for state, peers in plan.items():
        cast = {p: key for p in peers if (key := votes.get(p))}
        if (state.round, state.hash) in behind:
            bar = max(bar, (len(set(cast.values())), len(cast)))
            continue
        keys, voters = tally.get(state, (set(), []))
        tally[state] = (keys | set(cast.values()), voters + list(cast))
    tally = {state: cast for state, cast in tally.items() if cast[0]}  # (held: ours always has its vote)
    if not tally:
        return Choice(None)
    claimed = {state: len(set(plan.get(state, ())) | ({own.me} if state == own.state and own.held else set()))
               for state in tally}
    best = max(tally, key=lambda s: (len(tally[s][0]), len(tally[s][1]), s.round, claimed[s],
                                     [-b for b in bytes.fromhex(s.hash)]))
    if best == own.state and own.held:
        return Choice(None)
    keys, voters = tally[best]
    if own.held and (len(keys), len(voters)) <= bar:
        # (a state we descend from holds the run; a state beside ours that no more prefixes attest is no
        # better than ours, and its tie with our own vote went to a hash one identity ground small: a peer
        # restarted ahead of the run synced a lone attacker's sibling of its state, search seed 6,200,418)
        return Choice(None)
    detail = f"attested by {len(keys)} network prefixes/IPs ({len(voters)} identities)"
    return Choice(Attested(best.round, best.hash, best.parent, tuple(sorted(voters))), (), detail)
