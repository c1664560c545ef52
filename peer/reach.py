"""Where this peer listens, coming back there after a restart, and whether others can dial it.

A peer keeps its libp2p identity (``<state dir>/identity.key``) and the TCP port it listened on
(``<state dir>/listen.json``) in its state folder, so a restarted peer is the same peer at the same
address: the join line it printed keeps working and the peers that knew it re-dial it
(dht/node.py ``_refresh_routing``). An explicit port that is already taken is a one-line error
before anything is published (p2pd would share it silently through SO_REUSEPORT).

``Reachability`` finds out, with peers' dial-back checks, whether others can dial this peer, says so
in plain words, and tells the averager: a peer nobody can dial joins groups as an outbound-only
member (peer/averaging/views.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

from hivetrain.dht.diagnose import port_free, tcp_endpoint
from hivetrain.dht.facade import LoopRunner
from hivetrain.peer.net.dialback import (
    ASK_TIMEOUT,
    DIRECT,
    OUTBOUND_ONLY,
    UNKNOWN,
    Verdict,
    listen_ports,
)
from hivetrain.peer.net.dialback import check as dialback_check
from hivetrain.peer.net.link import Link

LISTEN_FILE = "listen.json"
IDENTITY_FILE = "identity.key"
MAX_REMEMBERED = 8  # addresses kept in listen.json
WILDCARDS = ("0.0.0.0", "::")
logger = logging.getLogger(__name__)


def remembered(state_dir: str, host_maddrs: Sequence[str]) -> list[str]:
    """``host_maddrs`` with each port 0 replaced by the port we listened on last time at that IP,
    if it is still free (else 0 again, with a warning: peers that knew the old address must be
    given the new one)."""
    saved = _load(state_dir)
    out = []
    for maddr in host_maddrs:
        where = tcp_endpoint(maddr)
        if where is None or where[2] != 0 or where[1] not in saved:
            out.append(maddr)
            continue
        proto, ip, _ = where
        port = saved[ip]
        if port_free(proto, ip, port):
            out.append(f"/{proto}/{ip}/tcp/{port}")
        else:
            logger.warning("the port this peer listened on last time (%s %d) is taken; listening on a new one "
                           "(peers that knew the old address need the new join line)", ip, port)
            out.append(maddr)
    return out


def remember(state_dir: str, host_maddrs: Sequence[str], listening: Sequence[str]) -> None:
    """Saves, per IP of ``host_maddrs``, the port we listen on now (from ``listening``, the daemon's
    addresses; a wildcard IP takes the port of any address of its family). Best effort."""
    saved = _load(state_dir)
    now = [w for w in map(tcp_endpoint, listening) if w is not None and w[2]]
    for host in map(tcp_endpoint, host_maddrs):
        if host is None:
            continue
        proto, ip, _ = host
        ports = [p for pr, i, p in now if pr == proto and (i == ip or ip in WILDCARDS)]
        if ports:
            saved.pop(ip, None)
            saved[ip] = ports[0]
    saved = dict(list(saved.items())[-MAX_REMEMBERED:])
    path = os.path.join(state_dir, LISTEN_FILE)
    try:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"ports": saved}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not remember the listening port in %s: %s", path, e.strerror)


def _load(state_dir: str) -> dict[str, int]:
    """{ip: port} from listen.json; anything malformed is ignored (it is only a preference)."""
    try:
        with open(os.path.join(state_dir, LISTEN_FILE)) as f:
            raw = json.load(f)
        ports = raw.get("ports", {}) if isinstance(raw, dict) else {}
        return {ip: p for ip, p in ports.items()
                if isinstance(ip, str) and len(ip) <= 64 and isinstance(p, int) and 0 < p < 65536}
    except (OSError, ValueError):
        return {}


def listening(hosts: Sequence[str], visible: Sequence[str]) -> str:
    """The line ``peer start`` says about where it listens: all interfaces or which address, and the
    TCP port (a port-0 host's from the daemon's ``visible`` addresses)."""
    ports = sorted({w[2] for w in map(tcp_endpoint, visible) if w is not None and w[2]})
    where = []
    endpoints = [w for w in map(tcp_endpoint, hosts) if w is not None]
    for proto, ip, port in endpoints:
        shown = port or (ports[0] if ports else 0)
        if ip in WILDCARDS:
            where.append(f"all {'IPv6 ' if proto == 'ip6' else ''}interfaces, TCP port {shown}")
        else:
            where.append(f"{ip} only, TCP port {shown}" + (" (only this machine can reach it)"
                                                           if ipaddress.ip_address(ip).is_loopback else ""))
    everywhere = any(ip in WILDCARDS for _, ip, _ in endpoints)
    hint = "--port chooses another" if everywhere else "--port N listens on all interfaces"
    return f"listening on {'; '.join(where) or ', '.join(hosts)} ({hint})"


def describe(verdict: Verdict) -> str:
    """The reachability line ``peer start`` prints, in plain words, with advice where it matters."""
    asked, yes = len(verdict.answers), sum(ok for _, ok in verdict.answers)
    port = verdict.ports[0] if verdict.ports else 0
    if verdict.mode == DIRECT:
        at = f", at {verdict.seen}" if verdict.seen else ""
        return f"reachability: reachable directly ({yes} of {asked} peers could dial us at port {port}{at})"
    if verdict.mode == OUTBOUND_ONLY:
        return (f"reachability: behind NAT: joined as an outbound-only member (none of {asked} peers could dial us "
                f"at port {port}): we send our parts and receive results over our own connections, and reduce and "
                f"audit nothing. To do those too, forward TCP port {port} on your router to this machine and "
                f"restart with --announce-maddrs /ip4/<your public ip>/tcp/{port}")
    why = f"none of {verdict.asked} peers answered our check" if verdict.asked else "no peer to check with"
    return f"reachability: not known yet ({why}); acting as reachable, checking again as peers join"


class Reachability:
    """Finds out how others reach this peer (peer/net/dialback.py) and keeps it up to date: again
    every RECHECK_UNKNOWN seconds while nobody could tell, every RECHECK_FEW seconds while fewer
    than FEW peers (of distinct prefixes) answered, every RECHECK seconds after, in a task on the
    link's loop. A verdict of fewer answers than the one we hold (and fewer than FEW) does not
    replace it: the first peer that connects to a newcomer, an attacker among them, does not
    decide its reachability for good (review N3). The averager reads ``closed`` at the start of
    each round; heartbeats carry ``mode``; ``on_change`` hears of every change."""

    RECHECK_UNKNOWN = 10.0
    RECHECK_FEW = 10.0  # (a peer asked within dialback.COOLDOWN answers "busy": not counted)
    RECHECK = 600.0
    FEW = 3

    def __init__(self, link: Link, runner: LoopRunner, say: Callable[[str], None],
                 on_change: Callable[[Verdict], None], rng: random.Random | None = None):
        self.link, self.runner, self.say, self.on_change = link, runner, say, on_change
        self.rng = rng  # whom to ask first (dialback.ask_order; None: the OS's randomness)
        self.verdict = Verdict(UNKNOWN, (), ())
        self._watcher: Any = None

    @property
    def mode(self) -> str:
        return self.verdict.mode

    def first_check(self, tries: int = 3, pause: float = 1.0) -> Verdict:
        """The check at start-up (blocks the caller): asked peers that did not answer (their
        service may not be up yet) are asked again, up to ``tries`` times; says the outcome either way."""
        return self.runner.run(self._first(tries, pause), tries * (ASK_TIMEOUT + 5 + pause) + 5)

    async def _first(self, tries: int, pause: float) -> Verdict:
        for attempt in range(tries):
            verdict = await self.acheck()
            if verdict.mode != UNKNOWN or not verdict.asked or attempt + 1 == tries:
                break
            await asyncio.sleep(pause)
        if verdict.mode == UNKNOWN:
            self.say(describe(verdict))
            self.on_change(verdict)
        return verdict

    def check(self) -> Verdict:
        """One check now (blocks the caller up to ASK_TIMEOUT and a little more); reports a change."""
        return self.runner.run(self.acheck(), ASK_TIMEOUT + 10)

    async def acheck(self) -> Verdict:
        """``check`` on the link's loop."""
        try:
            ports = listen_ports(await self.link.own_addrs())
            verdict = await asyncio.wait_for(dialback_check(self.link, ports, rng=self.rng), ASK_TIMEOUT + 5)
        except Exception as e:  # a slow daemon: keep what we knew
            logger.info("reachability check failed: %r", e)
            return self.verdict
        if verdict.mode == UNKNOWN and self.verdict.mode != UNKNOWN:
            return self.verdict  # nobody answered this time: what we knew still holds
        if len(verdict.answers) < min(self.FEW, len(self.verdict.answers)):
            return self.verdict  # fewer answered than before (busy, gone): what more of them said holds
        changed = verdict.mode != self.verdict.mode
        self.verdict = verdict
        if changed:
            self.say(describe(verdict))
            self.on_change(verdict)
        return verdict

    def start(self) -> Reachability:
        self._watcher = self.runner.submit(self._watch())
        return self

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch(self) -> None:
        while True:
            few = len(self.verdict.answers) < self.FEW
            await asyncio.sleep(self.RECHECK_UNKNOWN if self.verdict.mode == UNKNOWN else
                                self.RECHECK_FEW if few else self.RECHECK)
            await self.acheck()
