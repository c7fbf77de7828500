"""The fault tests' hook, loaded by every Python process of a run whose PYTHONPATH holds this
folder (helpers.pipeline.fault_hold): with EAGLE3PIPE_FAULT_HOLD=<an output's path>, the writer
of that output creates the file EAGLE3PIPE_FAULT_HELD names and waits before publishing it,
everything written and nothing renamed into place, to be killed (tests/test_faults.py). It joins
eagle3pipe.runtime.atomic.BEFORE_PUBLISH; nothing in src/ knows of it."""
import os
import time
from pathlib import Path

HOLD, HELD = os.environ.get("EAGLE3PIPE_FAULT_HOLD"), os.environ.get("EAGLE3PIPE_FAULT_HELD")


def _hold(path: Path) -> None:
    if Path(HOLD).resolve() != path.resolve():
        return
    if HELD:
        Path(HELD).write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError(f"{path}: held for 600 s and nothing killed the writer")


if HOLD:
    try:
        from eagle3pipe.runtime import atomic
    except ImportError:  # a process that cannot import eagle3pipe writes no output
        pass
    else:
        atomic.BEFORE_PUBLISH.append(_hold)
