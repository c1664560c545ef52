"""Can other peers dial us? A dial-back check, since p2pd keeps its AutoNAT verdict to itself.

p2pd runs AutoNAT but has no API to read its verdict (docs/REACH.md section 2), and a peer that
nobody can dial cannot reduce or audit: parts would never reach it. So a peer asks up to ASKED of
the peers it is connected to: "open a plain TCP connection to my address at these ports". Both
sides speak over the link (peer/net/link.py): the check is one request with no body, and the
``DialBackService`` answers it on the link's server, with its caps.

The asked peer dials only the IP that its own connection from the asker comes from (the stream's
remote address, as the link sees it), never an address the asker names, so nobody can aim it at a
third host; at most MAX_DIALBACK_PORTS ports, DIAL_TIMEOUT each, one check per asker per COOLDOWN,
CONCURRENT checks at once, and a relayed connection is refused (its remote end is the relay). A
NAT drops or refuses the unsolicited connection, so the answer is no; a symmetric NAT also maps the
asker's source port elsewhere.

The asker is reachable (``DIRECT``) when more answers say yes than no, ``OUTBOUND_ONLY`` when at
least as many say no, and ``UNKNOWN`` when nobody answered (the first peer of a run: it acts as
reachable, and checks again once peers come). A lying answer can only make a peer join as an
outbound-only member (it still contributes its part) or believe itself reachable (its groups
then fail to reach it and drop it, as any unreachable peer).

The asked peers are one per network prefix (/24, /48) as our own connections see them
(peer/net/prefixes.py; exempt addresses, such as loopback, each count as their own), in a fresh
random order, never the order we hold the connections in: identities on one prefix get one answer
between them, not the majority (review N3: 3 identities of one /24 that connected first were the
3 asked, said "not reachable", and every honest public peer became outbound-only, leaving an
attacker the lone reducer), and identities on several prefixes that connect first are asked no
sooner than anyone else. Honest answers agree (they test one fact), so answers that disagree mean
somebody lies: then every other prefix we are connected to is asked too (up to SPLIT_ASKED in
all), and the majority of all the answers decides. An attacker needs a majority of our connected
prefixes (up to SPLIT_ASKED of them), not of the ASKED drawn.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hivetrain.dht import clock
from hivetrain.dht.diagnose import tcp_endpoint
from hivetrain.peer.net.link import Link, Reply, Server, request
from hivetrain.peer.net.prefixes import first_prefix
from hivetrain.peer.net.wire import MAX_DIALBACK_PORTS, Code, reason

PROTOCOL = "hivetrain/dialback/3"  # 2: over the link's framing and caps; 3: the reply says the IP it dialed
DIRECT, OUTBOUND_ONLY, UNKNOWN = "direct", "outbound_only", "unknown"  # the heartbeat's ``reach`` values
REACH_WORDS = {DIRECT: "reachable directly", OUTBOUND_ONLY: "outbound-only (behind NAT)", UNKNOWN: "not known"}
ASKED = 5  # peers asked per check, one per prefix
SPLIT_ASKED = 15  # peers asked in all when the first ASKED disagree
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
    seen: str = ""  # the IP more than half of the answers that could dial us dialed (our public IP), or ""


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    """Our TCP listening ports, from the daemon's addresses (at most MAX_DIALBACK_PORTS)."""
    ports: list[int] = []
    for maddr in maddrs:
        where = tcp_endpoint(maddr)
        if where is not None and where[2] and where[2] not in ports:
            ports.append(where[2])
    return ports[:MAX_DIALBACK_PORTS]


class Answering(Protocol):
    """How this peer answers a check (the honest one: what its dial found)."""

    def dialback_answer(self, asker: str, connected: bool) -> bool:
        """What we tell ``asker`` about whether we could connect to it."""
        ...


def _reply(checked: bool, ok: bool, why: str, seen: str = "") -> Reply:
    return {"type": "dialback_reply", "checked": checked, "ok": ok, "reason": reason(why), "seen": seen}, b""


class _Check:
    """The server's ticket for one admitted check: the dials run in ``complete``."""

    deadline = 0.0

    def __init__(self, service: DialBackService, asker: str, host: str, ports: list[int]):
        self.service, self.asker, self.host, self.ports = service, asker, host, ports

    async def complete(self, body: bytes) -> Reply:
        service = self.service
        service.running += 1
        try:
            results = await asyncio.gather(*(service.link.connects(self.host, port, DIAL_TIMEOUT) for port in self.ports))
        finally:
            service.running -= 1
        service.checked += 1
        opened = [p for p, ok in zip(self.ports, results, strict=True) if ok]
        ok = service.answering.dialback_answer(self.asker, bool(opened))
        if ok:
            return _reply(True, True, f"connected to {self.host} port {(opened or self.ports)[0]}", self.host)
        return _reply(True, False, f"could not connect to {self.host} at ports {', '.join(map(str, self.ports))}",
                      self.host)

    def abort(self) -> None:
        pass


class DialBackService:
    """Answers other peers' checks; serve ``server`` on the link under ``PROTOCOL``."""

    max_body = 0

    def __init__(self, link: Link, answering: Answering):
        self.link, self.answering = link, answering
        self.server = Server(self)
        self.last: OrderedDict[str, float] = OrderedDict()  # asker -> when we last checked it (bounded)
        self.running = 0
        self.checked = 0  # checks answered (tests read it)

    def is_member(self, peer: str) -> bool:
        return False

    def refusal(self, header: dict[str, Any], code: Code, why: str) -> Reply:
        return _reply(False, False, why or code.name)

    def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Reply | _Check:
        if header["type"] != "dialback":
            return _reply(False, False, "not a dial-back request")
        where = tcp_endpoint(remote)
        if "/p2p-circuit" in remote or where is None:
            return _reply(False, False, f"we see you through {remote or 'no address'}, not at an address we can dial")
        now = clock.now()
        if now - self.last.get(sender, -COOLDOWN) < COOLDOWN or self.running >= CONCURRENT:
            return _reply(False, False, "busy: ask again later")
        self.last[sender] = now
        self.last.move_to_end(sender)
        while len(self.last) > MAX_ASKERS:
            self.last.popitem(last=False)
        return _Check(self, sender, where[1], list(header["ports"]))


async def one_per_prefix(link: Link, peers: Sequence[str]) -> list[str]:
    """``peers`` in their order, keeping the first of each network prefix (exempt ones all kept)."""
    addrs = await link.observed_addrs(peers)
    seen: set[str] = set()
    kept = []
    for peer in peers:
        prefix = first_prefix(addrs.get(peer, []))
        if prefix is not None:
            if prefix in seen:
                continue
            seen.add(prefix)
        kept.append(peer)
    return kept


def ask_order(connected: Collection[str], rng: random.Random | None = None) -> list[str]:
    """The connected peers in a random order: connecting to us first buys no place."""
    order = sorted(set(connected))
    (rng or random.SystemRandom()).shuffle(order)
    return order


async def check(link: Link, ports: Sequence[int], peers: Sequence[str] | None = None,
                rng: random.Random | None = None) -> Verdict:
    """Asks ASKED peers (default: those we hold direct connections to, one per prefix, in
    ``ask_order``) to dial us at ``ports``, and up to SPLIT_ASKED if their answers disagree; call
    on the link's loop."""
    if peers is None:
        peers = await one_per_prefix(link, ask_order(await link.connected(), rng))
    peers = list(peers)[:SPLIT_ASKED]
    asked = peers[:ASKED]
    if not ports or not asked:
        return Verdict(UNKNOWN, (), tuple(ports))

    async def ask(peer: str) -> tuple[str, bool | None, str]:
        try:
            reply, _ = await request(link, peer, PROTOCOL, {"type": "dialback", "ports": list(ports)}, b"",
                                     ASK_TIMEOUT)
        except Exception as e:  # an old peer without the protocol, a timeout, a dropped stream: no answer
            logger.debug("dial-back check by %s failed: %r", peer, e)
            return peer, None, ""
        if reply["type"] != "dialback_reply" or not reply["checked"]:
            return peer, None, ""
        return peer, bool(reply["ok"]), reply["seen"]

    replies = [r for r in await asyncio.gather(*(ask(p) for p in asked)) if r[1] is not None]
    if len({ok for _, ok, _ in replies}) > 1 and len(peers) > len(asked):  # somebody lies: ask every prefix
        replies += [r for r in await asyncio.gather(*(ask(p) for p in peers[len(asked):])) if r[1] is not None]
        asked = peers
    answers = tuple((p, bool(ok)) for p, ok, _ in replies)
    yes = sum(ok for _, ok in answers)
    mode = UNKNOWN if not answers else DIRECT if 2 * yes > len(answers) else OUTBOUND_ONLY
    seen = Counter(ip for _, ok, ip in replies if ok and ip).most_common(1)
    ip = seen[0][0] if seen and 2 * seen[0][1] > yes else ""  # (one liar among honest answers names nothing)
    return Verdict(mode, answers, tuple(ports), len(asked), ip if mode == DIRECT else "")
