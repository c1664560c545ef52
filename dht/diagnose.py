"""Why no initial peer let us in, in plain words, for the one-line bootstrap error."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence

from multiaddr import Multiaddr


def _where(maddr: Multiaddr) -> tuple[int, str, int, str] | None:
    """(socket family, ip, tcp port, peer id) of an initial peer's multiaddr, else None (DNS names)."""
    for proto, family in (("ip4", socket.AF_INET), ("ip6", socket.AF_INET6)):
        with contextlib.suppress(Exception):
            return family, maddr.value_for_protocol(proto), int(maddr.value_for_protocol("tcp")), \
                maddr.value_for_protocol("p2p")
    return None


def diagnose(initial_peers: Sequence[Multiaddr], timeout: float = 3.0) -> str:
    """Why none of ``initial_peers`` let us in, in plain words (the first that says something):
    nothing listens there, the host is unreachable, or something answers but not as that peer id."""
    reasons = []
    for maddr in initial_peers:
        where = _where(maddr)
        if where is None:
            continue
        family, ip, port, peer_id = where
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
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
