"""Shared run-time plumbing: seeds and threads, atomic outputs, canonical JSON."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def record_run(stage: str) -> None:
    """Appends the stage name to $EAGLE3PIPE_RUN_LOG, if set: the tests' record of which stage
    commands DVC really executed (as opposed to skipped or restored from its run-cache)."""
    log = os.environ.get("EAGLE3PIPE_RUN_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(stage + "\n")


def seed_everything(seed: int, threads: int) -> None:
    """Fixed seeds and an explicit thread count: same params, same bytes."""
    import numpy as np
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dumps(obj: Any) -> str:
    """The one JSON style every generated file uses: sorted keys, 2-space indent, newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, dumps(obj))


def read_json_object(path: str | Path, error: type[Exception], fix: str,
                     what: str = "file") -> dict:
    """A generated JSON object (what write_json wrote, usually another stage's output). Every
    failure raises `error` naming the file (and line) and ending with `fix`: missing or
    unreadable, not UTF-8, invalid or too deeply nested JSON, NaN/Infinity (Python's json
    reads them; they are not JSON and no config value may be non-finite), not an object."""
    import re

    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {what} not found; {fix}")
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror}); {fix}") from None
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                    f"{e.start}: {e.reason}); JSON is UTF-8; {fix}") from None
    constants: list[str] = []
    try:
        doc = json.loads(text, parse_constant=constants.append)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: invalid JSON ({e.msg}); {fix}") from None
    except RecursionError:
        raise error(f"{path}: invalid JSON (nested too deeply to read); {fix}") from None
    if constants:  # the first NaN/Infinity outside a string: its line
        at = next(m for m in re.finditer(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)', text)
                  if m[1]).start()
        line = text.count("\n", 0, at) + 1
        raise error(f"{path}:{line}: {constants[0]} is not JSON (no value here may be "
                    f"non-finite); {fix}")
    if not isinstance(doc, dict):
        kind = {list: "array", str: "string", bool: "true/false", int: "number",
                float: "number"}.get(type(doc), "null")
        raise error(f"{path}: expected a JSON object, got a JSON {kind}; {fix}")
    return doc


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yields a temporary sibling directory; on success it replaces `path` whole, on failure it
    is removed, so a killed or failed run never leaves a half-written output behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    tmp.chmod(0o755)
    try:
        yield tmp
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
