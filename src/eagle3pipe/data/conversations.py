"""A user's conversation source read into one form: each row of a JSON Lines (.jsonl, .json),
Parquet or Arrow file, in the declared dataset.format (never guessed), becomes a Conversation of
OpenAI chat messages, or is bad input: counted by reason and skipped (dataset.on_bad_input:
skip), or refused naming file:line, the params key and the fix (error).

Formats, and the upstream forms they mirror:
- messages: OpenAI chat's {"messages": [{"role", "content", "tool_calls"?, "tool_call_id"?,
  "name"?}], "tools"?}; text parts are joined and empty tool_calls dropped as vLLM does
  (vllm/renderers/chat_utils.py: _parse_chat_message_content_parts, _postprocess_messages).
- sharegpt: {"conversations": [{"from", "value", ...}], "tools"?}, `from` mapped as speculators
  0.9 maps it (speculators/data_generation/preprocessing.py: _normalize_conversation), except
  that an unknown `from` is bad input rather than an assistant turn.
- mtbench: FastChat's MT-Bench question.jsonl {"question_id", "category", "turns"}: user turns.
JSON lines are read by the project's one JSON-line parser (samples.parse_line); Parquet and
Arrow files are streamed by Hugging Face datasets, never loaded whole.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eagle3pipe.data.samples import json_type, parse_line
from eagle3pipe.errors import Error, ParamsAt, Problem

FORMATS = ("messages", "sharegpt", "mtbench")
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
ROLES = ("system", "user", "assistant", "tool")
# speculators 0.9, data_generation/preprocessing.py (_normalize_conversation): ShareGPT's from
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
# vLLM's content parts that carry a "text" (vllm/renderers/chat_utils.py: MM_PARSER_MAP)
TEXT_PARTS = ("text", "input_text", "output_text")
_KEY = {"messages": "messages", "sharegpt": "conversations", "mtbench": "turns"}
ROWS = {"messages": '{"messages": [{"role": "user", "content": "..."}, ...]}',
        "sharegpt": '{"conversations": [{"from": "human", "value": "..."}, ...]}',
        "mtbench": '{"question_id": 1, "category": "...", "turns": ["...", ...]}'}
EXAMPLES = 3  # the skipped rows a report names per reason

# Why a row is bad input; a report counts every reason, zeros included.
REASONS = ("malformed_json", "wrong_format", "empty_conversation", "bad_message", "unknown_role",
           "bad_content", "bad_content_part", "bad_tool_call", "bad_tools",
           "orphan_tool_result", "bad_turn_order", "no_user_turn")
_FIX = {
    "malformed_json": "make the line one complete JSON object",
    "empty_conversation": "remove the row or give it a user turn",
    "bad_message": 'make every turn an object with a "role" ("from" in sharegpt)',
    "unknown_role": "use the roles system, user, assistant, tool (from: system, human, gpt, tool)",
    "bad_content": 'make the content a string or a list of {"type": "text", "text": "..."} parts',
    "bad_content_part": "keep only non-empty text parts: the draft trains on text",
    "bad_tool_call": 'write each call as {"id": "...", "type": "function", "function": {"name": '
                     '"...", "arguments": "{...}"}}',
    "bad_tools": 'give "tools" as a list of OpenAI tool objects {"type": "function", ...}',
    "orphan_tool_result": "put each tool result after the assistant tool_calls it answers, "
                          "with that call's id as its tool_call_id",
    "bad_turn_order": "start with an optional system message, then a user turn",
    "no_user_turn": "add a user turn"}

log = logging.getLogger(__name__)


class ConversationsError(Error, ValueError):
    """A conversation source (dataset.source, dataset.format) is missing or unusable."""


class BadInputError(ConversationsError):
    """One bad row: its `source` (file:line, file:row n), `reason` (of REASONS), `detail`."""

    def __init__(self, source: str, reason: str, detail: str, key: str, fix: str):
        self.source, self.reason, self.detail = source, reason, detail
        super().__init__(problems=[Problem(source, None, key, detail, fix)])


class RowError(Exception):
    """A bad row, found while normalising it: reason, what is wrong, the fix."""

    def __init__(self, reason: str, detail: str, fix: str = ""):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix or _FIX[reason]


@dataclass(frozen=True)
class Conversation:
    """One row as OpenAI chat messages ({"role", "content": str} plus, where the row has them,
    "tool_calls", "tool_call_id", "name"). `source` is "<file>:<line>" (from 1) for JSON Lines,
    "<file>:row <n>" (from 0, as datasets and pandas index rows) for Parquet and Arrow."""

    source: str
    messages: tuple[dict, ...]
    tools: tuple | None = None  # the row's OpenAI "tools" schema list
    category: str | None = None  # MT-Bench's "category", else the row's "domain"

    @property
    def user_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)


@dataclass
class ReadReport:
    """Rows read, kept, skipped by reason (every reason) and the first few skipped per reason
    as "file:line: what"."""

    source: str
    format: str
    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, err: BadInputError) -> None:
        self.skipped[err.reason] += 1
        shown = self.examples.setdefault(err.reason, [])
        if len(shown) < EXAMPLES:
            shown.append(f"{err.source}: {err.detail}")
            log.warning("skipping %s: %s (%s)", err.source, err.detail, err.reason)


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:80]


def _content(where: str, value: Any, optional: bool) -> str:
    """A message's content as one string; `optional` (an assistant turn with tool_calls):
    missing, null or [] is ""."""
    if value is None or value == []:
        if optional:
            return ""
        raise RowError("bad_content", f"{where} is missing, null or []; only an assistant turn "
                                  "with tool_calls may have no content")
    if isinstance(value, list):  # text parts joined with "\n" as vLLM joins them for a
        # chat template (vllm/renderers/chat_utils.py: _parse_chat_message_content_parts)
        value = "\n".join(_part_text(f"{where}[{i}]", p) for i, p in enumerate(value))
    if not isinstance(value, str):
        raise RowError("bad_content", f"{where} is {_show(value)}, not a string or text parts")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's "\udc80" escapes decode to lone surrogates
        raise RowError("bad_content", f"{where} is not valid Unicode (a lone surrogate "
                                  f"{value[e.start]!r} at character {e.start})") from None
    return value


def _part_text(where: str, part: Any) -> str:
    text = part if isinstance(part, str) else (  # vLLM takes a bare string part as text
        part.get("text") if isinstance(part, dict) and part.get("type") in TEXT_PARTS else None)
    if not isinstance(text, str):
        raise RowError("bad_content_part", f"{where} is {_show(part)}, not a text part")
    if not text:
        raise RowError("bad_content_part", f"{where} is an empty text part")
    return text


def _tool_calls(where: str, value: Any) -> list[dict] | None:
    """OpenAI function calls, arguments as given (a JSON string or an object); none: None."""
    if value is not None and not isinstance(value, list):
        raise RowError("bad_tool_call", f"{where} is {_show(value)}, not a list of calls")
    calls = []
    for i, c in enumerate(value or ()):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and c.get("type") in (None, "function")
                and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("arguments"), (str, dict))
                and isinstance(c.get("id"), (str, type(None)))):
            raise RowError("bad_tool_call", f"{where}[{i}] is {_show(c)}, not a function call")
        calls.append(({"id": c["id"]} if c.get("id") else {}) | {
            "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return calls or None  # vLLM drops an empty tool_calls (_postprocess_messages)


def _message(fmt: str, j: int, m: Any) -> dict:
    """messages[j] (conversations[j] in sharegpt) as an OpenAI chat message."""
    at = f"{_KEY[fmt]}[{j}]"
    role_key, text_key = ("role", "content") if fmt == "messages" else ("from", "value")
    if not isinstance(m, dict) or m.get(role_key) is None:
        raise RowError("bad_message", f'{at} is {_show(m)}, not an object with a "{role_key}"')
    raw = m[role_key]
    role = raw if fmt == "messages" else SHAREGPT_ROLES.get(raw) if isinstance(raw, str) else None
    if role not in ROLES:
        known = ROLES if fmt == "messages" else tuple(SHAREGPT_ROLES)
        raise RowError("unknown_role", f"{at}.{role_key} is {_show(raw)}, not one of "
                                   f"{', '.join(known)}")
    calls = _tool_calls(f"{at}.tool_calls", m.get("tool_calls"))
    if calls and role != "assistant":
        raise RowError("bad_tool_call", f"{at} is a {role} turn with tool_calls")
    out = {"role": role, "content": _content(f"{at}.{text_key}", m.get(text_key), bool(calls))}
    out |= {"tool_calls": calls} if calls else {}
    for key in ("tool_call_id", "name") if role == "tool" else ("name",):  # as vLLM keeps them
        if m.get(key) is not None and not (isinstance(m[key], str) and m[key]):
            raise RowError("bad_message", f"{at}.{key} is {_show(m[key])}, not a non-empty string")
        out |= {key: m[key]} if m.get(key) is not None else {}
    return out


def _check_order(messages: list[dict], key: str) -> None:
    """The turn order chat templates take: an optional system message first, then a user turn;
    each tool result after an assistant turn's tool_calls (one of their ids, where given)."""
    if all(m["role"] != "user" for m in messages):
        raise RowError("no_user_turn", f'"{key}" has no user turn')
    first_user = next(j for j, m in enumerate(messages) if m["role"] == "user")
    calls: list[str] | None = None  # the ids of the open tool calls; None: none open
    for j, m in enumerate(messages):
        role, at = m["role"], f"{key}[{j}]"
        if role == "system" and j > 0:
            raise RowError("bad_turn_order", f"{at} is a system message after the first turn")
        if role in ("assistant", "tool") and j < first_user:
            raise RowError("bad_turn_order", f"{at} ({role}) comes before the first user turn")
        if role != "tool":
            calls = [c["id"] for c in m["tool_calls"] if "id" in c] if "tool_calls" in m \
                else None
        elif calls is None:
            raise RowError("orphan_tool_result", f"{at} is a tool result with no assistant "
                                             "tool_calls before it")
        elif calls and m.get("tool_call_id", calls[0]) not in calls:
            raise RowError("orphan_tool_result", f"{at}.tool_call_id {m['tool_call_id']!r} answers "
                                             f"none of the calls before it ({', '.join(calls)})")


def _not_format(row: Any, fmt: str) -> RowError:
    """Not the declared format: which format the row looks like, where its keys tell."""
    key, fix = _KEY[fmt], f"write each row as {ROWS[fmt]}"
    if not isinstance(row, dict):
        return RowError("wrong_format", f"the row is a JSON {json_type(row)}, not an object", fix)
    other = next((f for f, k in _KEY.items() if f != fmt and row.get(k) is not None), None)
    if other:
        return RowError("wrong_format", f'not {fmt} format (no "{key}" key; a "{_KEY[other]}" key: '
                                    f"set dataset.format: {other})", f"set dataset.format: {other}")
    return RowError("wrong_format", f'not {fmt} format (no "{key}" key; keys: '
                                f"{', '.join(sorted(map(str, row)))[:80]})", fix)


def _tools(value: Any) -> tuple | None:
    if isinstance(value, str):  # Parquet dumps often hold the schema list as a JSON string
        value, err = parse_line(value.encode("utf-8", "surrogatepass"))
        if err:
            raise RowError("bad_tools", f'"tools" is a string that is {err}')
    if value is not None and not (isinstance(value, list)
                                  and all(isinstance(t, dict) for t in value)):
        raise RowError("bad_tools", f'"tools" is {_show(value)}, not a list of tool objects')
    return tuple(value) if value else None


def parse_row(row: Any, fmt: str) -> tuple[list[dict], tuple | None, str | None]:
    """(messages, tools, category) of one parsed row in `fmt`, or RowError (the smoke stage's
    MT-Bench prompts are read by it too: eagle3pipe.data.prompts)."""
    key = _KEY[fmt]
    turns = row.get(key) if isinstance(row, dict) else None
    if turns is None:
        raise _not_format(row, fmt)
    if not isinstance(turns, list):
        raise RowError("wrong_format", f'"{key}" is a JSON {json_type(turns)}, not a list',
                   f"write each row as {ROWS[fmt]}")
    if not turns:
        raise RowError("empty_conversation", f'"{key}" is empty')
    if fmt == "mtbench":
        bad = next((j for j, t in enumerate(turns) if not isinstance(t, str)), None)
        if bad is not None:
            raise RowError("bad_content", f"turns[{bad}] is {_show(turns[bad])}, not a string")
        messages = [{"role": "user", "content": _content(f"turns[{j}]", t, False)}
                    for j, t in enumerate(turns)]
    else:
        messages = [_message(fmt, j, m) for j, m in enumerate(turns)]
    _check_order(messages, key)
    category = next((v for v in (row.get("category"), row.get("domain"))
                     if isinstance(v, str) and v), None)
    return messages, _tools(row.get("tools")), category


def _cut(messages: list[dict], max_turns: int | None) -> list[dict]:
    """The messages before the (max_turns + 1)-th user turn; None: all."""
    users = [j for j, m in enumerate(messages) if m["role"] == "user"]
    return messages if max_turns is None or len(users) <= max_turns \
        else messages[:users[max_turns]]


def _check_args(path: Path, fmt: str, on_bad_input: str, max_turns: int | None,
                at: ParamsAt) -> None:
    suffix = path.suffix.lower()
    where = (f"has no reader for the suffix {path.suffix or '(none)'!r}" if suffix not in SUFFIXES
             else "not found" if not path.exists() else "is not a file" if not path.is_file()
             else "")
    bad = [("dataset.format", fmt not in FORMATS, f"{fmt!r} is not a conversation format",
            f"set it to one of {', '.join(FORMATS)}"),
           ("dataset.on_bad_input", on_bad_input not in ("skip", "error"),
            f"{on_bad_input!r} is neither skip nor error", "set it to skip or error"),
           ("dataset.max_turns", max_turns is not None and (
               type(max_turns) is not int or max_turns < 1),
            f"{max_turns!r} is not a count of user turns >= 1", "set it to 1 or more, or null"),
           ("dataset.source", bool(where), f"{path} {where}",
            f"point it at a file of conversations: {', '.join(SUFFIXES)} (.jsonl and .json: "
            "one JSON object per line)")]
    problems = [at.problem(key, message, fix) for key, wrong, message, fix in bad if wrong]
    if problems:
        raise ConversationsError(problems=problems)


def _json_rows(path: Path, at: ParamsAt) -> Iterator[tuple[str, Any, str | None]]:
    """(file:line, parsed row, what is wrong with its JSON) of each non-blank line."""
    with path.open("rb") as fh:
        rows = 0
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            if not raw.strip():
                continue
            if rows == 0 and raw.lstrip().startswith(b"["):
                raise ConversationsError(problems=[at.problem(
                    "dataset.source", f"{path}:{lineno}: the file is one JSON array; rows are "
                    "read one JSON object per line", f"convert it to JSON Lines: jq -c '.[]' "
                    f"{path} > {path.with_suffix('.jsonl')}")])
            rows += 1
            row, err = parse_line(raw)
            yield f"{path}:{lineno}", row, err


def _table_rows(path: Path, at: ParamsAt) -> Iterator[tuple[str, Any, None]]:
    """(file:row n, row, None) of each row of a Parquet or Arrow file, streamed."""
    import datasets  # only Parquet and Arrow sources pay for its import
    import pyarrow as pa

    kind = path.suffix.lower()[1:]
    try:  # the caller's errors never reach this frame: only reading is caught here
        for n, row in enumerate(datasets.load_dataset(kind, data_files=str(path),
                                                      split="train", streaming=True)):
            yield f"{path}:row {n}", row, None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ConversationsError(problems=[at.problem(
            "dataset.source", f"{path}: cannot read it as {kind} ({str(e).splitlines()[0]})",
            f"write it again as {kind}, or as JSON Lines (.jsonl)")]) from None


class Reader:
    """An iterator over the conversations of one source; `report` counts rows as they are read.
    Its arguments are checked when it is made; a bad row raises BadInputError (on_bad_input:
    error) or is counted and skipped (skip); a source without rows is an error once read
    through. At most `limit` rows are read (None: all). `at` locates the params keys
    (StageView.params_at)."""

    def __init__(self, path: str | Path, fmt: str, *, on_bad_input: str,
                 max_turns: int | None = None, limit: int | None = None,
                 at: ParamsAt = ParamsAt()):
        self.path, self.fmt, self.at = Path(path), fmt, at
        _check_args(self.path, fmt, on_bad_input, max_turns, at)
        self.on_bad_input, self.max_turns, self.limit = on_bad_input, max_turns, limit
        self.report = ReadReport(str(self.path), fmt)
        self._conversations = self._read()

    def __iter__(self) -> Reader:
        return self

    def __next__(self) -> Conversation:
        return next(self._conversations)

    def _read(self) -> Iterator[Conversation]:
        rows = _json_rows if self.path.suffix.lower() in (".jsonl", ".json") else _table_rows
        for source, row, err in rows(self.path, self.at):
            if self.limit is not None and self.report.read >= self.limit:
                break
            self.report.read += 1
            try:
                if err:
                    raise RowError("malformed_json", err)
                messages, tools, category = parse_row(row, self.fmt)
            except RowError as bad:
                key = "dataset.format" if bad.reason == "wrong_format" else "dataset.source"
                error = BadInputError(source, bad.reason, bad.detail,
                                      f"{key} ({self.at.where(key)})", f"{bad.fix} (or set "
                                      "dataset.on_bad_input: skip to count and skip such rows)")
                if self.on_bad_input == "error":
                    raise error from None
                self.report.skip(error)
                continue
            self.report.kept += 1
            yield Conversation(source, tuple(_cut(messages, self.max_turns)), tools, category)
        if self.report.read == 0:
            raise ConversationsError(problems=[self.at.problem(
                "dataset.source", f"{self.path}: no conversation in it (empty, or only blank "
                "lines)", f"one conversation per row: {ROWS[self.fmt]}")])


def read(path: str | Path, fmt: str, *, on_bad_input: str, max_turns: int | None = None,
         limit: int | None = None, at: ParamsAt = ParamsAt()) -> Reader:
    """The conversations of the first `limit` rows (None: all) of `path` in `fmt` (one of
    FORMATS), each cut before its (max_turns + 1)-th user turn: a Reader, whose `report` counts
    them as they are read."""
    return Reader(path, fmt, on_bad_input=on_bad_input, max_turns=max_turns, limit=limit, at=at)
