"""Where ``--data`` points: a path or a glob pattern resolved to files, without reading them (no
torch: ``peer start`` checks it before anything starts, peer/flags.py; peer/train/data.py reads)."""

from __future__ import annotations

from pathlib import Path

from hivetrain.peer.errors import DataError

GLOB_CHARS = "*?["


def outside(path: Path, root: Path) -> bool:
    """Whether a link under ``root`` leads outside it (a data folder that reaches ~/.ssh is not data)."""
    try:
        path.resolve(strict=True).relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):  # (a dangling link or a loop is outside too)
        return True
    return False


def expand(path: str) -> tuple[Path, list[tuple[str, Path]] | None]:
    """A glob pattern (``data/*.parquet``) -> (its fixed leading folder, the files it matches, sorted);
    anything else -> (the path, None). DataError when the path does not exist or the pattern matches
    no file."""
    if not any(c in path for c in GLOB_CHARS) or Path(path).expanduser().exists():
        if not Path(path).expanduser().exists():
            raise DataError(f"data path {path} does not exist: pass a text file, a folder of text files, a .jsonl "
                            "or .parquet file, or a pattern such as 'data/*.parquet'")
        return Path(path).expanduser(), None
    pattern = Path(path).expanduser()
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in GLOB_CHARS))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    matched = sorted(p for p in root.glob(str(Path(*parts[fixed:])))
                     if p.is_file() and not (p.is_symlink() and outside(p, root)))
    if not matched:
        raise DataError(f"data pattern {path} matches no files (links that lead outside {root} are left out)")
    return root, [(p.relative_to(root).as_posix(), p) for p in matched]
