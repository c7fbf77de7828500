"""The fault tests' hook, loaded by every Python process of a run whose PYTHONPATH holds this
folder (helpers.pipeline.fault_hold): with EAGLE3PIPE_FAULT_HOLD=<an output's path, or a glob
of paths>, the writer of that output creates the file EAGLE3PIPE_FAULT_HELD names and waits
before publishing it, everything written and nothing renamed into place, to be killed
(tests/test_faults.py), or until the file EAGLE3PIPE_FAULT_RELEASE names exists, when it
publishes and goes on (tests/test_online.py holds the trainer while it kills the server). It
joins eagle3pipe.runtime.atomic.BEFORE_PUBLISH; nothing in src/ knows of it."""
import fnmatch
import os
import time
from pathlib import Path

HOLD, HELD = os.environ.get("EAGLE3PIPE_FAULT_HOLD"), os.environ.get("EAGLE3PIPE_FAULT_HELD")
RELEASE = os.environ.get("EAGLE3PIPE_FAULT_RELEASE")


def _released() -> bool:
    return bool(RELEASE) and Path(RELEASE).exists()


def _hold(path: Path) -> None:
    if _released() or not fnmatch.fnmatchcase(str(path.resolve()), str(Path(HOLD).resolve())):
        return
    if HELD:
        Path(HELD).write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if _released():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{path}: held for 600 s and nothing killed or released the writer")


if HOLD:
    try:
        from eagle3pipe.runtime import atomic
    except ImportError:  # a process that cannot import eagle3pipe writes no output
        pass
    else:
        atomic.BEFORE_PUBLISH.append(_hold)
