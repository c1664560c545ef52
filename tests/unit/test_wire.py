"""The wire format (peer/net/wire.py): framing, header schemas, bounds checked before reading."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import msgpack
import pytest

from hivetrain.peer.net.wire import (
    MAGIC,
    MAX_GROUP,
    MAX_HEADER,
    MAX_PIECES,
    PREFIX,
    ProtocolError,
    encode_frame,
    read_frame,
)

HEX = "0123456789abcdef" * 4
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER2 = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
MAX_BODY = 1 << 16


def _header(kind: str = "part", **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": kind, "run": HEX, "round": 3, "base": HEX}
    extra: dict[str, dict[str, Any]] = {
        "view": {"members": [PEER, PEER2], "excluded": [], "closed": False, "decided": False, "up": 1200,
                 "derived": True},
        "view_reply": {"members": [PEER], "excluded": [PEER2], "decided": False, "ready": True, "closed": True,
                       "up": 0, "derived": False},
        "part": {"group": HEX, "shard": 1, "digest": HEX[:32], "sig": ""},
        "result": {"group": HEX, "shard": 0, "result": HEX, "excluded": [], "parts": [HEX[:32], ""],
                   "probation": [PEER2], "sig": HEX * 2, "sigs": [bytes(64), b""]},
        "audit": {"group": HEX, "shard": 0, "ok": False, "result": HEX, "finding": 1, "reason": "wrong aggregate",
                  "sig": HEX * 2, "twins": [[1, HEX[:32], HEX * 2]]},
        "applied": {"group": HEX, "digest": HEX, "held": HEX},
        "evidence_req": {"group": HEX, "shard": 0, "index": 0},
        "ack": {"code": 0, "reason": ""},
    }
    return {**base, **extra[kind], **over}


def _raw_frame(header: Any, body: bytes = b"", **pack: Any) -> bytes:
    """A frame built without encode_frame's checks, as a hostile peer would send it."""
    raw = msgpack.packb(header, use_bin_type=True, **pack)
    return PREFIX.pack(MAGIC, len(raw), len(body)) + raw + body


def _read(data: bytes, timeout: float = 5.0, max_body: int = MAX_BODY, eof: bool = True) -> tuple[dict[str, Any], bytes]:
    async def go() -> tuple[dict[str, Any], bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await read_frame(reader, timeout, max_body)

    return asyncio.run(go())


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["view", "view_reply", "part", "result", "audit", "applied", "ack"])
def test_round_trip_every_type(kind: str) -> None:
    header = _header(kind)
    body = bytes(range(256)) * 3 if kind in ("part", "result") else b""
    frame = encode_frame(header, body)
    magic, header_len, body_len = PREFIX.unpack(frame[:PREFIX.size])
    assert magic == MAGIC and body_len == len(body) and len(frame) == PREFIX.size + header_len + body_len
    assert _read(frame) == (header, body)


def test_two_frames_back_to_back() -> None:
    a, b = _header("part"), _header("ack", code=5, reason="no")

    async def go() -> list[tuple[dict[str, Any], bytes]]:
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame(a, b"xyz") + encode_frame(b))
        reader.feed_eof()
        return [await read_frame(reader, 5.0, 16), await read_frame(reader, 5.0, 16)]

    assert asyncio.run(go()) == [(a, b"xyz"), (b, b"")]


def test_body_exactly_max_body_accepted() -> None:
    assert _read(encode_frame(_header(), b"x" * 100), max_body=100)[1] == b"x" * 100


# ---- rejected frames ------------------------------------------------------------------------------


def test_bad_magic() -> None:
    frame = b"HTW2" + encode_frame(_header())[4:]  # the previous protocol version
    with pytest.raises(ProtocolError, match="magic"):
        _read(frame)


def test_header_len_checked_before_reading() -> None:
    """Only the 16-byte prefix arrives and the stream stays open: the bound must fire at once."""
    prefix = PREFIX.pack(MAGIC, MAX_HEADER + 1, 0)
    with pytest.raises(ProtocolError, match="header"):
        _read(prefix, eof=False)
    with pytest.raises(ProtocolError, match="header"):
        _read(PREFIX.pack(MAGIC, 2**32 - 1, 0), eof=False)


def test_body_len_checked_before_reading() -> None:
    raw = msgpack.packb(_header(), use_bin_type=True)
    with pytest.raises(ProtocolError, match="body"):
        _read(PREFIX.pack(MAGIC, len(raw), MAX_BODY + 1), eof=False)
    with pytest.raises(ProtocolError, match="body"):
        _read(PREFIX.pack(MAGIC, len(raw), 2**64 - 1), eof=False)
    with pytest.raises(ProtocolError, match="body"):
        _read(encode_frame(_header(), b"xy"), max_body=1)


def test_header_exactly_max_header_is_parsed() -> None:
    padded = _header("ack", reason="r")
    raw = msgpack.packb(padded, use_bin_type=True)
    assert len(raw) < MAX_HEADER
    frame = PREFIX.pack(MAGIC, MAX_HEADER, 0) + raw + b"\x00" * (MAX_HEADER - len(raw))
    with pytest.raises(ProtocolError, match="malformed"):  # read and parsed (trailing data), not refused
        _read(frame)


@pytest.mark.parametrize("header", [
    _header(type="nope"),
    _header(type=5),
    {"run": HEX, "round": 3, "base": HEX},
    [1, 2, 3],
    "part",
    None,
])
def test_unknown_type_rejected(header: Any) -> None:
    with pytest.raises(ProtocolError):
        _read(_raw_frame(header))


@pytest.mark.parametrize("header", [
    _header(type=["part"]),  # a list: unhashable
    _header(type={"t": 1}),  # a map: unhashable
])
def test_unhashable_type_rejected(header: Any) -> None:
    """A hostile peer controls the type field; anything but a known string is a ProtocolError."""
    with pytest.raises(ProtocolError):
        _read(_raw_frame(header))


@pytest.mark.parametrize("header", [
    _header(extra=1),  # extra field
    _header("ack", decided=True),
    {k: v for k, v in _header().items() if k != "shard"},  # missing field
    {k: v for k, v in _header("view").items() if k != "excluded"},
    _header(base="xyz"),  # non-hex base
    _header(base=HEX.upper()),
    _header(base=HEX[:-1]),
    _header(base=HEX + "0"),
    _header(base=HEX[:-1] + "\n"),
    _header(base=HEX + "\n"),  # a trailing newline is not hex either
    _header(run="g" * 64),
    _header(round=-1),
    _header(round=True),
    _header(round="3"),
    _header(shard=MAX_PIECES),  # shards are pieces: up to MAX_PIECES - 1 (MAX_GROUP - 1 was the old cap)
    _header("evidence_req", shard=0, index=MAX_GROUP),  # an index is a member's position
    _header(digest=HEX),  # a part digest is 32 hex characters
    _header("ack", code=99),
    _header("ack", code=True),
    _header("result", sig=HEX),
    _header("audit", finding=3),
    _header("view", members=["not base58 0OIl" * 2]),
    _header("view", members=[PEER] * (MAX_GROUP + 1)),
    _header("view", members=PEER),
    _header("view_reply", decided=1),
    _header("ack", reason="x" * 300),
    _header("result", parts=[HEX]),  # a digest is 32 hex characters or empty
    _header("result", parts=[HEX[:31]]),
    _header("result", parts=[HEX[:32].upper()]),
    _header("result", parts=[""] * (MAX_GROUP + 1)),
    _header("result", parts=HEX[:32]),
    _header("audit", ok=1),
    _header("audit", result=HEX[:32]),
    _header("audit", reason="x" * 300),
    _header("result", sigs=[HEX * 2]),  # a signature is 64 bytes (or none), not hex
    _header("result", sigs=[bytes(63)]),
    _header("result", sigs=[b""] * (MAX_GROUP + 1)),
    _header("audit", twins=[[MAX_GROUP, HEX[:32], HEX * 2]]),  # an index is a member's position
    _header("audit", twins=[[0, HEX, HEX * 2]]),
    _header("audit", twins=[[0, HEX[:32], ""]]),  # a proof carries the signature
    _header("audit", twins=[[0, HEX[:32]]]),
])
def test_bad_header_fields_rejected(header: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        encode_frame(header)
    with pytest.raises(ProtocolError):
        _read(_raw_frame(header))


@pytest.mark.parametrize("value", [
    msgpack.ExtType(1, b"x"),
    msgpack.ExtType(0x40, msgpack.packb([1])),
    msgpack.ExtType(5, b""),
])
def test_ext_type_in_header_rejected(value: Any) -> None:
    with pytest.raises(ProtocolError):
        _read(_raw_frame(_header(base=value)))


def test_timestamp_ext_in_header_rejected() -> None:
    # msgpack's built-in Timestamp is ext code -1
    with pytest.raises(ProtocolError):
        _read(_raw_frame(_header(base=msgpack.Timestamp(1, 0))))


@pytest.mark.parametrize("raw", [
    b"",  # empty header
    b"\xc1",  # never-used byte
    msgpack.packb({1: 2}),  # non-string key
    msgpack.packb({"type": b"part"}, use_bin_type=True),  # bin where a string is expected
    msgpack.packb(_header()) + b"\x00",  # trailing bytes inside the declared header
    b"\x91" * 3000 + b"\x00",  # deep nesting
])
def test_malformed_header_bytes_rejected(raw: bytes) -> None:
    frame = PREFIX.pack(MAGIC, len(raw), 0) + raw
    with pytest.raises(ProtocolError):
        _read(frame)


# ---- short reads and deadlines --------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 3, PREFIX.size - 1, -1, -4])
def test_truncated_frame(cut: int) -> None:
    frame = encode_frame(_header(), b"body")
    with pytest.raises(asyncio.IncompleteReadError):
        _read(frame[:cut])


def test_truncated_header() -> None:
    # read_frame reads the header inside its msgpack try-block, so a short header surfaces as a
    # ProtocolError ("malformed frame header (IncompleteReadError)"), a short prefix or body as
    # IncompleteReadError; either way nothing is returned.
    frame = encode_frame(_header(), b"body")
    for cut in (PREFIX.size, PREFIX.size + 2, len(frame) - 5):
        with pytest.raises((asyncio.IncompleteReadError, ProtocolError)):
            _read(frame[:cut])


def test_silent_peer_times_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _read(b"", timeout=0.2, eof=False)
    assert time.monotonic() - t0 < 2.0


def test_stalled_body_times_out() -> None:
    frame = encode_frame(_header(), b"body")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _read(frame[:-2], timeout=0.2, eof=False)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_timeout(timeout: float) -> None:
    with pytest.raises(TimeoutError):
        _read(encode_frame(_header()), timeout=timeout)


def test_prefix_layout() -> None:
    assert PREFIX.size == 16
    assert PREFIX.pack(MAGIC, 1, 2) == b"HTW3" + struct.pack("<I", 1) + struct.pack("<Q", 2)


def test_the_largest_result_and_verdict_a_group_can_send_fit_a_header() -> None:
    """A result names up to MAX_GROUP members four times (digests, probation, left out, signatures)
    and a verdict up to MAX_GROUP proofs: both fit MAX_HEADER (signatures travel as bytes, not hex)."""
    peer = "12D3KooW" + "A" * 44  # a peer id's length
    encode_frame(_header("result", parts=[HEX[:32]] * MAX_GROUP, probation=[peer] * MAX_GROUP,
                         excluded=[peer] * MAX_GROUP, sigs=[bytes(64)] * MAX_GROUP, shard=MAX_PIECES - 1))
    encode_frame(_header("audit", twins=[[MAX_GROUP - 1, HEX[:32], HEX * 2]] * MAX_GROUP, reason="x" * 256))
