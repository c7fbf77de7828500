"""`eagle3pipe plan`: what each stage will run, hold and write, and what cannot work, from
params.yaml and the verifier's config.json alone (no model loaded, no engine started).

The figures are each stage's estimate (eagle3pipe.estimates: figures explains them, stages
holds one per stage; the stage runner logs the same estimate and refuses an output that cannot
fit), tabulated here with what this machine adds: vLLM's known limits, memory that exceeds a
device or the host, tensor-parallel ranks that do not split the verifier's heads. No stage
imports the planner, and the estimates are no stage's code deps, so editing either reruns no
stage.

The modes table compares the three ways the train stage gets its hidden states (extract.mode,
docs/stages.md), computed from the extract and train estimates: offline writes every token's
states in the extract stage and trains afterwards (the engine and the trainer never hold a
device at once); online captures each batch's states as the trainer needs them, from an engine
inside the train stage (extract.endpoint null: both on the same devices) or a server elsewhere
(the train nodes hold only the trainer), recomputing them every epoch; hybrid captures like
online in the first epoch and keeps the states in the per-sample store, so each token is
computed once and the store holds what offline writes. The disk problem is the selected mode's
only: a disk too small for offline does not refuse a run in online mode.
"""
from __future__ import annotations

import dataclasses
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

from eagle3pipe.config import cross_check
from eagle3pipe.config import params as P
from eagle3pipe.config.schema import Params
from eagle3pipe.data import store
from eagle3pipe.hidden.online import PREFETCH_PACKS
from eagle3pipe.draft.arch import NUM_AUX
from eagle3pipe.errors import Problem
from eagle3pipe.runtime import environment
from eagle3pipe.runtime.disk import free_bytes
from eagle3pipe.runtime.units import GiB, human, parse_size
from eagle3pipe.estimates import figures as E
from eagle3pipe.estimates import host
from eagle3pipe.estimates import stages as estimate
from eagle3pipe.verifier.handle import read_config
from eagle3pipe.engines.preflight import eagle3_limit


@dataclass
class Mode:
    """One way the train stage gets its hidden states: extract.mode, and for online and hybrid
    whether the engine is a server at extract.endpoint (else inside the train stage)."""
    mode: str
    endpoint: bool
    engine: str  # where the verifier engine that captures the states runs
    disk_bytes: int  # the most it holds on disk at once
    disk_at: str  # where those bytes are written
    device_bytes: int | None  # per device on the training nodes
    host_bytes: int | None
    forwards: int  # tokens whose states the verifier computes, over the whole training
    free_bytes: int  # the free disk judged against (--disk, or measured at disk_at)
    fits: bool
    selected: bool  # what params.yaml's extract.mode and extract.endpoint select

    @property
    def label(self) -> str:
        return self.mode + (", endpoint" if self.endpoint else "")


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
    modes: list[Mode]
    mode_notes: list[str]
    disk_from: str  # the free disk the modes are judged against: --disk, or where measured
    assumptions: list[str]
    problems: list[str]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _oracle_time(params: Params, f: E.Figures, stages: list[E.Estimate]) -> None:
    """Appends to the extract estimate the oracle's compute time at this host's measured
    float32 rate (its FLOP count is the estimate's own)."""
    if not params.extract.oracle_samples:
        return
    rate = host.float32_flops()
    flop = E.oracle_flop(params, f)
    next(s for s in stages if s.name == "extract").notes.append(
        f"oracle time on this host: ~{host.about(flop / rate)} of float32 compute ({flop:.2g} "
        f"FLOP at {rate / 1e9:.0f} GFLOP/s, a {host.MATMUL_N} x {host.MATMUL_N} matmul timed by "
        f"plan), plus reading every layer once from disk (~{human(f.verifier_bytes)}, the "
        "verifier's weights at the engine's size) and casting it to float32")


def _heads_problems(params: Params, cfg: dict, bad) -> None:
    """The verifier's heads against vLLM's tensor-parallel ranks (the draft's:
    config/cross_check.py)."""
    kv = None if "kv_lora_rank" in cfg else cfg.get("num_key_value_heads")
    found = cross_check.tp_problem(params.vllm.tensor_parallel_size,
                                   cfg.get("num_attention_heads"), kv, "verifier",
                                   "vLLM shards attention heads over the tensor-parallel ranks")
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


def parse_tokens(text: str) -> int:
    """--tokens: a positive whole count, written 1000000000 or 1e9; ValueError otherwise."""
    try:
        n = int(text)
    except ValueError:
        try:
            x = float(text)
        except ValueError:
            x = 0.0
        n = int(x) if x.is_integer() else 0  # 1.5, nan and inf are not counts
    if n < 1:
        raise ValueError(f"{text!r} is not a positive whole number of tokens "
                         "(e.g. 1e9 or 1000000000)")
    return n


def _free(path: Path, disk: int | None) -> tuple[str, int]:
    """The free disk a mode's bytes are judged against: --disk, else the free space where
    `path` (or its nearest existing parent) lives, or $EAGLE3PIPE_FREE_BYTES as the runner's
    check (eagle3pipe.estimates.check.disk_problem) reads it."""
    if disk is not None:
        return "--disk", disk
    where, free = free_bytes(path)
    what_if = environment.size(environment.FREE_BYTES, unset="the measured free space")
    return str(where), free if what_if is None else what_if


def _shown(path: Path) -> Path:
    """path relative to the working directory where it lies inside it (the report's form)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _as_offline(params: Params) -> Params:
    """params with extract.mode offline: the extract estimate is then
    the engine writing every state, the train estimate the trainer alone, whatever either stage
    estimates for another mode."""
    return dataclasses.replace(params, extract=dataclasses.replace(
        params.extract, mode="offline", endpoint=None))


def _add(*xs: int | None) -> int | None:
    return None if all(x is None for x in xs) else sum(x or 0 for x in xs)


def _most(*xs: int | None) -> int | None:
    return None if all(x is None for x in xs) else max(x or 0 for x in xs)


def modes_of(params: Params, f: E.Figures, artifacts: str | Path,
             disk: int | None) -> tuple[list[Mode], list[str]]:
    """The modes table's rows and its notes, from the offline extract and train estimates."""
    offline = _as_offline(params)
    ex, tr = estimate.extract(offline, f), estimate.train(offline, f)
    t = params.train
    per_epoch = tr.tokens // t.epochs  # train's estimate counts every epoch
    eval_tokens = ex.tokens - per_epoch
    rows, evals = ex.tokens * E.TOKEN_ROW_BYTES, eval_tokens * f.hidden_per_token
    window = PREFETCH_PACKS * t.nproc_per_node * t.batch_tokens * f.hidden_per_token
    online_disk, online_forwards = rows + evals + window, tr.tokens + eval_tokens
    # online's rows and transient states are judged where offline writes; hybrid's in the store
    hidden, kept = Path(artifacts) / "hidden", _shown(store.root())
    mode = params.extract.mode
    chosen = mode, mode != "offline" and params.extract.endpoint is not None
    both = _add(ex.device_bytes, tr.device_bytes), _add(ex.host_bytes, tr.host_bytes)
    alone = tr.device_bytes, tr.host_bytes
    rows_of = [("offline", False, "extract stage, then train", ex.disk_bytes, hidden,
                (_most(ex.device_bytes, tr.device_bytes), _most(ex.host_bytes, tr.host_bytes)),
                ex.tokens),
               ("online", False, "train stage, same devices", online_disk, hidden, both,
                online_forwards),
               ("online", True, "server at extract.endpoint", online_disk, hidden, alone,
                online_forwards),
               ("hybrid", False, "train stage, same devices", ex.disk_bytes, kept, both,
                ex.tokens),
               ("hybrid", True, "server at extract.endpoint", ex.disk_bytes, kept, alone,
                ex.tokens)]
    modes = []
    for name, endpoint, engine, need, at, (device, host), forwards in rows_of:
        _, free = _free(at, disk)
        modes.append(Mode(name, endpoint, engine, need, str(at), device, host, forwards, free,
                          need <= free, (name, endpoint) == chosen))
    bound = environment.text(environment.STORE_MAX_BYTES) or store.DEFAULT_BOUND
    try:
        bound = human(parse_size(bound))
    except ValueError:  # the data stages refuse it; the report shows it as written
        bound = repr(bound)
    notes = [f"offline and hybrid compute each token's states once ({ex.tokens:,} tokens); "
             f"online every epoch: {per_epoch:,} train tokens x {t.epochs} (train.epochs) + "
             f"{eval_tokens:,} eval tokens once",
             f"online disk: token rows {human(rows)} + the eval split's states {human(evals)} "
             f"(kept while training) + a prefetch window of {PREFETCH_PACKS} batches x "
             f"{t.nproc_per_node} processes x {t.batch_tokens} tokens (train.batch_tokens) = "
             f"{human(window)}",
             f"hybrid keeps {human(ex.disk_bytes)} in the per-sample store {kept} "
             f"(${environment.STORE}), which ${environment.STORE_MAX_BYTES} bounds (now {bound})",
             f"same devices: the engine ({human(ex.device_bytes)}) and the trainer "
             f"({human(tr.device_bytes or tr.host_bytes)}) at once; at extract.endpoint the "
             f"engine's {ex.processes} ranks run on the inference nodes"]
    return modes, notes


def _shared_device_problem(params: Params, trainer: E.Estimate, chosen: Mode, device: int,
                           bad) -> None:
    """The engine inside the train stage (online, hybrid without extract.endpoint) shares each
    GPU with the trainer: vLLM takes gpu_memory_utilization of it (or the weights plus
    kv_cache_memory_bytes), the trainer needs the rest."""
    v, need = params.vllm, trainer.device_bytes or 0
    if v.kv_cache_memory_bytes:
        if (chosen.device_bytes or 0) > device:
            bad("vllm.kv_cache_memory_bytes", f"extract.mode {chosen.mode} with the engine in "
                f"the train stage: engine and trainer need {human(chosen.device_bytes)} per GPU, "
                f"more than the device's {human(device)}", "lower vllm.kv_cache_memory_bytes, "
                "set extract.endpoint to a server on other nodes, or extract.mode: offline")
    elif need > (1 - v.gpu_memory_utilization) * device:
        bad("vllm.gpu_memory_utilization", f"{v.gpu_memory_utilization} leaves "
            f"{human((1 - v.gpu_memory_utilization) * device)} per GPU beside the engine, but "
            f"the trainer needs {human(need)} (extract.mode {chosen.mode}, engine in the train "
            "stage)", "lower vllm.gpu_memory_utilization (or set vllm.kv_cache_memory_bytes), "
            "set extract.endpoint to a server on other nodes, or extract.mode: offline")


def problems_of(params: Params, cfg: dict, f: E.Figures, stages: list[E.Estimate], device: int,
                chosen: Mode, disk: int | None) -> list[str]:
    """What cannot work; the disk problem is the selected mode's (chosen)."""
    file, lines = P.source_of(params), P.lines_of(params)
    found: list[Problem] = []
    cross_check.check_engine(params, file, lines, found)  # the draft's heads vs TP, max_model_len

    def bad(key: str, msg: str, fix: str) -> None:
        found.append(Problem(file, lines.get(key), key, msg, fix))

    _heads_problems(params, cfg, bad)
    _machine_problems(params, cfg, f, bad)
    _fit_problems(params, stages, device, f.gpu, bad)
    if f.gpu and not chosen.endpoint and chosen.mode != "offline":
        _shared_device_problem(params, estimate.train(_as_offline(params), f), chosen, device,
                               bad)
    if not chosen.fits:
        where, free = _free(Path(chosen.disk_at), disk)
        found.append(Problem(chosen.disk_at, None, "dataset.num_samples",
                             f"needs {human(chosen.disk_bytes)} (extract.mode {chosen.mode}) but "
                             + (f"--disk is {human(free)}" if disk is not None else
                                f"{where} has {human(free)} free"), "free disk there, put "
                             f"{chosen.disk_at} on a larger disk, lower dataset.num_samples, or "
                             "an extract.mode that fits (the modes table)"))
    return [str(p) for p in found]


def build(params: Params, verifier_config: str | Path, *, gpu: bool | None = None,
          device_gib: float = 80.0, artifacts: str | Path = "artifacts",
          tokens: int | None = None, disk: int | None = None) -> Plan:
    """The plan of a run of `params` on this machine. gpu None: torch's answer; a GPU's memory
    is device_gib, without a GPU the host's memory stands for the device. tokens: the token
    count every estimate uses instead of the dataset's; disk: the free disk to judge against
    instead of the measured one."""
    gpu = E.cuda_available() if gpu is None else gpu
    device = int(device_gib * GiB) if gpu else host_memory_bytes()
    _, cfg, cfg_file = read_config(verifier_config)
    f = E.figures(params, cfg_file, gpu)
    d = params.dataset
    counted = (f"tokens: {f.tokens:,} = dataset.num_samples x (max_prompt_tokens + "
               "max_new_tokens), an upper bound: every sample at its longest")
    if tokens is not None:
        counted = (f"tokens: {tokens:,} (--tokens), instead of dataset.num_samples "
                   f"{d.num_samples:,} x {d.max_prompt_tokens + d.max_new_tokens} = "
                   f"{f.tokens:,}")
        f = dataclasses.replace(f, tokens=tokens)
    stages = [e(params, f) for e in estimate.ESTIMATES.values()]
    _oracle_time(params, f, stages)
    modes, notes = modes_of(params, f, artifacts, disk)
    chosen = next(m for m in modes if m.selected)
    measured = dict(_free(Path(m.disk_at), None) for m in modes)
    disk_from = f"{human(disk)} (--disk)" if disk is not None else ", ".join(
        f"{human(free)} at {where}" for where, free in measured.items()) + (
        f" (${environment.FREE_BYTES})" if environment.text(environment.FREE_BYTES) else "")
    assumptions = [f"verifier weights: {f.verifier_from}", counted,
                   "training memory and activations are estimates"]
    return Plan(P.source_of(params), str(cfg_file), f.model_type, f.hidden_size, gpu, device,
                f.hidden_per_token, f.draft_params, f.draft_bytes, f.verifier_params,
                f.verifier_bytes, f.verifier_from, stages, modes, notes, disk_from, assumptions,
                problems_of(params, cfg, f, stages, device, chosen, disk))


COLUMNS = (("stage", 9), ("engine", 40), ("procs", 5), ("tokens", 13), ("disk written", 12),
           ("memory/device", 13), ("host memory", 11))


def _row(cells: list[str]) -> str:
    out = []
    for (_, width), cell in zip(COLUMNS, cells):
        out.append(cell.ljust(width) if not out or width == 40 else cell.rjust(width))
    return "  ".join(out).rstrip()


MODE_COLUMNS = (("mode", 18), ("verifier engine", 26), ("disk written", 12),
                ("memory/device", 13), ("host memory", 11), ("forwards (tokens)", 17),
                ("fits disk", 9))


def _mode_row(cells: list[str]) -> str:
    return "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                     for i, ((_, w), cell) in enumerate(zip(MODE_COLUMNS, cells))).rstrip()


def render(plan: Plan) -> str:
    """The human form: the figures, fixed-width tables of the stages and the modes, notes and
    problems."""
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
    lines += ["", f"modes (* extract.mode and extract.endpoint in {plan.params_file}; free disk "
              f"{plan.disk_from}):", _mode_row([c for c, _ in MODE_COLUMNS]),
              _mode_row(["-" * w for _, w in MODE_COLUMNS])]
    for m in plan.modes:
        lines.append(_mode_row([f"{'*' if m.selected else ' '} {m.label}", m.engine,
                                human(m.disk_bytes), human(m.device_bytes), human(m.host_bytes),
                                f"{m.forwards:,}", "yes" if m.fits else "no"]))
    lines += [textwrap.fill(n, 100, initial_indent="  ", subsequent_indent="    ")
              for n in plan.mode_notes]
    lines += ["", "notes:"] + [f"  {s.name}: {n}" for s in plan.stages for n in s.notes]
    lines += ["assumptions:"] + [f"  - {a}" for a in plan.assumptions]
    if plan.problems:
        lines += [f"problems ({len(plan.problems)}):"] + [f"  - {p}" for p in plan.problems]
    else:
        lines.append("problems: none")
    return "\n".join(lines)
