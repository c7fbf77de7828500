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
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from eagle3pipe.config.view import StageView
from eagle3pipe.data import gc, leases, store
from eagle3pipe.data.samples import Sample
from eagle3pipe.data.samples import read as read_split
from eagle3pipe.engines.engine import numeric, on_demand_settings, vllm_version
from eagle3pipe.runtime.atomic import atomic_dir
from eagle3pipe.runtime.jsonio import write_json
from eagle3pipe.runtime.kernels import kernels
from eagle3pipe.runtime.seeds import seed_everything
from eagle3pipe.hidden.keys import sample_keys
from eagle3pipe.hidden import spec as capture_spec
from eagle3pipe.hidden.checks import check_states, validate_split
from eagle3pipe.hidden.oracle import Oracle
from eagle3pipe.hidden.spec import CaptureSpec, ExtractError, read_capture, slot_names
from eagle3pipe.stages.runner import Paths
from eagle3pipe.verifier.handle import Verifier

log = logging.getLogger("eagle3pipe.stages.extract")

SPLITS = ("train", "eval")
LAYOUT = "speculators-0.9-arrow"


# ---------------------------------------------------------------------------------------------
# Inputs


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


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_split(out_dir: Path, samples: list[Sample], entries: list[Path] | None) -> int:
    """Writes one split: the tokenized rows, and hs_{i}.safetensors for sample i, published
    from its store entry (a hard link where the filesystem allows); entries None (on demand):
    the rows only. Returns the links made."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_dataset(samples, out_dir)
    if entries is None:
        return 0
    hs_dir = out_dir / "hidden_states"
    hs_dir.mkdir()
    return sum(store.publish(entry, hs_dir / f"hs_{i}.safetensors")
               for i, entry in enumerate(entries))


def extract(verifier_dir: str | os.PathLike, dataset_dir: str | os.PathLike,
            capture_path: str | os.PathLike, out_dir: str | os.PathLike, *, settings: dict,
            e, progress: bool = True, record_to: Path | None = None) -> dict:
    """The extract stage: verifier + dataset + capture.json -> artifacts/hidden, captured by
    vLLM with the run's engine settings, spot-checked against the transformers oracle,
    validated and published atomically. `e` is the params' `extract` section. Returns the
    metrics (tokens_per_second is the only timing)."""
    seed_everything(e.seed, e.threads)
    if e.mode != "offline":  # the train stage's engine computes the rest with these settings
        settings = on_demand_settings(settings)
    # fails fast on a vanished or changed external checkpoint
    v = Verifier(verifier_dir, trust_remote_code=settings["trust_remote_code"])
    spec = read_capture(capture_path, v.info)  # fail fast, before loading weights
    splits = _read_splits(v, Path(dataset_dir))
    aux = list(spec.aux_layer_ids)
    log.info("verifier %s: %d layers, H=%d; vLLM captures aux %s + pre-norm final, stored as "
             "%s", v.model_dir, v.info.num_hidden_layers, v.info.hidden_size, aux, e.dtype)
    layer_ids = spec.layer_ids
    recorded = numeric(settings, v.model_dir)  # what the keys, manifest and metrics hold
    keys = {name: sample_keys(v.fingerprint, [s.input_ids for s in ss], layer_ids,
                              recorded, e.dtype, vllm_version())
            for name, ss in splits.items()}
    hs = store.Store("hidden")
    # the oracle's memory is judged before the engine starts; its samples are checked once vLLM
    # has handed the last of them over (in the first batch), before they are stored
    oracle = Oracle(v, splits["train"], keys["train"], aux, e)
    # on demand (online, hybrid) the train stage captures the samples; here the oracle's only
    on_demand, upto = e.mode != "offline", max(oracle.chosen, default=-1) + 1
    capture = {n: ss[:upto] if on_demand and n == "train" else [] if on_demand else ss
               for n, ss in splits.items()}
    # no gc or other run's bound removes an entry this run reads until its output links it
    with leases.hold(store.root(), {"hidden": [k for ks in keys.values() for k in ks]}):
        with atomic_dir(Path(out_dir)) as tmp:
            seconds, computed = _capture_missing(v, capture, keys, hs, layer_ids, tmp, settings, e,
                                                 progress, oracle, Path(dataset_dir))
            linked = 0
            for name, samples in splits.items():
                linked += write_split(tmp / name, samples,
                                      None if on_demand else [hs.path(k) for k in keys[name]])
                validate_split(tmp / name, samples, len(layer_ids), v.info.hidden_size,
                               capture_spec.torch_dtype(e.dtype), layer_ids=layer_ids, rows_only=on_demand)
            total = sum(map(len, capture.values()))
            oracle = oracle.finish(lambda i: load_file(hs.path(keys["train"][i]))["hidden_states"])
            counts = {name: {"samples": len(ss), "tokens": sum(len(s.input_ids) for s in ss),
                             "supervised_tokens": sum(sum(s.loss_mask) for s in ss)}
                      for name, ss in splits.items()}
            write_json(tmp / "manifest.json",
                       _manifest(spec, counts, keys, layer_ids, recorded, e, on_demand))
    if e.mode == "online":  # keeps nothing past its use: the oracle's samples are checked
        others = leases.held(store.root()).get("hidden", set())  # another run reads those
        for k in computed:
            if k not in others:
                hs.path(k).unlink(missing_ok=True)
    store.record("extract", len(computed), total - len(computed), 0, total, linked,
                 to=record_to)
    log.info("store %s: %d samples computed, %d reused, %d published as hard links%s",
             store.root(), len(computed), total - len(computed), linked,
             f" ({e.mode}: the train stage computes the rest)" if on_demand else "")
    gc.enforce_bound()
    return _metrics(Path(out_dir), spec, counts, seconds, settings, recorded, e, oracle)


def _read_splits(v: Verifier, dataset_dir: Path) -> dict[str, list[Sample]]:
    """The dataset stage's splits, checked against the verifier's vocab and positions; an
    empty train split is an error."""
    splits = {name: read_split(dataset_dir / f"{name}.jsonl", v.info.vocab_size,
                               v.get("max_position_embeddings")) for name in SPLITS}
    if not splits["train"]:
        raise ExtractError(f"{dataset_dir / 'train.jsonl'}: no samples; "
                           "regenerate it with `dvc repro dataset`")
    return splits


def _manifest(spec: CaptureSpec, counts: dict, keys: dict, layer_ids: list[int],
              recorded: dict, e, on_demand: bool) -> dict:
    """manifest.json: the layout, the capture and each split's counts and store keys (what
    `eagle3pipe gc` keeps); on demand, the keys and settings the train stage captures with."""
    aux = list(spec.aux_layer_ids)
    doc = {"layout": LAYOUT, "aux_layer_ids": aux, "final": spec.final,
           "slots": slot_names(aux), "hidden_size": spec.hidden_size,
           "verifier_num_layers": spec.verifier_num_layers, "dtype": e.dtype,
           "splits": counts, "store_keys": keys}  # what `eagle3pipe gc` keeps
    if on_demand:  # a cache, not a published output: gc may evict these (no store_keys)
        doc |= {"mode": e.mode, "sample_keys": doc.pop("store_keys"),
                "layer_ids": layer_ids, "engine_settings": recorded,
                "vllm_version": vllm_version(),
                "oracle": {"oracle_samples": e.oracle_samples,
                           "oracle_tolerance": e.oracle_tolerance}}
    return doc


def _capture_missing(v: Verifier, splits: dict, keys: dict, hs, layer_ids: list[int],
                     tmp: Path, settings: dict, e, progress: bool, oracle: "Oracle",
                     dataset_dir: Path) -> tuple[float, list[str]]:
    """Captures, through one engine, every sample whose key the store lacks, each checked
    (check_states, then the oracle where it is an oracle sample) and stored as soon as the
    engine hands it over, the oracle's samples once the oracle has checked them (a crash keeps
    what was finished; a refused sample is not stored).
    No engine starts when nothing is missing. Returns (the engine's seconds, the keys
    computed)."""
    from eagle3pipe.engines import engine
    from eagle3pipe.hidden import capture
    todo = [(name, i) for name, ss in splits.items() for i, k in enumerate(keys[name][:len(ss)])
            if not hs.has(k)]
    todo = list({keys[n][i]: (n, i) for n, i in todo}.values())  # a repeated sample: once
    if not todo:
        return 0.0, []
    prompts = [list(splits[n][i].input_ids) for n, i in todo]
    prompt_of = {keys[n][i]: p for (n, i), p in zip(todo, prompts)}
    oracle.expect(prompt_of)
    bar = tqdm(total=sum(map(len, prompts)), unit="tok", desc="extract", disable=not progress,
               mininterval=1.0)
    seconds, t0 = 0.0, time.perf_counter()
    with capture.storage_dir(tmp) as storage, engine.engine(
            settings, v.model_dir, tokenizer=v.dir, threads=e.threads,
            **capture.engine_config(layer_ids, Path(storage))) as llm:
        for j, hidden in capture.hidden_states(llm, prompts, batch_size=e.batch_size):
            seconds += time.perf_counter() - t0
            n, i = todo[j]
            stored = hidden.to(capture_spec.torch_dtype(e.dtype)).contiguous()
            check_states(stored, prompts[j], layer_ids, file=str(dataset_dir / f"{n}.jsonl"),
                         sample=f"{n} sample {i} ({splits[n][i].id})")
            for key, states in oracle.see(keys[n][i], stored):  # an oracle sample once checked
                hs.put_hidden(key, prompt_of[key], states)
            bar.update(len(prompts[j]))
            t0 = time.perf_counter()
    bar.close()
    return seconds, [keys[n][i] for n, i in todo]


def _metrics(out_dir: Path, spec: CaptureSpec, counts: dict, seconds: float, settings: dict,
             recorded: dict, e, oracle: dict) -> dict:
    tokens = sum(c["tokens"] for c in counts.values())
    hs_bytes = sum(tree_bytes(out_dir / n / "hidden_states") for n in SPLITS)
    total = tree_bytes(out_dir)
    elem = torch.tensor([], dtype=capture_spec.torch_dtype(e.dtype)).element_size()
    return {
        "engine": "vllm", "tensor_parallel_size": settings["tensor_parallel_size"],
        "engine_settings": recorded,
        "kernels": kernels(vllm=True),
        "samples": sum(c["samples"] for c in counts.values()),
        "tokens": tokens,
        "splits": counts,
        "bytes_on_disk": total,
        "bytes_per_token": round(total / tokens, 2),
        "hidden_bytes_per_token": round(hs_bytes / tokens, 2),
        "min_bytes_per_token": spec.num_slots * spec.hidden_size * elem,
        "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
        **({"mode": e.mode} if e.mode != "offline" else {}),
        "oracle": oracle,
        "dtype": e.dtype,
        "batch_size": e.batch_size,
        "threads": e.threads,
    }


def run(params: StageView, paths: Paths) -> dict:
    """The stage (eagle3pipe.stages.runner.main): paths.verifier, .dataset, .capture -> paths.out; the
    returned metrics carry no timing (same inputs, same bytes)."""
    from eagle3pipe.engines.engine import settings_of

    m = extract(paths.verifier, paths.dataset, paths.capture, paths.out,
                settings=settings_of(params.vllm), e=params.extract, progress=paths.progress,
                record_to=store.counts_path("extract", paths.dvc_yaml))
    log.info("%d samples, %d tokens, %.0f tokens/s, %.0f bytes/token (min %d) -> %s",
             m["samples"], m["tokens"], m["tokens_per_second"], m["bytes_per_token"],
             m["min_bytes_per_token"], paths.out)
    return {k: v for k, v in m.items() if k != "tokens_per_second"}
