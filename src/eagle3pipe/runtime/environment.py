"""The environment variables eagle3pipe reads, every one of them here. Each is a setting of the
machine, never of what is computed (params.yaml holds those): where the per-sample store lives
and how large it may grow, how much memory the transformers oracle may take, a what-if free disk,
how long a trainer waits for a hidden-state server that went away;
or a record a run appends for whoever asks (the stage commands that executed, the params keys
each stage read). Each accessor parses its variable and names it, with the fix, when it is bad."""
from __future__ import annotations

import os
from pathlib import Path

from eagle3pipe.errors import Error
from eagle3pipe.runtime.units import parse_size

STORE = "EAGLE3PIPE_STORE"  # the per-sample store's root (eagle3pipe.data.store)
STORE_MAX_BYTES = "EAGLE3PIPE_STORE_MAX_BYTES"  # its size bound, a size such as 50G
ORACLE_MEMORY = "EAGLE3PIPE_ORACLE_MEMORY"  # the oracle's float32 weights at most, such as 64G
FREE_BYTES = "EAGLE3PIPE_FREE_BYTES"  # the free disk the estimates judge against (what-if)
SERVER_WAIT = "EAGLE3PIPE_SERVER_WAIT"  # seconds a trainer waits for an unreachable server
RUN_LOG = "EAGLE3PIPE_RUN_LOG"  # a file each stage run appends its name to
PARAMS_TRACE = "EAGLE3PIPE_PARAMS_TRACE"  # a file each stage appends the params keys it read to


def text(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def path(name: str) -> Path | None:
    value = text(name)
    return None if value is None else Path(value)


def size(name: str, *, unset: str, example: str = "50G", error: type[Error] = Error
         ) -> int | None:
    """The variable as a byte count (a size such as `example`, or plain bytes); None when
    unset. `unset` says what holds without it (for the fix); `error` is the class raised."""
    value = text(name)
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise error(f"${name}: {e}", fix=f"set it to a size such as {example}, or unset it "
                    f"for {unset}") from None


def seconds(name: str, *, default: float) -> float:
    """The variable as a number of seconds >= 0; `default` when unset."""
    value = text(name)
    if value is None:
        return default
    try:
        n = float(value)
    except ValueError:
        n = -1.0
    if not n >= 0 or n == float("inf"):
        raise Error(f"${name}: {value!r} is not a number of seconds",
                    fix=f"set it to seconds such as 600, or unset it for {default:.0f}")
    return n


def append_line(name: str, line: str) -> None:
    """Appends `line` to the file the variable names, if it is set (a run's record)."""
    target = path(name)
    if target is not None:
        with open(target, "a") as fh:
            fh.write(line + "\n")
