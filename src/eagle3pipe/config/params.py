"""params.yaml: a loader whose errors name file, line and key, and the checks that need several
keys. The schema is eagle3pipe.config.schema; the per-stage view that lets a stage read only
the keys dvc.yaml declares is eagle3pipe.config.view.for_stage.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from eagle3pipe.config.schema import Params
from eagle3pipe.config.cross_check import cross_check
from eagle3pipe.errors import Error, Problem


class ParamsError(Error, ValueError):
    def __init__(self, problems: list[Problem]):
        super().__init__(f"{len(problems)} problem(s) in params:" if len(problems) > 1 else "",
                         problems=problems)


# ---------------------------------------------------------------------------------------------
# Loading and validation


def _line_of(node: Any, key: Any) -> int | None:
    try:
        if isinstance(key, int):
            return node.lc.item(key)[0] + 1
        return node.lc.key(key)[0] + 1
    except Exception:
        try:
            return node.lc.line + 1
        except Exception:
            return None


def _check_scalar(value: Any, tp: Any, meta: dict) -> tuple[Any, str | None, str]:
    """Returns (converted value, error message or None, fix)."""
    if tp is bool:
        if not isinstance(value, bool):
            return value, f"expected true or false, got {value!r}", "write true or false"
        return value, None, ""
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return value, f"expected an integer, got {value!r}", "write a whole number"
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = " (YAML reads 1e-5 without a dot as a string; write 1.0e-05)" \
                if isinstance(value, str) else ""
            return value, f"expected a number, got {value!r}{hint}", "write a number"
        value = float(value)
        if not math.isfinite(value):
            return value, f"must be a finite number, got {value}", "write a finite number"
    elif tp is str:
        if not isinstance(value, str):
            return value, f"expected a string, got {value!r}", "quote the value"
    elif tp is dict:  # mapping-valued keys, each checked by what it holds (spec's mapping=)
        if not isinstance(value, dict):
            return value, f"expected a mapping, got {value!r}", "write a mapping"
        value = json.loads(json.dumps(dict(value)))
        err, fix = MAPPING_CHECKS[meta["mapping"]](value)
        return value, err, fix
    if meta.get("choices") and value not in meta["choices"]:
        return value, f"{value!r} is not one of {list(meta['choices'])}", \
            f"use one of {', '.join(map(str, meta['choices']))}"
    if meta.get("min") is not None and value < meta["min"]:
        return value, f"must be >= {meta['min']}, got {value!r}", f"use a value >= {meta['min']}"
    if meta.get("even") and value % 2:
        return value, f"must be even (rotary embeddings rotate pairs of dims), got {value}", \
            f"use an even value such as {value + 1}"
    return value, None, ""


# the fields each rope type needs besides rope_type and rope_theta (draft.rope_theta), as
# transformers' RotaryEmbeddingConfigMixin._validate_<type>_rope_parameters require them
# (transformers/modeling_rope_utils.py)
ROPE_REQUIRED = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
}


def _rope_problem(rope: dict) -> tuple[str | None, str]:
    """(what is wrong, the fix) with a rope_scaling mapping, or (None, "")."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ROPE_REQUIRED:
        return (f"rope_type {kind!r} is not one of {sorted(ROPE_REQUIRED)}",
                "set rope_type to one of those, or rope_scaling: null")
    missing = [k for k in ROPE_REQUIRED[kind] if k not in rope]
    if missing:
        return (f"rope_type {kind} needs {', '.join(missing)} (missing)",
                f"add {', '.join(f'{k}: ...' for k in missing)} under draft.rope_scaling")
    for k, v in rope.items():
        vals = v if isinstance(v, list) else [v]
        if k not in ("rope_type", "type") and not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in vals):
            return f"{k} must be a finite number (or list of numbers), got {v!r}", \
                "write finite numbers"
    return None, ""


def _template_kwargs_problem(kwargs: dict) -> tuple[str | None, str]:
    """(what is wrong, the fix) with chat-template arguments, or (None, ""): names as the
    template reads them, values JSON as vLLM's chat_template_kwargs field takes them."""
    for k, v in kwargs.items():
        if not str(k).isidentifier():
            return (f"argument name {k!r} is not a name a Jinja template can read",
                    "use the name the chat template reads, e.g. enable_thinking")
        if v is None:
            return (f"argument {k} is null: a template cannot tell it from absent",
                    f"give {k} a value or leave it out")
    return None, ""


MAPPING_CHECKS = {"rope_scaling": _rope_problem, "template_kwargs": _template_kwargs_problem}


def _validate(cls: type, node: Any, prefix: str, file: str, problems: list[Problem],
              lines: dict[str, int | None], parent: Any, parent_key: Any) -> Any:
    """One schema dataclass from one YAML mapping; appends every problem, returns None if any
    field could not be built."""
    if not isinstance(node, dict):
        problems.append(Problem(file, _line_of(parent, parent_key), prefix.rstrip(".") or "(top)",
                                f"expected a mapping of keys, got {node!r}",
                                "indent the section's keys under it"))
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in node:
        if key not in names:
            problems.append(Problem(file, _line_of(node, key), f"{prefix}{key}",
                                    "unknown key", f"remove it or use one of: "
                                    f"{', '.join(sorted(names))}"))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.name not in node:
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
                continue
            problems.append(Problem(file, _line_of(parent, parent_key) if parent is not None
                                    else 1, key, "missing required key",
                                    f"add `{f.name}:` ({f.metadata.get('help', '')}); "
                                    "it has no default on purpose"))
            continue
        lines[key] = _line_of(node, f.name)
        ok, value = _validate_field(f, hints[f.name], node, key, file, problems, lines)
        if ok:
            values[f.name] = value
    if any(f.name not in values or (values[f.name] is None and dataclasses.is_dataclass(hints[f.name]))
           for f in dataclasses.fields(cls)):
        return None
    try:
        return cls(**values)
    except TypeError:
        return None


def _validate_field(f: dataclasses.Field, tp: Any, node: Any, key: str, file: str,
                    problems: list[Problem], lines: dict) -> tuple[bool, Any]:
    """(built?, value) of one present field: a nested section, null, a list or a scalar."""
    value = node[f.name]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if dataclasses.is_dataclass(inner):
            if value is None:
                return True, None
            tp = inner
    if dataclasses.is_dataclass(tp):
        return True, _validate(tp, value, key + ".", file, problems, lines, node, f.name)
    nullable = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        nullable, tp = True, [a for a in typing.get_args(tp) if a is not type(None)][0]
    if value is None:
        if not nullable:
            problems.append(Problem(file, lines[key], key, "must not be null",
                                    f"set it explicitly ({f.metadata.get('help', '')})"))
        return True, None
    if typing.get_origin(tp) is list:
        return _validate_list(value, typing.get_args(tp)[0], f.metadata, key, file, problems,
                              lines[key])
    conv, err, fix = _check_scalar(value, tp, f.metadata)
    if err:
        problems.append(Problem(file, lines[key], key, err, fix))
    return True, conv


def _validate_list(value: Any, item_tp: Any, meta: dict, key: str, file: str,
                   problems: list[Problem], line: int | None) -> tuple[bool, Any]:
    if not isinstance(value, list):
        problems.append(Problem(file, line, key, f"expected a list, got {value!r}",
                                "write a YAML list such as [1, 2, 3]"))
        return False, None
    n = meta.get("length")
    if n is not None and len(value) != n:
        problems.append(Problem(file, line, key, f"expected exactly {n} items, got {len(value)}",
                                f"list exactly {n} values"))
    items = []
    for i, item in enumerate(value):
        conv, err, fix = _check_scalar(item, item_tp, {"min": 0})
        if err:
            problems.append(Problem(file, _line_of(value, i) or line, f"{key}[{i}]", err, fix))
        items.append(conv)
    return True, items


def load(path: str | os.PathLike = "params.yaml") -> Params:
    """Loads and validates params.yaml; raises ParamsError listing every problem."""
    file = str(path)
    p = Path(path)
    if not p.is_file():
        raise ParamsError([Problem(file, None, "(file)", "not found",
                                   "run from the project root or pass --params PATH")])
    text = p.read_text()
    if not text.strip():
        raise ParamsError([Problem(file, 1, "(file)", "is empty",
                                   "copy the project's params.yaml and edit it")])
    try:
        doc = YAML(typ="rt").load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise ParamsError([Problem(file, line, "(yaml)", f"YAML syntax error: {e.problem}",
                                   "fix the indentation/quoting at that line")]) from None
    except YAMLError as e:
        raise ParamsError([Problem(file, None, "(yaml)", f"YAML error: {e}", "")]) from None
    problems: list[Problem] = []
    lines: dict[str, int | None] = {}
    params = _validate(Params, doc, "", file, problems, lines, None, None)
    if params is not None and not problems:
        cross_check(params, file, lines, problems)
    if problems:
        raise ParamsError(problems)
    object.__setattr__(params, "_source", file)
    object.__setattr__(params, "_lines", lines)
    return params


def source_of(params: Params) -> str:
    return getattr(params, "_source", "params.yaml")


def leaf_keys(cls: type = Params, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def lines_of(params: Params) -> dict:
    """Line numbers of the loaded params' keys (for error messages)."""
    return getattr(params, "_lines", {})
