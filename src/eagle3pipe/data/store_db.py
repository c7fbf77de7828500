"""The per-sample store's `dataset` entries (each regenerated reply: a line of JSON, a few
hundred bytes) as rows of one SQLite database, `<store root>/dataset.sqlite` (Python's sqlite3).

Why not a file per reply, as the `hidden` kind keeps one per sample: a file's creation costs
0.02 to 1 ms of system time on some virtual disks (an ext4 one on a 2-core AMD EPYC machine,
varying by directory and minute), as long as generating a short reply on a small verifier, and
the dataset stage stores thousands of replies a minute beside a running engine. A row costs
~10 us, and one transaction holds every reply an engine step finished (Table.put_many).

The database: WAL journal (readers never wait for the writer; processes of one host share it),
synchronous NORMAL (a commit survives a crash of the process; a crash of the machine may undo
the last commits, never corrupt the file: https://www.sqlite.org/wal.html#durability), a busy
timeout for another process's write, incremental auto-vacuum (pages a gc frees go back to the
filesystem). WAL shares memory between the processes that use it, so every process using one
store's dataset database must run on one host (https://www.sqlite.org/wal.html, "all
processes using a database must be on the same host computer"): the dataset stage runs on
one; the hidden kind's files may be shared across nodes.
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from eagle3pipe.errors import Error

FILE = "dataset.sqlite"
BUSY_TIMEOUT_S = 600.0  # another process's transaction (a gc's delete) holds the write lock
SCHEMA = ("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, entry BLOB NOT NULL, "
          "bytes INTEGER NOT NULL, mtime REAL NOT NULL)")


class StoreDBError(Error, OSError):
    """The dataset store's database cannot be opened, read or written."""


class Table:
    """The dataset kind's entries under the store root `base`: has, get_json, put_many; rows
    for gc. The database is created at the first write; reading a store without one finds
    nothing. For use as a context manager (closes the connection)."""

    def __init__(self, base: Path):
        self.path = Path(base) / FILE
        self._db: sqlite3.Connection | None = None

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _conn(self, create: bool) -> sqlite3.Connection | None:
        if self._db is None:
            if not create and not self.path.is_file():
                return None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
                db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # before the first table only
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute(SCHEMA)
            except sqlite3.Error as e:
                raise self._error(e) from None
            self._db = db
        return self._db

    def _error(self, e: sqlite3.Error) -> StoreDBError:
        return StoreDBError(f"{self.path}: the dataset store's database: {e}",
                            fix="if another process holds it, let it finish; if the file is "
                                "damaged, remove it and its -wal and -shm files (it holds only "
                                "replies a rerun regenerates)")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        db = self._conn(create=False)
        if db is None:
            return []
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise self._error(e) from None

    def has(self, k: str) -> bool:
        return bool(self._query("SELECT 1 FROM entries WHERE key = ?", (k,)))

    def get_json(self, k: str) -> Any:
        row = self._query("SELECT entry FROM entries WHERE key = ?", (k,))
        if not row:
            raise KeyError(f"{self.path}: no entry {k}")
        return json.loads(row[0][0])

    def put_many(self, entries: Iterable[tuple[str, bytes]]) -> None:
        """Every (key, entry bytes) in one transaction: all are in the store when it returns,
        or none. An entry already there is kept (an entry's key determines its bytes)."""
        now = time.time()
        rows = [(k, e, len(e), now) for k, e in entries]
        db = self._conn(create=True)
        try:
            with db:  # BEGIN ... COMMIT, ROLLBACK on an exception
                db.execute("BEGIN IMMEDIATE")
                db.executemany("INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?)", rows)
        except sqlite3.Error as e:
            raise self._error(e) from None

    def rows(self) -> Iterator[tuple[float, str, int]]:
        """(mtime, key, bytes) of every entry, oldest first."""
        yield from self._query("SELECT mtime, key, bytes FROM entries ORDER BY mtime, key")

    def disk_bytes(self) -> int:
        """The database's files' sizes, read without opening it (from any host)."""
        return sum(f.stat().st_size for f in (self.path, self.path.with_name(FILE + "-wal"))
                   if f.is_file())

    def usage(self) -> tuple[int, int]:
        """(entries, bytes of their JSON)."""
        row = self._query("SELECT count(*), coalesce(sum(bytes), 0) FROM entries")
        return (row[0][0], row[0][1]) if row else (0, 0)

    def remove(self, keys: list[str]) -> None:
        """Deletes the entries in one transaction and gives the freed pages back."""
        db = self._conn(create=False)
        if db is None or not keys:
            return
        try:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])
            db.execute("PRAGMA incremental_vacuum")
        except sqlite3.Error as e:
            raise self._error(e) from None
