"""Wire format of the averaging and state protocols: one checked frame per message.

    b"HTW3" | header_len: u32 LE | body_len: u64 LE | header: msgpack map | body: raw bytes

The header is a flat msgpack map with a fixed schema per message type (no ext types, no binary,
no nesting beyond one list of peer ids or digests). A frame with a body is sent in two steps
(peer/net/link.py): the receiver reads the prefix and the header, decides from them alone whether
it wants a body of exactly ``body_len`` bytes, and says so before a single body byte is sent.
Every read has a deadline. Answers carry a ``Code``, never a reason to parse.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import math
import re
import struct
from collections.abc import Callable
from typing import Any

import msgpack

from hivetrain.dht.identity import MAX_PEER_ID_LEN, PEER_ID_RE
from hivetrain.peer.errors import PeerError

MAGIC = b"HTW3"
ZERO = "0" * 64  # "no state": the parent and link of a run's initial state, the base of an announcement made before it was known
PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 16 * 1024
MAX_GROUP = 64  # members of one group, and peer ids in one list
MAX_DIALBACK_PORTS = 4  # ports one reachability check may name
MAX_PIECES = 1024  # shards (pieces) of one round's all-reduce, in all
MAX_REASON = 280  # characters of a human-readable reason
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX128 = re.compile(r"^[0-9a-f]{128}$")
_DIGEST = re.compile(r"^(?:[0-9a-f]{32})?$")


class ProtocolError(PeerError):
    """A peer sent a malformed, oversized, out-of-order or foreign message."""


class Code(enum.IntEnum):
    """What a receiver says about a message (``ack.code``)."""

    OK = 0
    CONTINUE = 1  # the header is accepted: send the body now
    DUPLICATE = 2  # the same message arrived before (a retry after a lost ack): nothing to do
    NOT_READY = 3  # no session for that group here yet (still matchmaking): send again shortly
    WRONG_GROUP = 4  # we decided another group for that round
    NOT_MEMBER = 5  # the sender is not a member of that group
    WRONG_ROLE = 6  # the sender does not hold the role this message needs (reducer, auditor)
    WRONG_SIZE = 7  # the body is not the exact size this message has
    STALE = 8  # a round that is over here
    FOREIGN = 9  # another run spec, another base state, or a round far from ours
    EQUIVOCATION = 10  # a different message where the sender already sent one
    BUSY = 11  # too many streams from this peer, or in all
    MALFORMED = 12  # a header or body that does not parse or check
    BANNED = 13  # we caught the sender misbehaving: nothing from it is used
    NO_EVIDENCE = 14  # no evidence held for that shard
    INTERNAL = 15  # a bug on the receiving side


def reason(text: str) -> str:
    """A reason cut to what the wire carries."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def _hex64(v: Any) -> bool:
    return isinstance(v, str) and bool(_HEX64.fullmatch(v))


def _sig(v: Any) -> bool:
    return isinstance(v, str) and bool(_HEX128.fullmatch(v))


def _int(lo: int = 0, hi: int = 2**62) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_REASON


def _digests(v: Any) -> bool:  # per member: a part digest (peer/averaging/reduce.py), or "" where none arrived
    return isinstance(v, list) and len(v) <= MAX_GROUP and all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in v)


@functools.lru_cache(maxsize=16384)  # the same few dozen ids arrive in every view of a round
def _peer_id(v: str) -> bool:
    return bool(PEER_ID_RE.fullmatch(v))


def _peers(v: Any) -> bool:
    # only strings as long as a peer id can be reach the cache: a peer's junk cannot fill it with 16 KB keys
    return isinstance(v, list) and len(v) <= MAX_GROUP and all(type(p) is str and len(p) <= MAX_PEER_ID_LEN
                                                               for p in v) and all(map(_peer_id, v))


def _opt_sig(v: Any) -> bool:
    return v == "" or _sig(v)


VOUCH_LEN = 16 + 64  # one member's word in a group's ``vouch`` (peer/averaging/cross.py): part digest, signature


def _opt_sigs(v: Any) -> bool:  # per member: its signature of its part (64 bytes, not hex: 64 of them fit a header), or b""
    return isinstance(v, list) and len(v) <= MAX_GROUP and all(isinstance(s, bytes) and len(s) in (0, 64) for s in v)


def _twins(v: Any) -> bool:  # per equivocating member: [its index, the digest of our copy, its signature of it]
    return isinstance(v, list) and len(v) <= MAX_GROUP and all(
        isinstance(t, list) and len(t) == 3 and _int(0, MAX_GROUP - 1)(t[0]) and _part_digest(t[1]) and _sig(t[2])
        for t in v)


def _vouch(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) <= VOUCH_LEN * MAX_GROUP and len(v) % VOUCH_LEN == 0


MAX_MANIFEST = 256  # groups one designee's mean names (peer/averaging/cross.py MAX_CROSS_GROUPS)


def _manifest(v: Any) -> bool:  # per group of a mean: [its hash (32 bytes), the weight it was given]
    return isinstance(v, list) and len(v) <= MAX_MANIFEST and all(
        isinstance(g, list) and len(g) == 2 and isinstance(g[0], bytes) and len(g[0]) == 32
        and _int(0, 1 << 20)(g[1]) for g in v)


def _opt_peer(v: Any) -> bool:
    return v == "" or _peer(v)


def _part_digest(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 32 and bool(_DIGEST.fullmatch(v))


def _digest_or_none(v: Any) -> bool:
    return isinstance(v, str) and bool(_DIGEST.fullmatch(v))


def _peer(v: Any) -> bool:
    return type(v) is str and len(v) <= MAX_PEER_ID_LEN and _peer_id(v)


_SHARD = _int(0, MAX_PIECES - 1)  # a shard is one piece of a member's share (peer/averaging/session.py)
_MEMBER = _int(0, MAX_GROUP - 1)
_UP = _int(0, 10**8)
_SUB = _int(0, 63)  # a sub-piece of a shard (peer/averaging/cross.py MAX_SUBS)
_COMMON = {"type": lambda v: isinstance(v, str), "run": _hex64, "round": _int(), "base": _hex64}
_SESSION = {**_COMMON, "group": _hex64}
SCHEMAS: dict[str, dict[str, Callable[[Any], bool]]] = {
    # matchmaking: the sender's view of round ``round``'s group (members it accepts, peers it will not group with);
    # closed: nobody can dial the sender (an outbound-only member); decided: members is the group it decided
    # up: the sender's uplink claim for the round, kB/s (0: unknown; peer/averaging/rates.py)
    # derived: the sender derived its group from its board (false: members is what its window holds so far)
    "view": {**_COMMON, "members": _peers, "excluded": _peers, "closed": _bool, "decided": _bool, "up": _UP,
             "derived": _bool},
    # ready: whether the replier is forming that round's group from that base; decided: members is its group
    "view_reply": {**_COMMON, "members": _peers, "excluded": _peers, "decided": _bool, "ready": _bool,
                   "closed": _bool, "up": _UP, "derived": _bool},
    # before a round's partition: a sign of life, answered with an ack by any peer of the run (nothing else)
    "ping": _COMMON,
    # reduce-scatter: the sender's encoded slice of shard ``shard`` (to its reducer and its auditor); sig: its
    # signature of the digest (peer/averaging/statements.py), "" unless its auditor gets the copy relayed (a slow member)
    "part": {**_SESSION, "shard": _SHARD, "digest": _part_digest, "sig": _opt_sig},
    # a slow member's word to a shard's auditor: the digest of the part it sent the reducer (no body)
    "pledge": {**_SESSION, "shard": _SHARD, "digest": _part_digest},
    # the reducer's copy of a slow member's part (``member``, signed by it), to the shard's auditor; no body,
    # digest and sig "": the reducer refused that member's part
    "relay": {**_SESSION, "shard": _SHARD, "member": _peer, "digest": _digest_or_none, "sig": _opt_sig},
    # all-gather: the reducer's re-encoded result of its shard, the digests of the parts it used (per member),
    # the members it gave weight 0 (probation) and left out, signed by the reducer (peer/averaging/statements.py);
    # sigs: per member, its own signature of the part the reducer used (b"" where parts are not signed)
    "result": {**_SESSION, "shard": _SHARD, "result": _hex64, "parts": _digests, "probation": _peers,
               "excluded": _peers, "sig": _sig, "sigs": _opt_sigs},
    # audit: the auditor's signed verdict on the result with SHA-256 ``result``; finding: 0 none, else its kind;
    # twins: members that signed us another part than the one their reducer used (the proof: our copy's signature)
    "audit": {**_SESSION, "shard": _SHARD, "ok": _bool, "result": _hex64, "finding": _int(0, 2), "reason": _text,
              "sig": _sig, "twins": _twins},
    # disputes: a member asks the auditor of shard ``shard`` for its copy of member ``index``'s part
    "evidence_req": {**_SESSION, "shard": _SHARD, "index": _MEMBER},
    "evidence": {**_SESSION, "shard": _SHARD, "index": _MEMBER, "ok": _bool},
    # the cross-group stage (peer/averaging/cross.py): a reducer's sub-piece ``sub`` of shard ``shard`` of its
    # group's result, with the group's members and weight (members whose parts it used), to the sub-piece's designee
    # (attest: no body, another member's word that ``result`` is the group's approved sub-piece: ok)
    # vouch: per member, the digest of its part of the shard and its signature of it (its word that it is in the
    # group: the designee counts no one else); empty in an attestation and in a bucket's mean
    # tier 1: a bucket's mean (``bucket``, its designee the sender, ``group`` the bucket's label, no members, the
    # ``groups`` in it) to the sub-piece's designee in the round's top bucket, which sends its signed mean back
    # witness: (tier 0, level 0) the designee that checks the mean of the one we send it to (itself, when we
    # send it the same sub-piece as that witness); "" in a word, a bucket's mean, or a plan of one designee
    # sig: (tier 0) the sender's signature of the fields above (cross.py ``sub_message``), so that a designee can show them
    "cross": {**_SESSION, "shard": _SHARD, "sub": _SUB, "members": _peers, "weight": _int(0, 1 << 20),
              "result": _hex64, "enc": _int(1, MAX_GROUP), "attest": _bool, "ok": _bool, "tier": _int(0, 1),
              "bucket": _int(0, (1 << 12) - 1), "groups": _int(0, 1 << 16),
              "vouch": _vouch, "witness": _opt_peer, "sig": _opt_sig},
    # a reducer of a small round (cross.py ``proves``) asks the designee that signed a mean of sub-piece ``sub`` (SHA-256
    # ``result``) for its proof: every group it held, their reducers' signed values, members' vouches and words, and
    # the weights they counted with (``cross_proof``, the proof in the body: cross.py ``proven``)
    "cross_proof_req": {**_COMMON, "shard": _SHARD, "sub": _SUB, "result": _hex64},
    "cross_proof": {**_COMMON, "shard": _SHARD, "sub": _SUB, "code": _int(0, 64), "reason": _text},
    # a member whose reducer of shard ``shard`` sent it no mean of sub-piece ``sub`` in time asks that reducer
    # (BUSY: not passed on yet), then, if the reducer no longer holds the round (it died), the sub-piece's
    # designees: the reply is the ``cross_out`` the reducer passed on or the designee sent it (group: the
    # requester's, which must be among the groups the designee held), or a refusal
    "cross_mean_req": {**_SESSION, "shard": _SHARD, "sub": _SUB},
    # a designee's mean (body) of sub-piece ``sub`` to the witness its groups named: which groups it
    # averaged with which weights (``manifest``), so that the witness recomputes it from the same
    # groups' sub-pieces (it holds them too) and countersigns it (``cross_sig``) or refuses; no body when the
    # mean is one group's own bytes (the witness holds them); sig: the designee's own signature of the mean
    # (the witness hands the signed mean to a group that comes later)
    "cross_check": {**_SESSION, "shard": _SHARD, "sub": _SUB, "result": _hex64, "weight": _int(0, 1 << 20),
                    "groups": _int(0, 1 << 16), "enc": _int(1, MAX_GROUP), "sig": _sig, "manifest": _manifest},
    "cross_sig": {**_COMMON, "shard": _SHARD, "sub": _SUB, "code": _int(0, 64), "reason": _text, "sig": _opt_sig},
    # ... and the designee's signed weighted mean over the groups (``groups`` of them, ``weight`` members in
    # all), to each reducer, which forwards it to its members; result: its SHA-256 (all zeros: no group had values)
    # enc: encoded with the codec reducers use for groups of that size (one group's bytes pass through)
    "cross_out": {**_SESSION, "shard": _SHARD, "sub": _SUB, "result": _hex64, "weight": _int(0, 1 << 20),
                  "groups": _int(0, 1 << 16), "enc": _int(1, MAX_GROUP), "signer": _peer,
                  "sig": _sig, "witness": _opt_peer, "wsig": _opt_sig},  # (the witness's signature of the same)
    # after the round: the digest of what the sender applied and (held) the SHA-256 of the signed statements it
    # holds (peer/averaging/statements.py); no body
    "applied": {**_SESSION, "digest": _hex64, "held": _hex64},
    # a member whose digest or held statements differ asks for the sender's statements per shard (signed results and verdicts:
    # peer/averaging/statements.py), in the body of the reply
    "statements_req": _SESSION,
    "statements": {**_SESSION, "ok": _bool},
    # state sync: index -1 asks for the manifest (piece hashes), i >= 0 for piece i of state ``base``
    "state_req": {**_COMMON, "index": _int(-1, 2**31)},
    "state_resp": {**_COMMON, "index": _int(-1, 2**31), "ok": _bool, "reason": _text},
    "ack": {**_COMMON, "code": _int(0, max(Code)), "reason": _text},
    # reachability (peer/net/dialback.py): "dial my address at these TCP ports", and whether it worked
    "dialback": {"type": lambda v: isinstance(v, str),
                 "ports": lambda v: isinstance(v, list) and 0 < len(v) <= MAX_DIALBACK_PORTS
                 and all(_int(1, 65535)(p) for p in v)},
    # ... and the IP the asked peer saw the asker's connection come from (``seen``; "" when it did not check)
    "dialback_reply": {"type": lambda v: isinstance(v, str), "checked": _bool, "ok": _bool, "reason": _text,
                       "seen": lambda v: isinstance(v, str) and len(v) <= 45},
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


def encode_header(header: dict[str, Any], body_len: int = 0) -> bytes:
    """The prefix and the header of a frame whose body (sent separately) has ``body_len`` bytes."""
    raw = msgpack.packb(check_header(header), use_bin_type=True)
    return PREFIX.pack(MAGIC, len(raw), body_len) + raw


def encode_frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    return encode_header(header, len(body)) + body


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("msgpack ext types are not allowed")


def _check_timeout(timeout: float) -> None:
    if not math.isfinite(timeout) or timeout <= 0:
        raise TimeoutError()


async def read_header(reader: asyncio.StreamReader, timeout: float | None,
                      max_body: int | None = None) -> tuple[dict[str, Any], int]:
    """Reads a frame's prefix and header within ``timeout`` seconds (None: the caller's own deadline
    bounds the read); returns (header, body length). The body is left unread; a body longer than
    ``max_body`` is refused on the prefix alone. Raises ProtocolError for anything malformed,
    TimeoutError past the deadline, IncompleteReadError if the stream ends."""
    if timeout is not None:
        _check_timeout(timeout)
    async with asyncio.timeout(timeout):
        magic, header_len, body_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        if magic != MAGIC:
            raise ProtocolError("bad frame magic")
        if header_len > MAX_HEADER:
            raise ProtocolError(f"frame header of {header_len} bytes exceeds {MAX_HEADER}")
        if max_body is not None and body_len > max_body:
            raise ProtocolError(f"frame body of {body_len} bytes exceeds the {max_body} allowed here")
        try:
            header = msgpack.unpackb(
                await reader.readexactly(header_len), raw=False, strict_map_key=True, ext_hook=_reject_ext,
                max_str_len=4096, max_bin_len=VOUCH_LEN * MAX_GROUP, max_array_len=MAX_MANIFEST, max_map_len=24, max_ext_len=0,
            )
        except ProtocolError:
            raise
        except asyncio.IncompleteReadError:
            raise
        except Exception as e:
            raise ProtocolError(f"malformed frame header ({type(e).__name__})") from None
    return check_header(header), body_len


async def read_body(reader: asyncio.StreamReader, body_len: int, timeout: float | None) -> bytes:
    """Reads a body of exactly ``body_len`` bytes within ``timeout`` seconds (None: as ``read_header``)."""
    if timeout is not None:
        _check_timeout(timeout)
    if not body_len:
        return b""
    async with asyncio.timeout(timeout):
        return await reader.readexactly(body_len)


async def read_frame(reader: asyncio.StreamReader, timeout: float, max_body: int) -> tuple[dict[str, Any], bytes]:
    """Reads one whole frame within ``timeout`` seconds; the body may be at most ``max_body`` bytes,
    which is checked before it is read. Raises as ``read_header``."""
    _check_timeout(timeout)
    async with asyncio.timeout(timeout):
        header, body_len = await read_header(reader, timeout, max_body)
        body = await reader.readexactly(body_len) if body_len else b""
    return header, body
