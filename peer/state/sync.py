"""Verified state sync: serve our state to joiners; find, download and check the run's state.

Choosing the state (``choose``) is a fixed rule every peer applies to the heartbeats in the DHT:
among the (round, state hash) pairs attested by at least k peers, the highest round wins, then the
most attesters, then the smallest hash. A peer whose own state loses re-syncs; a joiner starts
from the winner. Nothing is taken from a single self-declared "freshest" peer.

Downloading: the manifest (piece hashes) from any attester, checked against the attested hash;
then the pieces from all attesters in parallel, each checked on arrival. A donor that serves a
wrong piece, stalls past the piece deadline, or fails is dropped and its pieces go to the others.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivetrain.dht.errors import DHTError
from hivetrain.dht.node import DHT
from hivetrain.peer.errors import PeerError, StateMismatch
from hivetrain.peer.faults import FaultPlan
from hivetrain.peer.net import transport
from hivetrain.peer.net.wire import ProtocolError, read_frame
from hivetrain.peer.runspec import read_heartbeats
from hivetrain.peer.state import checkpoint
from hivetrain.peer.state.snapshot import (
    DIGEST_LEN,
    PIECE_SIZE,
    Snapshot,
    assemble,
    num_pieces,
    parse_manifest,
)

logger = logging.getLogger(__name__)
PIECE_TIMEOUT = 30.0  # seconds for one 1 MiB piece (a donor slower than ~35 KB/s is dropped)
PER_DONOR = 2  # pieces in flight per donor


class StateSyncFailed(PeerError):
    """No state could be downloaded and verified from the attesting peers."""


@dataclass(frozen=True)
class Attested:
    round: int
    hash: str
    attesters: tuple[str, ...]  # peer ids that announced this state


LOOKBACK = 3  # rounds: a peer compares its own recent states with what the run attested for them


def choose(heartbeats: Iterable[dict[str, Any]], me: str, my_round: int, my_hash: str, quorum: int,
           history: dict[int, str] | None = None) -> Attested | None:
    """The state this peer should move to, or None if its own state stands. Pure.

    A state attested for a round ahead of ours wins. A state attested for our round, or one of the
    LOOKBACK rounds before it, wins over the state *we* held at that round if more peers attest it
    (ties: the smaller hash): then we are on a minority fork, even if we raced ahead of the others
    in round numbers, and we go back to their state. ``history`` maps our recent rounds to our
    hashes. k = ``quorum`` attesters, or 1 when only one other peer is alive, or when no state
    (ours included) has k attesters: then a split run still converges on one state."""
    mine_by_round = dict(history or {})
    mine_by_round[my_round] = my_hash
    latest: dict[str, dict[str, Any]] = {}
    for hb in heartbeats:
        if hb["peer_id"] != me and hb["round"] >= latest.get(hb["peer_id"], {"round": -1})["round"]:
            latest[hb["peer_id"]] = hb
    k = 1 if len(latest) <= 1 else quorum
    counts = Counter((hb["round"], hb["state_hash"]) for hb in latest.values())
    if counts[(my_round, my_hash)] + 1 < k and all(c < k for c in counts.values()):
        k = 1  # the run is fragmented (no state has k attesters): converge on the fixed rule anyway

    def beats_ours(r: int, c: int, h: str) -> bool:
        if r > my_round:
            return True
        ours = mine_by_round.get(r)
        if ours is None or ours == h or r < my_round - LOOKBACK:
            return False
        ours_count = counts[(r, ours)] + 1
        return c > ours_count or (c == ours_count and h < ours)

    candidates = [(r, c, h) for (r, h), c in counts.items() if c >= k and beats_ours(r, c, h)]
    if not candidates:
        return None
    # highest round, then most attesters, then the smallest hash (negated for max())
    r, c, h = max(candidates, key=lambda x: (x[0], x[1], [-b for b in bytes.fromhex(x[2])]))
    return Attested(r, h, tuple(sorted(p for p, hb in latest.items() if (hb["round"], hb["state_hash"]) == (r, h))))


class StateSync:
    """Serves this peer's recent snapshots and downloads verified states. Construct, then ``start()``."""

    def __init__(self, dht: DHT, run_key: str, spec_hash: str, numel: int, quorum: int, faults: FaultPlan):
        self.dht, self.run_key, self.spec_hash, self.numel = dht, run_key, spec_hash, numel
        self.quorum, self.faults = quorum, faults
        self.handler_name = f"hivetrain/state/1/{spec_hash[:32]}"
        self._served: dict[str, Snapshot] = {}  # state hash -> snapshot; the last two rounds
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
        try:
            header, _ = await read_frame(reader, 10.0, max_body=0)
        except (ProtocolError, TimeoutError, asyncio.IncompleteReadError, OSError):
            writer.close()
            return
        fields = {"type": "state_resp", "run": self.spec_hash, "round": header["round"], "base": header["base"],
                  "index": header.get("index", -1)}
        snapshot = self._served.get(header["base"])
        if header["type"] != "state_req" or header["run"] != self.spec_hash:
            await transport.reply(writer, {**fields, "ok": False, "reason": "not a state request for this run"})
        elif snapshot is None or snapshot.round != header["round"]:
            await transport.reply(writer, {**fields, "ok": False, "reason": "state not held here"})
        elif header["index"] == -1:
            await transport.reply(writer, {**fields, "ok": True, "reason": ""}, snapshot.manifest())
        elif header["index"] >= len(snapshot.piece_hashes):
            await transport.reply(writer, {**fields, "ok": False, "reason": "no such piece"})
        else:
            body = snapshot.piece(header["index"])
            if self.faults.active("serve_state", snapshot.round):  # test hook: a poisoned donor
                body = bytes(b ^ 0x5A for b in body[:64]) + body[64:]
            await transport.reply(writer, {**fields, "ok": True, "reason": ""}, body)

    # ---- choosing and downloading (training thread) ---------------------------------------------

    def check(self, my_round: int, my_hash: str, history: dict[int, str] | None = None) -> Attested | None:
        heartbeats = read_heartbeats(self.dht, self.run_key)
        self.dht.remember_threadsafe(hb["peer_id"] for hb in heartbeats)
        return choose(heartbeats, self.dht.peer_id, my_round, my_hash, self.quorum, history)

    def download(self, target: Attested, timeout: float) -> Snapshot:
        """Downloads and verifies ``target`` from its attesters; raises StateSyncFailed."""
        try:
            return self.dht.run(self._download(target), timeout=timeout)
        except StateSyncFailed:
            raise
        except Exception as e:
            raise StateSyncFailed(f"state sync of round {target.round} failed: {type(e).__name__}: {e}") from None

    async def _fetch(self, donor: str, target: Attested, index: int, max_body: int) -> bytes:
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
        piece_hashes: tuple[bytes, ...] | None = None
        for donor in donors:
            try:
                manifest = await self._fetch(donor, target, -1, num_pieces(self.numel) * DIGEST_LEN)
                piece_hashes = parse_manifest(target.round, self.numel, manifest, target.hash)
                break
            except Exception as e:
                bad[donor] = f"manifest: {type(e).__name__}: {e}"
        if piece_hashes is None:
            raise StateSyncFailed(f"no attester served a valid manifest for round {target.round}: {bad}")
        todo = deque(range(len(piece_hashes)))
        pieces: dict[int, bytes] = {}
        served: Counter[str] = Counter()

        transport_errors: Counter[str] = Counter()

        async def worker(donor: str) -> None:
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
                if hashlib.sha256(body).digest() != piece_hashes[index]:  # wrong bytes: out at once
                    todo.append(index)
                    bad[donor] = f"piece {index} does not match its hash"
                    logger.warning("dropping state donor %s: %s", donor, bad[donor])
                    return
                pieces[index] = body
                served[donor] += 1

        while todo:
            good = [d for d in donors if d not in bad]
            if not good:
                raise StateSyncFailed(f"every donor of round {target.round} failed: {bad}")
            await asyncio.gather(*(worker(d) for d in good for _ in range(PER_DONOR)))
        snapshot = assemble(target.round, self.numel, piece_hashes, pieces, verified=True)
        self.last_download = {"seconds": time.monotonic() - t0, "bytes": len(snapshot.data),
                              "donors": dict(served), "dropped": dict(bad)}
        return snapshot


class StateKeeper:
    """The loop's ``StateHooks`` over the network: catch up through ``StateSync``, serve, checkpoint."""

    def __init__(self, sync: StateSync, checkpoint_path: str | None, timeout: float, log: Any = print):
        self.sync, self.checkpoint_path, self.timeout, self.log = sync, checkpoint_path, timeout, log
        self.history: dict[int, str] = {}  # our recent rounds -> the state hash we held at them

    def catch_up(self, round_: int, state_hash: str) -> tuple[Snapshot, dict[str, Any]] | None:
        try:
            target = self.sync.check(round_, state_hash, self.history)
        except (PeerError, DHTError) as e:  # e.g. a DHT read past its timeout: train on, look again next round
            self.log(f"could not read the run's attestations ({e}); keeping our state this round")
            return None
        if target is None:
            return None
        self.log(f"the run is at round {target.round} (state {target.hash[:12]}, {len(target.attesters)} "
                 f"attesters), we are at round {round_}: syncing")
        try:
            snapshot = self.sync.download(target, self.timeout)
        except StateSyncFailed as e:
            self.log(f"state sync failed, trying again next round: {e}")
            return None
        info = dict(self.sync.last_download, attesters=list(target.attesters))
        self.log(f"downloaded {info['bytes'] / 1e6:.1f} MB in {info['seconds']:.1f} s from "
                 f"{len(info['donors'])} donors" + (f", dropped {sorted(info['dropped'])}" if info["dropped"] else ""))
        return snapshot, info

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """Waits until ``count`` peers (this one included) announce themselves, at most ``timeout``
        seconds; returns how many were seen. For runs that should start together."""
        deadline = time.monotonic() + timeout
        seen = 1
        while True:
            try:
                seen = 1 + len({hb["peer_id"] for hb in read_heartbeats(self.sync.dht, self.sync.run_key)}
                               - {self.sync.dht.peer_id})
            except (PeerError, DHTError):  # a slow read: ask again until the deadline
                pass
            if seen >= count or time.monotonic() >= deadline:
                return seen
            time.sleep(0.5)  # the DHT has no watch; bounded by the deadline

    def committed(self, snapshot: Snapshot) -> None:
        self.history = {r: h for r, h in self.history.items() if snapshot.round - LOOKBACK <= r < snapshot.round}
        self.history[snapshot.round] = snapshot.hash
        self.sync.serve(snapshot)
        if self.checkpoint_path:
            checkpoint.write(self.checkpoint_path, snapshot)
