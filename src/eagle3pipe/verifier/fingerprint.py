"""Fingerprints of a verifier checkpoint directory that never read terabytes.

A manifest lists every file of the checkpoint (sorted relative paths; hidden files and folders
such as .git/ and .cache/ are skipped; symlinked files are followed, symlinked folders are not)
with its size and, by kind of file and mode:

  kind                          mode "headers"                     mode "full"
  *.safetensors                 size + header_sha256               size + header_sha256 + sha256
  other weights (.bin .pt ...)  size only                          size + sha256
  everything else (config,      size + sha256 (files over          size + sha256
  tokenizer, index, code...)    SMALL_FILE_LIMIT: size only)

header_sha256 hashes the 8-byte length prefix and the JSON header of a safetensors file (every
tensor's name, dtype, shape and byte offsets, plus the file's __metadata__). The header is also
checked against the file size, so a truncated or over-long download is an error even in headers
mode.

What "headers" mode does NOT detect: a change of tensor VALUES that keeps every name, dtype, shape
and file size (e.g. a re-trained or re-quantised-in-place checkpoint with identical layout), and
any same-size change inside .bin/.pt weights or inside an other-kind file over SMALL_FILE_LIMIT.
Mode "full" detects every byte change, at the cost of reading every byte.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from tqdm import tqdm

from eagle3pipe.errors import Error
from eagle3pipe.runtime.hashing import sha256_file
from eagle3pipe.runtime.tensorfile import read_header

SAFETENSORS = (".safetensors",)
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz",
                 ".pdparams", ".distcp")
SMALL_FILE_LIMIT = 256 * 1024 * 1024  # other-kind files up to this size are always fully hashed
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
MODES = ("headers", "full")


class FingerprintError(Error, ValueError):
    pass


def list_files(root: str | Path) -> list[str]:
    """Sorted relative posix paths of the regular files under root (hidden entries skipped)."""
    root = Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            if p.is_file():  # follows file symlinks (Hugging Face cache snapshots are symlinks)
                out.append(p.relative_to(root).as_posix())
    return sorted(out)


def kind_of(name: str) -> str:
    low = name.lower()
    if low.endswith(SAFETENSORS):
        return "safetensors"
    if low.endswith(OTHER_WEIGHTS):
        return "weights"
    return "other"


def fingerprint(root: str | Path, mode: str = "headers", *, progress: bool = True) -> dict:
    """The manifest body {"mode", "files": {relpath: {...}}, "n_files", "total_bytes"} of a
    checkpoint directory. Deterministic: sorted paths, no timestamps."""
    if mode not in MODES:
        raise FingerprintError(f"hash mode {mode!r} is not one of {list(MODES)}",
                               fix="set verifier.hash_mode to headers or full")
    root = Path(root)
    if not root.is_dir():
        raise FingerprintError(f"{root}: not a directory", fix="set verifier.path to a "
                               "Hugging Face checkpoint directory, or null for the embedded one")
    names = list_files(root)
    sizes = {n: (root / n).stat().st_size for n in names}
    full_bytes = sum(s for n, s in sizes.items() if _needs_full_hash(n, s, mode))
    files: dict[str, dict] = {}
    bar = tqdm(total=full_bytes, unit="B", unit_scale=True, desc=f"verifier: hash ({mode})",
               disable=not progress, mininterval=1.0)
    with bar:
        for n in tqdm(names, desc="verifier: files", disable=not progress or len(names) < 20,
                      mininterval=1.0, leave=False):
            p = root / n
            entry: dict = {"size": sizes[n]}
            if kind_of(n) == "safetensors":
                header = read_header(p, error=FingerprintError)
                entry["header_sha256"] = hashlib.sha256(header.raw).hexdigest()
                entry["tensors"] = len(header.tensors)
            if _needs_full_hash(n, sizes[n], mode):
                entry["sha256"] = sha256_file(p, bar)
            files[n] = entry
    return {"mode": mode, "files": files, "n_files": len(files),
            "total_bytes": sum(sizes.values())}


def _needs_full_hash(name: str, size: int, mode: str) -> bool:
    if mode == "full":
        return True
    return kind_of(name) == "other" and size <= SMALL_FILE_LIMIT


def timed_fingerprint(root: str | Path, mode: str = "headers", *,
                      progress: bool = True) -> tuple[dict, float]:
    t0 = time.perf_counter()
    body = fingerprint(root, mode, progress=progress)
    return body, time.perf_counter() - t0
