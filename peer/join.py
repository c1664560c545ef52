"""The join string: one line that carries a run's key and addresses of some of its live peers.

    hivetrain://<run key>@<maddr>,<maddr>,...

``peer start --join`` (and ``status``, ``export``) takes it in place of ``--run KEY --initial-peers
MADDR ...``. Every peer prints one when it starts (its own addresses, and a joiner also the peers it
came in through), and ``peer status`` prints a fresh one from the heartbeats of the run's live peers
(``addrs``: each peer's own addresses, without the /p2p part, which the reader adds from the signer's
id: a peer can list addresses only under its own name). The string keeps working as long as one
listed peer lives. An address in it is a bootstrap hint and nothing more: libp2p checks the peer id
when it connects, and the state a joiner takes is chosen and verified as with ``--initial-peers``.
Imported before torch and hivemind (flags are checked first): multiaddr only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any

from hivetrain.dht.diagnose import parse_maddrs, tcp_endpoint
from hivetrain.dht.errors import AddressError
from hivetrain.dht.records import is_address
from hivetrain.peer.errors import ConfigError

SCHEME = "hivetrain://"
MAX_ADDRESSES = 8  # addresses one join string carries (a longer one is refused)
MAX_LENGTH = 4096  # characters of a join string
LINE_ADDRESSES = 4  # addresses a printed join string lists
OWN_ADDRESSES = 2  # addresses of its own a peer lists (in its join line and its heartbeat)
EXAMPLE = "hivetrain://demo.abcdefghijklmnopqrstuvwxyz234567@/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."


def parse(text: str) -> tuple[str, list[str]]:
    """(run key, addresses) of a join string, or one line (ConfigError) saying what is wrong with it.
    The key is lower case (base32 is case-insensitive); the addresses are checked as --initial-peers."""
    from hivetrain.peer.flags import run_key

    text = text.strip()
    if len(text) > MAX_LENGTH:
        raise ConfigError(f"--join: the string is {len(text)} characters long, at most {MAX_LENGTH}")
    if not text.lower().startswith(SCHEME):
        raise ConfigError(f"--join {text[:60]!r}: a join string starts with {SCHEME}, e.g. {EXAMPLE}")
    key, at, rest = text[len(SCHEME):].partition("@")
    addresses = [a.strip() for a in rest.split(",") if a.strip()]
    if not at or not addresses:
        raise ConfigError(f"--join: no peer address after the run key (<key>@<address>,...), e.g. {EXAMPLE}")
    if len(addresses) > MAX_ADDRESSES:
        raise ConfigError(f"--join: {len(addresses)} addresses, at most {MAX_ADDRESSES}")
    try:
        key = run_key(key)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--run:", "--join:", 1)) from None
    try:
        parse_maddrs(addresses, "--join: address", need_peer_id=True)
    except AddressError as e:
        raise ConfigError(str(e)) from None
    return key, addresses


def line(run_key: str, addresses: Sequence[str]) -> str:
    return f"{SCHEME}{run_key}@{','.join(addresses)}"


def rank(maddr: str) -> int:
    """0 a public address, 1 a private (LAN) one or a DNS name, 2 loopback (only this machine can use it)."""
    where = tcp_endpoint(maddr)
    if where is None:
        return 1
    try:
        ip = ipaddress.ip_address(where[1])
    except ValueError:
        return 1
    return 2 if ip.is_loopback else 0 if ip.is_global else 1


def pick(maddrs: Iterable[str], limit: int) -> list[str]:
    """At most ``limit`` of ``maddrs`` for a join line, best first (public, then private, loopback last
    and only when there is nothing else), without repeats; the daemon's order within each kind."""
    ranks = {m: rank(m) for m in maddrs}  # (in order, without repeats)
    ranked = sorted(ranks, key=ranks.__getitem__)
    if any(r < 2 for r in ranks.values()):
        ranked = [m for m in ranked if ranks[m] < 2]
    return ranked[:limit]


def without_peer_id(maddr: str) -> str:
    """``maddr`` without its /p2p/<id> part (what a heartbeat's ``addrs`` holds)."""
    head, sep, _ = maddr.partition("/p2p/")
    return head if sep else maddr


def own(maddrs: Sequence[str]) -> list[str]:
    """What a peer lists of its own addresses in its heartbeat: the best few, without /p2p/<id>."""
    return [a for a in (without_peer_id(m) for m in pick(maddrs, OWN_ADDRESSES)) if is_address(a)]


def limited(addresses: Sequence[str]) -> str:
    """A word on a join line whose addresses only some can use, or ''."""
    best = min((rank(a) for a in addresses), default=2)
    if best == 2:
        return " (loopback: only peers on this machine can use it)"
    if best == 1:
        return (" (a private address: only peers on your network can use it; a peer elsewhere needs a public "
                "address, see --announce-maddrs)")
    return ""


def fresh(run_key: str, peers: Iterable[Any], state_hash: str | None) -> str | None:
    """A join string from the run's heartbeats (``peer status``): the addresses of up to
    LINE_ADDRESSES live peers that others can dial (not outbound-only), those on the run's state
    first, the most recently seen first, one per network prefix (a /24 or /48: one operator's many
    identities fill one place); None when no heartbeat lists an address."""
    from hivetrain.peer.net.prefixes import prefix_of

    ranked = sorted((p for p in peers if p.addrs and p.reachability != "outbound_only"),
                    key=lambda p: (p.state_hash != state_hash, p.last_seen_s, p.peer_id))
    chosen: list[str] = []
    seen: set[str | None] = set()
    for p in ranked:
        best = pick([f"{a}/p2p/{p.peer_id}" for a in p.addrs], 1)
        where = prefix_of(best[0]) if best else None
        if best and (where is None or where not in seen):
            chosen.append(best[0])
            seen.add(where)
        if len(chosen) == LINE_ADDRESSES:
            break
    return line(run_key, chosen) if chosen else None


def learnt(verdict: Any, addrs: Sequence[str]) -> str | None:
    """Our public address from a reachability verdict (peer/net/dialback.py ``Verdict.seen``: the IP
    most of the peers that dialed us dialed, at our port), when it is public and not one ``addrs``
    (our heartbeat's) already lists; else None."""
    if not verdict.seen or not verdict.ports:
        return None
    proto = "ip6" if ":" in verdict.seen else "ip4"
    public = f"/{proto}/{verdict.seen}/tcp/{verdict.ports[0]}"
    return public if rank(public) == 0 and public not in addrs and is_address(public) else None
