"""Why no initial peer let us in, in plain words, for the one-line bootstrap error."""

from __future__ import annotations

import contextlib
import errno
import re
import socket
from collections.abc import Sequence

from multiaddr import Multiaddr

from hivetrain.dht.errors import AddressError, ListenError


def tcp_endpoint(maddr: Multiaddr | str) -> tuple[str, str, int] | None:
    """("ip4" or "ip6", ip, tcp port) of an /ip4|ip6/.../tcp/... multiaddr, else None (DNS names, junk)."""
    try:
        m = Multiaddr(maddr) if isinstance(maddr, str) else maddr
        for proto in ("ip4", "ip6"):
            with contextlib.suppress(Exception):
                return proto, m.value_for_protocol(proto), int(m.value_for_protocol("tcp"))
    except Exception:
        return None
    return None


def family(proto: str) -> socket.AddressFamily:
    return socket.AF_INET6 if proto == "ip6" else socket.AF_INET


def port_free(proto: str, ip: str, port: int) -> bool:
    """Whether nothing listens on (ip, port): a bind without SO_REUSEPORT fails while p2pd or anyone
    else listens there (SO_REUSEADDR: connections of a stopped peer in TIME_WAIT do not count)."""
    with socket.socket(family(proto), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            hint = ": ports below 1024 need root (or CAP_NET_BIND_SERVICE); pick one above" if port < 1024 else ""
            raise ListenError(f"cannot listen on {ip} port {port}: {e.strerror}{hint}") from None
    return True


def check_ports(host_maddrs: Sequence[str]) -> None:
    """Raises ListenError (one line: a usage error) for the first explicit port that is in use."""
    for maddr in host_maddrs:
        where = tcp_endpoint(maddr)
        if where is not None and where[2] != 0 and not port_free(*where):
            proto, ip, port = where
            raise ListenError(f"port {port} on {ip} is already in use (another peer?): stop it, or listen "
                              f"elsewhere with --port <free port> (or --host-maddrs /{proto}/{ip}/tcp/<port>)")


def diagnose(initial_peers: Sequence[Multiaddr], timeout: float = 3.0) -> str:
    """Why none of ``initial_peers`` let us in, in plain words (the first that says something):
    nothing listens there, the host is unreachable, or something answers but not as that peer id."""
    reasons: list[str] = []
    for maddr in initial_peers:
        where = tcp_endpoint(maddr) or _resolved(maddr, reasons)
        if where is None:
            continue
        proto, ip, port = where
        peer_id = maddr.value_for_protocol("p2p")
        try:
            with socket.socket(family(proto), socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect((ip, port))
        except ConnectionRefusedError:
            reasons.append(f"nothing listens at {ip} port {port} (the peer stopped, or the port is wrong)")
        except TimeoutError:
            reasons.append(f"{ip} port {port} does not answer within {timeout:g} s (host down, or a firewall)")
        except OSError as e:
            reasons.append(f"{ip} port {port} is unreachable ({e.strerror or e})")
        else:
            reasons.append(f"{ip} port {port} accepts connections, but no libp2p peer {peer_id[:16]}... let us in "
                           "there: the peer id is wrong (that peer restarted with a new identity?), or it is not "
                           "a hivetrain/hivemind peer")
    return "; ".join(reasons) if reasons else "no initial peer could be reached"


def _resolved(maddr: Multiaddr, reasons: list[str]) -> tuple[str, str, int] | None:
    """("ip4" or "ip6", ip, port) of a /dns*/NAME/tcp/PORT address, or None with the reason in ``reasons``
    when NAME does not resolve."""
    for proto in ("dns4", "dns6", "dns"):
        try:
            name, port = maddr.value_for_protocol(proto), int(maddr.value_for_protocol("tcp"))
        except Exception:
            continue
        try:
            family_, *_, sockaddr = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM,
                                                       family=socket.AF_INET6 if proto == "dns6" else
                                                       socket.AF_INET if proto == "dns4" else 0)[0]
        except (OSError, UnicodeError):
            reasons.append(f"the name {name} does not resolve (a typo, or no DNS here)")
            return None
        return ("ip6" if family_ == socket.AF_INET6 else "ip4"), str(sockaddr[0]), port
    return None


EXAMPLE_PEER = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."  # shown in errors: the form of a peer's address
EXAMPLE_HOST = "/ip4/0.0.0.0/tcp/31337"  # ... and of an address to listen on or announce


def parse_maddrs(values: Sequence[str], what: str, need_peer_id: bool) -> list[Multiaddr]:
    """Validates multiaddrs given by a user; raises AddressError with a one-line explanation."""
    out = []
    example = EXAMPLE_PEER if need_peer_id else EXAMPLE_HOST
    for value in values:
        try:
            maddr = Multiaddr(value)
        except Exception as e:
            if (hostport := re.fullmatch(r"\[?([\w.:-]+?)\]?:(\d{1,5})", value.strip())) is not None:
                host, port = hostport.groups()  # HOST:PORT, as other tools write it
                kind = "ip6" if ":" in host else "ip4" if re.fullmatch(r"[\d.]+", host) else "dns4"
                tail = "/p2p/<its peer id>" if need_peer_id else ""
                raise AddressError(f"{what} {value!r} is HOST:PORT; a multiaddr writes it /{kind}/{host}/tcp/{port}"
                                   f"{tail} (copy the full address, or the join string, a peer of the run printed)"
                                   ) from None
            raise AddressError(f"{what} {value!r} is not a valid multiaddr ({e}); the form is {example}") from None
        protocols = {p.name for p in maddr.protocols()}
        if not protocols & {"ip4", "ip6", "dns", "dns4", "dns6"} or "tcp" not in protocols:
            raise AddressError(f"{what} {value!r} must name an IP (or DNS) address and a TCP port, e.g. {example}")
        if need_peer_id and "p2p" not in protocols:
            raise AddressError(
                f"{what} {value!r} has no /p2p/<peer id> part; copy the full address a running peer prints, "
                f"e.g. {example}"
            )
        out.append(maddr)
    return out
