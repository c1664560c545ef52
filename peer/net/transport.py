"""One request/response exchange over a fresh libp2p stream, with a deadline on everything."""

from __future__ import annotations

import asyncio
from typing import Any

from hivetrain.peer.net.wire import encode_frame, read_frame


async def request(p2p: Any, peer: str, handler_name: str, header: dict[str, Any], body: bytes,
                  timeout: float, max_reply_body: int = 0) -> tuple[dict[str, Any], bytes, int]:
    """Sends one frame to ``peer`` and reads one reply frame; returns (header, body, bytes sent).

    Raises TimeoutError past ``timeout`` seconds, ProtocolError for a malformed reply, and
    OSError / IncompleteReadError / P2P errors if the peer cannot be reached."""
    from hivemind.p2p import PeerID

    frame = encode_frame(header, body)
    async with asyncio.timeout(timeout):
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler_name)
        try:
            writer.write(frame)
            await writer.drain()
            reply, reply_body = await read_frame(reader, timeout, max_body=max_reply_body)
        finally:
            writer.close()
    return reply, reply_body, len(frame)


async def reply(writer: asyncio.StreamWriter, header: dict[str, Any], body: bytes = b"") -> None:
    """Writes one reply frame and closes the stream; a vanished peer is not an error here."""
    try:
        writer.write(encode_frame(header, body))
        await writer.drain()
    except (OSError, ConnectionError):
        pass
    finally:
        writer.close()
