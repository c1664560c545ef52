"""Verified state sync, the client side: find (fork choice), download and check the run's state.

Which state to hold is fork choice's (peer/state/choose.py). ``StateSync.check`` reads the run's
bound heartbeats and, for a joiner, first contacts attesters (asks each for the manifest) so that
the prefixes of our own connections to them can be counted. The training loop's side (our lineage,
the trust ledger, the waits at round boundaries) is ``StateKeeper`` (peer/state/keeper.py); serving
our own states to others is ``StateService`` (peer/state/serve.py). Both ends speak over the link.

Downloading: the manifest (parent, link, piece hashes) from any attester, checked against the
attested hash and parent; then the pieces from all attesters in parallel, each checked on arrival
against its hash and for NaN/Inf. A donor that serves a wrong piece, stalls past the piece
deadline, or fails is dropped and its pieces go to the others. A state whose pieces hold NaN or Inf
is refused outright (``PoisonedState``: the donor is named) and never chosen again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
from collections import Counter, deque
from collections.abc import Collection, Mapping
from typing import Any

from hivetrain.dht import clock
from hivetrain.dht.facade import DHTFacade
from hivetrain.peer.errors import PeerError, StateMismatch
from hivetrain.peer.net.link import Link, Traffic, request
from hivetrain.peer.net.wire import Code
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
from hivetrain.peer.state.heartbeats import attestations, reach_mix, read_heartbeats, sample_buckets
from hivetrain.peer.state.serve import StateService
from hivetrain.peer.state.snapshot import (
    PIECE_SIZE,
    Manifest,
    Snapshot,
    all_finite,
    assemble,
    manifest_nbytes,
    parse_manifest,
)

logger = logging.getLogger(__name__)
PIECE_TIMEOUT = 30.0  # seconds for one 1 MiB piece (a donor slower than ~35 KB/s is dropped)
PER_DONOR = 2  # pieces in flight per donor
CONTACT_TIMEOUT = 5.0  # seconds for a joiner's manifest request to one attester (its vote)
CONTACT_PARALLEL = 64  # such requests at once: at most 1024 contacts take 80 s


class StateSyncFailed(PeerError):
    """No state could be downloaded and verified from the attesting peers."""


class PoisonedState(StateSyncFailed):
    """The attested state holds NaN or Inf: refused, and never to be chosen again."""

    def __init__(self, state_hash: str, message: str):
        super().__init__(message)
        self.state_hash = state_hash


class Refused(StateMismatch):
    """A donor answered our request with a refusal (``code``: why, e.g. BUSY)."""

    def __init__(self, message: str, code: Code | None = None):
        super().__init__(message)
        self.code = code


class StateSync:
    """Chooses and downloads verified states over ``link``; offers ours through ``service``.
    ``rng``: this peer's randomness (a joiner's secret sample, the donor order); None: the OS's."""

    def __init__(self, dht: DHTFacade, link: Link, service: StateService, run_key: str, numel: int,
                 rng: random.Random | None = None, heartbeat_level: int = 0):
        self.dht, self.link, self.service, self.run_key, self.numel = dht, link, service, run_key, numel
        self.heartbeat_level = heartbeat_level  # the run's (peer/state/heartbeats.py): fork choice reads a sample
        self.sampled = 1.0  # the share of the heartbeat buckets the last fork choice read
        self.spec_hash = service.run
        self.rng = rng or random.Random(os.urandom(16))
        self._salt = self.rng.randbytes(16)  # a joiner's secret: which attesters of a state it samples
        self.reach: dict[str, int] = {}  # how the run's peers say they are reached, per mode (last read)
        self.last_download: dict[str, Any] = {}
        self.traffic = Traffic()  # what our requests to donors moved

    def serve(self, snapshot: Snapshot) -> None:
        """Offers ``snapshot`` to peers that sync (training thread)."""
        self.service.serve(snapshot)

    # ---- choosing (training thread) --------------------------------------------------------------

    def check(self, own: Own, weights: Mapping[str, float], clock: Clock, exclude: Collection[str] = ()) -> Choice:
        """Fork choice over the run's heartbeats (training thread; in a bucketed run, those of a random
        sample of the buckets, which holds each lineage's attesters in proportion): the established rule
        if ``weights`` (earned trust) has anyone, else the joiner's, after contacting attesters.
        Raises DHTError or PeerError if the heartbeats cannot be read."""
        buckets = sample_buckets(self.heartbeat_level, self.rng)
        heartbeats = read_heartbeats(self.dht, self.run_key, self.heartbeat_level, buckets)
        self.sampled = len(buckets) / (1 << self.heartbeat_level)
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
        addrs = await self.link.observed_addrs(served)
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
        reply, body = await request(self.link, donor, self.service.protocol, header, b"", PIECE_TIMEOUT,
                                    max_reply_body=max_body, traffic=self.traffic)
        if reply["type"] == "ack":  # refused by the donor's server or service (BUSY, MALFORMED, ...)
            code = Code(reply["code"]) if reply["code"] in Code._value2member_map_ else None
            raise Refused(f"donor refused: {code.name if code else reply['code']} {reply['reason']}", code)
        if reply["type"] != "state_resp" or not reply["ok"] or reply["index"] != index:
            raise Refused(f"donor refused: {reply.get('reason', '?')}")
        return body

    async def _download(self, target: Attested) -> Snapshot:
        t0 = clock.now()
        donors = list(target.attesters)
        self.rng.shuffle(donors)
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
        self.last_download = {"seconds": clock.now() - t0, "bytes": len(snapshot.data),
                              "donors": dict(served), "dropped": dict(bad)}
        return snapshot
