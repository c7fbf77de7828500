"""The invalidation table: for every leaf key of params.yaml, the stages `dvc repro` reruns when it
changes. Computed from dvc.yaml (who declares the key, who depends on whose outputs) plus the one
thing dvc.yaml cannot say: which derived configs a draft key really changes (found by rendering
with the key changed and comparing bytes, so a rerun of `configs` that writes identical files is
known to stop there).

    python -m eagle3pipe.tools.invalidation            # markdown table for the README
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from eagle3pipe.config import dvcfile
from eagle3pipe.config import params as P
from eagle3pipe.config.schema import Params
from eagle3pipe.stages.configs import run as configs
from eagle3pipe.verifier.handle import find_config

# verifier.embedded keys that change the verifier's config.json (the rest change only weights)
VERIFIER_CONFIG_KEYS = {"tokenizer_vocab_size", "hidden_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "intermediate_size", "max_position_embeddings", "rope_theta",
                        "rms_norm_eps"}


def _touches(dep: str, changed: set[str]) -> bool:
    return any(dep == c or dep.startswith(c + "/") or c.startswith(dep + "/") for c in changed)


def _mutated(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 2
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, list):
        return [v + 1 for v in value]
    return f"{value}-changed"


# draft switches params refuses together (config.cross_check)
EXCLUSIVE = {"norm_before_fc": "fc_norm", "fc_norm": "norm_before_fc"}


def changed_configs(params: Params, key: str, verifier_config: Path) -> set[str]:
    """Which configs/ files change when `key` (a draft.* or verifier.path key) changes."""
    base = configs.render_files(params.draft, params.verifier.path, verifier_config)
    section, leaf = key.split(".", 1)
    if section == "draft":
        value = getattr(params.draft, leaf)
        if leaf == "aux_layer_ids":
            new = [v - 1 for v in value]
        elif leaf == "hidden_size":
            return set()  # optional: any value but the verifier's is refused
        elif leaf == "rope_scaling":
            new = {"rope_type": "linear",  # check: ignore (a probe value, never rendered)
                   "factor": 2.0} if value is None else None
        elif leaf == "hidden_act":
            return {f"configs/{f}" for f in base if f not in ("capture.json", "verifier_config.json")}
        elif leaf == "dtype":
            new = "float16" if value != "float16" else "bfloat16"
        elif leaf == "num_attention_heads":
            new = value * 2
        elif leaf == "draft_arch":
            new = "qwen3" if value == "llama" else "llama"
        else:
            new = _mutated(value)
        change = {leaf: new}
        if leaf in EXCLUSIVE and new:  # turning one on turns its exclusive partner off
            change[EXCLUSIVE[leaf]] = False
        draft = dataclasses.replace(params.draft, **change)
        other = configs.render_files(draft, params.verifier.path, verifier_config)
    else:  # verifier.path: only the rendered verifier name_or_path
        other = configs.render_files(params.draft, "/elsewhere", verifier_config)
    return {f"configs/{f}" for f in base if base[f] != other[f]}


def invalidation_table(dvc_yaml: str | Path = "dvc.yaml", params_file: str | Path = "params.yaml",
                       verifier_config: Path | None = None) -> dict[str, list[str]]:
    stages = dvcfile.stages(dvc_yaml)
    params = P.load(params_file)
    verifier_config = verifier_config or find_config(params.verifier.path)
    order = list(stages)
    table = {}
    for key in P.leaf_keys():
        if key.startswith("verifier.embedded.") and params.verifier.embedded is None:
            continue
        declared = [s for s in order if any(key == d or key.startswith(d + ".")
                                            for d in dvcfile.declared_params(s, dvc_yaml))]
        ran: list[str] = []
        changed: set[str] = set()
        for s in order:  # dvc.yaml lists stages in dependency order
            deps = [d if isinstance(d, str) else next(iter(d)) for d in stages[s].get("deps", [])]
            if s in declared or _touches_any(deps, changed):
                ran.append(s)
                if s == "configs":
                    changed |= changed_configs(params, key, verifier_config) \
                        if key.startswith("draft.") or key == "verifier.path" else set()
                elif s == "verifier":
                    if key == "verifier.hash_mode" and params.verifier.path is None:
                        continue  # the embedded verifier's bytes do not depend on it
                    changed |= set(dvcfile.outputs(stages[s])) - {"artifacts/verifier"}
                    changed.add("artifacts/verifier/weights")  # everything but config.json
                    leaf = key.rsplit(".", 1)[-1]
                    if key == "verifier.path" or (key.startswith("verifier.embedded.")
                                                  and leaf in VERIFIER_CONFIG_KEYS):
                        changed.add("artifacts/verifier/config.json")
                else:
                    changed |= set(dvcfile.outputs(stages[s]))
        table[key] = ran
    return table


def _touches_any(deps: list[str], changed: set[str]) -> bool:
    for d in deps:
        for c in changed:
            if c == "artifacts/verifier/weights":
                if d == "artifacts/verifier":
                    return True
                continue
            if _touches(d, {c}):
                return True
    return False


def markdown(table: dict[str, list[str]], stage_order: list[str]) -> str:
    head = "| params key | " + " | ".join(stage_order) + " |\n"
    head += "|---|" + "---|" * len(stage_order) + "\n"
    rows = [f"| `{k}` | " + " | ".join("x" if s in v else "" for s in stage_order) + " |"
            for k, v in table.items()]
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dvc-yaml", default="dvc.yaml")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    table = invalidation_table(a.dvc_yaml, a.params)
    if a.json:
        print(json.dumps(table, indent=1))
    else:
        print(markdown(table, list(dvcfile.stages(a.dvc_yaml))), end="")


if __name__ == "__main__":
    main()
