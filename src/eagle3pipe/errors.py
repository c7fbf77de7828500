"""The one error type of the project: a failure the user can fix.

Every module's error class (ParamsError, VerifierError, ExtractError, ...) derives from `Error`,
so the stage runner (eagle3pipe.stages.runner) catches exactly one type, prints its message (which names
the file, line or key, and ends with the fix) and exits with EXIT_CODE. Anything else is a bug
and keeps its traceback.
"""
from __future__ import annotations

EXIT_CODE = 2


class Error(Exception):
    """message names what is wrong and where; fix, when given, is appended as '    fix: ...'."""

    def __init__(self, message: str = "", fix: str = ""):
        super().__init__(message + (f"\n    fix: {fix}" if fix else ""))
