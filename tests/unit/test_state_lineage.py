"""State hashes commit to lineage (peer/state/snapshot.py); manifests and checkpoints carry and
verify it (peer/state/checkpoint.py)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import msgpack
import pytest
import torch

from hivetrain.peer.errors import StateMismatch
from hivetrain.peer.state import checkpoint
from hivetrain.peer.state.snapshot import (
    PIECE_SIZE,
    VOID_LINK,
    ZERO,
    Snapshot,
    all_finite,
    assemble,
    digest,
    manifest_nbytes,
    num_pieces,
    parse_manifest,
)

NUMEL = PIECE_SIZE // 8 + 100  # two pieces
PARENT, LINK = "1a" * 32, "2b" * 32


def _snapshot(round_: int = 7, parent: str = PARENT, link: str = LINK) -> Snapshot:
    g = torch.Generator().manual_seed(round_)
    return Snapshot.of(round_, torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g),
                       parent=parent, link=link)


def test_the_hash_is_the_documented_digest() -> None:
    snap = _snapshot()
    h = hashlib.sha256(b"hivetrain-state-v3\0" + struct.pack("<QQQ", 7, NUMEL, PIECE_SIZE)
                       + bytes.fromhex(PARENT) + bytes.fromhex(LINK) + b"".join(snap.piece_hashes))
    assert snap.hash == h.hexdigest()
    assert len(snap.piece_hashes) == num_pieces(NUMEL) == 2
    assert VOID_LINK == hashlib.sha256(b"void").hexdigest() and ZERO == "0" * 64


def test_digest_refuses_malformed_lineage() -> None:
    with pytest.raises(ValueError):
        digest(1, 1, "xy" * 32, ZERO, [])
    with pytest.raises(ValueError):
        digest(1, 1, ZERO, ZERO[:-1], [])


def test_the_manifest_carries_parent_and_link_and_rebuilds_the_state() -> None:
    snap = _snapshot()
    manifest = parse_manifest(7, NUMEL, snap.manifest(), snap.hash)
    assert (manifest.parent, manifest.link, manifest.piece_hashes) == (PARENT, LINK, snap.piece_hashes)
    assert len(snap.manifest()) == manifest_nbytes(NUMEL)
    rebuilt = assemble(7, NUMEL, manifest, {i: snap.piece(i) for i in range(2)})
    assert rebuilt == snap


@pytest.mark.parametrize("where", [0, 32, 64, 72])  # the parent, the link, the population, a piece hash
def test_a_manifest_with_any_field_changed_is_refused(where: int) -> None:
    snap = _snapshot()
    forged = bytearray(snap.manifest())
    forged[where] ^= 1
    with pytest.raises(StateMismatch, match="does not match"):
        parse_manifest(7, NUMEL, bytes(forged), snap.hash)
    with pytest.raises(StateMismatch, match="wrong length"):
        parse_manifest(7, NUMEL, snap.manifest()[:-1], snap.hash)


def test_a_population_is_committed_to_carried_by_the_manifest_and_kept_by_checkpoints(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    master, momentum = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    plain = Snapshot.of(7, master, momentum, parent=PARENT, link=LINK)
    snap = Snapshot.of(7, master, momentum, parent=PARENT, link=LINK, population=72)
    h = hashlib.sha256(b"hivetrain-state-v4\0" + struct.pack("<QQQQ", 7, NUMEL, PIECE_SIZE, 72)
                       + bytes.fromhex(PARENT) + bytes.fromhex(LINK) + b"".join(snap.piece_hashes))
    assert snap.hash == h.hexdigest() != plain.hash  # (population 0: the v3 hash of before)
    manifest = parse_manifest(7, NUMEL, snap.manifest(), snap.hash)
    assert manifest.population == 72
    assert assemble(7, NUMEL, manifest, {i: snap.piece(i) for i in range(2)}) == snap
    with pytest.raises(StateMismatch, match="does not match"):  # a donor cannot hand another population
        parse_manifest(7, NUMEL, plain.manifest(), snap.hash)
    path = str(tmp_path / "state.ckpt")
    checkpoint.write(path, snap)
    back = checkpoint.read(path, NUMEL)
    assert back is not None and (back.population, back.hash) == (72, snap.hash)


def test_equal_bytes_with_another_history_are_another_state() -> None:
    assert _snapshot(parent=PARENT).hash != _snapshot(parent=ZERO).hash
    assert _snapshot(link=LINK).hash != _snapshot(link=VOID_LINK).hash


def test_all_finite() -> None:
    ok = torch.tensor([0.0, -1.5, 3e38]).numpy().tobytes()
    assert all_finite(ok) and all_finite(b"")
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert not all_finite(ok + torch.tensor([bad]).numpy().tobytes())


# ---- checkpoints ----------------------------------------------------------------------------------


def test_a_checkpoint_keeps_the_lineage(tmp_path: Path) -> None:
    path = str(tmp_path / "c.ckpt")
    snap = _snapshot()
    checkpoint.write(path, snap)
    loaded = checkpoint.read(path, NUMEL)
    assert loaded == snap and (loaded.parent, loaded.link) == (PARENT, LINK)


def _rewrite_header(path: str, **changes: object) -> None:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<I", raw[6:10])
    header = msgpack.unpackb(raw[10 : 10 + n], raw=False)
    header.update(changes)
    packed = msgpack.packb(header)
    Path(path).write_bytes(raw[:6] + struct.pack("<I", len(packed)) + packed + raw[10 + n :])


@pytest.mark.parametrize("changes, match", [
    ({"parent": ZERO}, "does not match its recorded hash"),  # a lineage the bytes were not hashed with
    ({"link": VOID_LINK}, "does not match its recorded hash"),
    ({"round": "7"}, "malformed header"),  # used to raise struct.error, uncaught
    ({"parent": None}, "malformed header"),
    ({"round": -1}, "malformed header"),
])
def test_a_checkpoint_whose_header_disagrees_is_refused(tmp_path: Path, changes: dict[str, object],
                                                        match: str) -> None:
    path = str(tmp_path / "c.ckpt")
    checkpoint.write(path, _snapshot())
    _rewrite_header(path, **changes)
    with pytest.raises(StateMismatch, match=match):
        checkpoint.read(path, NUMEL)


def test_an_old_format_or_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    checkpoint.write(str(path), _snapshot())
    raw = path.read_bytes()
    path.write_bytes(b"HTCK1\n" + raw[6:])
    with pytest.raises(StateMismatch, match="older format"):
        checkpoint.read(str(path), NUMEL)
    path.write_bytes(raw[:-1])
    with pytest.raises(StateMismatch, match="truncated"):
        checkpoint.read(str(path), NUMEL)
    path.write_bytes(raw[:8])
    with pytest.raises(StateMismatch, match="truncated"):
        checkpoint.read(str(path), NUMEL)
