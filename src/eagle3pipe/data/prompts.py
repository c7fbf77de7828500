"""The smoke stage's evaluation prompts: the held-out stdlib snippets (`smoke.prompts: null`, one
domain "stdlib"), or a JSONL of chat prompts under prompts/ (the directory is a DVC dep of the
stage), one per line: {"messages": [{"role", "content"}, ...], "domain": "..."} (domain
optional: "default"); the last turn is the user turn the verifier answers. Lines are read by the
project's one JSON-line parser and its turn checks (eagle3pipe.data.samples), so a bad line is an
error naming file:line, the params key and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eagle3pipe.data import samples
from eagle3pipe.errors import Error

PROMPTS_DIR = "prompts"  # a dep of the smoke stage in dvc.yaml: smoke.prompts must lie in it
STDLIB_DOMAIN = "stdlib"  # the held-out stdlib prompts (smoke.prompts: null)
STDLIB_SOURCE = "stdlib:heldout"
DEFAULT_DOMAIN = "default"  # a JSONL prompt without "domain"
PROMPT_LINE = '{"messages": [{"role": "user", "content": "..."}], "domain": "..."}'


class PromptsError(Error, ValueError):
    """smoke.prompts names no usable prompt file, or a line of it is not a chat prompt."""


def _default_where(key: str) -> str:
    return "params.yaml"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # chat-templated prompt token ids
    domain: str
    source: str  # where it came from, for messages: "prompts/x.jsonl:7", "stdlib held-out #3"


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Messages formatted with the verifier's chat template (add_generation_prompt=True) and
    tokenized once, so vLLM adds no second BOS."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def build_prompts(tok, num_prompts: int, seed: int) -> list[list[int]]:
    """Held-out corpus snippets as user turns, tokenized with the chat template."""
    from eagle3pipe.verifier import corpus

    try:
        texts = corpus.snippets("heldout", num_prompts, seed=seed)
    except RuntimeError as e:
        raise PromptsError(f"smoke.num_prompts: {e}") from None
    return [chat_ids(tok, [{"role": "user", "content": text}]) for text in texts]


def prompts_path(value: str, where: Callable[[str], str] = _default_where) -> Path:
    """smoke.prompts as a path inside prompts/ (the stage's DVC dep, so that editing the file
    reruns the stage); any other place is refused."""
    fix = (f"put the file under {PROMPTS_DIR}/ (a dep of the smoke stage in dvc.yaml: DVC "
           f"reruns the stage when it changes) and set smoke.prompts: {PROMPTS_DIR}/<name>.jsonl")
    rel = os.path.normpath(value)
    parts = Path(rel).parts
    if os.path.isabs(value) or len(parts) < 2 or parts[0] != PROMPTS_DIR:
        raise PromptsError(f"{where('smoke.prompts')}: smoke.prompts: {value} is not inside "
                         f"{PROMPTS_DIR}/, so DVC would not rerun the smoke stage when it "
                         "changes", fix=fix)
    path = Path(rel)
    if not path.is_file():
        state = "is not a file" if path.exists() else "not found"
        raise PromptsError(f"{where('smoke.prompts')}: smoke.prompts: {path} {state} (relative "
                         "to the project root)", fix=fix)
    return path


def _prompt_problem(row: Any) -> tuple[str, str] | None:
    """(what is wrong, the fix) with one parsed prompt line, or None."""
    json_type, message_problem = samples.json_type, samples.message_problem
    if not isinstance(row, dict):
        return f"the line is a JSON {json_type(row)}, not an object", f"write {PROMPT_LINE}"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "no \"messages\"" if "messages" not in row else \
            f"\"messages\" is a JSON {json_type(messages)}" if not isinstance(messages, list) \
            else "\"messages\" is empty"
        return f"{got}; a prompt needs a non-empty list of turns", f"write {PROMPT_LINE}"
    for j, m in enumerate(messages):
        problem = message_problem(j, m)
        if problem:
            return problem, ('make every message an object with a "role" (system, user or '
                             'assistant) and a string "content"')
    if messages[-1]["role"] != "user":
        return (f"the last turn is {messages[-1]['role']!r}; the verifier answers the last "
                "turn, which must be the user's", "end the conversation with a user turn")
    domain = row.get("domain", DEFAULT_DOMAIN)
    if not isinstance(domain, str) or not domain.strip():
        return (f"\"domain\" is {str(domain)[:40]!r}, not a non-empty string",
                "name the domain with a string, or leave \"domain\" out")
    return None


def read_prompts(path: Path, tok, limit: int, where: Callable[[str], str] = _default_where
                 ) -> list[Prompt]:
    """The first `limit` prompts of a JSONL of chat prompts; a bad line is an error naming
    file:line, the fix and the params key. The JSON of each line is read by the project's one
    JSON-line parser (samples.parse_line) and its turns by samples.message_problem."""
    key = f"smoke.prompts at {where('smoke.prompts')}"
    out: list[Prompt] = []
    try:
        fh = path.open("rb")
    except OSError as e:
        raise PromptsError(f"{path}: cannot read it ({e.strerror}); {key}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            if len(out) >= limit:
                break
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            if not raw.strip():
                continue
            row, err = samples.parse_line(raw)
            problem = (err, "make the line one complete JSON object: " + PROMPT_LINE) if err \
                else _prompt_problem(row)
            if problem:
                raise PromptsError(f"{path}:{lineno}: {problem[0]} ({key})", fix=problem[1])
            messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
            out.append(Prompt(chat_ids(tok, messages), row.get("domain", DEFAULT_DOMAIN),
                              f"{path}:{lineno}"))
    if not out:
        raise PromptsError(f"{path}: no prompt in it (empty, or only blank lines; {key})",
                         fix=f"one prompt per line: {PROMPT_LINE}")
    return out


def load(s, tok, where: Callable[[str], str] = _default_where) -> tuple[list[Prompt], str]:
    """The prompts of the params' `smoke` section and where they came from."""
    if s.prompts is None:
        return [Prompt(ids, STDLIB_DOMAIN, f"stdlib held-out prompt {i}")
                for i, ids in enumerate(build_prompts(tok, s.num_prompts, s.seed))], \
            STDLIB_SOURCE
    path = prompts_path(s.prompts, where)
    return read_prompts(path, tok, s.num_prompts, where), str(path)
