"""The one JSON style of every generated file, written atomically, and the reader of generated
JSON whose errors name the file and line."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from eagle3pipe.runtime.atomic import write_text_atomic


def dumps(obj: Any) -> str:
    """The one JSON style every generated file uses: sorted keys, 2-space indent, newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_json(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, dumps(obj))


def read_json_object(path: str | Path, error: type[Exception], fix: str,
                     what: str = "file") -> dict:
    """A generated JSON object (what write_json wrote, usually another stage's output). Every
    failure raises `error` naming the file (and line) and ending with `fix`: missing or
    unreadable, not UTF-8, invalid or too deeply nested JSON, NaN/Infinity (Python's json
    reads them; they are not JSON and no config value may be non-finite), not an object."""
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
