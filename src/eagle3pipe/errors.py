"""The one way a problem is reported: a located Problem (file, line, key or tensor, message,
fix), raised as an Error alone or as a list, and the exit codes every stage and CLI command use.

Every module's error class (ParamsError, VerifierError, ExtractError, ...) derives from `Error`,
so the stage runner (eagle3pipe.stages.runner) and the CLI (eagle3pipe.tools.cli) catch exactly
one type, print its message (which names the file, line or key, and ends with the fix) and exit
with EXIT_INPUT. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# the exit codes of every stage and every CLI command (docs/check.md)
EXIT_OK = 0
EXIT_FOUND = 1  # a check ran and found differences (check, deps, the drift scan)
EXIT_INPUT = 2  # an input the user must fix: an Error


@dataclass(frozen=True)
class Problem:
    """What is wrong, where: `file` (and `line`), `key` (a params or config key, or a tensor
    name; may be empty), the message, and the fix."""

    file: str
    line: int | None
    key: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        text = f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"
        return text + (f"\n    fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class ParamsAt:
    """Where a run's params are written: the params file and the line of each dotted key
    (a stage's view gives its own: StageView.params_at). Makes the Problem for a key, and names
    a key's place in a message that is about another file."""

    file: str = "params.yaml"
    lines: Mapping[str, int | None] = field(default_factory=dict)

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.file}:{line}" if line else self.file

    def problem(self, key: str, message: str, fix: str = "") -> Problem:
        return Problem(self.file, self.lines.get(key), key, message, fix)


class Error(Exception):
    """A failure the user can fix: a message that names what is wrong and where, with the fix
    appended as '    fix: ...'; or `problems`, each a located Problem, reported together."""

    def __init__(self, message: str = "", fix: str = "", *,
                 problems: list[Problem] | tuple[Problem, ...] = ()):
        self.problems = list(problems)
        if self.problems:
            head = [message or f"{len(self.problems)} problems:"] if (
                message or len(self.problems) > 1) else []
            message = "\n".join(head + [str(p) for p in self.problems])
        super().__init__(message + (f"\n    fix: {fix}" if fix else ""))
