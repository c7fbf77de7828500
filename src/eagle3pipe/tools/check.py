"""`eagle3pipe check`: every way a draft's files can drift from params.yaml, each reported with
the file, key, line or tensor that is wrong.

- stale derived configs (hand edits, stale copies) vs what params.yaml renders;
- safetensors checkpoints (either layout) vs the shape contract of their own config and of
  params, and every weight finite, including what vLLM silently accepts (a head_dim smaller than
  the weights, a missing fc.weight, an all-zero d2t, a NaN fc.weight): eagle3pipe.draft.checkpoint,
  which the export stage runs too;
- a published config (flat, or speculators' layout as vLLM converts it: `vllm_view`), field by
  field, split into fields vLLM reads and fields it ignores; a field it omits is compared as
  the value vLLM then uses (`vllm_uses`);
- hand-written architecture and serving values in tracked files that contradict params.yaml:
  eagle3pipe.tools.scan.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from eagle3pipe.draft.formats import VLLM_READS

ABSENT = "<absent>"

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
                      if fa.get(k, ABSENT) != fb.get(k, ABSENT))
        detail = "; ".join(f"{k}: on disk {fa.get(k, ABSENT)!r}, params.yaml renders "
                           f"{fb.get(k, ABSENT)!r}" for k in keys[:6]) or "formatting"
        problems.append(f"{p}: differs from what params.yaml renders ({detail}). It is "
                        "generated: never edit it; change params.yaml and run `dvc repro configs`")
    return problems


# --------------------------------------------------------------------------------------------
# published reference config

AUX = "eagle_config.eagle_aux_hidden_state_layer_ids"
SPECULATORS_KEY = "speculators_model_type"  # the key that marks speculators' layout


def vllm_view(config: dict) -> dict:
    """`config` as vLLM 0.32 loads it. A speculators-layout config becomes the flat config vLLM
    builds from it, by vLLM's own SpeculatorsConfig.extract_transformers_pre_trained_config
    (vllm/transformers_utils/configs/speculators/base.py): transformer_layer_config lifted, then
    algos.update_eagle3, which states norm_before_residual (true where absent), the three
    EAGLE-3.1 switches (false where absent) and the architecture from the layer's model_type.
    The aux ids, which that path sets top-level (read first by vLLM), go where the flat layout
    has them. A flat config is returned as it is."""
    if SPECULATORS_KEY not in config:
        return config
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    flat = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))
    ids = flat.pop("eagle_aux_hidden_state_layer_ids", None)
    if ids is not None:
        flat.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = ids
    return flat


def _aux_fallback(ref: dict, verifier_num_layers: int) -> tuple[Any, str]:
    """vLLM 0.32 takes the aux ids from the draft config's top-level
    eagle_aux_hidden_state_layer_ids, else its eagle_config's (v1/worker/gpu_model_runner.py,
    _get_eagle3_aux_layers_from_config); with neither, from the verifier model class:
    SupportsEagle3.get_eagle3_default_aux_hidden_state_layers (model_executor/models/
    interfaces.py) returns (2, num_layers // 2, num_layers - 3) over the verifier's layers."""
    if ref.get("eagle_aux_hidden_state_layer_ids"):
        return (tuple(ref["eagle_aux_hidden_state_layer_ids"]),
                "its top-level eagle_aux_hidden_state_layer_ids, which vLLM reads first")
    n = verifier_num_layers
    return (2, n // 2, n - 3), (f"(2, L // 2, L - 3) for the verifier's L = {n} layers "
                                "(vllm interfaces.py get_eagle3_default_aux_hidden_state_layers)")


# fields whose fallback depends on other fields of the same config: v(field) is the value vLLM
# uses for that field (the reference's, or its own fallback)
_DERIVED = {
    "head_dim": (lambda v: v("hidden_size") // v("num_attention_heads"), "hidden_size // "
                 "num_attention_heads (transformers LlamaConfig.__post_init__, vllm llama.py)"),
    "num_key_value_heads": (lambda v: v("num_attention_heads"),
                            "num_attention_heads (transformers LlamaConfig.__post_init__)"),
    "draft_vocab_size": (lambda v: v("vocab_size"), "vocab_size (vllm llama_eagle3.py)"),
    "target_hidden_size": (lambda v: v("hidden_size"), "hidden_size (vllm llama_eagle3.py)"),
    "rope_scaling": (lambda v: None, "no rope scaling (transformers rope_type 'default')"),
    "layer_types": (lambda v: None, "every layer full attention (vllm llama.py, qwen3_eagle3.py: "
                    "a window only where layer_types says sliding_attention)"),
    "sliding_window": (lambda v: None, "no window (read for sliding_attention layers only)"),
}


def _config_class(ref: dict):
    """The transformers config class vLLM builds the flat config with (its model_type)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[ref.get("model_type") or "llama"]


def vllm_uses(field: str, ref: dict, verifier_num_layers: int) -> tuple[Any, str]:
    """(value, where it comes from) of a flat-config field vLLM reads (formats.VLLM_READS), as
    vLLM 0.32 loads `ref` (a flattened reference config): the reference's value where it states
    one, else vLLM's fallback. vLLM reads the flat config through transformers' LlamaConfig
    (or its model_type's, Qwen3Config for qwen3): plain fields fall back to that class's
    defaults (transformers/models/llama/configuration_llama.py), rope_theta to
    rope_parameters.rope_theta or RotaryEmbeddingConfigMixin.default_theta (modeling_rope_utils.py), rope_scaling to none;
    the EAGLE-3 fields to VLLM_READS' values (llama_eagle3.py) or _DERIVED; the aux ids as in
    _aux_fallback. (ABSENT, why) where vLLM has no fallback (it cannot load such a config)."""
    if field in ref:
        return ref[field], "the reference's"
    if field in ("architectures", "model_type"):  # pick the config and model classes
        return ABSENT, "vLLM has no fallback (it cannot load a config without it)"
    if field == AUX:
        return _aux_fallback(ref, verifier_num_layers)
    if field in _DERIVED:
        fn, source = _DERIVED[field]
        return fn(lambda f: vllm_uses(f, ref, verifier_num_layers)[0]), source
    if field == "rope_theta":
        if "rope_parameters.rope_theta" in ref:
            return ref["rope_parameters.rope_theta"], "its rope_parameters.rope_theta"
        return _config_class(ref).default_theta, \
            "transformers' default_theta (modeling_rope_utils.py)"
    if VLLM_READS.get(field) is not None:
        return VLLM_READS[field], "vLLM's default (vllm llama_eagle3.py; formats.VLLM_READS)"
    cls = _config_class(ref)
    return getattr(cls, field), f"transformers {cls.__name__}'s class default"


def same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _collapse(flat: dict) -> dict:
    """A flattened config with each object vLLM reads whole (rope_scaling) put back whole."""
    for key in VLLM_READS:
        sub = {k[len(key) + 1:]: v for k, v in flat.items() if k.startswith(key + ".")}
        if sub and key not in flat:
            flat = {k: v for k, v in flat.items() if not k.startswith(key + ".")} | {key: sub}
    return flat


def compare_reference(rendered: dict, reference: dict, *, verifier_num_layers: int
                      ) -> tuple[list[dict], list[str]]:
    """Our rendered config vs a published one of the same layout, field by field, each as vLLM
    loads it (vllm_view). For a field vLLM reads that the reference omits, the value compared is
    the one vLLM then uses (vllm_uses): row["omitted"] is True and row["source"] says where that
    value comes from; a field ours omits is compared as vLLM's value for it too."""
    ours, theirs = (_collapse(_flatten(vllm_view(c))) for c in (rendered, reference))
    rows, problems = [], []
    for key in sorted(set(ours) | set(theirs) | set(VLLM_READS)):
        read = key in VLLM_READS
        a, b = ours.get(key, ABSENT), theirs.get(key, ABSENT)
        omitted, source = read and key not in theirs, ""
        if read:
            a = vllm_uses(key, ours, verifier_num_layers)[0]
            b, source = vllm_uses(key, theirs, verifier_num_layers)
        equal = same(a, b)
        rows.append({"field": key, "ours": a, "reference": b, "vllm_reads": read,
                     "same": equal, "omitted": omitted, "source": source})
        if read and not equal:
            problems.append(
                f"{key}: rendered {a!r}, reference omits it: vLLM then uses {b!r} ({source})"
                if omitted else f"{key}: rendered {a!r}, reference {b!r} (vLLM reads this field)")
    return rows, problems
