"""The dial-back check (peer/net/dialback.py) between two real p2p daemons on 127.0.0.1, over the link."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from hivemind.p2p import PeerID

from hivetrain.peer.averaging.behaviour import HONEST
from hivetrain.peer.net import dialback
from hivetrain.peer.net.libp2p import LibP2PLink
from hivetrain.peer.net.wire import ProtocolError, encode_frame, read_frame

from .daemons import two_daemons


def _closed_port() -> int:
    """A port nothing listens on (bound and released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _checks() -> dict[str, Any]:
    async with two_daemons() as (a, b):
        link_a, link_b = LibP2PLink(a), LibP2PLink(b)
        service = dialback.DialBackService(link_a, HONEST)
        await link_a.serve(dialback.PROTOCOL, service.server)
        b_ports = dialback.listen_ports(await link_b.own_addrs())
        out: dict[str, Any] = {"b_ports": b_ports, "b_connected": await link_b.connected()}
        out["open"] = await dialback.check(link_b, b_ports)  # a dials b's real listening port
        service.last.clear()
        out["closed"] = await dialback.check(link_b, [_closed_port()])  # nothing listens there: as behind a NAT
        out["cooldown"] = await dialback.check(link_b, b_ports)  # asked again at once: a is not a free port scanner
        out["checked"] = service.checked
        # a request naming a host to dial is malformed: the schema has no such field, so a cannot be aimed anywhere
        _, reader, writer = await b.call_binary_stream_handler(a.peer_id, dialback.PROTOCOL)
        try:
            encode_frame({"type": "dialback", "ports": [80], "ip": "192.0.2.1"})
        except ProtocolError as e:
            out["aimed"] = str(e)
        writer.write(b"\x00" * 64)  # junk instead: refused with a reason, no crash, nothing dialed
        await writer.drain()
        try:
            out["junk_reply"] = await read_frame(reader, 5, max_body=0)
        except Exception as e:
            out["junk_reply"] = type(e).__name__
        writer.close()
        out["alone"] = await dialback.check(link_a, [1], peers=[])
        out["unknown_peer"] = await dialback.check(link_b, b_ports, peers=[str(PeerID.from_base58(
            "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"))])
        return out


def test_dial_back_tells_reachable_from_unreachable_and_cannot_be_aimed_or_spammed() -> None:
    out = asyncio.run(_checks())
    assert out["b_ports"], out
    assert out["b_connected"] == [out["open"].answers[0][0]], out  # the peers it asks: those it is connected to
    assert out["open"].mode == dialback.DIRECT and out["open"].answers[0][1], out
    assert out["closed"].mode == dialback.OUTBOUND_ONLY and out["closed"].answers[0][1] is False, out
    assert out["cooldown"].mode == dialback.UNKNOWN and out["cooldown"].asked == 1, out  # "busy": not counted
    assert out["checked"] == 2, out
    assert "exactly the fields" in out["aimed"], out
    assert out["junk_reply"][0]["type"] == "dialback_reply" and not out["junk_reply"][0]["checked"], out
    assert out["alone"].mode == dialback.UNKNOWN and out["alone"].asked == 0
    assert out["unknown_peer"].mode == dialback.UNKNOWN and out["unknown_peer"].asked == 1
