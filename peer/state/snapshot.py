"""The outer state as bytes: snapshot, piece hashes, state hash, restore. Pure: no network.

Layout of a state (what a joiner downloads): ``master`` fp32 LE (n values) then ``momentum`` fp32
LE (n values), cut into pieces of ``PIECE_SIZE`` bytes. The state hash commits to everything a
member needs to take part in the next round bit-identically::

    state_hash = SHA-256("hivetrain-state-v2\\0" | round u64 | n u64 | PIECE_SIZE u64 | sha256(piece_0) | ...)

so a joiner can check every piece on its own, from any donor, as soon as it arrives.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from dataclasses import dataclass

import torch

from hivetrain.peer.errors import StateMismatch

PIECE_SIZE = 1 << 20  # bytes per piece (1 MiB)
DIGEST_LEN = 32
MAX_NUMEL = 1 << 34  # sanity cap on the parameter count a peer will believe

assert sys.byteorder == "little", "the state layout is little-endian"


def state_nbytes(numel: int) -> int:
    return 2 * 4 * numel


def num_pieces(numel: int) -> int:
    return -(-state_nbytes(numel) // PIECE_SIZE)


def piece_range(numel: int, index: int) -> tuple[int, int]:
    start = index * PIECE_SIZE
    return start, min(start + PIECE_SIZE, state_nbytes(numel))


def digest(round_: int, numel: int, piece_hashes: list[bytes] | tuple[bytes, ...]) -> str:
    h = hashlib.sha256(b"hivetrain-state-v2\0")
    h.update(struct.pack("<QQQ", round_, numel, PIECE_SIZE))
    for piece_hash in piece_hashes:
        h.update(piece_hash)
    return h.hexdigest()


@dataclass(frozen=True)
class Snapshot:
    """An immutable copy of the outer state at a round boundary, ready to be served to joiners."""

    round: int
    numel: int
    data: bytes  # (2n,) fp32 LE: master then momentum
    piece_hashes: tuple[bytes, ...]
    hash: str

    @classmethod
    def of(cls, round_: int, master: torch.Tensor, momentum: torch.Tensor) -> Snapshot:
        numel = master.numel()
        data = master.numpy().tobytes() + momentum.numpy().tobytes()
        view = memoryview(data)
        pieces = tuple(hashlib.sha256(view[s:e]).digest()
                       for s, e in (piece_range(numel, i) for i in range(num_pieces(numel))))
        return cls(round_, numel, data, pieces, digest(round_, numel, pieces))

    def manifest(self) -> bytes:
        return b"".join(self.piece_hashes)

    def piece(self, index: int) -> bytes:
        start, end = piece_range(self.numel, index)
        return self.data[start:end]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(master, momentum) as new (n,) fp32 tensors."""
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.float32)
        return flat[: self.numel].clone(), flat[self.numel :].clone()


def parse_manifest(round_: int, numel: int, manifest: bytes, expected_hash: str) -> tuple[bytes, ...]:
    """Checks a manifest from an untrusted donor against the attested hash; returns the piece hashes."""
    if not 0 < numel <= MAX_NUMEL:
        raise StateMismatch(f"implausible parameter count {numel}")
    if len(manifest) != num_pieces(numel) * DIGEST_LEN:
        raise StateMismatch("state manifest has the wrong length")
    pieces = tuple(manifest[i : i + DIGEST_LEN] for i in range(0, len(manifest), DIGEST_LEN))
    if digest(round_, numel, pieces) != expected_hash:
        raise StateMismatch("state manifest does not match the attested state hash")
    return pieces


def assemble(round_: int, numel: int, piece_hashes: tuple[bytes, ...], pieces: dict[int, bytes],
             verified: bool = False) -> Snapshot:
    """Builds a snapshot from pieces; raises StateMismatch if any is missing or wrong.

    ``verified=True`` skips re-hashing pieces the caller already checked one by one on arrival."""
    if set(pieces) != set(range(len(piece_hashes))):
        raise StateMismatch("state is missing pieces")
    for i, expected in enumerate(piece_hashes):
        if not verified and hashlib.sha256(pieces[i]).digest() != expected:
            raise StateMismatch(f"state piece {i} does not match its hash")
    data = b"".join(pieces[i] for i in range(len(piece_hashes)))
    if len(data) != state_nbytes(numel):
        raise StateMismatch("state has the wrong size")
    return Snapshot(round_, numel, data, piece_hashes, digest(round_, numel, piece_hashes))
