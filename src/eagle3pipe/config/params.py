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
    elif tp is dict:  # the one mapping-valued key: draft.rope_scaling
        if not isinstance(value, dict):
            return value, f"expected a mapping, got {value!r}", "write a mapping or null"
        value = json.loads(json.dumps(dict(value)))
        err, fix = _rope_problem(value)
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
        _cross_check(params, file, lines, problems)
    if problems:
        raise ParamsError(problems)
    object.__setattr__(params, "_source", file)
    object.__setattr__(params, "_lines", lines)
    return params


# the folder train.init_from names a draft in: a dependency of the train stage (dvc.yaml), so a
# draft copied or `dvc add`ed there is content-addressed like every other input
INIT_DIR = "drafts"


def inside_init_dir(path: str) -> bool:
    """True when `path` is a relative path to a directory below INIT_DIR (no `..`)."""
    parts = Path(path).parts
    return (not Path(path).is_absolute() and len(parts) >= 2 and parts[0] == INIT_DIR
            and ".." not in parts)


def _cross_check(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """Checks that need several keys of params.yaml alone (verifier checks live in verifier.py)."""
    d = p.draft
    if d.num_attention_heads % d.num_key_value_heads:
        problems.append(Problem(file, lines.get("draft.num_key_value_heads"),
                                "draft.num_key_value_heads",
                                f"{d.num_key_value_heads} does not divide num_attention_heads "
                                f"{d.num_attention_heads} (grouped-query attention)",
                                "pick a divisor of draft.num_attention_heads"))
    if d.norm_before_fc and d.fc_norm:
        problems.append(Problem(file, lines.get("draft.fc_norm"), "draft.fc_norm",
                                "true together with draft.norm_before_fc: one RMSNorm over the "
                                "concatenated aux states and one per aux state are exclusive "
                                "(speculators' Eagle3SpeculatorConfig refuses the pair)",
                                "set one of draft.norm_before_fc and draft.fc_norm to false "
                                "(EAGLE-3.1 uses fc_norm; speculators' CLI norm_before_fc)"))
    ids = d.aux_layer_ids
    if len(set(ids)) != len(ids):
        problems.append(Problem(file, lines.get("draft.aux_layer_ids"), "draft.aux_layer_ids",
                                f"duplicated layer ids {ids}", "list 3 distinct verifier layers"))
    elif list(ids) != sorted(ids):
        problems.append(Problem(file, lines.get("draft.aux_layer_ids"), "draft.aux_layer_ids",
                                f"{ids} is not ascending; vLLM concatenates aux states in layer "
                                "order, so any other order trains the draft on permuted inputs",
                                f"write them ascending: {sorted(ids)}"))
    e = p.verifier.embedded
    if p.verifier.path is None and e is None:
        problems.append(Problem(file, lines.get("verifier.embedded") or lines.get("verifier.path"),
                                "verifier.embedded", "is null while verifier.path is null: "
                                "nothing says which verifier to use",
                                "set verifier.path to a checkpoint dir, or give the embedded "
                                "verifier's sizes"))
        return
    if p.verifier.path is None and e.num_attention_heads % e.num_key_value_heads:
        problems.append(Problem(file, lines.get("verifier.embedded.num_key_value_heads"),
                                "verifier.embedded.num_key_value_heads",
                                f"{e.num_key_value_heads} does not divide num_attention_heads "
                                f"{e.num_attention_heads}", "pick a divisor"))
    if p.verifier.path is None and e.hidden_size % e.num_attention_heads:
        problems.append(Problem(file, lines.get("verifier.embedded.num_attention_heads"),
                                "verifier.embedded.num_attention_heads",
                                f"{e.num_attention_heads} does not divide hidden_size "
                                f"{e.hidden_size}; transformers' LlamaConfig rejects that",
                                "pick a divisor of verifier.embedded.hidden_size"))
    check_engine(p, file, lines, problems)
    s = p.smoke
    most = p.draft.num_speculative_tokens + 1
    if s.min_acceptance_length > most:
        problems.append(Problem(file, lines.get("smoke.min_acceptance_length"),
                                "smoke.min_acceptance_length",
                                f"{s.min_acceptance_length} can never be reached: with "
                                f"draft.num_speculative_tokens {most - 1} a step accepts at most "
                                f"k + 1 = {most} tokens", f"use a value <= {most}"))
    if s.ngram_prompt_lookup_min > s.ngram_prompt_lookup_max:
        problems.append(Problem(file, lines.get("smoke.ngram_prompt_lookup_min"),
                                "smoke.ngram_prompt_lookup_min",
                                "is larger than smoke.ngram_prompt_lookup_max",
                                "make min <= max"))
    if p.dataset.eval_fraction > 0 and p.dataset.num_samples < 2:
        problems.append(Problem(file, lines.get("dataset.num_samples"), "dataset.num_samples",
                                f"{p.dataset.num_samples} sample cannot fill both a train and an "
                                f"eval split (dataset.eval_fraction {p.dataset.eval_fraction})",
                                "use at least 2, or dataset.eval_fraction: 0"))
    t = p.train
    if t.init_from is not None and not inside_init_dir(t.init_from):
        problems.append(Problem(file, lines.get("train.init_from"), "train.init_from",
                                f"{t.init_from!r} is not a directory under {INIT_DIR}/"
                                f", the folder the train stage depends on (dvc.yaml), so "
                                "editing or replacing it would rerun nothing",
                                f"copy the draft export into {INIT_DIR}/<name> (or "
                                f"`dvc add {INIT_DIR}/<name>`) and set "
                                f"train.init_from: {INIT_DIR}/<name>"))
    if t.nnodes > 1 and not _endpoint(t.rdzv_endpoint):
        unset = t.rdzv_endpoint is None  # then the key just set is nnodes
        key = "train.nnodes" if unset else "train.rdzv_endpoint"
        problems.append(Problem(file, lines.get(key), key,
                                (f"{t.nnodes} needs node 0's address, but train.rdzv_endpoint "
                                 "is null" if unset else f"{t.rdzv_endpoint!r} is not host:port "
                                 f"(train.nnodes is {t.nnodes}: the other nodes need node 0's "
                                 "address)"),
                                "set train.rdzv_endpoint to host:port of the node that runs "
                                "`dvc repro` (a port every node can reach, e.g. "
                                "node0.cluster:29500), or train.nnodes: 1"))
    _extract_problems(p, file, lines, problems)
    if s.batch1_prompts > s.num_prompts:
        problems.append(Problem(file, lines.get("smoke.batch1_prompts"), "smoke.batch1_prompts",
                                f"{s.batch1_prompts} is more than smoke.num_prompts "
                                f"{s.num_prompts}: batch 1 times the first prompts of the set",
                                f"use at most {s.num_prompts}"))
    if not 0.0 <= p.dataset.eval_fraction < 1.0:
        problems.append(Problem(file, lines.get("dataset.eval_fraction"), "dataset.eval_fraction",
                                f"must be in [0, 1), got {p.dataset.eval_fraction}",
                                "use e.g. 0.1"))


def _extract_problems(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """extract.mode and extract.endpoint against each other and the training processes."""
    e, t = p.extract, p.train
    if e.endpoint is not None and not _endpoint(e.endpoint):
        problems.append(Problem(file, lines.get("extract.endpoint"), "extract.endpoint",
                                f"{e.endpoint!r} is not host:port",
                                "set the host:port that `eagle3pipe serve --hidden-states` "
                                "listens on (e.g. infer0.cluster:8100), or null"))
    if e.endpoint is not None and e.mode == "offline":
        problems.append(Problem(file, lines.get("extract.endpoint"), "extract.endpoint",
                                f"{e.endpoint!r} is set, but extract.mode is offline (the "
                                "extract stage runs its own engine; the endpoint would be unused)",
                                "set extract.mode: online or hybrid, or extract.endpoint: null"))
    procs = t.nproc_per_node * t.nnodes
    if e.mode != "offline" and e.endpoint is None and procs > 1:
        problems.append(Problem(file, lines.get("extract.mode"), "extract.mode",
                                f"{e.mode} with the engine inside the train stage needs one "
                                f"training process; train.nproc_per_node x train.nnodes = {procs}",
                                "serve the verifier with `eagle3pipe serve --hidden-states` and "
                                "set extract.endpoint to its host:port, or train with one process"))


def _endpoint(value: str | None) -> bool:
    """host:port with a non-empty host and a port in 1..65535."""
    host, _, port = (value or "").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def tp_problem(tp: int, heads: int | None, kv_heads: int | None, whose: str, why: str = ""
               ) -> tuple[str, str] | None:
    """(message, fix) when vLLM cannot shard `whose` attention over `tp` tensor-parallel ranks:
    the query heads must split evenly; the KV heads must split or be replicated (one divides the
    other; vLLM's QKVParallelLinear). kv_heads None: no KV heads to shard (MLA's latent KV)."""
    if heads and heads % tp:
        return (f"{tp} does not divide the {whose}'s num_attention_heads {heads}"
                + (f": {why}" if why else ""), f"pick a tensor_parallel_size that divides {heads}")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        return (f"{tp} and the {whose}'s num_key_value_heads {kv_heads} do not divide one another "
                "(vLLM splits or replicates KV heads)", f"pick a divisor or multiple of {kv_heads}")
    return None


def check_engine(p: Params, file: str, lines: dict, problems: list[Problem]) -> None:
    """What vLLM would refuse only after loading weights: heads that do not split over the
    tensor-parallel ranks (vLLM's draft runs at the verifier's TP size), sequences longer than
    the engine accepts. The verifier's own heads are checked against it in the verifier stage."""
    v, d = p.vllm, p.draft
    key = "vllm.tensor_parallel_size"
    bad = tp_problem(v.tensor_parallel_size, d.num_attention_heads, d.num_key_value_heads,
                     "draft", "vLLM shards the draft's heads over the same ranks as the verifier's")
    if bad:
        problems.append(Problem(file, lines.get(key), key, *bad))
    if p.dataset.max_seq_len > v.max_model_len:
        problems.append(Problem(file, lines.get("vllm.max_model_len"), "vllm.max_model_len",
                                f"{v.max_model_len} is shorter than dataset.max_seq_len "
                                f"{p.dataset.max_seq_len}: the dataset engine would refuse "
                                "its own samples", f"raise it to at least "
                                f"{p.dataset.max_seq_len}"))
    if not 0.0 < v.gpu_memory_utilization <= 1.0:
        problems.append(Problem(file, lines.get("vllm.gpu_memory_utilization"),
                                "vllm.gpu_memory_utilization",
                                f"must be in (0, 1], got {v.gpu_memory_utilization}",
                                "use e.g. 0.9"))


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
