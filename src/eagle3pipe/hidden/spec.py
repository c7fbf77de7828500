"""The capture spec: which verifier hidden states the draft trains on, their names, their stored
dtype, and configs/capture.json, the one rendered form of them (written by
the configs stage, read by the extract stage and by `eagle3pipe serve --hidden-states`).

A slot is the residual stream at one layer id, in vLLM's capture semantics (vllm/model_executor/
models/interfaces.py `_maybe_add_hidden_state`): id i < L is the stream entering decoder layer
i, id L the last layer's output before the final norm. The draft reads its aux ids
(draft.aux_layer_ids) and then id L; layer_ids() is the one place that list is formed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.errors import Error
from eagle3pipe.runtime.jsonio import read_json_object
from eagle3pipe.verifier.handle import VerifierInfo

FINAL_MODES = ("pre_norm",)
STORED_DTYPES = ("bfloat16", "float16", "float32")  # extract.dtype's choices (config.schema)


class ExtractError(Error, ValueError):
    """A bad input or an output that failed validation; the message names the file and the fix."""


def layer_ids(aux_layer_ids, num_layers: int) -> list[int]:
    """The captured layer ids: the aux ids, then the last layer's pre-norm output (id L)."""
    return [*aux_layer_ids, num_layers]


def num_slots(aux_layer_ids) -> int:
    """The aux layers and the pre-norm last-layer output."""
    return len(layer_ids(aux_layer_ids, 0))


def slot_names(aux: list[int]) -> list[str]:
    return [f"layer_input_{i}" for i in aux] + ["final_pre_norm"]


def torch_dtype(name: str):
    """extract.dtype -> the torch dtype the states are stored in."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def render(arch) -> dict:
    """capture.json of a DraftArch (eagle3pipe.draft.arch, validated there): only what
    hidden-state extraction needs, so that a head_dim change never reruns it."""
    return {"aux_layer_ids": list(arch.aux_layer_ids), "final": "pre_norm",
            "hidden_size": arch.target_hidden_size,
            "verifier_num_layers": arch.verifier_num_layers}


@dataclass(frozen=True)
class CaptureSpec:
    """configs/capture.json, parsed and checked (read_capture)."""
    aux_layer_ids: tuple[int, ...]
    verifier_num_layers: int
    hidden_size: int
    final: str

    @property
    def num_slots(self) -> int:
        return len(self.aux_layer_ids) + 1

    @property
    def layer_ids(self) -> list[int]:
        return layer_ids(self.aux_layer_ids, self.verifier_num_layers)


def read_capture(path: str | os.PathLike, info: VerifierInfo | None = None) -> CaptureSpec:
    """Reads configs/capture.json and checks it against the verifier (when given)."""
    path = Path(path)
    regen = "regenerate it with `dvc repro configs` (it is derived from params.yaml and the verifier)"
    doc = read_json_object(path, ExtractError, regen, "capture config")
    for key in ("aux_layer_ids", "verifier_num_layers", "hidden_size", "final"):
        if key not in doc:
            raise ExtractError(f"{path}: missing key '{key}'; {regen}")
    ids = doc["aux_layer_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ExtractError(f"{path}: aux_layer_ids must be a non-empty list of integers, got "
                           f"{ids!r}; {regen}")
    for key in ("verifier_num_layers", "hidden_size"):
        v = doc[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ExtractError(f"{path}: {key} must be a positive integer, got {v!r}; {regen}")
    spec = CaptureSpec(tuple(ids), doc["verifier_num_layers"], doc["hidden_size"], doc["final"])
    if spec.final not in FINAL_MODES:
        raise ExtractError(f"{path}: final={spec.final!r} is not supported (only "
                           f"{list(FINAL_MODES)}: the last layer's output before the final "
                           f"norm, as vLLM feeds EAGLE-3); {regen}")
    if list(ids) != sorted(set(ids)):
        raise ExtractError(f"{path}: aux_layer_ids {ids} must be distinct and ascending (vLLM "
                           f"concatenates aux states in layer order); fix draft.aux_layer_ids in "
                           f"params.yaml and {regen}")
    if ids[0] < 0 or ids[-1] > spec.verifier_num_layers:
        raise ExtractError(f"{path}: aux_layer_ids {ids} out of range [0, "
                           f"{spec.verifier_num_layers}] for a {spec.verifier_num_layers}-layer "
                           f"verifier; fix draft.aux_layer_ids in params.yaml and {regen}")
    if info is not None:
        check_capture_matches(spec, info, path)
    return spec


def check_capture_matches(spec: CaptureSpec, info: VerifierInfo, path: str | os.PathLike) -> None:
    """capture.json was rendered for one verifier; extracting another one is a stale config."""
    problems = []
    if spec.verifier_num_layers != info.num_hidden_layers:
        problems.append(f"verifier_num_layers={spec.verifier_num_layers} but the verifier "
                        f"({info.source}) has num_hidden_layers={info.num_hidden_layers}")
    if spec.hidden_size != info.hidden_size:
        problems.append(f"hidden_size={spec.hidden_size} but the verifier ({info.source}) has "
                        f"hidden_size={info.hidden_size}")
    if problems:
        raise ExtractError(f"{path}: does not match the verifier: " + "; ".join(problems)
                           + ". The capture config is stale: regenerate it with `dvc repro "
                           "configs` (or point --capture/--verifier at matching files)")
