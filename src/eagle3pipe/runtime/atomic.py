"""Atomic outputs, and a stage process bound to its launcher."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from eagle3pipe.errors import Error

# ---------------------------------------------------------------------------------------------
# Atomic outputs
#
# Every output is written under a temporary sibling name and renamed into place whole
# (write_text_atomic, atomic_dir): a killed, failed or full-disk run leaves no partial file or
# directory under an output's name. The temporary names carry the writer: its pid and its host
# (writer_tag(): a store on a filesystem shared by several nodes sees writers with the same pid),
# `.<name>.<pid>-<host>.<random>.tmp` (and `.<name>.<pid>-<host>.old`, the replaced output during
# the swap), so the next writer of the same output on the same host removes what a dead writer
# left beside it (a killed extract's temporary directory is as large as its output), and never
# what a writer on another host is writing. tests/test_faults.py kills every stage at several
# points and checks this.

_LAUNCHER: int | None = None  # the stage's parent process, recorded by bind_to_launcher()
# this host, as the temporary names carry it: 8 hex digits of its name's sha256 (a hostname may
# hold dots and dashes; the tag holds neither)
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
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


def writer_alive(tag: str) -> bool:
    """Whether the writer named by `tag` (`<pid>-<host>`, writer_tag) may still run: another
    host's always may (its processes cannot be seen from here); this host's while its pid
    runs."""
    pid, _, host = tag.partition("-")
    return host != HOST or (pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))))


def writer_tag() -> str:
    """This process as temporary names carry it: `<pid>-<host>`."""
    return f"{os.getpid()}-{HOST}"


def temp_sibling(path: Path, data: bytes = b"") -> Path:
    """A temporary file beside `path` holding `data`, named for this writer (unique per call),
    with the mode an ordinary write would give it: for writers that rename it into place
    themselves."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{writer_tag()}.",
                               suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return Path(tmp)


LEFTOVER = re.compile(r"\..+\.(\d+)-([0-9a-f]{8})\.\w+\.tmp")  # a temporary named for its writer


def dead_writers(directory: Path) -> list[Path]:
    """The temporaries under `directory` (any depth) that dead writers on this host left: what
    no live process will rename into place or remove. Another host's are never listed."""
    found = []
    for p in sorted(Path(directory).rglob(".*.tmp")):
        m = LEFTOVER.fullmatch(p.name)
        if m and m[2] == HOST and int(m[1]) != os.getpid() and not _alive(int(m[1])) \
                and not any(q in found for q in p.parents):
            found.append(p)
    return found


def remove(p: Path) -> None:
    """A file or a directory tree, gone (already gone is fine)."""
    _remove(p)


def _sweep(path: Path) -> None:
    """Removes the temporary files and directories that dead writers of `path` on this host left
    beside it (a writer is identified by its pid and host; another host's are never touched)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)-([0-9a-f]{{8}})\.(?:\w+\.tmp|old)")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or m[2] != HOST or int(m[1]) == os.getpid() or _alive(int(m[1])):
            continue
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                e.unlink()


# called with each output's path just before it is renamed into place, everything written:
# empty in a run; the fault tests hold a writer here (tests/helpers/site/sitecustomize.py)
BEFORE_PUBLISH: list[Callable[[Path], None]] = []


def _before_publish(path: Path, output: bool = True) -> None:
    """The last step before an output is renamed into place. Refuses to publish a stage output
    (`output`) for a stage whose launcher is gone (see bind_to_launcher); then BEFORE_PUBLISH."""
    if output and _LAUNCHER is not None and os.getppid() != _LAUNCHER:
        raise Error(f"{path}: not published: the process that started this stage (pid "
                    f"{_LAUNCHER}) is gone, so nothing would record this output",
                    fix="rerun `dvc repro`")
    for hook in BEFORE_PUBLISH:
        hook(path)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes `path` whole or not at all (a temporary sibling renamed into place), with the
    mode an ordinary write would give it (0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{writer_tag()}.",
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


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, output: bool = True) -> Iterator[Path]:
    """Yields a temporary sibling directory; on success it replaces `path` whole, on failure it
    is removed, so a killed or failed run never leaves a half-written output behind (and what
    a killed one left beside it is removed by the next writer of `path`). `output` False: not
    a stage output (a training checkpoint), written even once the stage's launcher is gone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{writer_tag()}.",
                                suffix=".tmp"))
    tmp.chmod(0o755)
    try:
        yield tmp
        _before_publish(path, output)
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.{writer_tag()}.old")
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
