"""File hashes, in one place: a file's sha256 (streamed, with an optional progress bar), and a
set of files' (each file's name relative to a base, a NUL, its bytes, in the order given)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

CHUNK = 8 * 1024 * 1024


def _feed(h, path: Path, bar=None) -> None:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))


def sha256_file(path: str | Path, bar=None) -> str:
    h = hashlib.sha256()
    _feed(h, Path(path), bar)
    return h.hexdigest()


def sha256_files(base: str | Path, files: Iterable[Path]) -> str:
    """sha256 over each file's name relative to `base` and its bytes, in the order given."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(Path(f).relative_to(base)).encode() + b"\0")
        _feed(h, Path(f))
    return h.hexdigest()


def sha256_path(path: str | Path) -> str:
    """sha256_files of a file (its name) or of a directory's files (sorted relative names)."""
    path = Path(path)
    if path.is_file():
        return sha256_files(path.parent, [path])
    return sha256_files(path, sorted(p for p in path.rglob("*") if p.is_file()))
