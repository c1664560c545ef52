"""Leaderless group formation for one round.

1. Every peer ready for round r publishes a signed ``ready`` record (round, base state hash, spec
   hash) in the DHT, then collects the ready peers with the same base state until the group
   reaches its target size or the matchmaking window closes. A part from a member of our view
   closes the window early: that member has already decided a group with us (its window ended
   first) and waits for our part. We ask it directly and adopt its decision, even if an exclusion
   merged from a peer outside that group removed it from our view; otherwise it would void at its
   deadline while we formed another group.
2. Views are then reconciled peer to peer: each peer asks every member of its view for theirs,
   merging monotonically (members and excluded peers are both unions; a peer that does not answer
   is excluded). A peer decides when every member answered with exactly its own view. A member
   that already decided answers with its decision: a peer inside it adopts it, one outside drops
   that member.

No peer's word decides membership for others. Should views still disagree, the group hash carried
by every all-reduce message makes the round fail for the mismatched members: void, never mixed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class View:
    """One peer's evolving view of round r's group. Lives on the DHT loop only."""

    round: int
    base: str
    me: str
    members: set[str] = field(default_factory=set)
    excluded: set[str] = field(default_factory=set)
    decided: tuple[str, ...] | None = None
    abandoned: bool = False  # the round failed for us: we answer "decided without you" from now on
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.members.add(self.me)

    def effective(self) -> frozenset[str]:
        return frozenset(self.members - self.excluded)

    def merge(self, members: list[str], excluded: list[str]) -> bool:
        """Union with another peer's view; returns True if ours changed."""
        before = (len(self.members), len(self.excluded))
        self.members.update(members)
        self.excluded.update(p for p in excluded if p != self.me)
        grew = before != (len(self.members), len(self.excluded))
        if grew:
            self.changed.set()
        return grew

    def exclude(self, peer: str) -> None:
        if peer != self.me and peer not in self.excluded:
            self.excluded.add(peer)
            self.changed.set()


@dataclass(frozen=True)
class Reply:
    members: frozenset[str]
    excluded: frozenset[str]
    decided: bool


def reconcile_step(view: View, replies: dict[str, Reply | None]) -> tuple[str, ...] | None:
    """Folds one round of replies into ``view``; returns the decided group, or None to ask again.

    ``replies`` maps each other member of the view (as it was when asked) to its reply, or None if
    it did not answer in time."""
    asked = frozenset(replies) | {view.me}  # the view as it was when asked: handlers may grow it meanwhile
    for peer, reply in replies.items():
        if reply is None:
            view.exclude(peer)
        elif reply.decided:
            if view.me in reply.members:
                view.decided = tuple(sorted(reply.members))
                return view.decided
            view.exclude(peer)
        else:
            view.merge(sorted(reply.members), sorted(reply.excluded))
    unanimous = all(r is not None and not r.decided and r.members - r.excluded == asked for r in replies.values())
    if unanimous and view.effective() == asked:
        view.decided = tuple(sorted(asked))
        return view.decided
    return None
