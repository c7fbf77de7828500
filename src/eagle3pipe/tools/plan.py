"""`eagle3pipe plan`: what each stage will run, hold and write, and what cannot work, from
params.yaml and the verifier's config.json alone (no model loaded, no engine started).

The figures are each stage module's own `estimate` (eagle3pipe.stages.estimate explains them;
the stage runner logs the same estimate and refuses an output that cannot fit), tabulated here
with what this machine adds: vLLM's known limits, memory that exceeds a device or the host,
tensor-parallel ranks that do not split the verifier's heads. The planner depends on the
stages, never the reverse, so editing this report reruns no stage.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.config import params as P
from eagle3pipe.config.schema import Params
from eagle3pipe.draft.arch import NUM_AUX
from eagle3pipe.errors import Problem
from eagle3pipe.runtime.units import GiB, human
from eagle3pipe.stages import dataset, export, extract, smoke, train
from eagle3pipe.stages import estimate as E
from eagle3pipe.stages import verifier as verifier_stage
from eagle3pipe.verifier.handle import read_config
from eagle3pipe.verifier.preflight import eagle3_limit

# the stages with an estimate, in the pipeline's order
ESTIMATED = (verifier_stage, dataset, extract, train, export, smoke)


@dataclass
class Plan:
    params_file: str
    verifier_config: str
    model_type: str | None
    hidden_size: int
    gpu: bool
    device_bytes: int  # one GPU's memory (--device-gib), or the host's memory without a GPU
    hidden_bytes_per_token: int
    draft_params: int
    draft_bytes: int
    verifier_params: int
    verifier_weight_bytes: int
    verifier_weights_from: str
    stages: list[E.Estimate]
    assumptions: list[str]
    problems: list[str]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _heads_problems(params: Params, cfg: dict, bad) -> None:
    """The verifier's heads against vLLM's tensor-parallel ranks (the draft's: params.py)."""
    kv = None if "kv_lora_rank" in cfg else cfg.get("num_key_value_heads")
    found = P.tp_problem(params.vllm.tensor_parallel_size, cfg.get("num_attention_heads"), kv,
                         "verifier", "vLLM shards attention heads over the tensor-parallel ranks")
    if found:
        bad("vllm.tensor_parallel_size", *found)


def _machine_problems(params: Params, cfg: dict, f: E.Figures, bad) -> None:
    """vLLM's known limits on this machine (CPU build vs the GPU path)."""
    v = params.vllm
    limit = eagle3_limit(cfg, "the verifier config", cpu=not f.gpu)  # the preflight's words
    if limit:
        bad("verifier.path", limit.message, limit.fix)
    ranks = v.tensor_parallel_size * v.pipeline_parallel_size
    if not f.gpu and ranks > 1 and v.cpu_omp_threads_bind == "auto":
        bad("vllm.cpu_omp_threads_bind", f"auto with TP x PP = {ranks} ranks on vLLM's CPU "
            "backend: it refuses to start (\"Not enough allowed NUMA nodes\")",
            "give each rank its cores, e.g. \"0|1\" for 2 ranks")
    if params.train.device == "cuda" and not f.gpu:
        bad("train.device", "cuda, but torch sees no GPU on this machine",
            "use train.device: cpu here, or run training on a GPU machine")


def _fit_problems(params: Params, stages: list[E.Estimate], device: int, gpu: bool, bad) -> None:
    """Stages whose memory exceeds one device (GPU) or the host (CPU)."""
    util = params.vllm.gpu_memory_utilization
    for s in stages:
        if s.engine.startswith("vLLM") and gpu and s.device_bytes > device * util:
            bad("vllm.tensor_parallel_size", f"{s.name}: {human(s.device_bytes)} per GPU "
                f"exceeds {util} x {human(device)}", "raise vllm.tensor_parallel_size or "
                "pipeline_parallel_size (or use a quantized checkpoint)")
        elif s.name == "train" and (s.device_bytes or 0) > device:
            bad("train.nproc_per_node", f"train: the draft needs {human(s.device_bytes)} per "
                f"GPU (estimate), more than the device's {human(device)}",
                "lower train.batch_tokens, or a smaller draft (draft.intermediate_size, "
                "draft.draft_vocab_size)")
        elif s.host_bytes and s.host_bytes > host_memory_bytes():
            key = {"train": "train.nproc_per_node", "verifier": "verifier.embedded"}.get(
                s.name, "verifier.path")
            bad(key, f"{s.name}: needs {human(s.host_bytes)} of host memory, this machine has "
                f"{human(host_memory_bytes())}", "run it on a larger machine or the GPU path")


def problems_of(params: Params, cfg: dict, f: E.Figures, stages: list[E.Estimate], device: int,
                artifacts: str | Path) -> list[str]:
    file, lines = P.source_of(params), P.lines_of(params)
    found: list[Problem] = []
    P.check_engine(params, file, lines, found)  # the draft's heads vs TP, max_model_len

    def bad(key: str, msg: str, fix: str) -> None:
        found.append(Problem(file, lines.get(key), key, msg, fix))

    _heads_problems(params, cfg, bad)
    _machine_problems(params, cfg, f, bad)
    _fit_problems(params, stages, device, f.gpu, bad)
    extract = next(s for s in stages if s.name == "extract")
    disk = E.disk_problem(extract.disk_bytes, Path(artifacts) / "hidden", extract.sized_by)
    return [str(p) for p in found + ([disk] if disk else [])]


def build(params: Params, verifier_config: str | Path, *, gpu: bool | None = None,
          device_gib: float = 80.0, artifacts: str | Path = "artifacts") -> Plan:
    """The plan of a run of `params` on this machine. gpu None: torch's answer; a GPU's memory
    is device_gib, without a GPU the host's memory stands for the device."""
    gpu = E.cuda_available() if gpu is None else gpu
    device = int(device_gib * GiB) if gpu else host_memory_bytes()
    _, cfg, cfg_file = read_config(verifier_config)
    f = E.figures(params, cfg_file, gpu)
    stages = [m.estimate(params, f) for m in ESTIMATED]
    assumptions = [f"verifier weights: {f.verifier_from}",
                   "tokens are upper bounds: every sample at max_prompt_tokens + max_new_tokens",
                   "training memory and activations are estimates"]
    return Plan(P.source_of(params), str(cfg_file), f.model_type, f.hidden_size, gpu, device,
                f.hidden_per_token, f.draft_params, f.draft_bytes, f.verifier_params,
                f.verifier_bytes, f.verifier_from, stages, assumptions,
                problems_of(params, cfg, f, stages, device, artifacts))


COLUMNS = (("stage", 9), ("engine", 40), ("procs", 5), ("tokens", 13), ("disk written", 12),
           ("memory/device", 13), ("host memory", 11))


def _row(cells: list[str]) -> str:
    out = []
    for (_, width), cell in zip(COLUMNS, cells):
        out.append(cell.ljust(width) if not out or width == 40 else cell.rjust(width))
    return "  ".join(out).rstrip()


def render(plan: Plan) -> str:
    """The human form: the figures, a fixed-width table of the stages, notes and problems."""
    dtype_bytes = plan.hidden_bytes_per_token // ((NUM_AUX + 1) * plan.hidden_size)
    machine = (f"GPU, {human(plan.device_bytes)} per device (--device-gib)" if plan.gpu else
               f"CPU only (torch sees no GPU): host memory {human(plan.device_bytes)}")
    lines = [f"plan: {plan.params_file}; verifier config {plan.verifier_config}",
             f"  machine: {machine}",
             f"  verifier: {plan.model_type}, H {plan.hidden_size}: {plan.verifier_params:,} "
             f"parameters, {human(plan.verifier_weight_bytes)} in the engine",
             f"  draft: {plan.draft_params:,} parameters (arch.contract), "
             f"{human(plan.draft_bytes)} exported",
             f"  hidden states: ({NUM_AUX} + 1) x {plan.hidden_size} x {dtype_bytes} B = "
             f"{plan.hidden_bytes_per_token:,} B/token", "",
             _row([c for c, _ in COLUMNS]), _row(["-" * w for _, w in COLUMNS])]
    for s in plan.stages:
        lines.append(_row([s.name, s.engine, str(s.processes),
                           "-" if s.tokens is None else f"{s.tokens:,}", human(s.disk_bytes),
                           human(s.device_bytes), human(s.host_bytes)]))
    lines += ["", "notes:"] + [f"  {s.name}: {n}" for s in plan.stages for n in s.notes]
    lines += ["assumptions:"] + [f"  - {a}" for a in plan.assumptions]
    if plan.problems:
        lines += [f"problems ({len(plan.problems)}):"] + [f"  - {p}" for p in plan.problems]
    else:
        lines.append("problems: none")
    return "\n".join(lines)
