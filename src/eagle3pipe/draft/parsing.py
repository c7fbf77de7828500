"""Every config layout that describes the draft, parsed back into the DraftArch it was rendered
from (the inverse of eagle3pipe.draft.formats).

Three layouts describe the draft: draft_config.json (what training reads), speculators' nested
config and the flat vLLM one (both exported): for each, `parse_*(render(arch)) == arch`
(tests/test_formats.py). Nothing is defaulted on parse: a key the DraftArch needs that the file
lacks, or holds with the wrong type, is a ConfigError naming the file and the key. What a layout
does not hold by design the caller passes explicitly: draft_config.json has no dtype (training
keeps float32 weights), the speculators and flat configs have no verifier layer count (it is the
verifier's; no tensor shape depends on it). `differences()` is the one comparison of two
architectures, field by field.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from eagle3pipe.draft.arch import SAFETENSORS_DTYPE, DraftArch
from eagle3pipe.draft.formats import (FLAT_ARCHITECTURE, FLAT_ARCHITECTURES, TRAINED_DTYPE,
                                      canonical_rope, rope_parameters)
from eagle3pipe.errors import Error
from eagle3pipe.runtime.jsonio import read_json_object


class ConfigError(Error, ValueError):
    """A config file is missing, malformed or lacks a key; the message names file, key, fix."""


REGENERATE = "regenerate it with `dvc repro configs`"
ARCH_FIELDS = tuple(f.name for f in fields(DraftArch))
DRAFT_CONFIG_KEYS = tuple(f for f in ARCH_FIELDS if f != "dtype")
_TL = "transformer_layer_config."
_LAYER = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
          "hidden_act", "bos_token_id", "eos_token_id", "num_hidden_layers")
# DraftArch field -> its dotted key in each layout, mirroring formats' renderers (speculators:
# Eagle3SpeculatorConfig, speculators/models/eagle3/config.py, with the decoder layer under
# transformer_layer_config; vLLM: llama_eagle3.py reads the flat keys, the aux ids under
# eagle_config). A field missing from a layout's map is not in its files: the caller's.
KEYS = {
    "draft_config": {f: f for f in DRAFT_CONFIG_KEYS},
    "vllm": {**{f: f for f in ARCH_FIELDS if f != "verifier_num_layers"},
             "aux_layer_ids": "eagle_config.eagle_aux_hidden_state_layer_ids",
             "draft_arch": "model_type"},  # check: ignore (a key name, not a value)
    "speculators": {**{f: f for f in ("target_hidden_size", "draft_vocab_size",
                                      "norm_before_residual", "norm_before_fc", "fc_norm",
                                      "norm_output", "dtype")},
                    "draft_arch": _TL + "model_type",
                    **{f: _TL + f for f in _LAYER},
                    "aux_layer_ids": "eagle_aux_hidden_state_layer_ids",
                    "rope_theta": _TL + "rope_parameters.rope_theta",
                    "rope_scaling": _TL + "rope_parameters"},
}
# DraftArch's annotations -> the JSON values that may stand for them
_JSON = {"int": ((int,), "an integer"), "float": ((int, float), "a number"),
         "bool": ((bool,), "true or false"), "str": ((str,), "a string"),
         "tuple[int, ...]": ((list,), "a list of integers"),
         "dict | None": ((dict, type(None)), "an object or null"),
         "int | list | None": ((int, list, type(None)), "an integer, a list or null")}
_TYPES = {f.name: _JSON[f.type] for f in fields(DraftArch)}


def _lookup(cfg: dict, key: str) -> tuple[bool, Any]:
    v: Any = cfg
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return False, None
        v = v[part]
    return True, v


def _type_ok(field: str, v: Any) -> bool:
    types = _TYPES[field][0]
    if isinstance(v, bool) and bool not in types:
        return False
    if field == "aux_layer_ids":
        return isinstance(v, list) and all(type(i) is int for i in v)
    return isinstance(v, types)


def _parse(layout: str, cfg: dict, source: str, given: dict, fix: str) -> DraftArch:
    """The DraftArch from the keys KEYS[layout] names plus `given` (what the layout lacks; a
    given value the file also states must agree). Every problem is reported at once."""
    values, missing, bad = dict(given), [], []
    for field, key in KEYS[layout].items():
        found, v = _lookup(cfg, key)
        if not found:
            if field not in given:
                missing.append(key)
        elif not _type_ok(field, v):
            bad.append(f"{key} is {v!r}, not {_TYPES[field][1]}")
        elif field in given and v != given[field]:
            bad.append(f"{key} is {v!r}, but {given[field]!r} is expected here")
        else:
            values[field] = v
    unknown = sorted(set(cfg) - set(DRAFT_CONFIG_KEYS) - {"dtype"}) \
        if layout == "draft_config" else []
    if values.get("draft_arch", "llama") not in FLAT_ARCHITECTURES:
        bad.append(f"{KEYS[layout]['draft_arch']} is {values['draft_arch']!r}, not one of "
                   f"{sorted(FLAT_ARCHITECTURES)}")
    if "dtype" in values and values["dtype"] not in SAFETENSORS_DTYPE:
        bad.append(f"dtype is {values['dtype']!r}, not one of {sorted(SAFETENSORS_DTYPE)}")
    if missing or unknown or bad:
        raise ConfigError(f"{source}: " + "; ".join(
            ([f"missing keys {missing}"] if missing else [])
            + ([f"unknown keys {unknown}"] if unknown else []) + bad) + f"; {fix}")
    if layout == "speculators":  # rope_parameters = rope_scaling's rope_type form + rope_theta
        values["rope_scaling"] = canonical_rope(
            {k: v for k, v in values["rope_scaling"].items() if k != "rope_theta"})
    values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
    values["rope_theta"], values["rms_norm_eps"] = (float(values["rope_theta"]),
                                                    float(values["rms_norm_eps"]))
    return DraftArch(**values)


def parse_draft_config(cfg: dict, source: str, *, dtype: str, fix: str = REGENERATE
                       ) -> DraftArch:
    """draft_config.json (draft_config(): DraftArch.to_dict() minus dtype, which the caller
    gives: TRAINED_DTYPE for training). Exactly DRAFT_CONFIG_KEYS: a missing or unknown key is
    an error."""
    return _parse("draft_config", cfg, source, {"dtype": dtype}, fix)


def _given(verifier_num_layers: int | None, dtype: str | None) -> dict:
    return {"verifier_num_layers": verifier_num_layers, **({} if dtype is None else
                                                           {"dtype": dtype})}


def parse_speculators(cfg: dict, source: str, *, verifier_num_layers: int | None,
                      dtype: str | None = None, fix: str = REGENERATE) -> DraftArch:
    """speculators' nested config (speculators_config()). verifier_num_layers is not in it:
    the verifier's, or None where only tensor shapes are checked (none depends on it). dtype,
    when given, is the weights' dtype for a file that states none (the trained checkpoint's
    config, written by speculators with use_diff); a file stating another is an error."""
    return _parse("speculators", cfg, source, _given(verifier_num_layers, dtype), fix)


def parse_flat(cfg: dict, source: str, *, verifier_num_layers: int | None,
               dtype: str | None = None, fix: str = REGENERATE) -> DraftArch:
    """The flat vLLM config (flat_config()); verifier_num_layers and dtype as in
    parse_speculators. Its redundant keys (rope_parameters, torch_dtype) must agree."""
    arch = _parse("vllm", cfg, source, _given(verifier_num_layers, dtype), fix)
    bad = [f"{key} is {cfg[key]!r}, inconsistent with {what} ({want!r})" for key, what, want in (
        ("rope_parameters", "rope_scaling and rope_theta", rope_parameters(arch)),
        ("torch_dtype", "dtype", arch.dtype)) if key in cfg and cfg[key] != want]
    if bad:
        raise ConfigError(f"{source}: " + "; ".join(bad) + f"; {fix}")
    return arch


def layout_of(cfg: dict, source: str, fix: str = REGENERATE) -> str:
    """'speculators' or 'vllm' (the two layouts a draft checkpoint's config.json comes in)."""
    if "speculators_model_type" in cfg:
        return "speculators"
    if set(FLAT_ARCHITECTURES.values()) & set(cfg.get("architectures") or []) \
            or "eagle_config" in cfg:
        return "vllm"
    raise ConfigError(f"{source}: neither speculators' nested EAGLE-3 format "
                      "(speculators_model_type) nor the flat vLLM one (architectures: "
                      f"[{FLAT_ARCHITECTURE}]); {fix}")


def read_config_file(path: str | Path, *, verifier_num_layers: int | None,
                     dtype: str | None = None, fix: str = REGENERATE
                     ) -> tuple[bytes, DraftArch, str]:
    """(the file's bytes, the DraftArch it describes, its layout) of a speculators or flat
    config.json; arguments as in parse_speculators."""
    p = Path(path)
    cfg = read_json_object(p, ConfigError, fix, "config")
    layout = layout_of(cfg, str(p), fix)
    parse = parse_speculators if layout == "speculators" else parse_flat
    return p.read_bytes(), parse(cfg, str(p), verifier_num_layers=verifier_num_layers,
                                 dtype=dtype, fix=fix), layout


def read_draft_config(path: str | Path) -> DraftArch:
    """Reads configs/draft_config.json into a DraftArch for training: dtype TRAINED_DTYPE
    (training keeps float32 weights; the export stage casts to the configured dtype)."""
    p = Path(path)
    cfg = read_json_object(p, ConfigError, REGENERATE, "draft config")
    return parse_draft_config(cfg, str(p), dtype=TRAINED_DTYPE)


def _comparable(arch: DraftArch, field: str) -> Any:
    v = getattr(arch, field)
    if field == "aux_layer_ids":
        return list(v)
    return canonical_rope(v) if field == "rope_scaling" else v


def differences(a: DraftArch, b: DraftArch, *, ignore: tuple[str, ...] = ()
                ) -> list[tuple[str, Any, Any]]:
    """(field, a's value, b's value) for every DraftArch field but `ignore` on which a and b
    disagree: the one comparison of two architectures (export: the speculators config vs the
    flat one, the trained checkpoint vs the configs; check: a checkpoint vs params.yaml).
    rope_scaling compares in the form the speculators layout keeps, aux ids as lists."""
    out = []
    for f in ARCH_FIELDS:
        x, y = _comparable(a, f), _comparable(b, f)
        if f not in ignore and x != y:
            out.append((f, x, y))
    return out
