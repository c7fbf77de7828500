"""Verifier hidden-state extraction in vLLM's capture semantics, written in the on-disk layout
speculators 0.9's trainer reads (speculators.train.data.ArrowDataset).

Capture semantics (vLLM's, see vllm/model_executor/models/llama.py, LlamaModel.forward, and
vllm/model_executor/models/interfaces.py, `_maybe_add_hidden_state`):

    self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
    for idx, layer in enumerate(self.layers...):
        hidden_states, residual = layer(positions, hidden_states, residual)
        self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
    # _maybe_add_hidden_state appends `hidden_states + residual` when layer_idx is an aux id

so aux id i is the full residual stream ENTERING decoder layer i (transformers'
`output_hidden_states[i]`, and the input of `model.model.layers[i]`). The draft's last slot is
the last decoder layer's output BEFORE the final norm (vLLM's id L); transformers' last
`hidden_states` entry is after the norm, so it is captured with a pre-hook on `model.model.norm`.

On-disk layout, per split (artifacts/hidden/{train,eval}/), exactly what ArrowDataset reads:
    <split>/                       a `datasets` Dataset saved with save_to_disk, torch format,
                                   columns input_ids [int64], loss_mask [int64], seq_len int64
    <split>/hidden_states/hs_{i}.safetensors
                                   token_ids [T] int64, hidden_states [T, n_aux + 1, H]
(speculators/data_generation/preprocessing.py builds the same columns and calls
dataset.set_format(type="torch"); speculators/cli/prepare_data.py saves it with save_to_disk;
ArrowDataset loads `hs_{row}.safetensors` through hs_connectors.FileTransfer.)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from eagle3pipe.runtime import atomic_dir, read_json_object, seed_everything, write_json
from eagle3pipe.errors import Error
from eagle3pipe.samples import Sample, read as read_split
from eagle3pipe.verifier import Verifier, VerifierInfo

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FINAL_MODES = ("pre_norm",)
LAYOUT = "speculators-0.9-arrow"


class ExtractError(Error, ValueError):
    """A bad input or an output that failed validation; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class CaptureSpec:
    aux_layer_ids: tuple[int, ...]
    verifier_num_layers: int
    hidden_size: int
    final: str

    @property
    def num_slots(self) -> int:
        return len(self.aux_layer_ids) + 1


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


def load_verifier(model_path: str | os.PathLike):
    """The verifier in float32 (extraction computes in fp32 and casts at the end), eval mode."""
    from transformers import AutoModelForCausalLM

    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise ExtractError(f"{model_path}: no config.json; is this the verifier checkpoint? "
                           "rerun `dvc repro verifier` or fix verifier.path in params.yaml")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------
# Capture


def _decoder(model):
    """(decoder layers, final norm) of a decoder-only HF model (Llama-style layout)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise ExtractError(f"{type(model).__name__}: expected `.model.layers` and `.model.norm` "
                           "(a Llama-style decoder); extraction of this architecture is not "
                           "supported by the transformers extractor")
    return base, layers, norm


@torch.no_grad()
def capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            aux_ids: Iterable[int]) -> torch.Tensor:
    """Hidden states [B, T, len(aux_ids) + 1, H] in the model's dtype: slot k < n_aux is the
    residual stream entering decoder layer aux_ids[k] (id == num_layers: the last layer's
    output), the last slot is the last layer's output before the final norm. Runs the decoder
    only (no lm_head). Right-pad batches and pass the attention mask."""
    aux_ids = list(aux_ids)
    base, layers, norm = _decoder(model)
    n_layers = len(layers)
    if any(not 0 <= i <= n_layers for i in aux_ids):
        raise ExtractError(f"aux layer ids {aux_ids} out of range [0, {n_layers}]")
    got: dict[int, torch.Tensor] = {}

    def pre_hook(key: int):
        def hook(module, args, kwargs):
            got[key] = args[0] if args else kwargs["hidden_states"]
        return hook

    # key n_layers = input of the final norm = output of the last decoder layer (pre-norm)
    handles = [layers[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True)
               for i in sorted(set(aux_ids)) if i < n_layers]
    handles.append(norm.register_forward_pre_hook(pre_hook(n_layers), with_kwargs=True))
    try:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([got[i] for i in aux_ids] + [got[n_layers]], dim=2)


# ---------------------------------------------------------------------------------------------
# Validation


def validate_sample(data: dict, tokens: list[int], num_slots: int, hidden_size: int,
                    dtype: torch.dtype, where: str = "sample") -> None:
    """One hs_{i}.safetensors payload: keys, token ids, shape, dtype, finite values."""
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
    try:
        # speculators' own check: keys, token ids, length, non-finite values
        check_hidden_states(data, list(tokens))
    except ValueError as e:
        msg = str(e)
        if len(msg) > 300:
            msg = msg[:300] + "..."
        raise ExtractError(f"{where}: {msg}") from None


def validate_split(split_dir: str | os.PathLike, samples: list[Sample], num_slots: int,
                   hidden_size: int, dtype: torch.dtype) -> None:
    """Reads a written split back from disk and checks it against the source samples."""
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
    if names != want:
        raise ExtractError(f"{hs_dir}: {len(names)} files, expected exactly {len(want)} "
                           "hs_{i}.safetensors")
    for i, (row, s) in enumerate(zip(ds, samples)):
        if (row["input_ids"] != list(s.input_ids) or row["loss_mask"] != list(s.loss_mask)
                or row["seq_len"] != len(s.input_ids)):
            raise ExtractError(f"{split_dir}: row {i} ({s.id}) differs from the dataset")
        validate_sample(load_file(hs_dir / f"hs_{i}.safetensors"), list(s.input_ids), num_slots,
                        hidden_size, dtype, where=f"{hs_dir}/hs_{i}.safetensors ({s.id})")


# ---------------------------------------------------------------------------------------------
# Writing


def _save_dataset(samples: list[Sample], out_dir: Path) -> None:
    import datasets
    from datasets import Dataset, Features, List, Value

    features = Features({"input_ids": List(Value("int64")), "loss_mask": List(Value("int64")),
                        "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": [list(s.input_ids) for s in samples],
                            "loss_mask": [list(s.loss_mask) for s in samples],
                            "seq_len": [len(s.input_ids) for s in samples]}, features=features)
    ds.set_format(type="torch")  # as speculators' preprocessing saves it (ArrowDataset needs it)
    # save_to_disk writes the fingerprint into state.json; datasets may draw it at random, so pin
    # it to a hash of the content: same samples, same bytes.
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.input_ids, s.loss_mask]).encode())
        h.update(b"\n")
    fingerprint = h.hexdigest()[:16]
    ds._fingerprint = fingerprint
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(out_dir))
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    state = json.loads((out_dir / "state.json").read_text())
    if state.get("_fingerprint") != fingerprint:
        raise ExtractError(f"{out_dir}/state.json: fingerprint not pinned (datasets changed "
                           "save_to_disk?); output would not be byte-deterministic")


def padded_batches(samples: list[Sample], batch_size: int, pad_id: int
                   ) -> Iterable[tuple[list[int], list[int], torch.Tensor, torch.Tensor]]:
    """The batches extract_split runs: samples sorted by length (longest first, ties by row),
    padded right. Yields (sample indices, lengths, input_ids, attention_mask)."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), i))
    for k in range(0, len(order), batch_size):
        batch = order[k:k + batch_size]
        lens = [len(samples[i].input_ids) for i in batch]
        ids = torch.full((len(batch), max(lens)), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max(lens)), dtype=torch.long)
        for r, (i, n) in enumerate(zip(batch, lens)):
            ids[r, :n] = torch.tensor(samples[i].input_ids, dtype=torch.long)
            mask[r, :n] = 1
        yield batch, lens, ids, mask


def extract_split(model, samples: list[Sample], aux_ids: list[int], out_dir: Path,
                  dtype: torch.dtype, batch_size: int, pad_id: int = 0,
                  progress: bool = True, desc: str = "extract") -> float:
    """Writes one split; returns seconds spent in forward passes. Batches are formed from
    samples sorted by length (longest first, ties by row), padded right."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hs_dir = out_dir / "hidden_states"
    hs_dir.mkdir()
    _save_dataset(samples, out_dir)
    seconds = 0.0
    bar = tqdm(total=sum(len(s.input_ids) for s in samples), unit="tok", desc=desc,
               disable=not progress, mininterval=1.0)
    for batch, lens, ids, mask in padded_batches(samples, batch_size, pad_id):
        t0 = time.perf_counter()
        states = capture(model, ids, mask, aux_ids)
        seconds += time.perf_counter() - t0
        for r, (i, n) in enumerate(zip(batch, lens)):
            save_file({"token_ids": ids[r, :n].clone(),
                       "hidden_states": states[r, :n].to(dtype).contiguous()},
                      str(hs_dir / f"hs_{i}.safetensors"))
        bar.update(sum(lens))
    bar.close()
    return seconds


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def extract(verifier_dir: str | os.PathLike, dataset_dir: str | os.PathLike,
        capture_path: str | os.PathLike, out_dir: str | os.PathLike,
        metrics_path: str | os.PathLike | None, *, dtype: str, batch_size: int, threads: int,
        progress: bool = True) -> dict:
    """The extract stage: verifier + dataset + capture.json -> artifacts/hidden (atomically,
    validated before it is published) and metrics/extract.json. Returns the metrics."""
    if dtype not in DTYPES:
        raise ExtractError(f"extract.dtype={dtype!r}: use one of {sorted(DTYPES)}")
    seed_everything(0, threads)
    torch_dtype = DTYPES[dtype]
    v = Verifier(verifier_dir)  # fails fast on a vanished or changed external checkpoint
    mdir, info = v.model_dir, v.info
    spec = read_capture(capture_path, info)  # fail fast, before loading weights
    splits = {name: read_split(Path(dataset_dir) / f"{name}.jsonl", info.vocab_size,
                               v.get("max_position_embeddings")) for name in SPLITS}
    if not splits["train"]:
        raise ExtractError(f"{Path(dataset_dir) / 'train.jsonl'}: no samples; "
                           "regenerate it with `dvc repro dataset`")
    log.info("verifier %s: %d layers, H=%d; capturing aux %s + pre-norm final as %s",
             mdir, info.num_hidden_layers, info.hidden_size, list(spec.aux_layer_ids), dtype)
    model = load_verifier(mdir)
    mcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    check_capture_matches(spec, VerifierInfo(
        source=str(mdir), hidden_size=mcfg.hidden_size, num_hidden_layers=mcfg.num_hidden_layers,
        vocab_size=mcfg.vocab_size, num_attention_heads=None, bos_token_id=None,
        eos_token_id=None, model_type=None, architectures=()), capture_path)
    pad_id = mcfg.pad_token_id if isinstance(getattr(mcfg, "pad_token_id", None), int) else 0
    aux = list(spec.aux_layer_ids)
    seconds, counts = 0.0, {}
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        for name in SPLITS:
            samples = splits[name]
            seconds += extract_split(model, samples, aux, tmp / name, torch_dtype, batch_size,
                                     pad_id=pad_id, progress=progress, desc=f"extract {name}")
            validate_split(tmp / name, samples, spec.num_slots, spec.hidden_size, torch_dtype)
            counts[name] = {"samples": len(samples),
                            "tokens": sum(len(s.input_ids) for s in samples),
                            "supervised_tokens": sum(sum(s.loss_mask) for s in samples)}
        manifest = {"layout": LAYOUT, "aux_layer_ids": aux, "final": spec.final,
                    "slots": [f"layer_input_{i}" for i in aux] + ["final_pre_norm"],
                    "hidden_size": spec.hidden_size, "verifier_num_layers":
                    spec.verifier_num_layers, "dtype": dtype, "splits": counts}
        write_json(tmp / "manifest.json", manifest)
    tokens = sum(c["tokens"] for c in counts.values())
    hs_bytes = sum(tree_bytes(out_dir / n / "hidden_states") for n in SPLITS)
    total = tree_bytes(out_dir)
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    metrics = {
        "samples": sum(c["samples"] for c in counts.values()),
        "tokens": tokens,
        "splits": counts,
        "bytes_on_disk": total,
        "bytes_per_token": round(total / tokens, 2),
        "hidden_bytes_per_token": round(hs_bytes / tokens, 2),
        "min_bytes_per_token": spec.num_slots * spec.hidden_size * elem,
        "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
        "dtype": dtype,
        "batch_size": batch_size,
        "threads": threads,
    }
    if metrics_path is not None:  # the committed file carries no timing: same inputs, same bytes
        write_json(metrics_path, {k: v for k, v in metrics.items() if k != "tokens_per_second"})
    return metrics


def run(params, paths) -> dict:
    """The stage (eagle3pipe.stage.main): paths.verifier, .dataset, .capture -> paths.out; the
    returned metrics carry no timing (same inputs, same bytes)."""
    e = params.extract
    m = extract(paths.verifier, paths.dataset, paths.capture, paths.out, None, dtype=e.dtype,
                batch_size=e.batch_size, threads=e.threads, progress=paths.progress)
    log.info("%d samples, %d tokens, %.0f tokens/s, %.0f bytes/token (min %d) -> %s",
             m["samples"], m["tokens"], m["tokens_per_second"], m["bytes_per_token"],
             m["min_bytes_per_token"], paths.out)
    return {k: v for k, v in m.items() if k != "tokens_per_second"}
