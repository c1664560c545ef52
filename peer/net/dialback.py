"""Can other peers dial us? A dial-back check, since p2pd keeps its AutoNAT verdict to itself.

p2pd runs AutoNAT but has no API to read its verdict (docs/REACH.md section 2), and a peer that
nobody can dial cannot reduce or audit: parts would never reach it. So a peer asks up to ASKED of
the peers it is connected to: "open a plain TCP connection to my address at these ports".

The asked peer dials only the IP that its own connection from the asker comes from, never an
address the asker names, so nobody can aim it at a third host; at most MAX_DIALBACK_PORTS ports,
DIAL_TIMEOUT each, one check per asker per COOLDOWN, CONCURRENT checks at once, and a relayed
connection is refused (its remote end is the relay). A NAT drops or refuses the unsolicited
connection, so the answer is no; a symmetric NAT also maps the asker's source port elsewhere.

The asker is reachable (``DIRECT``) when more answers say yes than no, ``OUTBOUND_ONLY`` when at
least as many say no, and ``UNKNOWN`` when nobody answered (the first peer of a run: it acts as
reachable, and checks again once peers come). A lying answer can only make a peer join as an
outbound-only member (it still contributes its part) or believe itself reachable (its groups
then fail to reach it and drop it, as any unreachable peer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivetrain.dht.diagnose import tcp_endpoint
from hivetrain.peer.net.wire import MAX_DIALBACK_PORTS, encode_frame, read_frame, reason

PROTOCOL = "hivetrain/dialback/1"
DIRECT, OUTBOUND_ONLY, UNKNOWN = "direct", "outbound_only", "unknown"  # the heartbeat's ``reach`` values
ASKED = 3  # peers asked per check
DIAL_TIMEOUT = 3.0  # seconds for the asked peer's TCP connect
ASK_TIMEOUT = DIAL_TIMEOUT + 5.0  # seconds the asker waits for one answer
COOLDOWN = 20.0  # seconds between two checks for the same asker
CONCURRENT = 4  # checks an asked peer runs at once; more are refused
MAX_ASKERS = 1024  # askers remembered for the cooldown (the oldest is forgotten first)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    mode: str  # DIRECT, OUTBOUND_ONLY or UNKNOWN
    answers: tuple[tuple[str, bool], ...]  # (peer asked, whether it could dial us)
    ports: tuple[int, ...]
    asked: int = 0  # peers asked (some may not have answered)


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    """Our TCP listening ports, from the daemon's addresses (at most MAX_DIALBACK_PORTS)."""
    ports: list[int] = []
    for maddr in maddrs:
        where = tcp_endpoint(maddr)
        if where is not None and where[2] and where[2] not in ports:
            ports.append(where[2])
    return ports[:MAX_DIALBACK_PORTS]


class DialBackService:
    """Answers other peers' checks (on the loop that owns ``p2p``)."""

    def __init__(self) -> None:
        self.last: OrderedDict[str, float] = OrderedDict()  # asker -> when we last checked it (bounded)
        self.running = 0
        self.checked = 0  # checks answered (tests read it)

    async def serve(self, p2p: Any) -> None:
        await p2p.add_binary_stream_handler(PROTOCOL, self._handle)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ok, why = await self._answer(info.peer_id.to_base58(), str(info.addr), reader)
            writer.write(encode_frame({"type": "dialback_reply", "checked": ok is not None, "ok": bool(ok),
                                       "reason": reason(why)}))
            await writer.drain()
        except Exception as e:  # a malformed or vanished asker: nothing to answer
            logger.debug("dial-back check failed: %r", e)
        finally:
            writer.close()

    async def _answer(self, asker: str, remote: str, reader: asyncio.StreamReader) -> tuple[bool | None, str]:
        """(whether we could connect, or None: we did not check; why)."""
        header, _ = await read_frame(reader, ASK_TIMEOUT, max_body=0)
        if header["type"] != "dialback":
            return None, "not a dial-back request"
        where = tcp_endpoint(remote)
        if "/p2p-circuit" in remote or where is None:
            return None, f"we see you through {remote}, not at an address we can dial"
        now = time.monotonic()
        if now - self.last.get(asker, -COOLDOWN) < COOLDOWN or self.running >= CONCURRENT:
            return None, "busy: ask again later"
        self.last[asker] = now
        self.last.move_to_end(asker)
        while len(self.last) > MAX_ASKERS:
            self.last.popitem(last=False)
        self.running += 1
        try:
            results = await asyncio.gather(*(_connects(where[1], port) for port in header["ports"]))
        finally:
            self.running -= 1
        self.checked += 1
        opened = [p for p, ok in zip(header["ports"], results, strict=True) if ok]
        if opened:
            return True, f"connected to {where[1]} port {opened[0]}"
        return False, f"could not connect to {where[1]} at ports {', '.join(map(str, header['ports']))}"


async def _connects(ip: str, port: int) -> bool:
    try:
        async with asyncio.timeout(DIAL_TIMEOUT):
            _, writer = await asyncio.open_connection(ip, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def check(p2p: Any, ports: Sequence[int], peers: Sequence[str] | None = None) -> Verdict:
    """Asks up to ASKED peers (default: those we hold direct connections to) to dial us at
    ``ports``; call on the loop that owns ``p2p``."""
    from hivemind.p2p import PeerID

    if peers is None:
        infos = await p2p.list_peers()
        peers = list(dict.fromkeys(i.peer_id.to_base58() for i in infos
                                   if not any("/p2p-circuit" in str(a) for a in i.addrs)))
    asked = list(peers)[:ASKED]
    if not ports or not asked:
        return Verdict(UNKNOWN, (), tuple(ports))

    async def ask(peer: str) -> tuple[str, bool | None]:
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL)
                try:
                    writer.write(encode_frame({"type": "dialback", "ports": list(ports)}))
                    await writer.drain()
                    reply, _ = await read_frame(reader, ASK_TIMEOUT, max_body=0)
                finally:
                    writer.close()
        except Exception as e:  # an old peer without the protocol, a timeout, a dropped stream: no answer
            logger.debug("dial-back check by %s failed: %r", peer, e)
            return peer, None
        if reply["type"] != "dialback_reply" or not reply["checked"]:
            return peer, None
        return peer, bool(reply["ok"])

    answers = [(p, ok) for p, ok in await asyncio.gather(*(ask(p) for p in asked)) if ok is not None]
    yes = sum(ok for _, ok in answers)
    mode = UNKNOWN if not answers else DIRECT if 2 * yes > len(answers) else OUTBOUND_ONLY
    return Verdict(mode, tuple(answers), tuple(ports), len(asked))
