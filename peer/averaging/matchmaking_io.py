"""The matchmaking half of ``P2PAverager``: who is in round r's group (see peer/matchmaking.py).

Every peer ready for a round publishes a signed ready record, collects the ready peers with the
same base state until the group is full or the window closes, applies the per-prefix Sybil cap,
then reconciles views peer to peer until the members agree. Runs on the DHT's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from hivetrain.dht.identity import Identity
from hivetrain.dht.node import DHT
from hivetrain.dht.records import Envelope, decode_payload, encode_payload, ready_key
from hivetrain.peer.averaging.api import group_order
from hivetrain.peer.averaging.sybil import cap_by_prefix, first_prefix, observed_prefixes
from hivetrain.peer.averaging.views import Reply, View, reconcile_step
from hivetrain.peer.errors import RoundFailed

logger = logging.getLogger(__name__)
POLL = 0.25  # seconds between DHT reads while the matchmaking window is open
VIEW_ATTEMPTS = 3  # tries of one view request that fails fast (a dropped stream, a refused dial)
FAST_FAILURE = 1.0  # seconds: a view request that failed sooner than this is tried again
RECONCILE_PAUSE = 0.05  # seconds before asking again when a round of view requests changed nothing


class GroupFormation:
    """Mixin: the attributes below are set by ``P2PAverager.__init__``."""

    dht: DHT
    identity: Identity
    run_key: str
    spec: Any
    spec_hash: str
    me: str
    current_round: int
    _views: dict[int, View]
    _banned: dict[str, str]
    _round_excluded: dict[str, str]

    def _header(self, kind: str, round_: int, base: str, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _parts_from(self, view: View) -> set[str]:
        """The members of ``view`` (excluded or not, never banned) that already sent us a part of its round."""
        raise NotImplementedError

    async def _request(self, peer: str, header: dict[str, Any], body: bytes, round_: int,
                       deadline: float | None = None, max_reply_body: int = 0) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    async def _announce_ready(self, round_: int, base: str) -> None:
        payload = encode_payload("ready", dict(peer_id=self.me, round=round_, base_hash=base,
                                               spec_hash=self.spec_hash))
        expiration = time.time() + self.spec.matchmaking_timeout + self.spec.allreduce_timeout
        envelope = Envelope.sign(self.identity, "ready", ready_key(self.run_key, round_), payload, expiration)
        budget_end = time.monotonic() + min(self.dht.options.timeout, self.spec.matchmaking_timeout)
        while (remaining := budget_end - time.monotonic()) > 0:
            try:
                if await asyncio.wait_for(self.dht.astore(envelope), remaining):
                    return
            except TimeoutError:
                break
            except Exception as e:  # runs as a background task: say what went wrong, never raise unseen
                logger.warning("round %d: storing our ready record failed: %r", round_, e)
                return
            await asyncio.sleep(min(1.0, max(0.0, budget_end - time.monotonic())))  # refused: not a tight loop
        # not fatal: the peers we find still learn of us when we ask them for their view
        logger.warning("round %d: could not publish our ready record to the DHT", round_)

    async def _ready_peers(self, view: View) -> set[str]:
        found: set[str] = set()
        try:
            envelopes = await asyncio.wait_for(self.dht.aget(ready_key(self.run_key, view.round)), 5.0)
        except TimeoutError:
            return found  # a partitioned or slow DHT: the window goes on with what we know
        for envelope in envelopes:
            try:
                fields = decode_payload("ready", envelope.payload)
            except Exception:
                continue
            if (fields["round"], fields["base_hash"], fields["spec_hash"]) == (view.round, view.base, self.spec_hash):
                found.add(fields["peer_id"])
        self.dht.remember(found)
        return found

    async def _matchmake(self, view: View) -> tuple[str, ...]:
        spec = self.spec
        window_end = time.monotonic() + spec.matchmaking_timeout
        while view.decided is None and len(view.effective()) < spec.target_group_size:
            view.merge(sorted(await self._ready_peers(view)), [])
            for peer in self._banned:
                view.exclude(peer)
            remaining = window_end - time.monotonic()
            if remaining <= 0 or len(view.effective()) >= spec.target_group_size or self._parts_from(view):
                break
            view.changed.clear()
            try:
                await asyncio.wait_for(view.changed.wait(), min(POLL, remaining))
            except TimeoutError:
                pass
        await self._cap_prefixes(view)
        agree_end = time.monotonic() + max(5.0, spec.matchmaking_timeout / 2)
        checked: set[str] = set()
        while view.decided is None:
            if time.monotonic() > agree_end:
                raise RoundFailed(f"no agreement on the group of round {view.round}")
            if self.me in view.excluded:
                raise RoundFailed("excluded from the group by the other peers")
            if await self._adopt_waiting_group(view, checked):
                break
            asked = sorted(view.effective() - {self.me})
            if not asked:
                view.decided = (self.me,)
                break
            view.changed.clear()
            replies = await asyncio.gather(*(self._ask_view(view, peer) for peer in asked))
            if reconcile_step(view, dict(zip(asked, replies, strict=True))) is None and not view.changed.is_set():
                try:  # the others have yet to catch up: give them a moment, not a busy loop
                    await asyncio.wait_for(view.changed.wait(), RECONCILE_PAUSE)
                except TimeoutError:
                    pass
        group = view.decided
        assert group is not None  # every way out of the loop above decides
        if len(group) < spec.min_group_size:
            raise RoundFailed(f"group of {len(group)} is below the run's minimum of {spec.min_group_size}")
        return group_order(group, view.round, view.base)

    async def _adopt_waiting_group(self, view: View, checked: set[str]) -> bool:
        """A member that sent us its part has decided a group with us and waits for ours: ask it
        directly and adopt its decision, even if our view excludes it. (A peer outside its group
        excludes it on hearing "decided without you", and that exclusion reaches the group's own
        members through view merging; they would then form another group and leave it to void.)"""
        for peer in sorted(self._parts_from(view) - checked):
            checked.add(peer)
            reply = await self._ask_view(view, peer)
            if view.decided is None and reply is not None and reply.decided and self.me in reply.members:
                view.decided = tuple(sorted(reply.members))
        return view.decided is not None

    async def _cap_prefixes(self, view: View) -> None:
        """Sybil brake: at most ``spec.max_per_prefix`` members per IPv4 /24 or IPv6 /48, as our own
        connections see them (never what a peer claims). Which ones stay is ranked by a hash of the
        round, the base state and the peer id, so members that see the same addresses drop the same
        peers; where they see different ones, exclusions merge during reconciliation."""
        if self.spec.max_per_prefix <= 0:
            return
        members = sorted(view.effective())
        prefixes = await observed_prefixes(self.dht.p2p, [p for p in members if p != self.me])
        try:  # ourselves: the address we listen on or announce (None behind a NAT: we cannot see it)
            async with asyncio.timeout(5.0):
                prefixes[self.me] = first_prefix(str(a) for a in await self.dht.p2p.get_visible_maddrs())
        except Exception:
            prefixes[self.me] = None

        def rank(peer: str) -> bytes:
            return hashlib.sha256(f"prefix/{view.round}/{view.base}/{peer}".encode()).digest()

        _, dropped = cap_by_prefix(members, prefixes, self.spec.max_per_prefix, rank)
        for peer, why in dropped.items():  # if we are dropped, the others exclude us during reconciliation
            view.exclude(peer)
            if peer != self.me:
                self._round_excluded[peer] = f"not grouped: {why}"

    async def _ask_view(self, view: View, peer: str) -> Reply | None:
        header = self._header("view", view.round, view.base, members=sorted(view.members),
                              excluded=sorted(view.excluded))
        for attempt in range(VIEW_ATTEMPTS):
            started = time.monotonic()
            try:
                reply, _ = await self._request(peer, header, b"", view.round)
                break
            except Exception as e:  # unreachable, refused, timed out, malformed, p2pd dial error: not in our group
                logger.debug("view request to %s failed (attempt %d): %r", peer, attempt + 1, e)
                # Asking again is harmless (merging a view twice changes nothing). A stream that p2pd
                # dropped at once is worth a retry: one such hiccup used to put a live peer in a
                # group of its own. A request that ran into its timeout is not: the peer is stalled.
                if attempt + 1 == VIEW_ATTEMPTS or time.monotonic() - started > FAST_FAILURE:
                    return None
                await asyncio.sleep(0.1 * (attempt + 1))
        if reply["type"] != "view_reply" or reply["base"] != view.base:
            return None
        return Reply(frozenset(reply["members"]), frozenset(reply["excluded"]), reply["decided"])

    def _on_view(self, sender: str, header: dict[str, Any]) -> dict[str, Any]:
        round_, base = header["round"], header["base"]
        view = self._views.get(round_)
        fields: dict[str, Any] = dict(members=[], excluded=[], decided=False)
        if view is None or view.abandoned:
            if view is not None or round_ < self.current_round:
                fields["decided"] = True  # done with (or out of) that round, without the sender
        elif view.decided is not None:
            fields.update(members=list(view.decided), decided=True)
        elif sender in self._banned:  # we caught it: our view without it, and we do not take its view
            # (answering "decided" would make it exclude us, and its view could spread that to others)
            fields.update(members=sorted(view.members), excluded=sorted(view.excluded | {sender}))
        elif view.base == base:
            view.merge(header["members"] + [sender], header["excluded"])
            fields.update(members=sorted(view.members), excluded=sorted(view.excluded))
        return self._header("view_reply", round_, base, **fields)
