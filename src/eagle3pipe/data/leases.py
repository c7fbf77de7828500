"""Leases on store entries: what a live run still needs, which no `eagle3pipe gc`, no other
run's bound and no other run's on-demand cleanup removes.

A run that reads or writes store entries it has not published yet (the data stages until their
output links them, an on-demand train stage while it trains) holds a lease: a JSON file under
`<store>/leases/`, named for its writer (`<pid>-<host>.<random>.json`), listing the store keys
by kind, whose mtime the process's heartbeat thread renews every HEARTBEAT_S. A lease is live while its
heartbeat is younger than TTL_S and, on this host, while its process runs; a dead one (its run
killed, its node gone) is a leftover that gc removes. The same idea as a distributed lock's
lease (a TTL renewed by its holder), on the shared filesystem the store already needs.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable

from eagle3pipe.runtime.atomic import temp_sibling, writer_alive, writer_tag

LEASES = "leases"
HEARTBEAT_S = 30.0
# a heartbeat older than this is a dead holder's: ten missed beats (a busy filesystem or a
# stalled node may delay a few; none stalls for minutes and still trains)
TTL_S = 300.0
_parsed: dict[Path, tuple] = {}  # path -> (inode, size, (run, keys))


class _Heartbeat:
    """One daemon thread per process renews the mtime of every lease the process holds, each at
    its own interval: a data stage holds a lease per batch and turn depth until it publishes,
    and a thread each (its stack, the C allocator's arena for it) grew the resident set with
    the number of batches."""

    def __init__(self):
        self._due: dict[Path, tuple[float, float]] = {}  # path -> (interval, next beat)
        self._cond = threading.Condition()
        self._pid: int | None = None

    def add(self, path: Path, every: float) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first lease, or a forked child: a thread of its own
                self._pid, self._due = os.getpid(), {}
                threading.Thread(target=self._run, name="store-leases", daemon=True).start()
            self._due[path] = (every, time.monotonic() + every)
            self._cond.notify()

    def remove(self, path: Path) -> None:
        with self._cond:
            self._due.pop(path, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for path, (every, at) in list(self._due.items()):
                    if at <= now:
                        with contextlib.suppress(OSError):
                            os.utime(path)
                        self._due[path] = (every, now + every)
                nxt = min((at for _, at in self._due.values()), default=None)
                self._cond.wait(None if nxt is None else max(0.0, nxt - time.monotonic()))


_HEARTBEAT = _Heartbeat()


class hold(contextlib.AbstractContextManager):
    """A live lease on `keys` (kind -> store keys) under the store root `base` for the block;
    `with` gives its path (what held(mine=...) leaves out, with every lease of the same `run`:
    the processes of one training run share its entries and their cleanup). Removed at the end
    of the block. The lease keeps no key alive meanwhile (only its file lists them) and starts
    no thread (the process's one heartbeat renews it): a data stage holds one lease per batch
    until its output is published, so what it keeps must not grow with the data."""

    def __init__(self, base: Path, keys: dict[str, Iterable[str]], *, run: str | None = None,
                 heartbeat: float = HEARTBEAT_S):
        self._dir, self._heartbeat = Path(base) / LEASES, heartbeat
        self._text: str | None = json.dumps(
            {"pid": os.getpid(), "writer": writer_tag(), "run": run,
             "keys": {kind: sorted(set(ks)) for kind, ks in keys.items()}}, sort_keys=True)
        self.path: Path | None = None

    def __enter__(self) -> Path:
        self._dir.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(self._dir / "lease.json")
        tmp.write_text(self._text)
        self._text = None
        path = self._dir / f"{writer_tag()}.{tmp.name.rsplit('.', 2)[1]}.json"  # mkstemp's part
        os.replace(tmp, path)
        self.path = path
        _HEARTBEAT.add(path, self._heartbeat)
        return path

    def __exit__(self, *exc) -> None:
        _HEARTBEAT.remove(self.path)
        self.path.unlink(missing_ok=True)


def _leases(base: Path) -> list[Path]:
    d = Path(base) / LEASES
    return sorted(d.glob("*.json")) if d.is_dir() else []


def _live(p: Path, now: float) -> bool:
    try:
        fresh = now - p.stat().st_mtime < TTL_S
    except OSError:
        return False
    return fresh and writer_alive(p.name.split(".", 1)[0])


def _read(p: Path) -> tuple[str | None, dict[str, set[str]]]:
    """A lease's run and keys, parsed once (its content never changes; the heartbeat renews
    only its mtime)."""
    st = p.stat()
    ino, size, got = _parsed.get(p, (None, None, None))
    if (ino, size) != (st.st_ino, st.st_size):
        doc = json.loads(p.read_text())
        got = (doc.get("run"), {k: set(v) for k, v in doc["keys"].items()})
        _parsed[p] = (st.st_ino, st.st_size, got)
    return got


def held(base: Path, *, mine: Path | None = None) -> dict[str, set[str]]:
    """kind -> the store keys every live lease under `base` holds, but `mine`'s and those of
    `mine`'s run."""
    out: dict[str, set[str]] = {}
    now = time.time()
    own = None
    if mine is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            own = _read(mine)[0]
    for p in _leases(base):
        if p == mine or not _live(p, now):
            continue
        try:
            run, keys = _read(p)
        except (OSError, ValueError, KeyError):
            continue  # removed meanwhile, or not a lease: it holds nothing
        if own is not None and run == own:
            continue
        for kind, ks in keys.items():
            out.setdefault(kind, set()).update(ks)
    return out


def dead(base: Path) -> list[Path]:
    """The leases whose holders are gone (heartbeat past TTL_S, or this host's pid not
    running): leftovers for gc."""
    now = time.time()
    return [p for p in _leases(base) if not _live(p, now)]
