"""Network prefixes: which peers count as one operator (the Sybil cap of groups, a joiner's votes).

**Prefix cap.** Peers seen at addresses in one IPv4 /24 or IPv6 /48 count as one operator; a group
keeps at most ``cap`` of them (``cap_by_prefix``), and a joiner counts one vote per prefix
(peer/state/choose.py). The address is the remote end of the connection our own transport holds
(``Link.observed_addrs``), not anything the peer announces, so a
peer cannot choose it short of really sending from another network. Loopback, private (RFC 1918,
RFC 6598 shared space, fc00::/7), link-local and unspecified addresses are exempt: tests and LAN
setups use them, and a remote attacker cannot make a public peer see it at such an address.
Non-IP addresses are exempt too. A peer we reach only through a ``/p2p-circuit`` relay counts as
the relay's prefix, apart from the peers we reach directly there (``cap_key``; review N6).

The second Sybil brake is **probation** (peer/trust.py): a peer we have never completed an
all-reduce with gets weight 0 in the shards we reduce (``reduce.probation_claims``) and is kept a
minority of our groups (``views.Caps``), once we have a history of our own. A node without history
trusts everyone.

What they do NOT stop:

- An operator with addresses in many /24s or /48s (cloud VMs in several regions, a botnet, free
  IPv6 tunnel brokers that hand out a /48 per tunnel) gets ``cap`` seats per prefix; the cap only
  raises the price of a Sybil swarm from "one machine" to "many networks".
- Relayed peers are capped per relay prefix, not per operator: an attacker with relays in many
  /24s gets ``cap`` relayed seats per relay /24, next to ``cap`` direct ones in its own /24s (its
  identities relayed through one /24 once escaped the cap: review N6, the simulator's
  ``relayed_votes`` put 3 in every group against a cap of 2). Honest peers relayed through one
  relay /24 share its ``cap`` seats per group; those relayed through a private relay, or through
  none we can see, are not capped. Probation applies to them all.
- Probation lasts one completed round. A patient attacker sits through it with every identity and
  is trusted from then on; it delays and dilutes, it does not vet. Peers we forget (beyond
  ``MAX_KNOWN``) start over, which costs honest peers one round, not safety.
- Both brakes are local views. Two members may observe one peer at different addresses (LAN and
  public), and have different histories: the cap's choice is deterministic only given the same
  prefixes, so its drops belong in the monotone ``excluded`` set that views reconcile over.
- The transport's answer is fail-open: if the daemon call fails or times out, every peer's prefix
  is unknown (None) and nobody is capped for that round.
- Neither brake judges the content of a contribution; robust aggregation does that.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from multiaddr import Multiaddr

IPV4_PREFIX = 24  # one typical customer / cloud allocation; a NAT's neighbours share it
IPV6_PREFIX = 48  # the usual site allocation (RFC 6177); a /64 costs an attacker nothing
MAX_MADDR_CHARS = 1024  # longer strings are not addresses we parse (untrusted input)

_EXEMPT_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918
        "100.64.0.0/10",  # RFC 6598 carrier-grade NAT: only visible inside one ISP
        "fc00::/7",  # unique local IPv6
    )
)
# Not ``ip.is_private``: before Python 3.13 it also covers the documentation ranges (203.0.113.0/24,
# 2001:db8::/32, ...), which are as public as any for this purpose and which the tests use.


def _ip_of(addr: str | Multiaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a direct ``/ip4`` or ``/ip6`` multiaddr, or None (relayed, non-IP, malformed)."""
    try:
        text = str(addr) if isinstance(addr, Multiaddr) else addr
        if not isinstance(text, str) or len(text) > MAX_MADDR_CHARS:
            return None
        Multiaddr(text)  # the whole address must be well formed, not only its first part
    except Exception:  # multiaddr raises ValueError, TypeError, KeyError, ... on hostile input
        return None
    parts = text.split("/")
    if len(parts) < 3 or parts[0] != "" or parts[1] not in ("ip4", "ip6") or "p2p-circuit" in parts:
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if parts[1] == "ip4" and ip.version != 4 or parts[1] == "ip6" and ip.version != 6:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        # an IPv4 host seen through a mapped or 6to4 address is still that IPv4 host
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None:
            return embedded
    return ip


def prefix_of(addr: str | Multiaddr) -> str | None:
    """The network prefix that counts as one operator, e.g. "203.0.113.0/24" or "2001:db8::/48".

    None, meaning "exempt from the cap", for loopback, private, link-local and unspecified
    addresses (see the module docstring), for non-IP addresses (``/dns``, ``/unix``, ...), and
    for malformed input, which never raises: a peer's addresses are untrusted.

    ``/p2p-circuit`` addresses are exempt as well: their IP is the relay's, not the peer's (the
    group cap and a joiner's votes count them by the relay, as such: ``cap_key``).
    """
    ip = _ip_of(addr)
    if ip is None or ip.is_loopback or ip.is_link_local or ip.is_unspecified:
        return None
    if any(ip in net for net in _EXEMPT_NETWORKS):
        return None
    bits = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    return ipaddress.ip_network(f"{ip}/{bits}", strict=False).compressed


def cap_by_prefix(
    members: Sequence[str], prefixes: Mapping[str, str | None], cap: int, rank: Callable[[str], bytes]
) -> tuple[list[str], dict[str, str]]:
    """Keeps at most ``cap`` members per prefix; returns (kept, {dropped peer: reason}).

    ``kept`` is in input order. Within a prefix the members with the lowest ``rank`` stay (ties by
    peer id), so every member that holds the same ``prefixes`` and ``rank`` drops the same peers:
    the caller's rank hashes (round, base hash, peer id), which no peer can steer by choosing when
    to join. A member missing from ``prefixes``, or mapped to None, is never capped. ``cap <= 0``
    disables the cap. Raises ValueError if ``members`` has duplicates. Pure; any thread.
    """
    if len(set(members)) != len(members):
        raise ValueError("cap_by_prefix: members must be distinct peer ids")
    if cap <= 0:
        return list(members), {}
    counts = Counter(map(prefixes.get, members))  # (called for every view a peer sends: most prefixes hold one)
    crowded = {prefix for prefix, n in counts.items() if n > cap and prefix is not None}
    if not crowded:
        return list(members), {}
    by_prefix: dict[str, list[str]] = {}
    for peer in members:
        prefix = prefixes.get(peer)
        if prefix in crowded:
            by_prefix.setdefault(prefix, []).append(peer)
    dropped: dict[str, str] = {}
    for prefix, peers in by_prefix.items():
        for peer in sorted(peers, key=lambda p: (rank(p), p))[cap:]:
            dropped[peer] = f"{len(peers)} members in {prefix}, at most {cap} per prefix"
    return [p for p in members if p not in dropped], dropped


def first_prefix(addrs: Iterable[str]) -> str | None:
    """The prefix of the first non-exempt address, or None if all are exempt (or there are none)."""
    for addr in addrs:
        prefix = prefix_of(addr)
        if prefix is not None:
            return prefix
    return None


def relay_prefix(addr: str) -> str | None:
    """For a ``/p2p-circuit`` address through a relay at a public IP, "relay:" and the relay's prefix
    (every identity relayed through one /24 or /48 shares it); None for any other address."""
    parts = addr.split("/") if isinstance(addr, str) and len(addr) <= MAX_MADDR_CHARS else []
    if len(parts) < 3 or "p2p-circuit" not in parts:
        return None
    relay = prefix_of("/".join(parts[:3]))
    return None if relay is None else f"relay:{relay}"


def cap_key(addrs: Iterable[str]) -> str | None:
    """What one peer counts as for the group cap: the prefix of the first direct public address we
    see it at; else the prefix of the public relay we reach it through (``relay_prefix``, kept apart
    from the peers seen directly in that /24: a run's own reachable peers may relay for others);
    else None (exempt)."""
    addrs = list(addrs)
    prefix = first_prefix(addrs)
    if prefix is not None:
        return prefix
    return next((key for addr in addrs if (key := relay_prefix(addr)) is not None), None)
