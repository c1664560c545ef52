"""Local checkpoints of the outer state: written atomically every round, verified on read.

Format: ``b"HTCK2\\n"`` | header length u32 LE | msgpack header {round, numel, hash, parent, link,
population (may be absent: 0)}
| state bytes. The state bytes are the same layout a joiner downloads (peer/state/snapshot.py), and
the hash, which commits to the lineage (parent, link), is recomputed on read: a torn file, or one
whose header and bytes disagree, is refused, never half-loaded. The hash lives in the same file, so
this guards against accidents, not against someone who can rewrite the file. A ``HTCK1`` file
(before lineage) is refused as an old format.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import struct
from collections.abc import Callable
from typing import IO

import msgpack

from hivetrain.peer.errors import ConfigError, StateMismatch
from hivetrain.peer.state.snapshot import MAX_POPULATION, Snapshot, is_hex64, state_nbytes

MAGIC = b"HTCK2\n"
OLD_MAGIC = b"HTCK1\n"
MAX_ROUND = 2**62


def write(path: str, snapshot: Snapshot) -> None:
    """Writes ``snapshot`` to ``path`` atomically (temp file, fsync, rename)."""
    header = msgpack.packb({"round": snapshot.round, "numel": snapshot.numel, "hash": snapshot.hash,
                            "parent": snapshot.parent, "link": snapshot.link, "population": snapshot.population})
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(snapshot.data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BeganFile:
    """The last few (round, base state) pairs whose averaging this peer began, in a small JSON file
    next to the checkpoint, written before the first message of the round (the training loop's
    ``Began``). A peer that crashes inside a round and restarts from the checkpoint of that round's
    base computes its pseudo-gradient again, and on a GPU, or with its data read again, not to the
    same bytes: sent to the same group, the others would prove it an equivocator and ban it. With
    this note the restarted peer voids that round instead and catches up at the boundary."""

    KEEP = 4  # pairs noted (overlap keeps two rounds in flight at most)

    def __init__(self, path: str, log: Callable[[str], None]):
        self.path, self.log = path, log
        self._pairs: list[tuple[int, str]] = []

    def marked(self) -> set[tuple[int, str]]:
        try:
            with open(self.path, "rb") as f:
                raw = json.loads(f.read(4096))
            pairs = {(int(r), str(b)) for r, b in raw["began"]}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.log(f"warning: ignoring {self.path} ({str(e)[:80]})")
            return set()
        self._pairs = sorted(pairs)[-self.KEEP:]
        return set(self._pairs)

    def mark(self, round_: int, base: str) -> None:
        self._pairs = [p for p in self._pairs if p != (round_, base)][-(self.KEEP - 1):] + [(round_, base)]
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"began": [list(p) for p in self._pairs]}, f)
            os.replace(tmp, self.path)  # (a SIGKILL leaves the page cache written: no fsync)
        except OSError as e:
            self.log(f"warning: could not note the round we average ({e}); a restart inside it may be "
                     "taken for equivocation")


class Writer:
    """Writes each snapshot given to ``path``, off the caller's thread, one at a time and in order
    (a snapshot is immutable). A failed write (a full disk) is said through ``log`` every time it
    happens; training goes on."""

    def __init__(self, path: str, log: Callable[[str], None]):
        self.path, self.log = path, log
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")

    def __call__(self, snapshot: Snapshot) -> None:
        self._pool.submit(self._write, snapshot)

    def _write(self, snapshot: Snapshot) -> None:
        try:
            write(self.path, snapshot)
        except OSError as e:
            self.log(f"warning: could not write the checkpoint ({e})")


def read(path: str, numel: int) -> Snapshot | None:
    """The checkpoint at ``path``, verified; None if there is none. Raises StateMismatch if corrupt."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        magic = f.read(len(MAGIC))
        if magic == OLD_MAGIC:
            raise StateMismatch(f"{path} is a checkpoint of an older format (no lineage)")
        if magic != MAGIC:
            raise StateMismatch(f"{path} is not a hivetrain checkpoint")
        raw_len = f.read(4)
        if len(raw_len) != 4:
            raise StateMismatch(f"{path} is truncated")
        (header_len,) = struct.unpack("<I", raw_len)
        if header_len > 4096:
            raise StateMismatch(f"{path}: header too large")
        try:
            header = msgpack.unpackb(f.read(header_len), raw=False, max_bin_len=0, max_ext_len=0)
            round_, saved_numel, saved_hash = header["round"], header["numel"], header["hash"]
            parent, link, population = header["parent"], header["link"], header.get("population", 0)
        except Exception:  # msgpack raises many types for a damaged file; all mean "unreadable"
            raise StateMismatch(f"{path}: unreadable header") from None
        if not (_is_int(round_) and _is_int(saved_numel) and is_hex64(saved_hash) and is_hex64(parent)
                and is_hex64(link) and _is_int(population) and population <= MAX_POPULATION):
            raise StateMismatch(f"{path}: malformed header")
        if saved_numel != numel:
            raise StateMismatch(f"{path} holds {saved_numel} values, the run's model has {numel}")
        data = f.read(state_nbytes(numel) + 1)
    if len(data) != state_nbytes(numel):
        raise StateMismatch(f"{path} is truncated")
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
    snapshot = Snapshot.of(round_, flat[:numel], flat[numel:], parent=parent, link=link, population=population)
    if snapshot.hash != saved_hash:
        raise StateMismatch(f"{path} does not match its recorded hash")
    return snapshot


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ROUND


def lock_dir(path: str) -> IO[bytes]:
    """Takes an exclusive lock on a state folder so two peers never share one; keep the file open."""
    os.makedirs(path, exist_ok=True)
    handle = open(os.path.join(path, "lock"), "wb")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(f"another peer is using the state folder {path} (it holds that peer's identity and port); "
                          f"give this one its own, e.g. --state-dir {path.rstrip('/')}-2") from None
    return handle
