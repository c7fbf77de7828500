"""What every stage's estimate is computed from, from params.yaml and the verifier's config.json
alone (no model loaded, no engine started), and the record an estimate is.

Hand-checkable figures: hidden-state bytes/token = (NUM_AUX + 1) x H x bytes(extract.dtype)
(57,344 for bf16 at H 7168); tokens = dataset.num_samples x (max_prompt_tokens +
max_new_tokens), an upper bound; draft parameters = numel of arch.contract's floating tensors;
verifier weights from eagle3pipe.estimates.size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eagle3pipe.config import params as P
from eagle3pipe.config.schema import Params, VllmParams
from eagle3pipe.draft import arch as A
from eagle3pipe.estimates.size import oracle_active_params, oracle_float32, verifier_weights
from eagle3pipe.runtime.device import cuda_available  # noqa: F401 - plan and the runner's check read it here
from eagle3pipe.runtime.units import DTYPE_BYTES, human
from eagle3pipe.verifier.handle import VerifierInfo, read_config

ADAMW_BYTES_PER_PARAM = 4 + 4 + 8  # float32 weights + grads + AdamW's two moments
TOKEN_ROW_BYTES = 8 + 8  # input_ids + loss_mask, int64, per token (extract's Arrow rows)
HS_TOKEN_IDS_BYTES = 8  # token_ids int64 beside every hs_{i}.safetensors' hidden_states


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
    num_layers: int
    oracle_embedding_bytes: int  # float32, what the transformers oracle holds beside a layer
    oracle_layer_bytes: int  # the largest decoder layer in float32
    oracle_from: str
    oracle_active_params: int  # what one token passes through (eagle3pipe.estimates.size)


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
                   v_bytes, v_from, v_params * stored, info.model_type, gpu,
                   info.num_hidden_layers, *oracle_float32(cfg, cfg_file),
                   oracle_active_params(cfg))


def oracle_flop(params: Params, f: Figures) -> int:
    """The oracle's float32 work: extract.oracle_samples samples at their longest (max_prompt
    + max_new tokens) x 2 x the parameters each token passes through."""
    d = params.dataset
    return params.extract.oracle_samples * (d.max_prompt_tokens + d.max_new_tokens) \
        * 2 * f.oracle_active_params


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
