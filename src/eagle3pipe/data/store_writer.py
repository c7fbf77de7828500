"""The per-sample store's JSON entries written by a process of their own (eagle3pipe.data.store
owns the entries; this module only moves their writes out of the stage's process).

The dataset stage stores each reply the moment the engine returns it. A file's creation is
system time, 0.1 to 1 ms on some virtual disks (an ext4 one on a 2-core AMD EPYC machine,
varying by directory and minute), as long as generating a short reply on a small verifier. A thread would not
take it off the engine's path: between its system calls it needs the interpreter lock, which
the engine's Python loop holds, so it waits up to the switch interval (5 ms) at every call and
the writes fall behind. A process writes beside the engine on another core.

`Writer` starts `python -m eagle3pipe.data.store_writer <store root> <kind>`: entries arrive on
its stdin as lines `<key> <entry>` (the entry's bytes, one line of JSON: data.store.json_entry),
each acknowledged on stdout as `<key>` once it is in place; a failed write is reported as
`! <errno>\t<path>\t<message>` and ends the process.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from eagle3pipe.data.store import Store, json_entry
from eagle3pipe.errors import Error

PIPE_BYTES = 1 << 20  # a burst of replies (a turn depth of dataset.batch_size) waits here


class Writer:
    """A store's JSON entries put by a child process, for use as a context manager around the
    puts. has and get_json see an entry from its put on; flush() and the block's end wait until
    every entry is in place and raise the first failed write (an OSError naming its file, as a
    write in this process would). At most a pipe's worth of entries waits (put_json blocks
    beyond); a crash loses the entries waiting."""

    def __init__(self, st: Store):
        self.store = st
        self._waiting: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(st.dir.parent), st.kind],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        with contextlib.suppress(OSError):  # Linux: room for a burst; elsewhere the default
            fcntl.fcntl(self._proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._reader = threading.Thread(target=self._read, name="store-writer-acks", daemon=True)
        self._reader.start()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        self._proc.wait()
        self._reader.join()
        if exc[0] is None:
            self._raise()

    def has(self, k: str) -> bool:
        return k in self._waiting or self.store.has(k)

    def get_json(self, k: str) -> Any:
        obj = self._waiting.get(k)  # removed only once the entry is in place
        return self.store.get_json(k) if obj is None else obj

    def put_json(self, k: str, obj: Any) -> None:
        self._raise()
        self._waiting[k] = obj
        try:
            self._proc.stdin.write(k.encode() + b" " + json_entry(obj))
        except BrokenPipeError:  # the writer ended: _read recorded why
            self._reader.join()
            self._raise()
            raise

    def flush(self) -> None:
        with self._done:
            self._done.wait_for(lambda: not self._waiting or self._error is not None)
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _read(self) -> None:
        """Acknowledgements (and the failure report) from the child, as they arrive."""
        rest = b""
        while chunk := os.read(self._proc.stdout.fileno(), 1 << 16):
            *lines, rest = (rest + chunk).split(b"\n")
            with self._done:
                for line in lines:
                    if line.startswith(b"! "):
                        no, path, msg = line[2:].decode().split("\t", 2)
                        self._error = OSError(int(no), msg, path or None) if int(no) else \
                            Error(f"{self.store.dir}: the store writer failed: {msg}")
                    else:
                        self._waiting.pop(line.decode(), None)
                self._done.notify_all()
        code = self._proc.wait()
        with self._done:
            if self._waiting and self._error is None:
                self._error = Error(f"{self.store.dir}: the store writer (pid {self._proc.pid}) "
                                    f"ended with exit code {code} before writing "
                                    f"{len(self._waiting)} entries", fix="rerun the stage")
            self._done.notify_all()


def main(root: str, kind: str) -> int:
    """The child: entries from stdin into Store(kind, root), each acknowledged on stdout, until
    stdin ends (the stage closed it, or died). Ctrl-C reaches the whole process group: the
    stage handles it, and this process writes what it was given."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    st, out = Store(kind, Path(root)), sys.stdout.buffer
    for line in sys.stdin.buffer:
        k, _, entry = line.partition(b" ")
        try:
            st.put(k.decode(), entry)
        except Exception as e:  # noqa: BLE001 - reported to the stage, which raises it
            no, path = ((e.errno or errno.EIO, e.filename or "") if isinstance(e, OSError)
                        else (0, ""))
            text = e.strerror if isinstance(e, OSError) and e.strerror else \
                f"{type(e).__name__}: {e}"
            out.write(f"! {no}\t{path}\t{text}".replace("\n", " ").encode() + b"\n")
            out.flush()
            return 1
        out.write(k + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
