"""Chat prompts for the verifier. The smoke stage's evaluation prompts: the held-out stdlib
snippets (`smoke.prompts: null`, one domain "stdlib"), or a JSONL of chat prompts under prompts/
(the directory is a DVC dep of the stage), one per line, in `smoke.prompts_format`: messages,
{"messages": [{"role", "content"}, ...], "domain": "..."} (domain optional: "default"), whose
last turn is the user turn the verifier answers; or mtbench, FastChat's MT-Bench
question.jsonl {"question_id", "category", "turns"}, whose first turn is the prompt and whose
category is its domain (a later turn would answer the verifier's own first reply). Lines are
read by the project's one JSON-line parser and its turn checks (eagle3pipe.data.samples; an
MT-Bench row by eagle3pipe.data.conversations.parse_row), so a bad line is an error naming
file:line, the params key and the fix. The dataset stage's stdlib prompts (`dataset.source: null`), the chat templating and
prompt fitting both dataset sources share, and path_inside: the one check that a params path
lies in the folder its stage depends on (prompts/ for smoke.prompts, conversations/ for
dataset.source). A conversation source is read by eagle3pipe.data.conversations.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle3pipe.data import conversations, samples
from eagle3pipe.errors import Error, ParamsAt
from eagle3pipe.verifier import corpus

PROMPTS_DIR = "prompts"  # a dep of the smoke stage in dvc.yaml: smoke.prompts must lie in it
STDLIB_DOMAIN = "stdlib"  # the held-out stdlib prompts (smoke.prompts: null)
STDLIB_SOURCE = "stdlib:heldout"
DEFAULT_DOMAIN = "default"  # a JSONL prompt without "domain"
PROMPT_LINE = '{"messages": [{"role": "user", "content": "..."}], "domain": "..."}'


class PromptsError(Error, ValueError):
    """A prompt source (dataset.source, smoke.prompts) is missing or unusable."""


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One chat prompt for the verifier (the dataset stage's and the smoke stage's)."""

    ids: list[int]  # chat-templated prompt token ids, ending with the generation prompt
    source: str  # what names it: a sample id ("stdlib-000003", "jsonl-0000007") or file:line
    messages: list[dict] = field(default_factory=list)  # the kept turns (last user turn cut)
    domain: str = DEFAULT_DOMAIN
    truncated: bool = False
    tools: list | None = None  # the OpenAI tools schema list the template rendered, if any


def snippets_of(part: str, section, n: int) -> list[str]:
    """n stdlib snippets of `part`, sized by a params section's snippet_lines and
    snippet_max_chars (dataset's or smoke's), drawn with its seed."""
    lo, hi = section.snippet_lines
    return corpus.snippets(part, n, seed=section.seed, min_lines=lo, max_lines=hi,
                           max_chars=section.snippet_max_chars)


def build_prompts(tok, s, template_kwargs: dict) -> list[list[int]]:
    """Held-out corpus snippets as user turns, tokenized with the chat template (`s`: the
    params' smoke section)."""
    try:
        texts = snippets_of("heldout", s, s.num_prompts)
    except RuntimeError as e:
        raise PromptsError(f"smoke.num_prompts: {e}") from None
    return [template_ids(tok, [{"role": "user", "content": text}], add_generation_prompt=True,
                         template_kwargs=template_kwargs) for text in texts]


def path_inside(value: str, folder: str, key: str, stage: str,
                at: ParamsAt = ParamsAt()) -> Path:
    """`value` (params `key`) as a relative path to a file inside `folder`, a DVC dep of `stage`
    in dvc.yaml, so that editing the file reruns the stage; any other place, or no file, is
    refused naming the key's line and the fix."""
    fix = (f"put the file under {folder}/ (a dep of the {stage} stage in dvc.yaml: DVC reruns "
           f"the stage when it changes) and set {key}: {folder}/<name>")
    rel = os.path.normpath(value)
    parts = Path(rel).parts
    if os.path.isabs(value) or len(parts) < 2 or parts[0] != folder:
        raise PromptsError(problems=[at.problem(
            key, f"{value} is not inside {folder}/, so DVC would not rerun the {stage} stage "
            "when it changes", fix)])
    path = Path(rel)
    if not path.is_file():
        state = "is not a file" if path.exists() else "not found"
        raise PromptsError(problems=[at.problem(
            key, f"{path} {state} (relative to the project root)", fix)])
    return path


def prompts_path(value: str, at: ParamsAt = ParamsAt()) -> Path:
    """smoke.prompts as a path inside prompts/ (path_inside)."""
    return path_inside(value, PROMPTS_DIR, "smoke.prompts", "smoke", at)


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


def _row_prompt(row: Any, fmt: str) -> tuple[list[dict], str] | tuple[str, str]:
    """(messages, domain) of one parsed prompt line in `fmt`, or (what is wrong, the fix)."""
    if fmt == "mtbench":
        try:
            messages, _, category = conversations.parse_row(row, "mtbench")
        except conversations.RowError as bad:
            return bad.detail, bad.fix
        return messages[:1], category or DEFAULT_DOMAIN
    problem = _prompt_problem(row)
    if problem:
        return problem
    return ([{"role": m["role"], "content": m["content"]} for m in row["messages"]],
            row.get("domain", DEFAULT_DOMAIN))


def read_prompts(path: Path, tok, limit: int, template_kwargs: dict,
                 at: ParamsAt = ParamsAt(), fmt: str = "messages") -> list[Prompt]:
    """The first `limit` prompts of a JSONL of chat prompts in `fmt` (smoke.prompts_format); a
    bad line is an error naming file:line, the fix and the params key. The JSON of each line is
    read by the project's one JSON-line parser (samples.parse_line), its turns by
    samples.message_problem or, for MT-Bench, conversations.parse_row."""
    key = f"smoke.prompts at {at.where('smoke.prompts')}"
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
            line = PROMPT_LINE if fmt == "messages" else conversations.ROWS[fmt]
            got = (err, "make the line one complete JSON object: " + line) if err \
                else _row_prompt(row, fmt)
            if isinstance(got[0], str):
                raise PromptsError(f"{path}:{lineno}: {got[0]} ({key}, smoke.prompts_format "
                                   f"{fmt})", fix=got[1])
            messages, domain = got
            out.append(Prompt(template_ids(tok, messages, add_generation_prompt=True,
                                           template_kwargs=template_kwargs),
                              f"{path}:{lineno}", domain=domain))
    if not out:
        raise PromptsError(f"{path}: no prompt in it (empty, or only blank lines; {key})",
                         fix=f"one prompt per line: {PROMPT_LINE}")
    return out


def load(s, tok, template_kwargs: dict, at: ParamsAt = ParamsAt()) -> tuple[list[Prompt], str]:
    """The prompts of the params' `smoke` section, rendered with dataset.chat_template_kwargs
    (`template_kwargs`), and where they came from."""
    if s.prompts is None:
        return [Prompt(ids, f"stdlib held-out prompt {i}", domain=STDLIB_DOMAIN)
                for i, ids in enumerate(build_prompts(tok, s, template_kwargs))], \
            STDLIB_SOURCE
    path = prompts_path(s.prompts, at)
    return read_prompts(path, tok, s.num_prompts, template_kwargs, at, s.prompts_format), \
        str(path)


# ---------------------------------------------------------------------------------------------
# Chat templating shared by the dataset and smoke stages


def template_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool,
                 template_kwargs: dict, tools: list | None = None) -> list[int]:
    """Messages (and the OpenAI `tools` schema list, when given) through the verifier's chat
    template with dataset.chat_template_kwargs (`template_kwargs`), tokenized by it
    (transformers tokenizes the rendered text without adding special tokens again: no second
    BOS)."""
    out = tokenizer.apply_chat_template(messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=True, **template_kwargs)
    return list(out["input_ids"])


def fit_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int, *,
               template_kwargs: dict,
               tools: list | None = None) -> tuple[list[dict], list[int], bool] | None:
    """Chat-templated prompt ids (with the generation prompt), the last user turn cut from its
    end until they fit max_prompt_tokens. None when even an empty last user turn is too long."""
    ids = template_ids(tokenizer, messages, add_generation_prompt=True,
                       template_kwargs=template_kwargs, tools=tools)
    if len(ids) <= max_prompt_tokens:
        return messages, ids, False
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    content_ids = tokenizer(messages[last]["content"], add_special_tokens=False)["input_ids"]
    keep = len(content_ids)
    while True:
        keep = max(0, min(keep - 1, keep - (len(ids) - max_prompt_tokens)))
        cut = [dict(m) for m in messages]
        cut[last]["content"] = tokenizer.decode(content_ids[:keep], skip_special_tokens=False)
        ids = template_ids(tokenizer, cut, add_generation_prompt=True,
                           template_kwargs=template_kwargs, tools=tools)
        if len(ids) <= max_prompt_tokens:
            return cut, ids, True
        if keep == 0:
            return None


# ---------------------------------------------------------------------------------------------
# The dataset stage's stdlib prompts (dataset.source: null)


def stdlib_prompts(cfg: Any, tokenizer, *, progress: bool = True) -> list[Prompt]:
    """cfg.num_samples snippets of the corpus' "prompt" part, each one user turn fitted to
    dataset.max_prompt_tokens."""
    snippets = snippets_of("prompt", cfg, cfg.num_samples)
    prompts = []
    for i, text in enumerate(tqdm(snippets, desc="dataset: prompts", disable=not progress,
                                  mininterval=1.0)):
        fitted = fit_prompt(tokenizer, [{"role": "user", "content": text}],
                            cfg.max_prompt_tokens, template_kwargs=cfg.chat_template_kwargs)
        if fitted is None:
            raise PromptsError(
                f"params.yaml: dataset.max_prompt_tokens ({cfg.max_prompt_tokens}) is shorter "
                "than the chat template's own tokens", fix="raise dataset.max_prompt_tokens")
        messages, ids, truncated = fitted
        prompts.append(Prompt(ids, f"stdlib-{i:06d}", messages, truncated=truncated))
    return prompts
