"""dvc.yaml, read: the one reader of the stage graph for the library and the tools (which stages
there are, the params keys each declares, the files each writes, the top-level metrics files).
`eagle3pipe deps --write` edits it round-trip (eagle3pipe.tools.deps); nothing else writes it.
"""
from __future__ import annotations

import os
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from eagle3pipe.errors import Error


def load(dvc_yaml: str | os.PathLike = "dvc.yaml") -> dict:
    """The whole document; an Error naming the file when it is missing or not YAML."""
    path = Path(dvc_yaml)
    try:
        doc = YAML(typ="safe").load(path.read_text())
    except OSError as e:
        raise Error(f"{path}: cannot read the stage graph ({e.strerror})",
                    fix="run from the project root, or pass --dvc-yaml") from None
    except YAMLError as e:
        raise Error(f"{path}: not valid YAML ({e})", fix="restore it with `git checkout dvc.yaml`"
                    ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
        raise Error(f"{path}: no `stages:` mapping", fix="restore it with `git checkout dvc.yaml`")
    return doc


def stages(dvc_yaml: str | os.PathLike = "dvc.yaml") -> dict:
    """name -> stage body, in the file's order (dependency order)."""
    return load(dvc_yaml)["stages"]


def stage(name: str, dvc_yaml: str | os.PathLike = "dvc.yaml") -> dict:
    body = stages(dvc_yaml).get(name)
    if body is None:
        raise Error(f"{dvc_yaml}: no stage named '{name}'")
    return body


def declared_params(name: str, dvc_yaml: str | os.PathLike = "dvc.yaml") -> frozenset[str]:
    """The params keys a stage declares (`- key`, or `- {params.yaml: [keys]}`)."""
    keys: set[str] = set()
    for entry in stage(name, dvc_yaml).get("params", []) or []:
        if isinstance(entry, str):
            keys.add(entry)
        elif isinstance(entry, dict):
            for v in entry.values():
                keys.update(v or [])
    return frozenset(keys)


def outputs(body: dict) -> list[str]:
    """The paths a stage body writes: its outs, metrics and plots."""
    return [o if isinstance(o, str) else next(iter(o))
            for kind in ("outs", "metrics", "plots") for o in body.get(kind) or []]


def top_metrics(dvc_yaml: str | os.PathLike = "dvc.yaml") -> list[Path]:
    """The top-level `metrics:` files (what no stage depends on), relative to dvc.yaml's folder."""
    base = Path(dvc_yaml).parent
    return [base / (m if isinstance(m, str) else next(iter(m)))
            for m in load(dvc_yaml).get("metrics") or []]
