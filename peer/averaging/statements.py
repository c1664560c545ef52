"""Signed statements: what a reducer sent as its result, what an auditor found, what a member applied
(and what a slow member sent its reducer, for the relayed audit copy).

A reducer signs (round, group, shard, result hash, commitment hash) with its libp2p key; an auditor
signs (round, group, shard, ok, result hash). After the round every member sends every other member
the digest of what it applied together with the statements it holds, so two members that applied
different things can tell who equivocated: two validly signed, different statements by one signer
for one shard are proof, whoever forwards them. A statement whose signature does not verify
convicts the member that forwarded it instead.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from hivetrain.dht.errors import InvalidRecord
from hivetrain.dht.identity import Identity, verify_peer

_RESULT = b"hivetrain-result-v1\0"
_VERDICT = b"hivetrain-audit-v1\0"
_APPLIED = b"hivetrain-applied-v1\0"
_PART = b"hivetrain-part-v1\0"
NO_AUDIT, REJECTED, APPROVED = 0, 1, 2  # verdict states in a statement
_LAYOUT = struct.Struct("<32s32s64sB32s64s")  # result hash, commitment hash, reducer sig, verdict, hash, auditor sig
STATEMENT_LEN = _LAYOUT.size
ZERO32, ZERO64 = bytes(32), bytes(64)


@dataclass(frozen=True)
class Where:
    """The shard a statement is about."""

    run: str  # spec hash, hex
    round: int
    group: str  # group hash, hex
    shard: int


def commitment(digests: Sequence[str], probation: Sequence[str], excluded: Sequence[str]) -> bytes:
    """The hash of what a reducer committed to beside its result (part digests, claims, exclusions)."""
    return hashlib.sha256(msgpack.packb([list(digests), list(probation), list(excluded)])).digest()


def result_message(where: Where, result_hash: bytes, commit: bytes) -> bytes:
    return _RESULT + msgpack.packb([where.run, where.round, where.group, where.shard, result_hash, commit])


def verdict_message(where: Where, ok: bool, result_hash: bytes) -> bytes:
    return _VERDICT + msgpack.packb([where.run, where.round, where.group, where.shard, ok, result_hash])


def part_message(where: Where, part_digest: str) -> bytes:
    return _PART + msgpack.packb([where.run, where.round, where.group, where.shard, part_digest])


def sign_part(identity: Identity, where: Where, part_digest: str) -> bytes:
    """A slow member's signature of the part it sends a reducer: the reducer relays it to the
    shard's auditor with the part, which the reducer can then neither alter nor swap."""
    return identity.sign(part_message(where, part_digest))


def sign_result(identity: Identity, where: Where, result_hash: bytes, commit: bytes) -> bytes:
    return identity.sign(result_message(where, result_hash, commit))


def sign_verdict(identity: Identity, where: Where, ok: bool, result_hash: bytes) -> bytes:
    return identity.sign(verdict_message(where, ok, result_hash))


def valid(signer: str, signature: bytes, message: bytes) -> bool:
    try:
        verify_peer(signer, signature, message)
    except InvalidRecord:
        return False
    return True


@dataclass(frozen=True)
class Statement:
    """What one member holds about one shard: the reducer's signed result, the auditor's signed verdict."""

    result_hash: bytes = ZERO32
    commit: bytes = ZERO32
    result_sig: bytes = ZERO64
    verdict: int = NO_AUDIT
    verdict_hash: bytes = ZERO32
    verdict_sig: bytes = ZERO64

    def pack(self) -> bytes:
        return _LAYOUT.pack(self.result_hash, self.commit, self.result_sig, self.verdict, self.verdict_hash,
                            self.verdict_sig)

    @classmethod
    def unpack(cls, raw: bytes) -> Statement:
        fields = _LAYOUT.unpack(raw)
        if fields[3] not in (NO_AUDIT, REJECTED, APPROVED):
            raise ValueError("bad verdict state")
        return cls(*fields)


def pack_all(statements: Sequence[Statement]) -> bytes:
    return b"".join(s.pack() for s in statements)


def unpack_all(body: bytes, n: int) -> list[Statement]:
    """Raises ValueError unless ``body`` holds exactly ``n`` well-formed statements."""
    if len(body) != n * STATEMENT_LEN:
        raise ValueError(f"{len(body)} bytes of statements for a group of {n}")
    return [Statement.unpack(body[i * STATEMENT_LEN:(i + 1) * STATEMENT_LEN]) for i in range(n)]


def applied_digest(group: str, applied: Sequence[bytes | None]) -> str:
    """What a member applied: per shard the hash of the result it applied, or None for a void shard.
    The state hash of the next round commits to it (its lineage)."""
    h = hashlib.sha256(_APPLIED + bytes.fromhex(group))
    for result_hash in applied:
        h.update(b"\x00" * 32 if result_hash is None else result_hash)
        h.update(b"v" if result_hash is None else b"a")
    return h.hexdigest()
