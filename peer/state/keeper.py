"""The training loop's side of state (``StateHooks``, peer/train/loop.py): fork choice and sync at
round boundaries through ``StateSync``, serving and checkpointing each new state, and the waits
around a round's end.

Its methods are called on the training thread; whatever waits on the run (heartbeats to change)
runs as a coroutine on the DHT facade's loop, bounded by its own deadline, never as a sleep loop on
the training thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from hivetrain.dht import clock
from hivetrain.dht.errors import DHTError
from hivetrain.peer.errors import PeerError
from hivetrain.peer.net.dialback import REACH_WORDS
from hivetrain.peer.net.wire import ZERO
from hivetrain.peer.state.choose import Clock, Own, State
from hivetrain.peer.state.heartbeats import aread_heartbeats, attestations, buckets_of
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.state.sync import PoisonedState, StateSync, StateSyncFailed
from hivetrain.peer.trust import Trust

V = TypeVar("V")
HISTORY = 8  # our recent states kept for lineage links
END_GRACE = 2.0  # seconds wait_for_end gives the rest of a round's peers once one of them said how it ended
MAX_REMEMBERED = 1024  # poisoned hashes and already-named claimants (oldest forgotten)
POLL = 0.25  # seconds between heartbeat reads while waiting (the DHT has no watch)
POLL_PEERS = 0.5  # ... while waiting for peers at start


def _note(bounded: dict[str, V], key: str, value: V) -> bool:
    """Sets ``key`` last in an insertion-ordered map of at most MAX_REMEMBERED entries (the oldest
    goes first); returns whether ``key`` was new."""
    new = key not in bounded
    bounded.pop(key, None)
    bounded[key] = value
    while len(bounded) > MAX_REMEMBERED:
        bounded.pop(next(iter(bounded)))
    return new


class StateKeeper:
    """The loop's ``StateHooks`` over the network. ``trust`` is the ledger the training thread
    updates after every completed round; ``save`` writes a checkpoint (off the training thread, in
    order; None: no checkpoints)."""

    def __init__(self, sync: StateSync, trust: Trust, save: Callable[[Snapshot], None] | None, timeout: float,
                 min_round_s: float, log: Any = print):
        self.sync, self.trust, self.save, self.timeout = sync, trust, save, timeout
        self.min_round_s, self.log = min_round_s, log
        self.history: deque[State] = deque(maxlen=HISTORY)  # our recent states, oldest first
        self._boundary = clock.now()  # when we last reached a round boundary
        self._poisoned: dict[str, None] = {}  # state hashes refused for NaN/Inf
        self._named: dict[str, None] = {}  # peers whose refused claims we already logged
        self._reach: dict[str, int] = {}  # the run's reachability mix we last reported
        self._seen: dict[str, tuple[int, float]] = {}  # trusted peer -> (round, clock.now()) last accepted
        self.present: set[str] = set()  # the other peers ``wait_for_peers`` last saw
        # (round, base) -> None: announces that we will train that round (set by the caller; see catch_up)
        self.announce: Callable[[int, str], None] | None = None

    def catch_up(self, round_: int, state_hash: str, announce: bool = False, held: bool = True,
                 partners: Collection[str] = ()) -> tuple[Snapshot, dict[str, Any]] | None:
        """At a round boundary (training thread): the state fork choice moves us to, verified, or None.
        ``held``: False while our state is not one of the run's (its weights come by sync): no vote.
        ``partners``: the group whose round made our state (none after a void or lone round, or a sync)."""
        mine = next((s for s in reversed(self.history) if (s.round, s.hash) == (round_, state_hash)),
                    State(round_, state_hash, ZERO))
        own = Own(self.sync.dht.peer_id, mine, tuple(self.history), held, frozenset(partners))
        weights = self.trust.trusted(round_) if held and self.trust.has_history(round_) else {}
        now = clock.now()
        clock_ = Clock(self.min_round_s, now - self._boundary, {p: (r, now - t) for p, (r, t) in self._seen.items()})
        try:
            choice = self.sync.check(own, weights, clock_, self._poisoned)
        except (PeerError, DHTError) as e:  # e.g. a DHT read past its timeout: train on, look again next round
            self.log(f"could not read the run's attestations ({e}); keeping our state this round")
            return None
        if self.sync.reach and self.sync.reach != self._reach:
            self._reach = dict(self.sync.reach)
            self.log("peers of the run, as their heartbeats say: " + ", ".join(
                f"{n} {REACH_WORDS.get(mode, mode)}" for mode, n in sorted(self._reach.items())))
        for peer, seen_round in choice.seen:
            _note(self._seen, peer, (seen_round, now))
        for peer, why in choice.refused:
            if _note(self._named, peer, None):
                self.log(f"refused the heartbeat of {peer}: {why}")
        target = choice.target
        if target is None:
            return None
        who = "trusted peers" if weights else "a joiner's count"
        self.log(f"fork choice ({who}): state {target.hash[:12]} of round {target.round}, {choice.detail}; "
                 f"we are at round {round_}: syncing")
        if announce and self.announce is not None:  # we will train that round: the others can wait for us
            self.announce(target.round, target.hash)
        try:
            snapshot = self.sync.download(target, self.timeout)
        except PoisonedState as e:
            _note(self._poisoned, e.state_hash, None)
            self.log(f"state sync refused: {e}")
            return None
        except StateSyncFailed as e:
            self.log(f"state sync failed, trying again next round: {e}")
            return None
        info = dict(self.sync.last_download, attesters=list(target.attesters), why=choice.detail,
                    joiner=not weights)
        self.log(f"downloaded {info['bytes'] / 1e6:.1f} MB in {info['seconds']:.1f} s from "
                 f"{len(info['donors'])} donors" + (f", dropped {sorted(info['dropped'])}" if info["dropped"] else ""))
        return snapshot, info

    def wait_for_next(self, round_: int, attesters: list[str], timeout: float) -> bool:
        """After a joiner's sync to round ``round_``: waits (training thread) until most of the peers
        that attested it announce a later state, at most ``timeout`` seconds; returns whether they
        did. The state we synced may be seconds old, so the others are that far into their inner
        steps: starting ours now we would be ready too late for their group and train a round alone.
        Syncing again right after their next boundary, we start with them."""
        watched = set(attesters)
        moved = self._wait_past(round_, watched, clock.now() + timeout, lambda m: 2 * len(m) > len(watched))
        return 2 * len(moved) > len(watched)  # most of them: fork choice will see the new state

    def _wait_past(self, round_: int, peers: set[str], until: float, enough: Callable[[set[str]], bool]) -> set[str]:
        """Reads the run's heartbeats until those of ``peers`` that attest a state past ``round_`` are
        ``enough``, or ``until`` (``clock.now()``) passes; returns them."""
        moved: set[str] = set()
        level = self.sync.heartbeat_level
        buckets = buckets_of(peers, level)  # theirs only

        async def watch() -> None:
            while True:
                try:
                    found = attestations(await aread_heartbeats(self.sync.dht, self.sync.run_key, level, buckets))
                except (PeerError, DHTError, TimeoutError):  # a slow read: ask again until the deadline
                    found = []
                moved.update(a.peer for a in found if a.peer in peers and a.state.round > round_)
                if enough(moved) or clock.now() >= until:
                    return
                await asyncio.sleep(min(POLL, max(0.0, until - clock.now())))

        try:
            self.sync.dht.run(watch(), max(0.0, until - clock.now()) + self.sync.dht.timeout)
        except DHTError:  # a read that hung past the deadline: what we saw is the answer
            pass
        return moved

    def wait_for_end(self, round_: int, peers: tuple[str, ...], until: float) -> list[str]:
        """After a round we voided or trained alone (training thread): waits until each of ``peers``
        announces a state past ``round_``, at most until ``until`` (``clock.now()``); returns
        the peers that did not. A member that died never announces: once one of them has, the rest
        get ``END_GRACE`` seconds more (members of one group end a round within moments of each
        other), else the wait would last until ``until`` (their all-reduce deadline) and we would
        come too late for their next group."""
        waited = set(peers)
        first: list[float] = []

        def enough(moved: set[str]) -> bool:
            if moved and not first:
                first.append(clock.now())
            return moved == waited or bool(first) and clock.now() - first[0] >= END_GRACE

        return sorted(waited - self._wait_past(round_, waited, until, enough))

    def peers_seen(self) -> int | None:
        """Peers whose heartbeats the last fork choice read (ours included; None: none read yet), or in
        a bucketed run, as many as its sample of the buckets stands for."""
        return round(sum(self.sync.reach.values()) / self.sync.sampled) if self.sync.reach else None

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """Waits until ``count`` peers (this one included) announce themselves, at most ``timeout``
        seconds; returns how many were seen. Counts libp2p identities whose heartbeats are bound
        to them: one identity is one peer, but identities are free, so this is a convenience for
        friends starting a run together, not a guarantee that ``count`` independent peers exist.
        Reads every heartbeat bucket: this is a run's start, not every round."""
        deadline = clock.now() + timeout
        me = self.sync.dht.peer_id

        async def watch() -> None:
            while True:
                try:
                    found = await aread_heartbeats(self.sync.dht, self.sync.run_key, self.sync.heartbeat_level)
                    self.present = {hb["peer_id"] for hb in found}
                    self.present.discard(me)
                except (PeerError, DHTError, TimeoutError):  # a slow read: ask again until the deadline
                    pass
                if 1 + len(self.present) >= count or clock.now() >= deadline:
                    return
                await asyncio.sleep(min(POLL_PEERS, max(0.0, deadline - clock.now())))

        try:
            self.sync.dht.run(watch(), timeout + self.sync.dht.timeout)
        except DHTError:
            pass
        return 1 + len(self.present)

    def committed(self, snapshot: Snapshot) -> None:
        """A new round boundary (training thread): remember the state, serve it, checkpoint it."""
        self._boundary = clock.now()
        if not self.history or (self.history[-1].round, self.history[-1].hash) != (snapshot.round, snapshot.hash):
            self.history.append(State(snapshot.round, snapshot.hash, snapshot.parent))
        self.sync.serve(snapshot)
        if self.save is not None:
            self.save(snapshot)
