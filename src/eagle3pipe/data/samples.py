"""The dataset stage's sample files (artifacts/dataset/{train,eval}.jsonl): one writer, one
checked reader, for every stage that reads them (vocab, extract, train's benchmarks).

One JSON object per line, keys sorted, compact: {"id", "input_ids", "loss_mask", "messages",
...}; input_ids are the verifier's token ids of the chat-formatted conversation, loss_mask is 1
on the assistant tokens the draft learns to predict.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle3pipe.errors import Error


class SamplesError(Error, ValueError):
    """A bad sample file: names file:line and the command that regenerates it."""


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


def line(sample: dict) -> str:
    """Canonical JSON of one sample."""
    return json.dumps(sample, sort_keys=True, separators=(",", ":")) + "\n"


def write_jsonl(path: Path, samples: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for s in samples:
            fh.write(line(s))


def parse_line(raw: bytes) -> tuple[Any, str | None]:
    """(value, None) of one JSONL line, or (None, what is wrong with it): not UTF-8, invalid
    JSON, nested too deeply, an integer longer than Python converts. The one JSON-line parser of
    both JSONL readers (this module's sample files, the dataset stage's conversations)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 ({e.reason}: byte 0x{raw[e.start]:02x} at byte {e.start + 1})"
    try:
        return json.loads(text.rstrip()), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON: {e.msg} at column {e.colno}"
    except RecursionError:
        return None, "not valid JSON: nested too deeply to read"
    except ValueError as e:  # int() refuses more digits than sys.get_int_max_str_digits()
        return None, f"not valid JSON: {str(e).split(':')[0]}"


def json_type(value: Any) -> str:
    """JSON's name of a parsed value's type (object, array, string, ...)."""
    names = {dict: "object", list: "array", str: "string", bool: "true/false", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


ROLES = ("system", "user", "assistant")  # the turns a conversation line may hold


def message_problem(j: int, m: Any) -> str | None:
    """What is wrong with messages[j] of a conversation (the dataset stage's JSONL input, a
    sample's "messages"), or None."""
    if not isinstance(m, dict):
        return f'messages[{j}] is {json.dumps(m)[:80]}, not an object {{"role", "content"}}'
    for key in ("role", "content"):
        if key not in m:
            return f'messages[{j}] has no "{key}": {json.dumps(m)[:80]}'
        if not isinstance(m[key], str):
            return f"messages[{j}].{key} is {json.dumps(m[key])[:60]}, not a string"
        try:
            m[key].encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\udc80" escapes decode to lone surrogates
            return (f"messages[{j}].{key} is not valid Unicode (a lone surrogate "
                    f"{m[key][e.start]!r} at character {e.start})")
    if m["role"] not in ROLES:
        return f"messages[{j}].role is {m['role']!r}, not one of {', '.join(ROLES)}"
    return None


def read(path: str | os.PathLike, vocab_size: int, max_positions: int | None = None, *,
         progress: bool = False, desc: str = "read") -> list[Sample]:
    """One dataset JSONL ({"id", "input_ids", "loss_mask", ...} per line), every line checked
    against the verifier's vocabulary (and max positions, when given); a bad line is an error
    naming file:line and `dvc repro dataset`."""
    path = Path(path)
    fix = "regenerate it with `dvc repro dataset`"
    if not path.is_file():
        raise SamplesError(f"{path}: dataset split not found", fix)
    samples: list[Sample] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(tqdm(fh, desc=desc, disable=not progress,
                                          mininterval=1.0), 1):
            if not raw.strip():
                continue
            row, err = parse_line(raw)
            problem = (f"invalid JSON line ({err})", fix) if err else \
                _row_problem(row, vocab_size, max_positions, fix)
            if problem:
                raise SamplesError(f"{path}:{lineno}: {problem[0]}", problem[1])
            samples.append(Sample(row["id"], tuple(row["input_ids"]), tuple(row["loss_mask"])))
    return samples


def _row_problem(row: Any, vocab_size: int, max_positions: int | None, fix: str
                 ) -> tuple[str, str] | None:
    """(what is wrong, the fix) with one parsed sample line, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got a JSON {json_type(row)}", fix
    missing = [k for k in ("id", "input_ids", "loss_mask") if k not in row]
    if missing:
        return f"missing key(s) {missing}", fix
    ids, mask = row["input_ids"], row["loss_mask"]
    if not isinstance(row["id"], str) or not row["id"]:
        return f"id must be a non-empty string, got {json.dumps(row['id'])[:40]}", fix
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        return "input_ids must be a non-empty list of integers", fix
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return (f"token id {bad[0]} outside the verifier vocabulary [0, {vocab_size}); the "
                "dataset was tokenized for another verifier", fix)
    if not isinstance(mask, list) or len(mask) != len(ids) or any(
            m not in (0, 1) or isinstance(m, bool) for m in mask):
        return f"loss_mask must be a list of 0/1 with one entry per input id ({len(ids)})", fix
    if max_positions is not None and len(ids) > max_positions:
        return (f"{len(ids)} tokens exceed the verifier's max_position_embeddings="
                f"{max_positions}", "lower dataset.max_seq_len in params.yaml")
    return None
