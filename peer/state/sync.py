"""Verified state sync: serve our state; find (fork choice), download and check the run's state.

Which state to hold is fork choice's (peer/state/choose.py). ``StateSync.check`` reads the run's
bound heartbeats and, for a joiner, first contacts attesters (asks each for the manifest) so that
the prefixes of our own connections to them can be counted. ``StateKeeper`` is the training loop's
side: our lineage, the trust ledger, the time since our last round boundary.

Downloading: the manifest (parent, link, piece hashes) from any attester, checked against the
attested hash and parent; then the pieces from all attesters in parallel, each checked on arrival
against its hash and for NaN/Inf. A donor that serves a wrong piece, stalls past the piece
deadline, or fails is dropped and its pieces go to the others. A state whose pieces hold NaN or Inf
is refused outright (``PoisonedState``: the donor is named) and never chosen again.

Serving: at most MAX_SERVING requests at once and MAX_PER_REQUESTER per requesting peer, keyed by
the stream's authenticated libp2p id; an extra request is refused at once. Every reply write has a
deadline (WRITE_TIMEOUT), after which the stream is aborted: a requester that never reads pins
no memory here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, TypeVar

from hivetrain.dht.errors import DHTError
from hivetrain.dht.node import DHT
from hivetrain.peer.averaging.sybil import observed_addrs
from hivetrain.peer.errors import PeerError, StateMismatch
from hivetrain.peer.net import transport
from hivetrain.peer.net.wire import ProtocolError, read_frame
from hivetrain.peer.state import checkpoint
from hivetrain.peer.state.choose import (
    Attested,
    Choice,
    Clock,
    Own,
    State,
    choose,
    choose_joiner,
    plan_contacts,
    vote_key,
)
from hivetrain.peer.state.heartbeats import attestations, reach_mix, read_heartbeats
from hivetrain.peer.state.snapshot import (
    PIECE_SIZE,
    ZERO,
    Manifest,
    Snapshot,
    all_finite,
    assemble,
    manifest_nbytes,
    parse_manifest,
)
from hivetrain.peer.trust import Trust

REACH_WORDS = {"direct": "reachable directly", "outbound_only": "outbound-only (behind NAT)",
               "unknown": "not known"}
logger = logging.getLogger(__name__)
V = TypeVar("V")
PIECE_TIMEOUT = 30.0  # seconds for one 1 MiB piece (a donor slower than ~35 KB/s is dropped)
PER_DONOR = 2  # pieces in flight per donor
CONTACT_TIMEOUT = 5.0  # seconds for a joiner's manifest request to one attester (its vote)
CONTACT_PARALLEL = 64  # such requests at once: at most 1024 contacts take 80 s
MAX_SERVING = 32  # requests served at once (a piece reply holds ~2 MiB until written)
MAX_PER_REQUESTER = 4  # per requesting peer: a download keeps PER_DONOR in flight per donor
WRITE_TIMEOUT = 20.0  # seconds to write one reply
HISTORY = 8  # our recent states kept for lineage links
END_GRACE = 2.0  # seconds wait_for_end gives the rest of a round's peers once one of them said how it ended
MAX_REMEMBERED = 1024  # poisoned hashes and already-named claimants (oldest forgotten)


class ServingFaults(Protocol):
    """The test hook ``StateSync`` consults while serving (peer/faults.py ``FaultPlan`` is one)."""

    def active(self, point: str, round_: int) -> bool:
        """Whether the standing fault at ``point`` (here "serve_state") applies at ``round_``."""
        ...


class StateSyncFailed(PeerError):
    """No state could be downloaded and verified from the attesting peers."""


class PoisonedState(StateSyncFailed):
    """The attested state holds NaN or Inf: refused, and never to be chosen again."""

    def __init__(self, state_hash: str, message: str):
        super().__init__(message)
        self.state_hash = state_hash


class StateSync:
    """Serves this peer's recent snapshots, chooses and downloads verified states. Construct, then ``start()``."""

    def __init__(self, dht: DHT, run_key: str, spec_hash: str, numel: int, faults: ServingFaults):
        self.dht, self.run_key, self.spec_hash, self.numel, self.faults = dht, run_key, spec_hash, numel, faults
        self.handler_name = f"hivetrain/state/1/{spec_hash[:32]}"
        self._served: dict[str, Snapshot] = {}  # state hash -> snapshot; the last two rounds
        self._serving, self._by_peer = 0, Counter[str]()
        self._salt = os.urandom(16)  # a joiner's secret: which attesters of a state it samples
        self.reach: dict[str, int] = {}  # how the run's peers say they are reached, per mode (last read)
        self.last_download: dict[str, Any] = {}

    def start(self) -> StateSync:
        self.dht.run(self.dht.p2p.add_binary_stream_handler(self.handler_name, self._handle), timeout=10)
        return self

    # ---- serving (training thread publishes, loop thread reads) --------------------------------

    def serve(self, snapshot: Snapshot) -> None:
        """Offers ``snapshot`` to joiners; keeps the previous one for joiners in flight."""
        keep = {h: s for h, s in self._served.items() if s.round >= snapshot.round - 1}
        keep[snapshot.hash] = snapshot
        self._served = keep  # one atomic rebinding: the loop thread sees the old or the new dict

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requester = stream_info.peer_id.to_base58()  # authenticated by the transport, not claimed
        if self._serving >= MAX_SERVING or self._by_peer[requester] >= MAX_PER_REQUESTER:
            await _reply(writer, {"type": "state_resp", "run": self.spec_hash, "round": 0, "base": ZERO,
                                  "index": -1, "ok": False, "reason": "busy: too many requests"})
            return
        self._serving += 1
        self._by_peer[requester] += 1
        try:
            try:
                header, _ = await read_frame(reader, 10.0, max_body=0)
            except (ProtocolError, TimeoutError, asyncio.IncompleteReadError, OSError):
                writer.close()
                return
            await _reply(writer, *self._answer(header))
        finally:
            self._serving -= 1
            self._by_peer[requester] -= 1
            if self._by_peer[requester] <= 0:
                del self._by_peer[requester]

    def _answer(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        fields = {"type": "state_resp", "run": self.spec_hash, "round": header["round"], "base": header["base"],
                  "index": header.get("index", -1)}
        snapshot = self._served.get(header["base"])
        if header["type"] != "state_req" or header["run"] != self.spec_hash:
            return {**fields, "ok": False, "reason": "not a state request for this run"}, b""
        if snapshot is None or snapshot.round != header["round"]:
            return {**fields, "ok": False, "reason": "state not held here"}, b""
        if header["index"] == -1:
            return {**fields, "ok": True, "reason": ""}, snapshot.manifest()
        if header["index"] >= len(snapshot.piece_hashes):
            return {**fields, "ok": False, "reason": "no such piece"}, b""
        body = snapshot.piece(header["index"])
        if self.faults.active("serve_state", snapshot.round):  # test hook: a poisoned donor
            body = bytes(b ^ 0x5A for b in body[:64]) + body[64:]
        return {**fields, "ok": True, "reason": ""}, body

    # ---- choosing (training thread) --------------------------------------------------------------

    def check(self, own: Own, weights: Mapping[str, float], clock: Clock, exclude: Collection[str] = ()) -> Choice:
        """Fork choice over the run's heartbeats (training thread): the established rule if
        ``weights`` (earned trust) has anyone, else the joiner's, after contacting attesters.
        Raises DHTError or PeerError if the heartbeats cannot be read."""
        heartbeats = read_heartbeats(self.dht, self.run_key)
        self.reach = reach_mix(heartbeats)
        found = attestations(heartbeats)
        if weights:
            # we count as much as the peer we trust most (1 once we completed a round with anyone; see
            # peer/trust.py on why trust does not keep growing)
            choice = choose(found, own, weights, clock, self_weight=min(1.0, max(weights.values())),
                            exclude=exclude)
            self.dht.remember_threadsafe(a.peer for a in found if weights.get(a.peer, 0.0) > 0)
            return choice
        plan = plan_contacts(found, own, self._salt, exclude)
        if not plan:
            return choose_joiner(plan, own, {})
        votes = self.dht.run(self._votes(plan), timeout=CONTACT_TIMEOUT * (1 + sum(map(len, plan.values()))
                                                                            / CONTACT_PARALLEL) + 10)
        self.dht.remember_threadsafe(list(votes))  # attesters that served what they attest: bound and reachable
        return choose_joiner(plan, own, votes)

    async def _votes(self, plan: Mapping[State, tuple[str, ...]]) -> dict[str, str | None]:
        """Asks every planned attester for its state's manifest; those that serve a matching one
        vote as the prefix of our connection to them (``vote_key``)."""
        gate, served = asyncio.Semaphore(CONTACT_PARALLEL), []

        async def ask(peer: str, state: State) -> None:
            async with gate:
                try:
                    async with asyncio.timeout(CONTACT_TIMEOUT):
                        self._check_manifest(state, await self._fetch(peer, state, -1, manifest_nbytes(self.numel)))
                except Exception as e:  # whatever went wrong, this attester gets no vote
                    logger.debug("attester %s gets no vote: %s: %s", peer, type(e).__name__, e)
                    return
                served.append(peer)

        await asyncio.gather(*(ask(p, s) for s, peers in plan.items() for p in peers))
        addrs = await observed_addrs(self.dht.p2p, served)
        return {p: vote_key(addrs.get(p, [])) for p in served}

    # ---- downloading (training thread) -----------------------------------------------------------

    def download(self, target: Attested, timeout: float) -> Snapshot:
        """Downloads and verifies ``target`` from its attesters; raises StateSyncFailed."""
        try:
            return self.dht.run(self._download(target), timeout=timeout)
        except StateSyncFailed:
            raise
        except Exception as e:  # a DHT timeout, a daemon error: the same outcome, try again next round
            raise StateSyncFailed(f"state sync of round {target.round} failed: {type(e).__name__}: {e}") from None

    def _check_manifest(self, target: State | Attested, body: bytes) -> Manifest:
        manifest = parse_manifest(target.round, self.numel, body, target.hash)
        if manifest.parent != target.parent:
            raise StateMismatch("the manifest's parent is not the one its attesters announced")
        return manifest

    async def _fetch(self, donor: str, target: State | Attested, index: int, max_body: int) -> bytes:
        header = {"type": "state_req", "run": self.spec_hash, "round": target.round, "base": target.hash,
                  "index": index}
        reply, body, _ = await transport.request(self.dht.p2p, donor, self.handler_name, header, b"",
                                                 PIECE_TIMEOUT, max_reply_body=max_body)
        if reply.get("type") != "state_resp" or not reply.get("ok") or reply.get("index") != index:
            raise StateMismatch(f"donor refused: {reply.get('reason', '?')}")
        return body

    async def _download(self, target: Attested) -> Snapshot:
        t0 = time.monotonic()
        donors = list(target.attesters)
        random.shuffle(donors)
        bad: dict[str, str] = {}
        manifest: Manifest | None = None
        for donor in donors:
            for attempt in range(2):  # a lost stream gets one more chance, as a piece does; a refusal none
                try:
                    body = await self._fetch(donor, target, -1, manifest_nbytes(self.numel))
                    manifest = self._check_manifest(target, body)
                    bad.pop(donor, None)
                    break
                except StateMismatch as e:  # refused, or not the attested state: this donor is out
                    bad[donor] = f"manifest: {e}"
                    break
                except Exception as e:  # e.g. the stream closed before a reply (seen once in CI on loopback)
                    bad[donor] = f"manifest: {type(e).__name__}: {e}" + (" (twice)" if attempt else "")
            if manifest is not None:
                break
        if manifest is None:
            raise StateSyncFailed(f"no attester served a valid manifest for round {target.round}: {bad}")
        todo = deque(range(len(manifest.piece_hashes)))
        pieces: dict[int, bytes] = {}
        served: Counter[str] = Counter()
        transport_errors: Counter[str] = Counter()
        poisoned: list[str] = []

        async def worker(donor: str, hashes: tuple[bytes, ...]) -> None:
            while todo and donor not in bad:
                index = todo.popleft()
                try:
                    body = await self._fetch(donor, target, index, PIECE_SIZE)
                except Exception as e:  # stalled or lost stream: one more chance, then the donor is out
                    todo.append(index)
                    transport_errors[donor] += 1
                    if transport_errors[donor] > 1:
                        bad[donor] = f"piece {index}: {type(e).__name__}: {e}"
                        logger.warning("dropping state donor %s: %s", donor, bad[donor])
                        return
                    continue
                if hashlib.sha256(body).digest() != hashes[index]:  # wrong bytes: out at once
                    todo.append(index)
                    bad[donor] = f"piece {index} does not match its hash"
                    logger.warning("dropping state donor %s: %s", donor, bad[donor])
                    return
                if not all_finite(body):  # the attested state itself is bad: every attester of it is
                    bad[donor] = f"piece {index} holds NaN or Inf"
                    poisoned.append(f"{donor} (piece {index})")
                    todo.clear()
                    return
                pieces[index] = body
                served[donor] += 1

        while todo:
            good = [d for d in donors if d not in bad]
            if not good:
                raise StateSyncFailed(f"every donor of round {target.round} failed: {bad}")
            await asyncio.gather(*(worker(d, manifest.piece_hashes) for d in good for _ in range(PER_DONOR)))
        if poisoned:
            raise PoisonedState(target.hash, f"state {target.hash[:12]} of round {target.round} holds NaN or Inf: "
                                f"served by {poisoned[0]}, attested by {list(target.attesters)}; refused")
        snapshot = assemble(target.round, self.numel, manifest, pieces, verified=True)
        self.last_download = {"seconds": time.monotonic() - t0, "bytes": len(snapshot.data),
                              "donors": dict(served), "dropped": dict(bad)}
        return snapshot


async def _reply(writer: asyncio.StreamWriter, header: dict[str, Any], body: bytes = b"") -> None:
    """``transport.reply`` with a deadline; past it the stream is aborted, dropping what is buffered."""
    try:
        await asyncio.wait_for(transport.reply(writer, header, body), WRITE_TIMEOUT)
    except TimeoutError:
        writer.transport.abort()


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
    """The loop's ``StateHooks`` over the network: fork choice and sync through ``StateSync``, serve,
    checkpoint. ``trust`` is the ledger the training thread updates after every completed round."""

    def __init__(self, sync: StateSync, trust: Trust, checkpoint_path: str | None, timeout: float,
                 min_round_s: float, log: Any = print):
        self.sync, self.trust, self.checkpoint_path, self.timeout = sync, trust, checkpoint_path, timeout
        self.min_round_s, self.log = min_round_s, log
        self.history: deque[State] = deque(maxlen=HISTORY)  # our recent states, oldest first
        self._boundary = time.monotonic()  # when we last reached a round boundary
        self._poisoned: dict[str, None] = {}  # state hashes refused for NaN/Inf
        self._named: dict[str, None] = {}  # peers whose refused claims we already logged
        self._reach: dict[str, int] = {}  # the run's reachability mix we last reported
        self._seen: dict[str, tuple[int, float]] = {}  # trusted peer -> (round, monotonic time) last accepted
        self.present: set[str] = set()  # the other peers ``wait_for_peers`` last saw
        self._writes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
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
        now = time.monotonic()
        clock = Clock(self.min_round_s, now - self._boundary, {p: (r, now - t) for p, (r, t) in self._seen.items()})
        try:
            choice = self.sync.check(own, weights, clock, self._poisoned)
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
        moved = self._wait_past(round_, watched, time.monotonic() + timeout, lambda m: 2 * len(m) > len(watched))
        return 2 * len(moved) > len(watched)  # most of them: fork choice will see the new state

    def _wait_past(self, round_: int, peers: set[str], until: float, enough: Callable[[set[str]], bool]) -> set[str]:
        """Reads the run's heartbeats until those of ``peers`` that attest a state past ``round_`` are
        ``enough``, or ``until`` (``time.monotonic()``) passes; returns them."""
        moved: set[str] = set()
        while True:
            try:
                found = attestations(read_heartbeats(self.sync.dht, self.sync.run_key))
            except (PeerError, DHTError):  # a slow read: ask again until the deadline
                found = []
            moved |= {a.peer for a in found if a.peer in peers and a.state.round > round_}
            if enough(moved) or time.monotonic() >= until:
                return moved
            time.sleep(0.25)  # the DHT has no watch; bounded by ``until``

    def wait_for_end(self, round_: int, peers: tuple[str, ...], until: float) -> list[str]:
        """After a round we voided or trained alone (training thread): waits until each of ``peers``
        announces a state past ``round_``, at most until ``until`` (``time.monotonic()``); returns
        the peers that did not. A member that died never announces: once one of them has, the rest
        get ``END_GRACE`` seconds more (members of one group end a round within moments of each
        other), else the wait would last until ``until`` (their all-reduce deadline) and we would
        come too late for their next group."""
        waited = set(peers)
        first: list[float] = []

        def enough(moved: set[str]) -> bool:
            if moved and not first:
                first.append(time.monotonic())
            return moved == waited or bool(first) and time.monotonic() - first[0] >= END_GRACE

        return sorted(waited - self._wait_past(round_, waited, until, enough))

    def peers_seen(self) -> int | None:
        """Peers whose heartbeats the last fork choice read (ours included; None: none read yet)."""
        return sum(self.sync.reach.values()) if self.sync.reach else None

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """Waits until ``count`` peers (this one included) announce themselves, at most ``timeout``
        seconds; returns how many were seen. Counts libp2p identities whose heartbeats are bound
        to them: one identity is one peer, but identities are free, so this is a convenience for
        friends starting a run together, not a guarantee that ``count`` independent peers exist."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.present = {hb["peer_id"] for hb in read_heartbeats(self.sync.dht, self.sync.run_key)} \
                    - {self.sync.dht.peer_id}
            except (PeerError, DHTError):  # a slow read: ask again until the deadline
                pass
            seen = 1 + len(self.present)
            if seen >= count or time.monotonic() >= deadline:
                return seen
            time.sleep(0.5)  # the DHT has no watch; bounded by the deadline

    def committed(self, snapshot: Snapshot) -> None:
        """A new round boundary (training thread): remember the state, serve it, checkpoint it."""
        self._boundary = time.monotonic()
        if not self.history or (self.history[-1].round, self.history[-1].hash) != (snapshot.round, snapshot.hash):
            self.history.append(State(snapshot.round, snapshot.hash, snapshot.parent))
        self.sync.serve(snapshot)
        if self.checkpoint_path:  # off the training thread: one writer, in order (a snapshot is immutable)
            path = self.checkpoint_path
            self._writes.submit(self._write, path, snapshot)

    def _write(self, path: str, snapshot: Snapshot) -> None:
        try:
            checkpoint.write(path, snapshot)
        except OSError as e:  # a full disk must not stop training; say it every time it happens
            self.log(f"warning: could not write the checkpoint ({e})")
