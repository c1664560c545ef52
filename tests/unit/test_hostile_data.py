"""``--data`` with hostile files (review N12): a data folder someone else prepared may hold links to
our secrets, to /dev/zero, pipes that block a reader, or a parquet file whose other columns
decompress to gigabytes. The corpus reads regular files inside the folder, and of a parquet file
only its ``text`` column."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hivetrain.peer.errors import DataError
from hivetrain.peer.train import data
from hivetrain.peer.train.data import load_text_files

SECRET = "a private line from a file outside the data folder"


def _folder(tmp_path: Path) -> Path:
    """A data folder of 12 honest documents, plus a secret file outside it."""
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "id_rsa").write_text(SECRET)
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(12):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "honest words. " * 30)
    return folder


def test_links_out_of_the_folder_pipes_and_devices_are_left_out_unread(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "notes.txt").symlink_to(tmp_path / "home" / "id_rsa")  # a link to a secret
    (folder / "zero.txt").symlink_to("/dev/zero")  # st_size 0, read without end
    os.mkfifo(folder / "pipe.txt")  # open() blocks until a writer comes: never
    (folder / "more").symlink_to(tmp_path / "home", target_is_directory=True)
    (folder / "again.txt").symlink_to(folder / "doc00.txt")  # a link inside the folder is data
    assert (folder / "notes.txt").read_text() == SECRET  # the attack's links work
    c = load_text_files(str(folder), min_tokens=64)
    assert SECRET.encode() not in bytes(c.train.tolist()) + bytes(c.heldout.tolist())
    assert dict(c.skipped) == {"notes.txt": "a link to outside the data folder", "zero.txt": "a link to outside the data folder",
                               "pipe.txt": "not a regular file", "more/": "a link to a folder"}
    assert c.n_files == 13


def test_a_path_given_by_itself_must_be_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "zero").symlink_to("/dev/zero")
    for path in (tmp_path / "pipe", tmp_path / "zero", Path("/dev/zero")):
        with pytest.raises(DataError, match="not a regular file") as e:
            load_text_files(str(path))
        assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_pattern_leaves_out_links_that_lead_outside_its_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "notes.txt").symlink_to(tmp_path / "home" / "id_rsa")
    os.mkfifo(folder / "pipe.txt")
    c = load_text_files(str(folder / "*.txt"), min_tokens=64)
    assert SECRET.encode() not in bytes(c.train.tolist()) + bytes(c.heldout.tolist())
    assert c.n_files == 12


def _bomb(path: Path, blob_mb: int, text_rows: int = 64, text: str = "") -> None:
    """A parquet file with a small text column (or ``text`` in every row) and a column of ``blob_mb``
    MB of zeros; zstd and dictionaries make both a few KB on disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [text or f"row {i}: " + "honest words in a parquet file. " * 8 for i in range(text_rows)]
    blob = pa.array([b"\0" * (blob_mb * 1024 * 1024 // text_rows)] * text_rows, type=pa.large_binary())
    pq.write_table(pa.table({"text": texts, "blob": blob}), path, compression="zstd")


def test_a_parquet_file_costs_its_text_column_not_its_other_columns(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "bomb.parquet"
    _bomb(path, 256)
    meta = pq.ParquetFile(path).metadata
    assert path.stat().st_size < 64 * 1024 and meta.num_rows == 64  # the bomb: a few KB; 256 MB once decoded
    assert pq.read_table(path, columns=["blob"]).nbytes > 256 * 1024**2
    probe = textwrap.dedent(f"""
        import resource, sys
        from hivetrain.peer.train.data import read_records
        import datasets, pyarrow.parquet  # (imports are not the file's cost)
        from pathlib import Path
        rows = read_records(Path({str(path)!r}), "bomb")  # warm: the first read loads the builder's modules
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rows = read_records(Path({str(path)!r}), "bomb")
        print(len(rows), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows, grown_kb = map(int, out.stdout.split())
    assert rows == 64
    assert grown_kb < 64 * 1024, f"reading the text column grew the peak RSS by {grown_kb / 1024:.0f} MB"


def test_a_parquet_text_column_over_the_cap_is_refused_from_its_footer(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.parquet"
    _bomb(path, 1)
    monkeypatch.setattr(data, "MAX_CORPUS_BYTES", 1024)
    with pytest.raises(DataError, match="'text' column is .* uncompressed, over the"):
        data.read_records(path, "big.parquet")
    monkeypatch.setattr(data, "MAX_CORPUS_BYTES", 1024**2)
    _bomb(path, 1, text_rows=1000, text="x" * 10_000)  # one dictionary entry: ~10 KB coded, 10 MB of rows
    with pytest.raises(DataError, match="holds over"):
        data.read_records(path, "big.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "notext.parquet")
    with pytest.raises(DataError, match="has no 'text' field"):
        data.read_records(tmp_path / "notext.parquet", "notext.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "numbers.parquet")
    with pytest.raises(DataError, match="'text' field is int64, not text"):
        data.read_records(tmp_path / "numbers.parquet", "numbers.parquet")
