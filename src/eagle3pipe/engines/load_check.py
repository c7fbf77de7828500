"""Engine-less load check of an exported EAGLE-3 draft, with vLLM's own code.

vLLM's EAGLE-3 loader (llama_eagle3.py `Eagle3LlamaForCausalLM.load_weights`) returns no list of
loaded weights, so vLLM's strict "weights not initialized" check is off for these drafts: a
missing tensor (fc.weight, say) stays uninitialised memory, and a tensor larger than the config
says (weights built with head_dim 64 under a config saying 32) is silently narrowed to fit. The
engine starts, speculates garbage, and nothing fails.

This module builds the exact VllmConfig an engine would build, instantiates the draft model class
vLLM resolves for the export (on CPU, no KV cache, no verifier weights), fills every parameter
with NaN (integer ones with a sentinel), runs vLLM's weight loader on the export's safetensors,
and reports, naming tensors:
  - every parameter still NaN afterwards (the embedding is excepted when vLLM shares the
    verifier's, which it does for a draft without embed_tokens of the same width);
  - every checkpoint tensor whose shape differs from the slot vLLM loads it into (a trim);
  - every checkpoint tensor vLLM never handed to a weight loader (t2d excepted: vLLM derives
    nothing from it);
  - any exception vLLM's config, model or loader code raised.

Engines themselves (start, environment, teardown) are eagle3pipe.engines.engine's.
"""
from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3pipe.engines import engine

# tensors a draft checkpoint may carry that vLLM's EAGLE-3 loader deliberately skips
IGNORED_BY_VLLM = ("t2d",)


@dataclass
class LoadReport:
    draft_dir: str
    architecture: str = ""
    problems: list[str] = field(default_factory=list)
    parameters: dict[str, list[int]] = field(default_factory=dict)  # vLLM param -> shape
    loaded_tensors: list[str] = field(default_factory=list)  # checkpoint tensors vLLM consumed
    shared_embedding: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def build_vllm_config(settings: dict, model_dir: str | Path, speculative_config: dict):
    """The VllmConfig `LLM(...)` would build with the run's engine settings (vLLM's
    EngineArgs), for one rank: tensor names and shapes do not depend on the parallelism, and
    the check runs in this one process."""
    from vllm.engine.arg_utils import EngineArgs

    kw = engine.engine_kwargs(settings, model_dir, speculative_config=speculative_config,
                              tensor_parallel_size=1, pipeline_parallel_size=1,
                              data_parallel_size=1, enable_expert_parallel=False)
    return EngineArgs(**kw).create_engine_config()


@contextlib.contextmanager
def single_process_group(vllm_config):
    """vLLM's model classes need an initialized (world size 1) distributed env and model-parallel
    groups, and a current VllmConfig; this sets them up with gloo and tears down what it made."""
    import torch.distributed
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.utils.network_utils import (
        get_distributed_init_method,
        get_loopback_ip,
        get_open_port,
    )

    owned = False
    with set_current_vllm_config(vllm_config):
        if not torch.distributed.is_initialized():
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=get_distributed_init_method(get_loopback_ip(),
                                                                    get_open_port()))
            owned = True
        if not ps.model_parallel_is_initialized():
            ps.ensure_model_parallel_initialized(1, 1)
            owned = True
        try:
            yield
        finally:
            if owned:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()


def _fill_sentinel(model) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data.fill_(float("nan"))
            elif p.dtype != torch.bool:
                p.data.fill_(torch.iinfo(p.dtype).min)


def _unfilled(p) -> int:
    import torch

    if p.is_floating_point():
        return int(torch.isnan(p.data).sum())
    if p.dtype == torch.bool:
        return 0
    return int((p.data == torch.iinfo(p.dtype).min).sum())


def _vocab_rows(module) -> int | None:
    """Real rows of a vocab-parallel parameter (vLLM pads lm_head/embeddings to a multiple of
    64 rows; the padding is never loaded and never read)."""
    idx = getattr(module, "shard_indices", None)
    return idx.num_org_elements if idx is not None and hasattr(idx, "num_org_elements") else None


def _slot_shape(module, param, shard_id) -> tuple[int, ...] | None:
    """Shape of the part of a (possibly fused) vLLM parameter one checkpoint tensor fills."""
    shape = tuple(param.shape)
    rows = _vocab_rows(module)
    if rows is not None and shard_id is None:
        return (rows, *shape[1:])
    if shard_id is None:
        return shape
    sizes = getattr(module, "output_sizes", None)
    out_dim = getattr(param, "output_dim", 0)
    if not sizes or out_dim is None:
        return None
    if isinstance(shard_id, str):
        idx = {"q": 0, "k": 1, "v": 2}.get(shard_id)
        span = [idx] if idx is not None else []
    elif isinstance(shard_id, tuple):
        span = list(shard_id)
    else:
        span = [int(shard_id)]
    if not span or max(span) >= len(sizes):
        return None
    s = list(shape)
    s[out_dim] = sum(sizes[i] for i in span)
    return tuple(s)


def check_draft(settings: dict, model_dir: str | Path, draft_dir: str | Path, *,
                num_speculative_tokens: int) -> LoadReport:
    """Loads `draft_dir` into vLLM's EAGLE-3 draft class engine-less and reports what vLLM would
    silently get wrong. `settings`: the run's engine settings (engine.settings_of); `model_dir`
    is the verifier checkpoint (its config is read, not its weights)."""
    return load_draft(settings, model_dir, draft_dir,
                      num_speculative_tokens=num_speculative_tokens)[0]


def load_draft(settings: dict, model_dir: str | Path, draft_dir: str | Path, *,
               num_speculative_tokens: int) -> tuple[LoadReport, "_Load | None"]:
    """check_draft's load and report, and what was loaded: `load.model` is vLLM's draft model
    with the export's weights (what no tensor filled still holds NaN), `load.vllm_config` its
    VllmConfig; run it inside single_process_group(load.vllm_config). `load` is None when vLLM
    raised (the report's problem says where). engines/forward_check.py runs the model."""
    t0 = time.perf_counter()
    draft_dir = Path(draft_dir)
    report = LoadReport(draft_dir=str(draft_dir))
    spec = {"method": "eagle3", "model": str(draft_dir),
            "num_speculative_tokens": int(num_speculative_tokens)}
    steps: list[str] = []
    try:
        load = _load(settings, model_dir, spec, report, steps)
    except Exception as e:  # noqa: BLE001 - reported with vLLM's own message
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        report.problems.append(f"{draft_dir}: vLLM failed while {steps[-1]}: {tb}")
        report.seconds = time.perf_counter() - t0
        return report, None
    consumed = _compare_slots(load, report)
    _report_unfilled(load, report)
    _report_unloaded(load, consumed, report)
    report.seconds = time.perf_counter() - t0
    return report, load


@dataclass
class _Load:
    """An engine-less load: the draft model vLLM built and what its weight loaders received."""
    vllm_config: Any
    model: Any
    named: dict[str, Any]  # vLLM parameter name -> parameter
    owner: dict[int, Any]  # id(parameter) -> the module holding it
    # per parameter, each outermost weight-loader call: (tensor shape, shard id, tensor key)
    received: dict[str, list[tuple[tuple[int, ...], Any, tuple]]] = field(default_factory=dict)
    sources: dict[tuple, str] = field(default_factory=dict)  # tensor key -> checkpoint name
    keep: list = field(default_factory=list)  # the checkpoint tensors, so no key is reused


def _load(settings: dict, model_dir: str | Path, spec: dict, report: LoadReport,
          steps: list[str]) -> _Load:
    """Builds vLLM's config, instantiates the draft class and runs vLLM's weight loader on the
    export; `steps` ends with the step under way (for the report when one raises)."""
    steps.append("building vLLM's config")
    vc = build_vllm_config(settings, model_dir, spec)
    with single_process_group(vc):
        steps.append("instantiating vLLM's draft model class")
        load = _instantiate(vc, report)
        steps.append("running vLLM's weight loader")
        _run_weight_loader(load)
    return load


def _instantiate(vc, report: LoadReport) -> _Load:
    """vLLM's draft model on CPU, every parameter filled with the sentinel and its weight loader
    wrapped to record what it receives."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    dmc = vc.speculative_config.draft_model_config
    with set_default_torch_dtype(dmc.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=vc, model_config=dmc)
    report.architecture = type(model).__name__
    named = dict(model.named_parameters())
    report.parameters = {n: list(p.shape) for n, p in named.items()}
    load = _Load(vc, model, named,
                 {id(p): mod for mod in model.modules() for p in mod.parameters(recurse=False)})
    _fill_sentinel(model)
    for pname, p in named.items():
        p.weight_loader = _recording(load.received, pname,
                                     getattr(p, "weight_loader", default_weight_loader))
    return load


def _recording(received: dict, pname: str, inner):
    """`inner` (a weight loader), recording each call's tensor into received[pname]."""
    def loader(p, loaded_weight, *args, **kwargs):
        shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
        received.setdefault(pname, []).append(
            (tuple(loaded_weight.shape), shard, _key(loaded_weight)))
        return inner(p, loaded_weight, *args, **kwargs)
    return loader


def _run_weight_loader(load: _Load) -> None:
    """vLLM's draft loader on the export's safetensors, noting each tensor's checkpoint name."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    dmc = load.vllm_config.speculative_config.draft_model_config
    loader = get_model_loader(get_draft_load_config(load.vllm_config))

    def weights():
        for name, t in loader.get_all_weights(dmc, load.model):
            load.sources[_key(t)] = name
            load.keep.append(t)
            yield name, t

    load.model.load_weights(weights())


def _compare_slots(load: _Load, report: LoadReport) -> set[str]:
    """Reports every tensor whose shape differs from the slot it was loaded into; returns the
    checkpoint tensors that reached a weight loader (also report.loaded_tensors)."""
    consumed: set[str] = set()
    for pname, calls in sorted(load.received.items()):
        p = load.named[pname]
        for shape, shard, key in calls:
            src = load.sources.get(key)  # shards vLLM splits off alias the same storage
            if src is not None:
                consumed.add(src)
            slot = _slot_shape(load.owner.get(id(p)), p, shard)
            if slot is not None and shape != slot:
                where = f" (shard {shard!r})" if shard is not None else ""
                report.problems.append(
                    f"{report.draft_dir}: tensor {src or '?'} has shape {list(shape)} but "
                    f"vLLM's {pname}{where} holds {list(slot)}: vLLM would silently "
                    f"{'trim' if _numel(shape) > _numel(slot) else 'misplace'} it "
                    "(weights built for another head_dim/heads/sizes than config.json says)")
    report.loaded_tensors = sorted(consumed)
    return consumed


def _report_unfilled(load: _Load, report: LoadReport) -> None:
    """Reports every parameter still (partly) holding the sentinel, but the embedding vLLM
    replaces with the verifier's (report.shared_embedding)."""
    hidden = load.vllm_config.model_config.get_hidden_size()
    embed = getattr(getattr(load.model, "model", None), "embed_tokens", None)
    own_embed = bool(getattr(load.model, "has_own_embed_tokens", False))
    report.shared_embedding = (embed is not None and not own_embed
                               and embed.weight.shape[-1] == hidden)
    for pname, p in load.named.items():
        rows = _vocab_rows(load.owner.get(id(p)))
        n = _unfilled(p.data[:rows] if rows is not None else p)
        if not n:
            continue
        if report.shared_embedding and p is getattr(embed, "weight", None):
            continue  # vLLM replaces it with the verifier's embedding after loading
        hint = ""
        if pname.endswith("lm_head.weight"):
            hint = " (vLLM would substitute the verifier's lm_head, of another vocab size)"
        elif pname.endswith("embed_tokens.weight"):
            hint = f" (not shared: verifier hidden {hidden} != draft width {p.shape[-1]})"
        report.problems.append(
            f"{report.draft_dir}: vLLM's {report.architecture}.{pname} {list(p.shape)}: {n} of "
            f"{p.numel()} values never loaded ({_expected_source(pname)} missing from the "
            f"checkpoint?); vLLM would run with uninitialised memory{hint}")


def _report_unloaded(load: _Load, consumed: set[str], report: LoadReport) -> None:
    """Reports every checkpoint tensor no weight loader received (IGNORED_BY_VLLM excepted)."""
    for name in sorted(set(load.sources.values()) - consumed):
        if name in IGNORED_BY_VLLM:
            continue
        report.problems.append(f"{report.draft_dir}: tensor {name} was never loaded by vLLM "
                               "(silently ignored: a misnamed or extra tensor)")


def _key(t) -> tuple[int, tuple[int, ...]]:
    return (t.data_ptr(), tuple(t.shape))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _expected_source(pname: str) -> str:
    """The checkpoint tensor name(s) (flat layout) that fill a vLLM parameter."""
    n = pname.removeprefix("model.").replace("layers.0.", "midlayer.")
    n = n.replace("qkv_proj", "{q,k,v}_proj").replace("gate_up_proj", "{gate,up}_proj")
    return "d2t" if n == "draft_id_to_target_id" else n
