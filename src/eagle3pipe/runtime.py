"""Shared run-time plumbing: seeds and threads, atomic outputs, canonical JSON."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from eagle3pipe.errors import Error


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


# ---------------------------------------------------------------------------------------------
# Atomic outputs
#
# Every output is written under a temporary sibling name and renamed into place whole
# (write_text_atomic, atomic_dir): a killed, failed or full-disk run leaves no partial file or
# directory under an output's name. The temporary names carry the writer's pid,
# `.<name>.<pid>.<random>.tmp` (and `.<name>.<pid>.old`, the replaced output during the swap),
# so the next writer of the same output removes what a dead writer left beside it (a killed
# extract's temporary directory is as large as its output). tests/test_faults.py kills every
# stage at several points and checks this.

_LAUNCHER: int | None = None  # the stage's parent process, recorded by bind_to_launcher()
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def bind_to_launcher() -> None:
    """The stage runner calls this first: the stage process dies with the process that started
    it (DVC, or torchrun for the train stage: torchrun starts its workers in sessions of their
    own, so killing `dvc repro`'s process group would leave them training and publishing into
    the next run's outputs), and once that process is gone it publishes nothing. A torchrun
    worker whose torchrun was killed while the worker was still importing (before this call)
    has been adopted by init already: it exits here, before reading or writing anything. (An
    orphan adopted by a subreaper other than init is not recognised; the publish check below
    then still stops nothing, so such a run publishes as a run without DVC would.)"""
    global _LAUNCHER
    _LAUNCHER = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PDEATHSIG
    gone = os.getppid() != _LAUNCHER  # it died before the death signal was armed
    if not gone and _LAUNCHER == 1 and os.environ.get("TORCHELASTIC_RUN_ID"):
        try:  # a torchrun worker's parent is torchrun, init only when torchrun is pid 1
            gone = b"torch" not in Path("/proc/1/cmdline").read_bytes()
        except OSError:
            pass
    if gone:
        print(f"{sys.argv[0]}: the process that started it is gone; exiting before any work",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) is dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _sweep(path: Path) -> None:
    """Removes the temporary files and directories that dead writers of `path` left beside it
    (same machine: a writer is identified by its pid)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.(?:\w+\.tmp|old)")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or int(m[1]) == os.getpid() or _alive(int(m[1])):
            continue
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                e.unlink()


def _before_publish(path: Path) -> None:
    """The last step before an output is renamed into place. Refuses to publish for a stage
    whose launcher is gone (see bind_to_launcher). Test hook (tests/test_faults.py): with
    EAGLE3PIPE_FAULT_HOLD=<this output's path> the writer creates the file named by
    EAGLE3PIPE_FAULT_HELD and waits here, everything written and nothing published, to be
    killed."""
    if _LAUNCHER is not None and os.getppid() != _LAUNCHER:
        raise Error(f"{path}: not published: the process that started this stage (pid "
                    f"{_LAUNCHER}) is gone, so nothing would record this output",
                    fix="rerun `dvc repro`")
    hold = os.environ.get("EAGLE3PIPE_FAULT_HOLD")
    if hold and Path(hold).resolve() == path.resolve():
        marker = os.environ.get("EAGLE3PIPE_FAULT_HELD")
        if marker:
            Path(marker).write_text(f"{os.getpid()}\n")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise Error(f"{path}: EAGLE3PIPE_FAULT_HOLD held it for 600 s and nothing killed the "
                    "stage", fix="unset EAGLE3PIPE_FAULT_HOLD (a test hook)")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes `path` whole or not at all (a temporary sibling renamed into place), with the
    mode an ordinary write would give it (0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)
        _before_publish(path)
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
    is removed, so a killed or failed run never leaves a half-written output behind (and what
    a killed one left beside it is removed by the next writer of `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                                suffix=".tmp"))
    tmp.chmod(0o755)
    try:
        yield tmp
        _before_publish(path)
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            _remove(old)
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


# ---------------------------------------------------------------------------------------------
# A full disk


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
