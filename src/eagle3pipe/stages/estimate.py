"""What a stage will run, hold and write, estimated before any compute from params.yaml and the
verifier's config.json alone (no model loaded, no engine started).

Each stage module supplies `estimate(params, figures) -> Estimate`; the runner logs it at the
start of the stage and refuses, before any compute, an output that would not fit on the free
disk where it is written (`check`); `eagle3pipe plan` (eagle3pipe.tools.plan) tabulates the
same estimates for every stage. Hand-checkable figures: hidden-state bytes/token =
(NUM_AUX + 1) x H x bytes(extract.dtype) (57,344 for bf16 at H 7168); tokens =
dataset.num_samples x (max_prompt_tokens + max_new_tokens), an upper bound; draft parameters =
numel of arch.contract's floating tensors; verifier weights from eagle3pipe.verifier.size.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eagle3pipe.config import params as P
from eagle3pipe.config.schema import Params, VllmParams
from eagle3pipe.draft import arch as A
from eagle3pipe.errors import Error, Problem
from eagle3pipe.runtime.disk import free_bytes
from eagle3pipe.runtime.units import DTYPE_BYTES, human
from eagle3pipe.verifier.handle import (
    VerifierConfigError,
    VerifierInfo,
    find_config,
    read_config,
)
from eagle3pipe.verifier.size import verifier_weights

ADAMW_BYTES_PER_PARAM = 4 + 4 + 8  # float32 weights + grads + AdamW's two moments
TOKEN_ROW_BYTES = 8 + 8  # input_ids + loss_mask, int64, per token (extract's Arrow rows)
HS_TOKEN_IDS_BYTES = 8  # token_ids int64 beside every hs_{i}.safetensors' hidden_states
FREE_BYTES_ENV = "EAGLE3PIPE_FREE_BYTES"  # what-if (and tests): the free disk to plan against


@dataclass
class Estimate:
    name: str
    engine: str
    processes: int
    tokens: int | None = None
    disk_bytes: int | None = None
    device_bytes: int | None = None  # per device (GPU), or the whole host's share on CPU
    host_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    sized_by: str = ""  # the params key that sizes the output (for a disk refusal)


@dataclass(frozen=True)
class Figures:
    """What every estimate is computed from: the run's sizes, derived once."""
    tokens: int
    hidden_size: int
    hidden_per_token: int
    draft_params: int
    draft_bytes: int
    train_bytes: int  # the float32 training checkpoint
    activation_floats: int
    verifier_params: int
    verifier_bytes: int
    verifier_from: str
    verifier_disk: int  # what the embedded verifier stage writes (its stored dtype)
    model_type: str | None
    gpu: bool


Estimator = Callable[[Params, Figures], Estimate]


def hidden_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes of one token's stored hidden states: (3 aux + 1 last) x H x bytes(dtype)."""
    return (A.NUM_AUX + 1) * hidden_size * DTYPE_BYTES[dtype]


def activation_floats_per_token(specs: dict[str, A.TensorSpec]) -> int:
    """Floats kept for backward per token and TTT step: every contract matrix's input and
    output width (a rough estimate, read off the contract's shapes)."""
    return sum(s.shape[0] + s.shape[1] for s in specs.values() if len(s.shape) == 2)


def dataset_tokens(params: Params) -> int:
    d = params.dataset
    return d.num_samples * (d.max_prompt_tokens + d.max_new_tokens)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def figures(params: Params, verifier_config: str | Path, gpu: bool) -> Figures:
    whole, cfg, cfg_file = read_config(verifier_config)
    info = VerifierInfo.from_config(cfg_file)
    arch = A.derive(params.draft, info, params_file=P.source_of(params), lines=P.lines_of(params))
    specs = A.contract(arch, "speculators")
    draft_params, draft_bytes = A.totals(specs)
    _, train_bytes = A.totals(A.contract(dataclasses.replace(arch, dtype="float32"),
                                         "speculators"))
    v_params, v_bytes, v_from = verifier_weights(whole, cfg, cfg_file, params.vllm.dtype)
    stored = DTYPE_BYTES.get(cfg.get("dtype") or cfg.get("torch_dtype"), 4)
    return Figures(dataset_tokens(params), info.hidden_size,
                   hidden_bytes_per_token(info.hidden_size, params.extract.dtype), draft_params,
                   draft_bytes, train_bytes, activation_floats_per_token(specs), v_params,
                   v_bytes, v_from, v_params * stored, info.model_type, gpu)


def engine_estimate(name: str, v: VllmParams, f: Figures, tokens: int, disk: int | None,
                    extra: int = 0, sized_by: str = "") -> Estimate:
    """A stage that runs the verifier in vLLM; `extra` is what it adds per device (a draft)."""
    shards = v.tensor_parallel_size * v.pipeline_parallel_size
    ranks = shards * v.data_parallel_size
    kv = v.kv_cache_memory_bytes or 0
    per_device = f.verifier_bytes // shards + extra + kv
    ep = " EP" if v.enable_expert_parallel else ""
    label = (f"vLLM TP{v.tensor_parallel_size} PP{v.pipeline_parallel_size} "
             f"DP{v.data_parallel_size}{ep} {'GPU' if f.gpu else 'CPU'}")
    host = (per_device - kv) * ranks + kv * v.data_parallel_size  # CPU: every rank is here
    e = Estimate(name, label, ranks, tokens, disk, per_device, None if f.gpu else host,
                 sized_by=sized_by)
    e.notes.append(f"verifier {human(f.verifier_bytes)} / (TP x PP = {shards})"
                   + (f" + draft {human(extra)}" if extra else "")
                   + (f" + KV cache {human(kv)} (vllm.kv_cache_memory_bytes)" if kv else
                      f" + KV cache up to vllm.gpu_memory_utilization {v.gpu_memory_utilization}"
                      " of the device"))
    return e


def disk_problem(bytes_needed: int, path: str | Path, key: str) -> Problem | None:
    """The problem when `bytes_needed` exceed the free disk where `path` (or its nearest
    existing parent) lives; None when it fits. $EAGLE3PIPE_FREE_BYTES stands in for the measured
    free space."""
    where, free = free_bytes(path)
    if os.environ.get(FREE_BYTES_ENV):
        free = int(os.environ[FREE_BYTES_ENV])
    if bytes_needed <= free:
        return None
    return Problem(str(path), None, key, f"needs {human(bytes_needed)} but {where} has "
                   f"{human(free)} free", f"free disk there, put {path} on a larger disk, or "
                   f"lower {key}")


def line(e: Estimate, gpu: bool) -> str:
    return (f"estimate ({'GPU' if gpu else 'CPU'}): {e.engine}, {e.processes} process(es), "
            f"tokens {e.tokens if e.tokens is not None else '-'}, disk {human(e.disk_bytes)}, "
            f"memory/device {human(e.device_bytes)}, host {human(e.host_bytes)}")


def check(stage: str, estimate: Estimator, params_file: str | os.PathLike,
          out: Path | None) -> None:
    """The runner's step before `run`: the stage's estimate at the start of its log, and a
    refusal (before any compute) when its output would not fit on the free disk where it is
    written. Like for_validation, it reads the whole params file; it changes no output.
    Nothing to estimate from before the verifier stage built the embedded verifier, nor from a
    verifier config on disk that the draft params do not fit: the verifier stage runs before the
    configs stage renders that file for the params, and each stage's own checks refuse real
    misfits."""
    params = P.load(params_file)
    log = logging.getLogger(f"eagle3pipe.{stage}")
    try:
        cfg = find_config(params.verifier.path)
    except VerifierConfigError:
        return
    try:
        f = figures(params, cfg, cuda_available())
    except Error as err:
        why = (f"{err.problems[0].key}: {err.problems[0].message}" if err.problems
               else (str(err).splitlines() or [type(err).__name__])[0])
        log.info("estimate: skipped (%s does not fit the draft params yet: %s)", cfg, why)
        return
    e = estimate(params, f)
    for text in [line(e, f.gpu)] + [f"estimate: {n}" for n in e.notes]:
        log.info("%s", text)
    problem = disk_problem(e.disk_bytes, out, e.sized_by or stage) \
        if out is not None and e.disk_bytes else None
    if problem:
        raise Error(problems=[problem])
