"""A full disk: recognising it in any writer's error, and the free space where a path lives."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a full disk or an exhausted quota: an OSError with
    ENOSPC/EDQUOT, or the same error as a library reports it without the OSError type
    (safetensors' Rust writer, vLLM's re-raised worker errors, pyarrow)."""
    codes = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    words = ("No space left on device", "Disk quota exceeded",
             *(f"os error {c}" for c in sorted(codes)))
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in codes:
            return True
        if any(w in str(e) for w in words):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: str | Path) -> tuple[Path, int]:
    """The nearest existing directory at or above `path` and the bytes free on its
    filesystem for an ordinary user."""
    p = Path(os.path.abspath(path))
    while not p.is_dir() and p != p.parent:
        p = p.parent
    return p, shutil.disk_usage(p).free
