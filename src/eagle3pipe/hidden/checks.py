"""Checks on captured hidden states, before anything is stored, published or trained on: every
sample's shapes and dtypes (validate_sample, validate_split) and states no verifier computes
(check_states: non-finite, all zero, constant across positions, equal to another layer's
slot). The extract stage runs them on what it captures, the on-demand producer
(eagle3pipe.hidden.online) on every sample it computes; the transformers oracle is
eagle3pipe.hidden.oracle."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3pipe.data.samples import Sample
from eagle3pipe.errors import Problem
from eagle3pipe.hidden.spec import ExtractError, slot_names

log = logging.getLogger("eagle3pipe.stages.extract")


# ---------------------------------------------------------------------------------------------
# Validation


def validate_sample(data: dict, tokens: list[int], num_slots: int, hidden_size: int,
                    dtype: torch.dtype, where: str = "sample",
                    layer_ids: list[int] | None = None, sample: str = "the sample") -> None:
    """One hs_{i}.safetensors payload: keys, token ids, shape, dtype, finite values; with
    `layer_ids` (the slots' layers), no degenerate slot (check_states)."""
    from speculators.data_generation.offline import check_hidden_states

    extra = set(data) - {"token_ids", "hidden_states"}
    if extra:
        raise ExtractError(f"{where}: unexpected tensors {sorted(extra)}")
    tid = data.get("token_ids")
    if isinstance(tid, torch.Tensor) and (tid.dtype != torch.int64 or tid.dim() != 1):
        raise ExtractError(f"{where}: token_ids must be int64 [T], got {tid.dtype} "
                           f"{list(tid.shape)}")
    hs = data.get("hidden_states")
    if isinstance(hs, torch.Tensor):
        want = [len(tokens), num_slots, hidden_size]
        if list(hs.shape) != want or hs.dtype != dtype:
            raise ExtractError(f"{where}: hidden_states is {hs.dtype} {list(hs.shape)}, expected "
                               f"{dtype} {want}")
        if layer_ids is not None:
            check_states(hs, list(tokens), layer_ids, file=where, sample=sample)
    try:
        # speculators' own check: keys, token ids, length, non-finite values
        check_hidden_states(data, list(tokens))
    except ValueError as e:
        msg = str(e)
        if len(msg) > 300:
            msg = msg[:300] + "..."
        raise ExtractError(f"{where}: {msg}") from None


def validate_split(split_dir: str | os.PathLike, samples: list[Sample], num_slots: int,
                   hidden_size: int, dtype: torch.dtype,
                   layer_ids: list[int] | None = None, rows_only: bool = False) -> None:
    """Reads a written split back from disk and checks it against the source samples (with
    `layer_ids`, every sample's states with check_states too: a reused store entry is checked
    like a computed one; rows_only: the rows, and that no hidden states were written)."""
    from datasets import load_from_disk

    split_dir = Path(split_dir)
    ds = load_from_disk(str(split_dir)).with_format(None)
    if len(ds) != len(samples):
        raise ExtractError(f"{split_dir}: {len(ds)} rows, expected {len(samples)}")
    if sorted(ds.column_names) != ["input_ids", "loss_mask", "seq_len"]:
        raise ExtractError(f"{split_dir}: columns {ds.column_names}")
    hs_dir = split_dir / "hidden_states"
    names = sorted(p.name for p in hs_dir.iterdir()) if hs_dir.is_dir() else []
    want = sorted(f"hs_{i}.safetensors" for i in range(len(samples)))
    if rows_only:
        want = []  # on demand (extract.mode online, hybrid): the train stage computes them
    if names != want:
        raise ExtractError(f"{hs_dir}: {len(names)} files, expected exactly {len(want)} "
                           "hs_{i}.safetensors")
    for i, (row, s) in enumerate(zip(ds, samples)):
        if (row["input_ids"] != list(s.input_ids) or row["loss_mask"] != list(s.loss_mask)
                or row["seq_len"] != len(s.input_ids)):
            raise ExtractError(f"{split_dir}: row {i} ({s.id}) differs from the dataset")
        if rows_only:
            continue
        validate_sample(load_file(hs_dir / f"hs_{i}.safetensors"), list(s.input_ids), num_slots,
                        hidden_size, dtype, where=f"{hs_dir}/hs_{i}.safetensors ({s.id})",
                        layer_ids=layer_ids, sample=f"{split_dir.name} sample {i} ({s.id})")


# ---------------------------------------------------------------------------------------------
# Degenerate states: what no verifier computes, refused before anything is stored or published

# per kind: (what the slot holds, the likely cause, the fix)
DEGENERATE = {
    "non-finite": (
        "dtype overflow: the verifier's activations exceed the range of the dtype it is "
        "computed or stored in (float16), or its weights hold nan/inf",
        "set vllm.dtype: float32 (or bfloat16, which has float32's range) and extract.dtype: "
        "bfloat16 or float32; check the checkpoint's weights for nan/inf"),
    "all-zero": (
        "the capture hook is on the wrong tensor (one the forward never writes), or the "
        "connector returned padding instead of the request's states (an all-zero embedding "
        "matrix does the same)",
        "check the capture (eagle3pipe.hidden.capture, eagle3pipe.engines.connector) against "
        "this vLLM, and the verifier's weights"),
    "constant": (
        "a position-independent tensor was captured (a bias, a weight row, a state broadcast "
        "over the sequence) instead of the per-token residual stream",
        "check the capture (eagle3pipe.hidden.capture, eagle3pipe.engines.connector) against "
        "this vLLM, and the verifier's weights"),
    "equal": (
        "two aux ids resolve to the same layer, or the engine returned the same buffer for "
        "both slots (or the decoder layers between them leave the residual stream unchanged: "
        "zeroed weights)",
        "check draft.aux_layer_ids against the verifier's layers and the capture "
        "(eagle3pipe.hidden.capture) against this vLLM"),
}


def check_states(hidden: torch.Tensor, tokens: list[int], layer_ids: list[int], *, file: str,
                 sample: str) -> None:
    """Refuses one sample's hidden states [T, slots, H] (as stored) where a slot is non-finite,
    all zero, the same vector at every position (tokens that differ), or equal to another
    slot of a different layer: states no verifier computes, which would train a draft
    silently wrong. Vectorised: it runs on every sample."""
    T, S = hidden.shape[0], hidden.shape[1]
    names = slot_names(layer_ids[:-1])
    # one pass: each slot's per-feature max and min over the positions ([S, H]); amax/amin
    # propagate nan, so finite extrema mean finite values
    hi, lo = hidden.amax(dim=0), hidden.amin(dim=0)
    finite = (torch.isfinite(hi).all(dim=1) & torch.isfinite(lo).all(dim=1)).tolist()
    zero = ((hi == 0).all(dim=1) & (lo == 0).all(dim=1)).tolist()
    constant = (hi == lo).all(dim=1).tolist()
    if T < 2 or (any(constant) and len(set(tokens)) < 2):
        constant = [False] * S  # one position, or one token repeated: constant states are right
    found: list[tuple[int, str, str]] = []
    for k in range(S):
        if not finite[k]:
            n = int((~torch.isfinite(hidden[:, k])).sum())
            found.append((k, "non-finite", f"{n} of its {T * hidden.shape[2]} values are "
                          f"non-finite (nan/inf) in {str(hidden.dtype).removeprefix('torch.')}"))
        elif zero[k]:
            found.append((k, "all-zero", f"all zero at every one of its {T} positions"))
        elif constant[k]:
            found.append((k, "constant", f"the same vector at every one of its {T} positions, "
                          "though the sample's tokens differ"))
    flagged = {k for k, _, _ in found}
    for b in range(S):
        for a in range(b):
            if (a in flagged or b in flagged or layer_ids[a] == layer_ids[b]
                    or not torch.equal(hidden[:, a], hidden[:, b])):
                continue
            found.append((b, "equal", f"equal, at every one of its {T} positions, to slot "
                          f"{names[a]} (layer {layer_ids[a]})"))
            flagged.add(b)
            break
    if not found:
        return
    problems = [Problem(file, None, f"{sample}: slot {names[k]} (layer {layer_ids[k]})",
                        f"{what}; likely cause: {DEGENERATE[kind][0]}",
                        DEGENERATE[kind][1]) for k, kind, what in found]
    raise ExtractError(f"degenerate hidden states for {sample} (nothing published):",
                       problems=problems)
