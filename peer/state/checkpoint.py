"""Local checkpoints of the outer state: written atomically every round, verified on read.

Format: ``b"HTCK1\\n"`` | header length u32 LE | msgpack header {round, numel, hash} | state bytes.
The state bytes are the same layout a joiner downloads (peer/state.py), and the hash is
recomputed on read: a torn or tampered file is refused, never half-loaded.
"""

from __future__ import annotations

import fcntl
import os
import struct
from typing import IO

import msgpack

from hivetrain.peer.errors import StateMismatch
from hivetrain.peer.state.snapshot import Snapshot, state_nbytes

MAGIC = b"HTCK1\n"


def write(path: str, snapshot: Snapshot) -> None:
    """Writes ``snapshot`` to ``path`` atomically (temp file, fsync, rename)."""
    header = msgpack.packb({"round": snapshot.round, "numel": snapshot.numel, "hash": snapshot.hash})
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(snapshot.data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: str, numel: int) -> Snapshot | None:
    """The checkpoint at ``path``, verified; None if there is none. Raises StateMismatch if corrupt."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise StateMismatch(f"{path} is not a hivetrain checkpoint")
        (header_len,) = struct.unpack("<I", f.read(4))
        if header_len > 4096:
            raise StateMismatch(f"{path}: header too large")
        try:
            header = msgpack.unpackb(f.read(header_len), raw=False, max_bin_len=0, max_ext_len=0)
            round_, saved_numel, saved_hash = header["round"], header["numel"], header["hash"]
        except Exception:
            raise StateMismatch(f"{path}: unreadable header") from None
        if saved_numel != numel:
            raise StateMismatch(f"{path} holds {saved_numel} values, the run's model has {numel}")
        data = f.read(state_nbytes(numel) + 1)
    if len(data) != state_nbytes(numel):
        raise StateMismatch(f"{path} is truncated")
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
    snapshot = Snapshot.of(round_, flat[:numel], flat[numel:])
    if snapshot.hash != saved_hash:
        raise StateMismatch(f"{path} does not match its recorded hash")
    return snapshot


def lock_dir(path: str) -> IO[bytes]:
    """Takes an exclusive lock on a state folder so two peers never share one; keep the file open."""
    os.makedirs(path, exist_ok=True)
    handle = open(os.path.join(path, "lock"), "wb")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StateMismatch(f"another peer is using the state folder {path}; give this one its own --state-dir") from None
    return handle
