"""Wire format of the averaging protocol: one checked frame per message.

    b"HTW1" | header_len: u32 LE | body_len: u64 LE | header: msgpack map | body: raw bytes

The header is a flat msgpack map with a fixed schema per message type (no ext types, no nesting
beyond one list of peer ids); the body is codec bytes whose exact length the receiver computes
itself before reading. Every read has a deadline.
"""

from __future__ import annotations

import asyncio
import math
import re
import struct
from typing import Any

import msgpack

from hivetrain.peer.errors import PeerError

MAGIC = b"HTW1"
PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 16 * 1024
MAX_GROUP = 64
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^(?:[0-9a-f]{32})?$")
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")  # base58


class ProtocolError(PeerError):
    """A peer sent a malformed, oversized, out-of-order or foreign message."""


def _hex64(v: Any) -> bool:
    return isinstance(v, str) and bool(_HEX64.fullmatch(v))


def _int(v: Any, lo: int = 0, hi: int = 2**62) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _digests(v: Any) -> bool:  # per member: a part digest (peer/reduce.py), or "" where none arrived
    return isinstance(v, list) and len(v) <= MAX_GROUP and all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in v)


def _peers(v: Any) -> bool:
    return (isinstance(v, list) and len(v) <= MAX_GROUP
            and all(isinstance(p, str) and _PEER_ID.fullmatch(p) for p in v))


_COMMON = {"type": lambda v: isinstance(v, str), "run": _hex64, "round": _int, "base": _hex64}
SCHEMAS: dict[str, dict[str, Any]] = {
    # matchmaking: the sender's current view of the group for this round
    "view": {**_COMMON, "members": _peers, "excluded": _peers},
    "view_reply": {**_COMMON, "members": _peers, "excluded": _peers, "decided": lambda v: isinstance(v, bool)},
    # reduce-scatter: the sender's encoded slice for shard ``shard``
    "part": {**_COMMON, "group": _hex64, "shard": lambda v: _int(v, 0, MAX_GROUP - 1),
             "size": lambda v: _int(v, 1, MAX_GROUP)},
    # all-gather: the reducer's re-encoded result for shard ``shard``, with the digests of the parts it got
    # and the members it gave weight 0 (probation)
    "result": {**_COMMON, "group": _hex64, "shard": lambda v: _int(v, 0, MAX_GROUP - 1),
               "size": lambda v: _int(v, 1, MAX_GROUP), "excluded": _peers, "parts": _digests,
               "probation": _peers},
    # audit: the verdict of shard ``shard``'s auditor on the result with SHA-256 ``result``
    "audit": {**_COMMON, "group": _hex64, "shard": lambda v: _int(v, 0, MAX_GROUP - 1),
              "size": lambda v: _int(v, 1, MAX_GROUP), "ok": lambda v: isinstance(v, bool), "result": _hex64,
              "reason": lambda v: isinstance(v, str) and len(v) < 300},
    # disputes: a member asks the auditor of shard ``shard`` for its copy of member ``index``'s part
    "evidence_req": {**_COMMON, "group": _hex64, "shard": lambda v: _int(v, 0, MAX_GROUP - 1),
                     "index": lambda v: _int(v, 0, MAX_GROUP - 1)},
    "evidence": {**_COMMON, "group": _hex64, "shard": lambda v: _int(v, 0, MAX_GROUP - 1),
                 "index": lambda v: _int(v, 0, MAX_GROUP - 1), "ok": lambda v: isinstance(v, bool)},
    # state sync: index -1 asks for the manifest (piece hashes), i >= 0 for piece i of state ``base``
    "state_req": {**_COMMON, "index": lambda v: _int(v, -1, 2**31)},
    "state_resp": {**_COMMON, "index": lambda v: _int(v, -1, 2**31), "ok": lambda v: isinstance(v, bool),
                   "reason": lambda v: isinstance(v, str) and len(v) < 300},
    "ack": {**_COMMON, "ok": lambda v: isinstance(v, bool), "reason": lambda v: isinstance(v, str) and len(v) < 300},
}


def check_header(header: Any) -> dict[str, Any]:
    if not isinstance(header, dict) or not isinstance(header.get("type"), str) or header["type"] not in SCHEMAS:
        raise ProtocolError("unknown message type")
    schema = SCHEMAS[header["type"]]
    if set(header) != set(schema):
        raise ProtocolError(f"{header['type']} header must have exactly the fields {sorted(schema)}")
    for name, check in schema.items():
        if not check(header[name]):
            raise ProtocolError(f"{header['type']} header field {name!r} is invalid")
    return header


def encode_frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = msgpack.packb(check_header(header), use_bin_type=True)
    return PREFIX.pack(MAGIC, len(raw), len(body)) + raw + body


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("msgpack ext types are not allowed")


async def read_frame(
    reader: asyncio.StreamReader, timeout: float, max_body: int
) -> tuple[dict[str, Any], bytes]:
    """Reads one frame within ``timeout`` seconds; the body may be at most ``max_body`` bytes.

    Raises ProtocolError for anything malformed and asyncio.TimeoutError past the deadline."""
    if not math.isfinite(timeout) or timeout <= 0:
        raise TimeoutError()
    async with asyncio.timeout(timeout):
        magic, header_len, body_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        if magic != MAGIC:
            raise ProtocolError("bad frame magic")
        if header_len > MAX_HEADER:
            raise ProtocolError(f"frame header of {header_len} bytes exceeds {MAX_HEADER}")
        if body_len > max_body:
            raise ProtocolError(f"frame body of {body_len} bytes exceeds the {max_body} allowed here")
        try:
            header = msgpack.unpackb(
                await reader.readexactly(header_len), raw=False, strict_map_key=True, ext_hook=_reject_ext,
                max_str_len=4096, max_bin_len=0, max_array_len=MAX_GROUP, max_map_len=16, max_ext_len=0,
            )
        except ProtocolError:
            raise
        except Exception as e:
            raise ProtocolError(f"malformed frame header ({type(e).__name__})") from None
        body = await reader.readexactly(body_len) if body_len else b""
    return check_header(header), body
