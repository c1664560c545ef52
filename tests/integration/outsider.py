"""An outside attacker built from stock hivemind, msgpack and cryptography only (no hivetrain code):
it joins a run's DHT, publishes forged heartbeats and ready records, and throws junk frames and
stream floods at the run's peers. Run as a script; it writes what it did, and what it was told,
to a JSON file.

    python tests/integration/outsider.py MADDR RUN_KEY SPEC_HASH PEER_ID[,PEER_ID...] SECONDS OUT.json [VERSION]

VERSION: the averaging protocol's version (part of its libp2p protocol name; an attacker reads it
off the peers' code), 6 unless given.

    python tests/integration/outsider.py lockout MADDR SPEC_HASH PEER_ID[,PEER_ID...] IDENTITIES SECONDS OUT.json VERSION HOLD

Serving lockout (review N2): IDENTITIES transport identities (one p2p daemon each) hold as many
silent streams as each peer lets one requester have (4) on every peer's state-serving protocol
(VERSION: its version), reopening each one the peer drops, until SECONDS pass or OUT.json.stop
exists. OUT.json.holding appears once it holds HOLD streams at every peer at once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import struct
import sys
import time
from typing import Any

import base58
import msgpack
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID

EVIL = hashlib.sha256(b"the attacker's state").hexdigest()
MAGIC = b"HTW3"  # the averaging protocol's frame magic, as a wire sniffer would see it
PREFIX = struct.Struct("<4sIQ")


class Key:
    """An Ed25519 key, its libp2p peer id and its record fingerprint, computed from the public formats."""

    def __init__(self) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.public = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.peer_id = base58.b58encode(bytes([0, 36, 8, 1, 18, 32]) + self.public).decode()
        self.subkey = base64.b32encode(hashlib.sha256(b"hivetrain-key-v1\0" + self.public).digest()[:20]).decode().lower()

    def envelope(self, kind: str, key: str, fields: dict[str, Any], ttl: float = 120.0) -> bytes:
        """A signed record; stored with expiration ``expires(ttl)`` (the DHT's may not exceed the signed one)."""
        payload = msgpack.packb(fields, use_bin_type=True)
        expiration = expires(ttl)
        message = b"hivetrain-record-v1\0" + msgpack.packb([kind, key, self.subkey, payload, float(expiration)],
                                                            use_bin_type=True)
        return msgpack.packb(["HT1", kind, key, self.subkey, payload, float(expiration), self.public,
                              self.key.sign(message)], use_bin_type=True)


def expires(ttl: float) -> float:
    """Whole seconds, so that the signed and the stored expiration are the same number."""
    return float(int(time.time()) + int(ttl))


def note(log: dict[str, Any], what: str, stored: bool) -> None:
    """Whether a store of ``what`` was ever accepted (a later copy of the same record may be refused
    as not newer than the one held)."""
    log["stored"][what] = log["stored"].get(what, False) or bool(stored)


def heartbeat(who: Key, claimed_id: str, round_: int, state: str) -> dict[str, Any]:
    return dict(peer_id=claimed_id, round=round_, state_hash=state, parent=EVIL, throughput=1e6, train_loss=0.1,
                eval_loss=0.1)


async def honest_heartbeats(node: DHTNode, run_key: str) -> list[dict[str, Any]]:
    found = await node.get(f"hivetrain/{run_key}/peers", latest=True)
    out = []
    if found is not None and isinstance(found.value, dict):
        for item in found.value.values():
            try:
                raw = msgpack.unpackb(item.value, raw=False)
                out.append(msgpack.unpackb(raw[4], raw=False))
            except Exception:
                continue
    return out


async def reply_code(reader: asyncio.StreamReader, timeout: float | None = 5) -> str:
    """The code of the one frame a peer sent on a stream (or what happened instead)."""
    try:
        prefix = await asyncio.wait_for(reader.readexactly(PREFIX.size), timeout)
        _, header_len, _ = PREFIX.unpack(prefix)
        header = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(header_len), 5), raw=False)
        return f"code {header['code']}" if header.get("type") == "ack" else str(header.get("type"))
    except Exception as e:
        return type(e).__name__


async def frame(p2p: P2P, peer: str, protocol: str, data: bytes, read: bool = True) -> str:
    """Writes raw bytes on a fresh stream; returns the reply code the peer sent (or what happened)."""
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol), 10)
        writer.write(data)
        await writer.drain()
        if not read:
            return "sent"
        prefix = await asyncio.wait_for(reader.readexactly(PREFIX.size), 10)
        _, header_len, _ = PREFIX.unpack(prefix)
        header = msgpack.unpackb(await reader.readexactly(header_len), raw=False)
        writer.close()
        return f"code {header['code']}" if header.get("type") == "ack" else str(header.get("type"))
    except Exception as e:
        return type(e).__name__


async def exchange(p2p: P2P, peer: str, protocol: str, data: bytes) -> dict[str, Any] | str:
    """Writes one frame on a fresh stream; returns the header the peer answered with (or what happened)."""
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol), 10)
        writer.write(data)
        await writer.drain()
        prefix = await asyncio.wait_for(reader.readexactly(PREFIX.size), 10)
        _, header_len, _ = PREFIX.unpack(prefix)
        reply = msgpack.unpackb(await reader.readexactly(header_len), raw=False)
        writer.close()
        return reply if isinstance(reply, dict) else "not a header"
    except Exception as e:
        return type(e).__name__


def header(kind: str, spec_hash: str, round_: int, base: str, **fields: Any) -> bytes:
    raw = msgpack.packb({"type": kind, "run": spec_hash, "round": round_, "base": base, **fields}, use_bin_type=True)
    return raw


async def main(maddr: str, run_key: str, spec_hash: str, peers: list[str], seconds: float, out: str,
               version: int = 6) -> None:
    log: dict[str, Any] = {"stored": {}, "frames": {}, "flood": {}, "sybils": [], "decided": []}
    p2p = await P2P.create(initial_peers=[maddr])
    me = p2p.peer_id.to_base58()  # the identity the peers' transport authenticates: ours
    log["outsider"] = me
    node = await DHTNode.create(p2p=p2p, initial_peers=[maddr], client_mode=True)
    sybils = [Key() for _ in range(3)]
    log["sybils"] = [s.peer_id for s in sybils]
    protocol = f"hivetrain/avg/{version}/{spec_hash[:32]}"  # (the averaging protocol: peer/averaging/context.py)
    end = time.monotonic() + seconds
    stalled: list[Any] = []
    try:
        while time.monotonic() < end:
            beats = await honest_heartbeats(node, run_key)
            current = max((b.get("round", 0) for b in beats if b.get("peer_id") not in log["sybils"]), default=0)
            base = next((b["state_hash"] for b in beats if b.get("round") == current), EVIL)
            # 1. fork choice: three strangers claim a state of their own far ahead, and one round ahead
            for i, s in enumerate(sybils):
                claimed = 10**9 if i == 0 else current + 1
                ok = await node.store(f"hivetrain/{run_key}/peers", s.envelope("hb", f"hivetrain/{run_key}/peers",
                                      heartbeat(s, s.peer_id, claimed, EVIL)), expires(120), subkey=s.subkey, exclude_self=True)
                note(log, f"hb sybil{i}", ok)
            # ... and a heartbeat in an honest peer's name, signed by a stranger (a fresh one each time)
            liar = Key()
            ok = await node.store(f"hivetrain/{run_key}/peers", liar.envelope(
                "hb", f"hivetrain/{run_key}/peers", heartbeat(liar, peers[0], current + 1, EVIL)),
                expires(120), subkey=liar.subkey, exclude_self=True)
            note(log, "hb in another's name", ok)
            # 2. matchmaking: ready records of identities that never answer, for this round and the next
            # (half "ready", half announced ahead and never ready: each costs at most the grace)
            for r in (current, current + 1):
                for i, s in enumerate(sybils):
                    key = f"hivetrain/{run_key}/ready/{r}"
                    ok = await node.store(key, s.envelope("ready", key, dict(peer_id=s.peer_id, round=r, base_hash=base,
                                                                           spec_hash=spec_hash, done=i % 2 == 0,
                                                                           eta=time.time() + 1.0), 60),
                                          expires(60), subkey=s.subkey, exclude_self=True)
                    note(log, f"ready sybil{i}", ok)
            # 3. junk frames at every peer
            for peer in peers:
                tries = {
                    "oversized header": PREFIX.pack(MAGIC, 1 << 30, 0),
                    "foreign magic": PREFIX.pack(b"JUNK", 10, 0) + b"x" * 10,
                    "part of an unknown group, 100 MB claimed": (lambda h: PREFIX.pack(MAGIC, len(h), 100 << 20) + h)(
                        header("part", spec_hash, current, base, group=os.urandom(32).hex(), shard=0,
                               digest=os.urandom(16).hex(), sig="")),
                    "part of an unknown group, 1 kB": (lambda h: PREFIX.pack(MAGIC, len(h), 1000) + h)(
                        header("part", spec_hash, current, base, group=os.urandom(32).hex(), shard=0,
                               digest=os.urandom(16).hex(), sig="")),
                    "view naming 64 made-up members": (lambda h: PREFIX.pack(MAGIC, len(h), 0) + h)(
                        header("view", spec_hash, current, base, members=[Key().peer_id for _ in range(64)],
                               excluded=[], closed=False, decided=False, up=0, derived=True)),
                }
                for name, data in tries.items():
                    log["frames"].setdefault(name, []).append(await frame(p2p, peer, protocol, data))
                # review N1: one unsolicited view request "decided: {you, me}" (as if we were closed)
                h = header("view", spec_hash, current, base, members=sorted([peer, me]), excluded=[], closed=True,
                           decided=True, up=0, derived=True)
                reply = await exchange(p2p, peer, protocol, PREFIX.pack(MAGIC, len(h), 0) + h)
                log["decided"].append(reply if isinstance(reply, str) else
                                      {k: reply.get(k) for k in ("type", "decided", "members", "code")})
                # a body pushed without waiting to be asked for it (20 MB)
                h = header("part", spec_hash, current, base, group=os.urandom(32).hex(), shard=0,
                           digest=os.urandom(16).hex(), sig="")
                log["frames"].setdefault("body pushed unasked", []).append(await frame(
                    p2p, peer, protocol, PREFIX.pack(MAGIC, len(h), 20 << 20) + h + os.urandom(20 << 20)))
            # 4. a flood of streams that never say anything
            opened = 0
            for peer in peers:
                last = None
                for _ in range(100):
                    try:
                        _, last, writer = await asyncio.wait_for(
                            p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol), 5)
                        stalled.append(writer)
                        opened += 1
                    except Exception:
                        break
                if last is not None:  # the last silent stream is beyond the per-peer cap: answered at once
                    log["flood"].setdefault("last reply", []).append(await reply_code(last))
            log["flood"]["opened"] = log["flood"].get("opened", 0) + opened
            stalled = stalled[-600:]
            await asyncio.sleep(1.0)
    finally:
        with open(out, "w") as f:
            json.dump(log, f)
        await node.shutdown()
        await p2p.shutdown()


PER_REQUESTER = 4  # the silent streams one identity may hold at one peer's state server


async def lockout(maddr: str, spec_hash: str, peers: list[str], identities: int, seconds: float, out: str,
                  version: int, enough: int) -> None:
    log: dict[str, Any] = {"identities": [], "replies": {}, "opened": 0, "samples": []}
    nodes = await asyncio.gather(*(P2P.create(initial_peers=[maddr]) for _ in range(identities)))
    log["identities"] = [n.peer_id.to_base58() for n in nodes]
    protocol = f"hivetrain/state/{version}/{spec_hash[:32]}"  # (state serving: peer/state/serve.py)
    held = dict.fromkeys(peers, 0)

    async def hold(node: P2P, peer: str) -> None:
        while True:
            try:
                _, reader, writer = await asyncio.wait_for(
                    node.call_binary_stream_handler(PeerID.from_base58(peer), protocol), 5)
            except Exception as e:
                what = type(e).__name__
            else:
                log["opened"] += 1
                held[peer] += 1
                try:
                    what = await reply_code(reader, timeout=None)  # whatever the peer does with a silent stream
                finally:
                    held[peer] -= 1
                    writer.close()
            log["replies"][what] = log["replies"].get(what, 0) + 1
            if what != "IncompleteReadError":  # refused, or could not open: not in a tight loop
                await asyncio.sleep(0.2)

    tasks = [asyncio.ensure_future(hold(n, p)) for n in nodes for p in peers for _ in range(PER_REQUESTER)]
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and not os.path.exists(out + ".stop"):
            log["samples"].append([held[p] for p in peers])
            if all(held[p] >= enough for p in peers) and not os.path.exists(out + ".holding"):
                open(out + ".holding", "w").close()
            await asyncio.sleep(0.25)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with open(out, "w") as f:
            json.dump(log, f)
        await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)


if __name__ == "__main__" and sys.argv[1] == "lockout":
    maddr, spec_hash, peers, identities, seconds, out, version, enough = sys.argv[2:10]
    asyncio.run(lockout(maddr, spec_hash, peers.split(","), int(identities), float(seconds), out, int(version),
                        int(enough)))
elif __name__ == "__main__":
    maddr, run_key, spec_hash, peers, seconds, out = sys.argv[1:7]
    version = int(sys.argv[7]) if len(sys.argv) > 7 else 6
    asyncio.run(main(maddr, run_key, spec_hash, peers.split(","), float(seconds), out, version))
