"""`eagle3pipe check`: every way a draft's files can drift from params.yaml, each reported with
the file, key or tensor that is wrong.

- stale derived configs (hand edits, stale copies) vs what params.yaml renders;
- safetensors checkpoints (either layout) vs the shape contract of their own config and of
  params, including what vLLM silently accepts (a head_dim smaller than the weights, a missing
  fc.weight, an all-zero d2t): eagle3pipe.checkpoint, which the export stage runs too;
- a published flat config, field by field, split into fields vLLM reads and fields it ignores;
- hand-written architecture constants in tracked files that contradict params.yaml.
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import fields
from pathlib import Path

from eagle3pipe.formats import VLLM_READS

# --------------------------------------------------------------------------------------------
# derived configs on disk vs what params.yaml renders


def _flatten(d, prefix=""):
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): d}


def check_rendered(rendered: dict[str, str], configs_dir: str | Path) -> list[str]:
    """Each derived config on disk vs the text params.yaml renders, naming the keys that differ."""
    problems = []
    for rel, text in rendered.items():
        p = Path(configs_dir) / rel
        if not p.is_file():
            problems.append(f"{p}: missing (run `dvc repro configs`)")
            continue
        on_disk = p.read_text()
        if on_disk == text:
            continue
        try:
            fa, fb = _flatten(json.loads(on_disk)), _flatten(json.loads(text))
        except json.JSONDecodeError as e:
            problems.append(f"{p}:{e.lineno}: not valid JSON ({e.msg}); it is generated: run "
                            "`dvc repro configs`")
            continue
        keys = sorted(k for k in set(fa) | set(fb)
                      if fa.get(k, "<absent>") != fb.get(k, "<absent>"))
        detail = "; ".join(f"{k}: on disk {fa.get(k, '<absent>')!r}, params.yaml renders "
                           f"{fb.get(k, '<absent>')!r}" for k in keys[:6]) or "formatting"
        problems.append(f"{p}: differs from what params.yaml renders ({detail}). It is "
                        "generated: never edit it; change params.yaml and run `dvc repro configs`")
    return problems


# --------------------------------------------------------------------------------------------
# published reference config


def compare_reference(rendered_flat: dict, reference: dict) -> tuple[list[dict], list[str]]:
    ours, theirs = _flatten(rendered_flat), _flatten(reference)
    rows, problems = [], []
    for key in sorted(set(ours) | set(theirs)):
        read = key in VLLM_READS
        a, b = ours.get(key, "<absent>"), theirs.get(key, "<absent>")
        if read and b == "<absent>":
            default = VLLM_READS[key]
            b = ours.get("hidden_size") if default == "=hidden_size" else default
            b = "<absent>" if b is None else b
        same = a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and
                          float(a) == float(b))
        rows.append({"field": key, "ours": a, "reference": b, "vllm_reads": read, "same": same})
        if read and not same:
            problems.append(f"{key}: rendered {a!r}, reference {b!r} (vLLM reads this field)")
    return rows, problems


# --------------------------------------------------------------------------------------------
# hand-written architecture constants


SCAN_KEYS = ("head_dim", "num_attention_heads", "num_key_value_heads", "hidden_size",
             "intermediate_size", "draft_vocab_size", "num_hidden_layers", "vocab_size",
             "target_hidden_size")
SCAN_SUFFIXES = {".py", ".json", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".ini", ".mk"}
SCAN_NAMES = {"Makefile", "run"}
# generated, or fixtures with their own sizes (tests build micro models; examples have their
# own params.yaml): not hand-written copies of this project's architecture
SCAN_EXEMPT = ("configs/", "metrics/", "plots/", "dvc.lock", "params.yaml", "examples/",
               "tests/", "bench/", ".dvc/", "requirements.lock")
_PATTERN = re.compile(r"""["']?\b(%s)\b["']?\s*[:=]\s*(\d+)\b""" % "|".join(SCAN_KEYS))


def allowed_values(params, verifier_cfg: dict | None) -> dict[str, set[int]]:
    allowed: dict[str, set[int]] = {k: set() for k in SCAN_KEYS}
    for section in (params.draft, params.verifier.embedded):
        if section is None:
            continue
        for f in fields(section):
            if f.name in allowed and isinstance(getattr(section, f.name), int):
                allowed[f.name].add(getattr(section, f.name))
    if verifier_cfg:
        for k in SCAN_KEYS:
            if isinstance(verifier_cfg.get(k), int):
                allowed[k].add(verifier_cfg[k])
        for k in ("hidden_size", "target_hidden_size"):
            if isinstance(verifier_cfg.get("hidden_size"), int):
                allowed[k].add(verifier_cfg["hidden_size"])
    allowed["num_hidden_layers"].add(1)  # the draft's single decoder layer
    if params.verifier.embedded is not None:
        allowed["vocab_size"].add(params.verifier.embedded.tokenizer_vocab_size)
    return allowed


def tracked_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (subprocess.CalledProcessError, FileNotFoundError):
        out = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(f for f in out if f)


def scan_constants(root: str | Path, params, verifier_cfg: dict | None) -> list[str]:
    root = Path(root)
    allowed = allowed_values(params, verifier_cfg)
    problems = []
    for rel in tracked_files(root):
        p = root / rel
        if rel.startswith(SCAN_EXEMPT) or not p.is_file():
            continue
        if p.suffix not in SCAN_SUFFIXES and p.name not in SCAN_NAMES:
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if "check: ignore" in line:
                continue
            for m in _PATTERN.finditer(line):
                key, val = m.group(1), int(m.group(2))
                if allowed[key] and val not in allowed[key]:
                    problems.append(f"{rel}:{i}: {key} = {val} written by hand contradicts "
                                    f"params.yaml / the verifier ({key} in "
                                    f"{sorted(allowed[key])}); derive it from params instead")
    return problems
