"""The local text corpus: the running interpreter's standard-library sources.

Every machine with Python has them, so the embedded default needs no network. Files are split
deterministically by a hash of their relative path into three disjoint parts:
  train   (80%): tokenizer and verifier pre-training
  prompt  (15%): prompts whose responses the verifier regenerates (draft training data)
  heldout  (5%): verifier eval loss and the smoke test's prompts (never trained on)
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path

from eagle3pipe.errors import Error

PARTS = ("train", "prompt", "heldout")
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo",
              "ensurepip", "tkinter", "pydoc_data", "encodings"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


class CorpusError(Error, ValueError):
    """The standard library cannot supply the text asked of it."""


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the stdlib's .py files (tests and vendored code excluded)."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        out.append(rel.as_posix())
    if not out:
        raise CorpusError(f"no Python sources under {root}: the embedded verifier and the "
                          "stdlib prompts need the standard library's sources",
                          fix="install Python with its sources (Debian: python3.11 ships them), "
                          "or set verifier.path to a real checkpoint and dataset.source / "
                          "smoke.prompts to prompt files")
    return sorted(out)


def part_of(relpath: str) -> str:
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 80 else "prompt" if bucket < 95 else "heldout"


def files(part: str, root: Path | None = None) -> list[Path]:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}")
    root = root or stdlib_root()
    return [root / r for r in stdlib_files(root) if part_of(r) == part]


def snippets(part: str, n: int, *, seed: int, min_lines: int, max_lines: int, max_chars: int,
             root: Path | None = None) -> list[str]:
    """n deterministic code snippets (runs of consecutive non-blank-started lines) of a part."""
    rng = random.Random(seed)
    candidates: list[str] = []
    for p in files(part, root):
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
        for start in range(0, max(0, len(lines) - min_lines), max_lines):
            block = lines[start:start + rng.randint(min_lines, max_lines)]
            text = "\n".join(block).strip("\n")
            if len(text) >= 40 and text.strip():
                candidates.append(text[:max_chars])
    if len(candidates) < n:
        raise CorpusError(f"only {len(candidates)} snippets in the standard library's "
                          f"'{part}' part, {n} wanted",
                          fix="lower dataset.num_samples / smoke.num_prompts, or give "
                          "dataset.source / smoke.prompts a prompt file")
    rng.shuffle(candidates)
    return candidates[:n]
